"""GPU tier: fp16 and fp32 (and bf16) rows on the kernel transports against the reference.

N processes share the GPU (`MDEEP_TEST_PROCS`; 1 runs the EP = 1 kernels, 2-8 the NVLink
kernels). Each drives the kernel Buffer on the GPU and the reference Buffer on CPU copies of the
same inputs over one gloo group and compares: dispatch bit-exact (a byte copy), combine
bit-exact (same fp32 order, the same rounding to the row dtype: none for fp32), weighted combine
and the per-(token, k) weights, cached dispatch, the no-sync mode, and autograd.
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
from tests.helpers.cases import expert_scale, make_inputs
from tests.helpers.compile_jobs import warm_up
from tests.helpers.distributed import cpu_group, run_distributed, tier_backend

pytestmark = pytest.mark.gpu

NUM_PROCS = list(test_knobs.get("TEST_PROCS"))
DTYPES = (torch.float16, torch.float32, torch.bfloat16)
# kind, tokens per rank, hidden, experts per rank, top-k, alignment
CASES = [
    ("random", 48, 2048, 4, 8, 1),
    ("dropped", 33, 2880, 2, 8, 16),
    ("uneven", None, 1024, 3, 2, 1),
    ("random", 0, 1024, 1, 1, 1),
]
TOPKS = (1, 2, 8)  # every top-k used here (dev/gpu/gpu_parity.sh precompiles these)


def _case(rank, world, kern, ref, dev, seed, dtype, kind, num_tokens, hidden, per_rank, topk,
          align):
    if kind == "uneven":
        num_tokens = [0] + [5 + 7 * r for r in range(1, world)]
        kind = "random"
    experts = per_rank * world
    xs, idxs, ws = make_inputs(seed, world, num_tokens, hidden, experts, topk, kind, dtype=dtype)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    tag = f"{dtype}, {kind}, H={hidden}, top-{topk}"
    recv_x, recv_w, handle, _ = kern.dispatch(x.to(dev), idx.to(dev), w.to(dev),
                                              num_experts=experts, expert_alignment=align)
    exp_x, exp_w, exp_handle, _ = ref.dispatch(x, idx, w, num_experts=experts,
                                               expert_alignment=align)
    assert recv_x.dtype == dtype and torch.equal(recv_x.cpu(), exp_x), f"dispatch: {tag}"
    assert torch.equal(recv_w.cpu(), exp_w)
    assert handle.tokens_per_expert_list == exp_handle.tokens_per_expert_list

    # Values that are not exact in 16 bits: the partial rounding is exercised.
    y = (expert_scale(exp_x.float(), exp_handle.tokens_per_expert_list) * 1.37).to(dtype)
    grad_rows = torch.rand(y.shape[0])
    for weighted in (False, True):
        out, out_w, _ = kern.combine(y.to(dev), handle, weighted=weighted,
                                     grad_row_weights=grad_rows.to(dev))
        ref_out, ref_w, _ = ref.combine(y, exp_handle, weighted=weighted,
                                        grad_row_weights=grad_rows)
        assert out.dtype == dtype
        assert torch.equal(out.cpu(), ref_out), f"combine (weighted={weighted}): {tag}"
        assert torch.equal(out_w.cpu(), ref_w)

    cached, _, _, _ = kern.dispatch((x * 3).to(dev), handle=handle)
    assert torch.equal(cached.cpu(), ref.dispatch(x * 3, handle=exp_handle)[0])

    bound = world * max(max(t.shape[0] for t in xs), 1) * topk + per_rank * align
    free_x, _, free_handle, _ = kern.dispatch(x.to(dev), idx.to(dev), w.to(dev),
                                              num_experts=experts, expert_alignment=align,
                                              num_max_recv_rows=bound)
    used = sum(exp_handle.tokens_per_expert_list)
    assert free_x.shape == (bound, hidden) and free_x.dtype == dtype
    assert torch.equal(free_x[:used].cpu(), exp_x)
    out, _, _ = kern.combine(free_x, free_handle)
    assert torch.equal(out.cpu(), ref.combine(exp_x, exp_handle)[0])


def _autograd(rank, world, kern, ref, kern_dev, seed, dtype):
    experts = 4 * world
    xs, idxs, ws = make_inputs(seed, world, 29, 1024, experts, 2, "dropped", dtype=dtype)
    results = []
    for buf, dev in ((kern, kern_dev), (ref, "cpu")):
        x = xs[rank].to(dev).requires_grad_()
        w = ws[rank].to(dev).requires_grad_()
        recv_x, recv_w, handle = ag_dispatch(buf, x, idxs[rank].to(dev), w, num_experts=experts)
        out = ag_combine(buf, (recv_x.float() * recv_w.unsqueeze(1) * 1.5).to(dtype), handle)
        g = torch.linspace(-1, 1, out.numel()).view_as(out).to(dev)  # the same values on both
        (out.float() * g).sum().backward()
        results.append((out.detach().cpu(), x.grad.cpu(), w.grad.cpu()))
    (o1, gx1, gw1), (o2, gx2, gw2) = results
    assert o1.dtype == dtype and gx1.dtype == dtype
    assert torch.equal(o1, o2) and torch.equal(gx1, gx2), f"autograd {dtype}"
    torch.testing.assert_close(gw1, gw2, rtol=1e-5, atol=1e-5)


def _worker(rank, world):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    if rank == 0:  # (dev/gpu/gpu_parity.sh precompiles them in parallel first)
        warm_up(TOPKS, row_dtypes=("bf16", "fp16", "fp32"))
    dist.barrier()
    group = dist.group.WORLD
    # hidden counts 2-byte elements: fp32 rows of 2880 need 5760.
    kern = Buffer(group, 64, 2 * 2880, 8, num_sms=8, timeout_s=30)
    ref = Buffer(cpu_group(), 64, 2 * 2880, 8, transport="reference")
    assert kern.transport_name == ("local" if world == 1 else "nvlink")
    for d, dtype in enumerate(DTYPES):
        for i, case in enumerate(CASES):
            _case(rank, world, kern, ref, "cuda", 100 * world + 10 * d + i, dtype, *case)
        _autograd(rank, world, kern, ref, "cuda", 7 + world + d, dtype)
    kern.check_errors()
    kern.destroy()


@pytest.mark.parametrize("num_procs", NUM_PROCS)
def test_row_dtypes_match_reference(num_procs):
    run_distributed(num_procs, _worker, backend=tier_backend(), timeout_s=600)
