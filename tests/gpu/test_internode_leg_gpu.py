"""GPU tier: the network leg (cuda_src/bench/internode_leg.cu over net.cuh on NVSHMEM) on virtual
nodes.

4 processes share the GPU as 2 virtual nodes x 2 ranks (NVSHMEM's limited several-processes-
per-GPU mode; gloo is the control plane). Each PE bootstraps the symmetric heap through torch
(`SymmetricHeap`) and launches the leg kernels through `ops` (`nvshmem_link.get_kernel` links,
loads and initializes them). For a few rounds each PE puts its bytes (in several blocks, each
adding 1 to the signal) to the PE with the same local index on the next node and waits for its
own incoming slot; every rank checks every byte it received. Then a planted stall: one PE sends
nothing, and its receiver's wait must expire and record (rank, peer, phase, expected, seen)
naming that PE instead of hanging. With `MDEEP_TEST_BACKEND=nccl` the 4 PEs run on 4 GPUs
(NCCL control plane, NVSHMEM's full mode), skipped with fewer GPUs.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_deepep.kernels import jit
from megatron_deepep.transport.errors import PeerTimeoutError, error_from_record
from tests.helpers.distributed import run_distributed, tier_backend, use_rank_device

pytestmark = pytest.mark.gpu

KERNELS = ["internode_leg_send", "internode_leg_wait"]
NUM_NODES, RANKS_PER_NODE = 2, 2
NUM_BYTES = 1 << 20
NUM_SEND_BLOCKS = 4
NUM_ROUNDS = 5
STALLED_RANK = 1  # node 0, local index 1: sends nothing in the stall round
PHASE_NET_LEG = 6  # kPhaseNetLeg in internode_leg.cu
WAIT_TIMEOUT_NS = 30 * 10**9  # 4 processes time-slice one GPU: generous
STALL_TIMEOUT_NS = 500 * 10**6

# Set in the parent (inherited by the spawned ranks) and again in each rank, before NVSHMEM
# starts: no NVLink multicast / NVLS on a GPU shared by several processes.
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NVSHMEM_DISABLE_NVLS": "1"}


def _pattern(src_rank: int, round_: int) -> torch.Tensor:
    """The bytes PE `src_rank` sends in `round_` (position-dependent, so misplaced bytes show)."""
    positions = torch.arange(NUM_BYTES, dtype=torch.int64, device="cuda")
    return ((positions * 7 + src_rank * 16 + round_) % 251).to(torch.uint8)


def _leg_worker(rank, world):
    os.environ.update(ENV)
    from megatron_deepep import ops
    from megatron_deepep.ops.bench import internode_leg
    from megatron_deepep.transport.nvshmem_heap import SymmetricHeap

    use_rank_device(rank, gloo_device=0)
    heap = SymmetricHeap()
    recv = heap.zeros(world * NUM_BYTES, torch.uint8)
    send = heap.empty(NUM_BYTES, torch.uint8)
    signals = heap.zeros(world, torch.int64)
    error_claim = torch.zeros(1, dtype=torch.int32, device="cuda")
    error_record = torch.zeros(10, dtype=torch.int32, device="cuda")
    errors = ops.ErrorSink(error_claim.data_ptr(), error_record.data_ptr())
    info = torch.full((2,), -1, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    dist.barrier()  # every PE's signals are zero before anyone sends

    node, local = divmod(rank, RANKS_PER_NODE)
    peer = ((node + 1) % NUM_NODES) * RANKS_PER_NODE + local
    source = ((node - 1) % NUM_NODES) * RANKS_PER_NODE + local

    for round_ in range(1, NUM_ROUNDS + 1):
        send.copy_(_pattern(rank, round_))
        internode_leg.internode_leg_send(recv, send, signals, peer, NUM_SEND_BLOCKS, errors)
        internode_leg.internode_leg_wait(signals, source, round_ * NUM_SEND_BLOCKS, WAIT_TIMEOUT_NS,
                               errors, info)
        torch.cuda.synchronize()
        error = error_from_record(error_record.cpu().numpy(), WAIT_TIMEOUT_NS / 1e9)
        assert error is None, f"round {round_}: {error}"
        got = recv[source * NUM_BYTES:(source + 1) * NUM_BYTES]
        assert torch.equal(got, _pattern(source, round_)), (
            f"rank {rank} round {round_}: bytes from PE {source} wrong at "
            f"{(got != _pattern(source, round_)).nonzero()[:4].flatten().tolist()}")
        assert int(signals[source]) == round_ * NUM_SEND_BLOCKS
        assert info.tolist() == [rank, world], f"kernel saw my_pe/num_pes {info.tolist()}"
        dist.barrier()  # the receiver has read this round's slot before it is overwritten

    # The planted stall: STALLED_RANK sends nothing; its receiver must time out, naming it.
    round_ = NUM_ROUNDS + 1
    internode_leg.internode_leg_send(recv, send, signals, -1 if rank == STALLED_RANK else peer,
                           NUM_SEND_BLOCKS, errors)
    internode_leg.internode_leg_wait(signals, source, round_ * NUM_SEND_BLOCKS, STALL_TIMEOUT_NS,
                                     errors,
                           info)
    torch.cuda.synchronize()
    record = error_record.cpu().numpy()
    error = error_from_record(record, STALL_TIMEOUT_NS / 1e9)
    stalled_receiver = ((STALLED_RANK // RANKS_PER_NODE + 1) % NUM_NODES) * RANKS_PER_NODE + \
        STALLED_RANK % RANKS_PER_NODE
    if rank == stalled_receiver:
        assert isinstance(error, PeerTimeoutError), f"expected a timeout, got {error!r}"
        assert f"rank {rank} " in str(error) and f"peer {STALLED_RANK} " in str(error), error
        expected, seen = record[6:10].view("int64").tolist()
        assert record[3] == PHASE_NET_LEG
        assert (expected, seen) == (round_ * NUM_SEND_BLOCKS, NUM_ROUNDS * NUM_SEND_BLOCKS)
    else:
        assert error is None, f"rank {rank}: {error}"
    dist.barrier()
    # No heap teardown call: NVSHMEM host calls at teardown are what limited mode forbids.


def test_internode_leg_on_virtual_nodes(monkeypatch, require_nvshmem):
    from megatron_deepep.kernels import nvshmem_link
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    # Link once here, so the ranks find the cubins in the disk cache instead of all linking.
    for kernel in KERNELS:
        nvshmem_link.link_cubin("bench/internode_leg.cu", [kernel], jit.device_arch())
    run_distributed(NUM_NODES * RANKS_PER_NODE, _leg_worker, backend=tier_backend(), timeout_s=300)
