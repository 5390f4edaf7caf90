"""GPU tier: FP8 dispatch on the NVLink kernels against the reference, N processes on one GPU.

Per format (blockwise 1x128 with power-of-two and with fp32 scales, MXFP8 1x32) and routing
case: the quantization fused into the send (bf16 input) and the pre-quantized input give the
reference's e4m3 rows and scales bit for bit; the dequantizing expand equals the reference's
bf16 dispatch of the dequantized input; cached dispatch replays the same rows. Inputs carry
zero rows, huge and tiny values, and a few NaN/inf, whose handling is defined in formats.py.
At 1 process (the EP = 1 kernels) it runs at an SM budget below `MDEEP_FP8_ROW_STAGE_MIN_SMS`
and at one from it up, so both paths of the quantizing expand run: quantizing in registers
and staging whole rows in shared memory.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_deepep import ops
from megatron_deepep.buffer import Buffer
from megatron_deepep.fp8 import FORMATS
from megatron_deepep.fp8.dispatch import Fp8Dispatch
from tests.helpers.cases import make_inputs
from tests.helpers.distributed import cpu_group, run_distributed, tier_backend

pytestmark = pytest.mark.gpu

NUM_PROCS = [int(n) for n in os.environ.get("MDEEP_TEST_PROCS", "1,2,3,4,8").split(",")]
# SM budgets: 8 everywhere; at EP = 1 also the row-stage threshold, the other expand path
# (with the knob at 8 or below, both budgets stage rows; the test says which path it ran).
ROW_STAGE_MIN_SMS = ops.dispatch.row_stage_min_sms()
RUNS = [(n, sms) for n in NUM_PROCS
        for sms in ((8, max(ROW_STAGE_MIN_SMS, 9)) if n == 1 else (8,))]

# kind, tokens per rank, hidden, experts per rank, top-k, alignment
CASES = [
    ("random", 48, 7168, 4, 8, 1),
    ("random", 29, 2880, 3, 4, 16),
    ("skewed", 20, 2048, 2, 2, 32),
    ("dropped", 33, 4096, 2, 6, 1),
    ("random", 0, 2048, 1, 2, 1),
]


def _with_specials(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Adds a zero row, a huge and a tiny row, and scattered NaN/inf to bf16 rows."""
    x = x.clone()
    if x.shape[0] < 4:
        return x
    g = torch.Generator().manual_seed(seed)
    x[0] = 0
    x[1] *= 1e30
    x[2] *= 1e-30
    flat = x.view(-1)
    picks = torch.randint(0, flat.numel(), (6,), generator=g)
    flat[picks[:2]] = float("nan")
    flat[picks[2:4]] = float("inf")
    flat[picks[4:]] = float("-inf")
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An exact, NaN-safe integer view for comparisons."""
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(
        {2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same(got, exp, what: str) -> None:
    got = got if isinstance(got, tuple) else (got,)
    exp = exp if isinstance(exp, tuple) else (exp,)
    assert len(got) == len(exp), what
    for g, e in zip(got, exp):
        assert g.dtype == e.dtype and g.shape == e.shape, f"{what}: {g.dtype}{tuple(g.shape)}"
        assert torch.equal(_bits(g), _bits(e)), f"{what}: bytes differ"


def _padding_rows(handle) -> torch.Tensor:
    """`[M]` bool: the alignment-padding rows of a (reference) dispatch."""
    counts = handle.num_recv_tokens_per_expert.cpu().tolist()
    padded = handle.tokens_per_expert.cpu().tolist()
    mask = torch.zeros(sum(padded), dtype=torch.bool)
    start = 0
    for used, size in zip(counts, padded):
        mask[start + used:start + size] = True
        start += size
    return mask


def _expected_fp8(fmt, recv_x: torch.Tensor, handle):
    """Oracle: quantization is per token, so dispatch(quantize(x)) == quantize(dispatch(x))
    rows, except that padding rows carry all-zero data and scales."""
    data, scales = fmt.quantize(recv_x)
    pad = _padding_rows(handle)
    data.view(torch.uint8)[pad] = 0
    scales[pad] = 0
    return data, scales


def _dispatch(buf, x, idx, w, experts, align, fp8, x_scales=None):
    """Buffer.dispatch in FP8: bf16 `x`, or the pre-quantized pair when `x_scales` is given."""
    rows = x if x_scales is None else (x, x_scales)
    return buf.dispatch(rows, idx, w, num_experts=experts, expert_alignment=align, fp8=fp8)[:3]


def _case(rank, world, nvl, ref, seed, kind, num_tokens, hidden, per_rank, topk, align):
    experts = per_rank * world
    xs, idxs, ws = make_inputs(seed, world, num_tokens, hidden, experts, topk, kind)
    x = _with_specials(xs[rank], seed + rank)
    idx, w = idxs[rank], ws[rank]
    dev = torch.device("cuda")
    xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)
    # The bf16 reference of every rank's rows (with the specials each rank planted).
    all_x = [_with_specials(xs[r], seed + r) for r in range(world)]
    exp_x, exp_w, exp_handle = ref.dispatch(all_x[rank], idx, w, num_experts=experts,
                                            expert_alignment=align)[:3]
    for name, fmt in FORMATS.items():
        keep, deq = Fp8Dispatch(fmt, "fp8"), Fp8Dispatch(fmt, "bf16")
        where = f"{name} {kind} H={hidden} K={topk} R={world}"
        expected = _expected_fp8(fmt, exp_x, exp_handle)
        got, got_w, handle = _dispatch(nvl, xd, idxd, wd, experts, align, keep)
        _assert_same(got, expected, f"fused quantize ({where})")
        assert torch.equal(got_w.cpu(), exp_w), f"weights ({where})"

        # Pre-quantized input: the same bytes, nothing quantized again.
        x_fp8, x_scales = fmt.quantize(x)
        pre = _dispatch(nvl, x_fp8.to(dev), idxd, wd, experts, align, keep, x_scales.to(dev))
        _assert_same(pre[0], expected, f"pre-quantized ({where})")

        # The dequantizing expand == the dequantized expected rows (padding rows zero).
        exp_bf = fmt.dequantize(*expected)
        bf = _dispatch(nvl, xd, idxd, wd, experts, align, deq)
        _assert_same(bf[0], exp_bf, f"dequantized expand ({where})")
        pre_bf = _dispatch(nvl, x_fp8.to(dev), idxd, wd, experts, align, deq, x_scales.to(dev))
        _assert_same(pre_bf[0], exp_bf, f"pre-quantized, dequantized ({where})")

        # Cached FP8 dispatch replays the same rows.
        cached = nvl.dispatch(xd, handle=handle, fp8=keep)[0]
        _assert_same(cached, expected, f"cached ({where})")
    nvl.check_errors()


def _worker(rank, world, num_sms):
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    group = dist.group.WORLD
    nvl = Buffer(group, 64, 7168, 8, transport="nvlink", num_sms=num_sms, timeout_s=30)
    ref = Buffer(cpu_group(), 64, 7168, 8, transport="reference")
    for i, case in enumerate(CASES):
        _case(rank, world, nvl, ref, 500 * world + i, *case)
    dist.barrier()
    nvl.destroy()


def _expand_path(num_procs: int, num_sms: int) -> str:
    """Which path the quantizing expand takes: only the EP = 1 expand has two."""
    if num_procs > 1:
        return "nvlink"
    fp8 = Fp8Dispatch(FORMATS["blockwise_1x128"], "fp8")
    staged = ops.dispatch._quantize_stage_bytes(7168, ops.dispatch.COMM_THREADS, fp8, None,
                                                num_sms)
    return "row stage" if staged >= 7168 else "registers"  # a whole row, or scales alone


@pytest.mark.parametrize("num_procs,num_sms", RUNS,
                         ids=[f"{n}procs-{sms}sms-{_expand_path(n, sms).replace(' ', '_')}"
                              for n, sms in RUNS])
def test_fp8_dispatch_matches_reference(num_procs, num_sms):
    run_distributed(num_procs, _worker, num_sms, backend=tier_backend(), timeout_s=1500)


def test_both_expand_paths_are_in_the_runs():
    """At EP = 1 the budgets above straddle MDEEP_FP8_ROW_STAGE_MIN_SMS (when it is above 8)."""
    if 1 not in NUM_PROCS:
        pytest.skip("MDEEP_TEST_PROCS has no 1: the EP = 1 expand is not run")
    paths = {_expand_path(1, sms) for n, sms in RUNS if n == 1}
    want = {"registers", "row stage"} if ROW_STAGE_MIN_SMS > 8 else {"row stage"}
    assert paths == want, (ROW_STAGE_MIN_SMS, paths)
