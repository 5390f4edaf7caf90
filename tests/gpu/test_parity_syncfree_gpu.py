"""GPU tier: sync-free dispatch and combine (a row bound, `num_max_recv_rows`) on the kernel
transports, N processes sharing the GPU (`MDEEP_TEST_PROCS`; 1: the EP = 1 kernels).

Forward and backward run under `torch.cuda.set_sync_debug_mode("error")` (any host
synchronization fails the test), with the dispatcher's own sync-free pieces (counts fitted to the
bound, the unused tail zeroed forward and backward), and must equal the synchronous reference.
A bound that is too small is an error naming it at the Buffer's next call, on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_deepep import knobs
from tests.helpers import knobs as test_knobs
from megatron_deepep.autograd import combine as ag_combine
from megatron_deepep.autograd import dispatch as ag_dispatch
from megatron_deepep.buffer import Buffer
from tests.helpers.cases import make_inputs
from tests.helpers.compile_jobs import warm_up
from tests.helpers.distributed import cpu_group, run_distributed, tier_backend

pytestmark = pytest.mark.gpu
pytest.importorskip("megatron.core")  # the dispatcher's sync-free helpers live with it

NUM_PROCS = list(test_knobs.get("TEST_PROCS"))


def _step(buf, dev, x, idx, w, grad, experts, bound, dtype):
    """One layer's dispatch -> stand-in experts -> combine, forward and backward."""
    from megatron_deepep.megatron.dispatcher import _bounded_counts, _ZeroUnusedRows

    x = x.to(dev).detach().clone().requires_grad_()
    w = w.to(dev).detach().clone().requires_grad_()
    recv_x, recv_w, handle = ag_dispatch(buf, x, idx.to(dev), w, num_experts=experts,
                                         num_max_recv_rows=bound)
    if bound is not None:
        counts, used = _bounded_counts(handle.tokens_per_expert, bound)
        recv_x = _ZeroUnusedRows.apply(recv_x, used)
        recv_w = recv_w.masked_fill(~used, 0)
    y = (recv_x.float() * recv_w.unsqueeze(1) * 1.5).to(dtype)
    if bound is not None:
        y = _ZeroUnusedRows.apply(y, used)
    out = ag_combine(buf, y, handle)
    (out.float() * grad.to(dev)).sum().backward()
    return out.detach(), x.grad, w.grad


def _sync_free(rank, world, kern, ref, seed, dtype, dev="cuda"):
    experts, topk, hidden = 4 * world, 2, 1024
    xs, idxs, ws = make_inputs(seed, world, [20 + 7 * r for r in range(world)], hidden, experts,
                               topk, "dropped", dtype=dtype)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    grad = torch.linspace(-1, 1, x.numel()).view_as(x)
    bound = world * max(t.shape[0] for t in xs) * topk
    inputs = [t.to(dev) for t in (x, idx, w, grad)]
    _step(kern, dev, *inputs, experts, bound, dtype)  # warm: kernels, workspaces, buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _step(kern, dev, *inputs, experts, bound, dtype)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = _step(ref, "cpu", x, idx, w, grad, experts, None, dtype)
    assert torch.equal(got[0].cpu(), want[0]), f"sync-free output {dtype}"
    assert torch.equal(got[1].cpu(), want[1]), f"sync-free x.grad {dtype}"
    torch.testing.assert_close(got[2].cpu(), want[2], rtol=1e-5, atol=1e-5)


def _overflow(rank, world):
    """Every rank receives more than a bound of 1 row: each raises at its next call (the rows
    past the bound were never written)."""
    experts = 2 * world
    xs, idxs, ws = make_inputs(77, world, 24, 1024, experts, 2, "random")
    dev = torch.device("cuda")
    buf = Buffer(dist.group.WORLD, 32, 1024, 2, num_sms=4, timeout_s=30)
    recv_x, _, handle, _ = buf.dispatch(xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev),
                                        num_experts=experts, num_max_recv_rows=1)
    assert recv_x.shape[0] == 1
    torch.cuda.synchronize()
    dist.barrier()
    with pytest.raises(ValueError, match=r"num_max_recv_rows=1 is too small: rank \d+ "
                                         r"receives \d+ rows"):
        buf.combine(recv_x, handle)
    buf.destroy()


def _worker(rank, world):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    if rank == 0:
        warm_up([2], row_dtypes=("bf16", "fp32"))
    dist.barrier()
    group = dist.group.WORLD
    kern = Buffer(group, 64, 2 * 1024, 2, num_sms=8, timeout_s=30)
    ref = Buffer(cpu_group(), 64, 2 * 1024, 2, transport="reference")
    for i, dtype in enumerate((torch.bfloat16, torch.float32)):
        _sync_free(rank, world, kern, ref, 500 + 10 * world + i, dtype)
    kern.check_errors()
    kern.destroy()
    dist.barrier()
    _overflow(rank, world)


@pytest.mark.parametrize("num_procs", NUM_PROCS)
def test_sync_free_matches_reference_without_host_sync(num_procs):
    run_distributed(num_procs, _worker, backend=tier_backend(), timeout_s=600)
