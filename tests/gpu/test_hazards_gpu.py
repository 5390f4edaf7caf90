"""GPU tier: hazards that ranks time-sliced on one GPU rarely exercise.

1. Calls in flight on two streams: an asynchronous dispatch on the Buffer's comm stream, then at
   once a synchronous dispatch and combine on the caller's stream (they share the transport's
   epoch words and block counters), many times; and Megatron's overlap pattern, the dispatch
   of micro-batch n + 1 on one stream while the combine of n runs on another. Every result is
   checked against the single-process oracle (`tests/helpers/oracle.py`).
2. Co-residency of the persistent ring kernels: a kernel on another stream holds most SMs while
   a ring-staging dispatch and combine run: a correct result or a clear error, never the
   timeout that breaks the Buffer. The test bounds progress (the kernels' own wait timeouts),
   not wall time: the ring kernels may queue behind the hog for its SMs.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
import torch.distributed as dist

from megatron_deepep.buffer import Buffer
from megatron_deepep.transport.errors import PeerTimeoutError
from tests.helpers import knobs as test_knobs
from tests.helpers.cases import make_inputs
from tests.helpers.distributed import run_distributed, tier_backend, use_rank_device
from tests.helpers.oracle import oracle_dispatch

pytestmark = pytest.mark.gpu

NUM_PROCS = [n for n in test_knobs.get("TEST_PROCS") if n >= 2]
NUM_CALLS = test_knobs.get("TEST_CALLS")
HIDDEN, TOPK, PER_RANK = 2048, 4, 2


def _integer_inputs(seed, world, num_tokens):
    """Every rank's inputs with integer-valued rows (every combine sum is exact)."""
    xs, idxs, ws = make_inputs(seed, world, num_tokens, HIDDEN, PER_RANK * world, TOPK,
                               "dropped")
    xs = [torch.randint(-3, 4, x.shape, generator=torch.Generator().manual_seed(seed + r))
          .to(torch.bfloat16) for r, x in enumerate(xs)]
    return xs, idxs, ws


class _Call:
    """One micro-batch of this rank: inputs on the GPU and the oracle's rows for it."""

    def __init__(self, seed, rank, world, num_tokens=40):
        xs, idxs, ws = _integer_inputs(seed, world, num_tokens)
        self.expected = oracle_dispatch(xs, idxs, ws, PER_RANK * world)[rank]
        self.x, self.idx, self.w = (t[rank].cuda() for t in (xs, idxs, ws))
        self.tag = f"seed {seed}"

    def check_dispatch(self, recv_x, recv_w):
        rows, weights = self.expected[0], self.expected[1]
        assert torch.equal(recv_x[:rows.shape[0]].cpu(), rows), f"{self.tag}: rows differ"
        assert torch.equal(recv_w[:rows.shape[0]].cpu(), weights), f"{self.tag}: weights"

    def check_combine(self, out):
        # Unweighted combine of the received rows: each token's row times its valid entries.
        expected = self.x.float() * (self.idx >= 0).sum(1, keepdim=True)
        assert torch.equal(out.float(), expected), f"{self.tag}: combine differs"


def _mixed_async_sync(rank, world, num_calls):
    use_rank_device(rank, gloo_device=0)
    buf = Buffer(dist.group.WORLD, 64, HIDDEN, TOPK, num_sms=8, timeout_s=30)
    experts = PER_RANK * world
    for call in range(num_calls):
        a = _Call(10_000 + 2 * call, rank, world)
        b = _Call(10_001 + 2 * call, rank, world)
        recv_a, w_a, handle_a, event_a = buf.dispatch(a.x, a.idx, a.w, num_experts=experts,
                                                      async_finish=True)
        # At once, while the async dispatch may still run on the comm stream.
        recv_b, w_b, handle_b, _ = buf.dispatch(b.x, b.idx, b.w, num_experts=experts)
        out_b, _, _ = buf.combine(recv_b, handle_b)
        event_a.current_stream_wait()
        out_a, _, event = buf.combine(recv_a, handle_a, async_finish=True)
        event.current_stream_wait()
        a.check_dispatch(recv_a, w_a)
        b.check_dispatch(recv_b, w_b)
        a.check_combine(out_a)
        b.check_combine(out_b)
    buf.check_errors()
    dist.barrier()


