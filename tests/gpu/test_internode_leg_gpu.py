"""GPU tier: the network leg (cuda_src/internode_leg.cu over net.cuh on NVSHMEM) on virtual nodes.

4 processes share the GPU as 2 virtual nodes x 2 ranks (NVSHMEM's limited several-processes-
per-GPU mode; gloo is the control plane). Each PE bootstraps the symmetric heap through torch
(`SymmetricHeap`), loads the cubin linked by `nvshmem_link` and inits its NVSHMEM state, then
for a few rounds puts its bytes (in several blocks, each adding 1 to the signal) to the PE with
the same local index on the next node and waits for its own incoming slot; every rank checks
every byte it received. Then a planted stall: one PE sends nothing, and its receiver's wait must
expire and record (rank, peer, phase, expected, seen) naming that PE instead of hanging.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
import torch.distributed as dist

from megatron_deepep import knobs
from megatron_deepep.transport.errors import PeerTimeoutError, error_from_record
from tests.distributed import run_distributed

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


class LegArgs(ctypes.Structure):
    """Mirror of `LegArgs` in cuda_src/internode_leg.cu (same fields, same order)."""

    _fields_ = [("recv", ctypes.c_void_p), ("send", ctypes.c_void_p),
                ("signals", ctypes.c_void_p), ("bytes", ctypes.c_int64),
                ("expected", ctypes.c_uint64), ("timeout_ns", ctypes.c_uint64),
                ("peer", ctypes.c_int32), ("from_", ctypes.c_int32),
                ("error_claim", ctypes.c_void_p), ("error_record", ctypes.c_void_p),
                ("info", ctypes.c_void_p)]


def _launch(driver, function, grid: int, block: int, args: LegArgs) -> None:
    """cuLaunchKernel with the struct as the one by-value argument, on torch's stream."""
    params = (ctypes.c_void_p * 1)(ctypes.addressof(args))
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    err, = driver.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, 0, stream,
                                 ctypes.addressof(params), 0)
    assert int(err) == 0, f"cuLaunchKernel: {err}"


def _pattern(src_rank: int, round_: int) -> torch.Tensor:
    """The bytes PE `src_rank` sends in `round_` (position-dependent, so misplaced bytes show)."""
    positions = torch.arange(NUM_BYTES, dtype=torch.int64, device="cuda")
    return ((positions * 7 + src_rank * 16 + round_) % 251).to(torch.uint8)


def _leg_worker(rank, world, cubin, lowered):
    os.environ.update(ENV)
    from cuda.bindings import driver

    from megatron_deepep.transport.nvshmem_heap import SymmetricHeap, load_module

    torch.cuda.set_device(0)
    heap = SymmetricHeap()
    # Collective allocations: same sizes, same order on every PE.
    recv = heap.zeros(world * NUM_BYTES, torch.uint8)
    send = heap.empty(NUM_BYTES, torch.uint8)
    signals = heap.zeros(world, torch.int64)
    error_claim = torch.zeros(1, dtype=torch.int32, device="cuda")
    error_record = torch.zeros(10, dtype=torch.int32, device="cuda")
    info = torch.full((2,), -1, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    dist.barrier()  # every PE's signals are zero before anyone sends

    module = load_module(cubin)
    functions = {}
    for expr in KERNELS:
        err, functions[expr] = driver.cuModuleGetFunction(module, lowered[expr].encode())
        assert int(err) == 0, f"cuModuleGetFunction({expr}): {err}"

    node, local = divmod(rank, RANKS_PER_NODE)
    peer = ((node + 1) % NUM_NODES) * RANKS_PER_NODE + local
    source = ((node - 1) % NUM_NODES) * RANKS_PER_NODE + local
    args = LegArgs(recv=recv.data_ptr(), send=send.data_ptr(), signals=signals.data_ptr(),
                   bytes=NUM_BYTES, timeout_ns=WAIT_TIMEOUT_NS, peer=peer, from_=source,
                   error_claim=error_claim.data_ptr(), error_record=error_record.data_ptr(),
                   info=info.data_ptr())

    for round_ in range(1, NUM_ROUNDS + 1):
        send.copy_(_pattern(rank, round_))
        args.expected = round_ * NUM_SEND_BLOCKS
        _launch(driver, functions["internode_leg_send"], NUM_SEND_BLOCKS, 256, args)
        _launch(driver, functions["internode_leg_wait"], 1, 32, args)
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
    args.expected = round_ * NUM_SEND_BLOCKS
    args.timeout_ns = STALL_TIMEOUT_NS
    if rank == STALLED_RANK:
        args.peer = -1
    _launch(driver, functions["internode_leg_send"], NUM_SEND_BLOCKS, 256, args)
    _launch(driver, functions["internode_leg_wait"], 1, 32, args)
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


def test_internode_leg_on_virtual_nodes(monkeypatch):
    from megatron_deepep import nvshmem_link
    from megatron_deepep.transport import nvshmem_heap

    try:
        nvshmem_heap.check_available()
        nvshmem_link.nvshmem_paths()
    except nvshmem_link.NvshmemUnavailable as exc:
        pytest.skip(str(exc))
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    major, minor = torch.cuda.get_device_capability()
    arch = knobs.get("ARCH") or f"sm_{major}{minor}"
    cubin, lowered = nvshmem_link.link_cubin("internode_leg.cu", KERNELS, arch)
    run_distributed(NUM_NODES * RANKS_PER_NODE, _leg_worker, cubin, lowered, backend="gloo",
                    timeout_s=300)