def _overlapped_micro_batches(rank, world, num_calls):
    """Dispatch of n + 1 on one caller stream while the combine of n runs on another (no
    events between them from the caller: the Buffer must order its own calls)."""
    use_rank_device(rank, gloo_device=0)
    buf = Buffer(dist.group.WORLD, 64, HIDDEN, TOPK, num_sms=8, timeout_s=30)
    experts = PER_RANK * world
    comm, compute = torch.cuda.Stream(), torch.cuda.Stream()
    calls = [_Call(20_000 + n, rank, world) for n in range(num_calls + 1)]
    comm.wait_stream(torch.cuda.current_stream())
    compute.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(comm):
        pending = buf.dispatch(calls[0].x, calls[0].idx, calls[0].w, num_experts=experts)
    results = []
    for n in range(num_calls):
        with torch.cuda.stream(comm):
            following = buf.dispatch(calls[n + 1].x, calls[n + 1].idx, calls[n + 1].w,
                                     num_experts=experts)
        compute.wait_stream(comm)  # the rows of n are on the comm stream
        with torch.cuda.stream(compute):
            out, _, _ = buf.combine(pending[0], pending[2])
        results.append((calls[n], pending, out))
        pending = following
    torch.cuda.synchronize()
    for call, (recv_x, recv_w, _, _), out in results:
        call.check_dispatch(recv_x, recv_w)
        call.check_combine(out)
    buf.check_errors()
    dist.barrier()


@pytest.mark.parametrize("world", NUM_PROCS)
def test_async_then_sync_calls_match_the_oracle(world):
    run_distributed(world, _mixed_async_sync, max(NUM_CALLS // 10, 20), backend=tier_backend())


@pytest.mark.parametrize("world", NUM_PROCS)
def test_overlapped_dispatch_and_combine_match_the_oracle(world):
    run_distributed(world, _overlapped_micro_batches, max(NUM_CALLS // 10, 20),
                    backend=tier_backend())


# ------------------------------------------------------------------------------ co-residency

HOG_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(1024, 1) hold_sms(unsigned long long ns) {
    extern __shared__ int smem[];
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (threadIdx.x == 0) smem[0] = (int)now;
    } while (now - start < ns);
}
"""


def _hog_kernel():
    """A kernel whose blocks each take a whole SM (all but 1 KB of its shared memory)."""
    from cuda.bindings import driver
    from megatron_deepep.kernels import jit
    cubin, _ = jit.compile_code(HOG_SOURCE, "hold_sms.cu", arch=jit.device_arch())
    jit.ensure_context(torch.cuda.current_device())
    image = ctypes.create_string_buffer(cubin, len(cubin))
    module = jit.cu_check(driver.cuModuleLoadData(ctypes.addressof(image)), "load hog")
    function = jit.cu_check(driver.cuModuleGetFunction(module, b"hold_sms"), "hold_sms")
    kernel = jit.Kernel("hold_sms", function, torch.cuda.current_device())
    kernel.module = module
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return kernel, props.multi_processor_count, props.shared_memory_per_block_optin


class _HogArgs(ctypes.Structure):
    _fields_ = [("ns", ctypes.c_uint64)]

    @property
    def kernel_params(self):
        """The address of the one-entry argument pointer array `cuLaunchKernel` takes."""
        self._params = (ctypes.c_void_p * 1)(ctypes.addressof(self))
        return ctypes.addressof(self._params)


def _ring_beside_a_hog(rank, world, per_node):
    from megatron_deepep.kernels.jit import CoResidencyError
    os.environ.update(MDEEP_INTERNODE_STAGING="ring", NVSHMEM_SYMMETRIC_SIZE="2G")
    use_rank_device(rank, gloo_device=0)
    timeout_s = 30.0
    buf = Buffer(dist.group.WORLD, 64, HIDDEN, TOPK, transport="internode", num_sms=8,
                 timeout_s=timeout_s, num_ranks_per_node=per_node)
    assert buf._transport.staging == "ring"
    experts = PER_RANK * world
    hog, num_sms, smem = _hog_kernel()
    hog_stream = torch.cuda.Stream()
    for attempt in range(3):
        call = _Call(30_000 + attempt, rank, world)
        dist.barrier()
        args = _HogArgs(ns=2_000_000_000)  # 2 s on all SMs but two
        hog.launch(num_sms - 2, 1024, args, hog_stream, shared_mem=smem - 1024)
        hog_done = torch.cuda.Event()
        hog_done.record(hog_stream)
        # Progress, not wall time, is bounded: each of the kernels' waits gives up after
        # timeout_s (PeerTimeoutError, below), however long the ring kernels queue behind the
        # hog for SMs before they start. The hog must still hold its SMs as the call is queued,
        # or this attempt did not test the hazard.
        assert not hog_done.query(), "the hog ended before the ring call was queued"
        try:
            recv_x, recv_w, handle, _ = buf.dispatch(call.x, call.idx, call.w,
                                                     num_experts=experts)
            out, _, _ = buf.combine(recv_x, handle)
            torch.cuda.synchronize()
        except PeerTimeoutError:
            raise AssertionError("a ring kernel beside a kernel holding SMs timed out")
        except CoResidencyError as exc:  # a clear refusal is the other acceptable outcome
            assert "num_sms" in str(exc)
            return
        call.check_dispatch(recv_x, recv_w)
        call.check_combine(out)
    buf.check_errors()
    dist.barrier()


def test_ring_kernels_beside_a_kernel_holding_most_sms(require_nvshmem):
    run_distributed(2, _ring_beside_a_hog, 1, backend=tier_backend(), timeout_s=600,
                    hard_exit=True)
