"""GPU tier with Transformer Engine: the FP8 experts (`megatron.te_experts`) against TE's own.

0. The wgrad's columnwise copy by `cuda_src/fp8_columnwise.cu` against TE's own `split_quantize`
   of the dequantized rows (bit-exact), and `grouped_fp8_linear` with either (equal outputs).
1. `grouped_fp8_linear` on wire rows against `te.GroupedLinear` quantizing the same bf16 rows,
   same weights, under `Float8BlockScaling`: forward and dgrad use the same FP8 operands (TE's
   input quantizer makes the wire bytes), wgrad differs by the columnwise copy made from the
   dequantized rows; every result is also checked against the exact (fp32) product.
2. Megatron's `MoELayer` with the `deepep` dispatcher: FP8 dispatch handed to `FP8GroupedMLP`
   (`with_fp8_experts`) against bf16 dispatch into `TEGroupedMLP`, same weights (needs
   megatron-core; dev/gpu/gpu_te.sh installs the wheels from .whl/).
Run by dev/gpu/gpu_te.sh; skipped without TE or a GPU.
"""

from __future__ import annotations

import time

import pytest
import torch

from megatron_deepep.fp8 import formats as F
from megatron_deepep.fp8 import te_bridge
from tests.gpu.marks import TE_GPU

pytestmark = TE_GPU

#: Relative Frobenius-norm tolerances. Forward and dgrad see the operands TE sees (only the
#: accumulation order may differ); the wgrad operand is quantized from dequantized rows.
TOL_SAME = 2e-2
TOL_WGRAD = 0.15  # measured against TE's wgrad and against the exact product


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _autocast(recipe=None):
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8BlockScaling

    recipe = recipe if recipe is not None else Float8BlockScaling()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


@pytest.fixture(autouse=True)
def _needs_block_scaling():
    import transformer_engine.pytorch as te

    ok = te.is_fp8_block_scaling_available()
    if not (ok[0] if isinstance(ok, tuple) else ok):
        pytest.skip("TE: FP8 block scaling unavailable on this GPU")


class _Wire(torch.autograd.Function):
    """bf16 rows -> the wire tensor (as the dispatch hands it over); straight-through grad."""

    @staticmethod
    def forward(ctx, x):
        q, s = F.quantize(x.detach(), F.BLOCKWISE_1x128)
        return te_bridge.to_te_tensor(q, s, F.BLOCKWISE_1x128)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _grouped(num, h, out):
    import transformer_engine.pytorch as te

    torch.manual_seed(1)
    return te.GroupedLinear(num, h, out, bias=False, params_dtype=torch.bfloat16, device="cuda")


def _weights(module):
    return [getattr(module, f"weight{i}") for i in range(module.num_gemms)]


@pytest.mark.parametrize("splits,h,out", [
    ([64, 0, 128, 48], 2048, 1024),
    ([256, 512, 16, 0, 1024, 32, 96, 64], 7168, 2048),
])
def test_grouped_fp8_linear_matches_grouped_linear(splits, h, out):
    from megatron_deepep.megatron import te_experts

    gl = _grouped(len(splits), h, out)
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(sum(splits), h, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(sum(splits), out, device="cuda", generator=gen).bfloat16()

    x_te = x.clone().requires_grad_(True)
    with _autocast():
        y_te = gl(x_te, splits)
    y_te.backward(dy)
    w_te = [w.grad.clone() for w in _weights(gl)]
    for w in _weights(gl):
        w.grad = None

    x_ours = x.clone().requires_grad_(True)
    with _autocast():
        y_ours = te_experts.grouped_fp8_linear(gl, _Wire.apply(x_ours), splits)
    assert type(y_ours) is torch.Tensor and y_ours.dtype == torch.bfloat16
    y_ours.backward(dy)
    w_ours = [w.grad.clone() for w in _weights(gl)]

    print(f"\nsplits {splits} H {h} out {out}: forward rel {_rel(y_ours, y_te):.2e}, "
          f"dgrad rel {_rel(x_ours.grad, x_te.grad):.2e}, wgrad rel "
          f"{max(_rel(a, b) for a, b, m in zip(w_ours, w_te, splits) if m):.2e}")
    assert _rel(y_ours, y_te) < TOL_SAME
    assert _rel(x_ours.grad, x_te.grad) < TOL_SAME
    start = 0
    for m, weight, wo, wt in zip(splits, _weights(gl), w_ours, w_te):
        if m == 0:
            assert int(torch.count_nonzero(wo)) == 0 and int(torch.count_nonzero(wt)) == 0
            continue
        exact = dy[start:start + m].float().t() @ x[start:start + m].float()
        assert _rel(wo, wt) < TOL_WGRAD
        assert _rel(wo, exact) < TOL_WGRAD
        start += m
    exact_y = torch.cat([x[a:b].float() @ w.float().t() for a, b, w in
                         zip(_offsets(splits), _offsets(splits)[1:], _weights(gl))])
    assert _rel(y_ours, exact_y) < TOL_WGRAD


def _offsets(splits):
    out = [0]
    for m in splits:
        out.append(out[-1] + m)
    return out


def test_grouped_fp8_linear_inference_equals_te():
    from megatron_deepep.megatron import te_experts

    splits, h, out = [32, 16, 0, 80], 4096, 512
    gl = _grouped(len(splits), h, out)
    x = torch.randn(sum(splits), h, device="cuda").bfloat16()
    with torch.no_grad(), _autocast():
        y_te = gl(x, splits)
        y_ours = te_experts.grouped_fp8_linear(gl, _Wire.apply(x), splits)
    print(f"\ninference forward rel {_rel(y_ours, y_te):.2e}, bit-equal "
          f"{torch.equal(y_ours, y_te)}")
    assert _rel(y_ours, y_te) < TOL_SAME


# ---- the wgrad's columnwise copy: the kernel against TE's split_quantize ------------------------


def _call(splits, method, power_2_scale=True, amax_epsilon=0.0):
    from megatron_deepep.megatron import te_experts

    settings = dict(fp8_dtype="e4m3", amax_epsilon=amax_epsilon,
                    force_pow_2_scales=power_2_scale, block_scaling_dim=1)
    return te_experts._Call(splits=list(splits), settings={"input": settings},
                            fmt=F.BLOCKWISE_1x128, out_dtype=torch.bfloat16, columnwise=method)


@pytest.fixture
def kernel_calls(monkeypatch):
    """How often the FP8 experts made the columnwise copy with the kernel."""
    from megatron_deepep.megatron import te_experts

    calls = []
    original = te_experts._columnwise_by_kernel

    def counting(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(te_experts, "_columnwise_by_kernel", counting)
    return calls


@pytest.mark.parametrize("hidden,splits,kind,power_2_scale", [
    (2048, [64, 0, 272, 16, 128], "random", True),
    (4096, [16, 512, 0, 0, 144, 1024, 32], "random", True),
    (7168, [256, 48, 0, 400], "random", True),
    (4096, [16, 512, 0, 0, 144, 1024, 32], "random", False),
    (4096, [144, 0, 272], "nan_inf", True),
    (4096, [144, 0, 272], "tiny", False),
    (4096, [144, 0, 272], "huge", True),
])
def test_columnwise_kernel_equals_te_split_quantize(kernel_calls, hidden, splits, kind,
                                                    power_2_scale):
    """Per expert, the kernel's columnwise tensors equal TE's `split_quantize` of the
    dequantized rows (the `dequantize` method): shapes, data bytes (a NaN only a NaN) and scale
    bits; and both equal the pure-torch reference."""
    from megatron_deepep.fp8 import columnwise as C
    from megatron_deepep.megatron import te_experts
    from tests.gpu.test_fp8_columnwise_gpu import make_rows
    from tests.gpu.test_fp8_gpu import _assert_fp8_equal, _assert_scales_equal

    x_fp8, scales = make_rows(kind, splits, hidden, seed=hidden + len(splits))
    ours = te_experts.columnwise_operands(x_fp8.cuda(), scales.cuda(),
                                          _call(splits, "kernel", power_2_scale))
    theirs = te_experts.columnwise_operands(x_fp8.cuda(), scales.cuda(),
                                            _call(splits, "dequantize", power_2_scale))
    torch.cuda.synchronize()
    assert len(kernel_calls) == 1, "the kernel path was not taken"
    reference = C.reference(x_fp8, scales, splits, power_2_scale=power_2_scale)
    for ours_e, theirs_e, (data_ref, scale_ref) in zip(ours, theirs, reference):
        assert ours_e._rowwise_data is None and theirs_e._rowwise_data is None
        assert ours_e._columnwise_data.shape == theirs_e._columnwise_data.shape
        assert ours_e._columnwise_scale_inv.shape == theirs_e._columnwise_scale_inv.shape
        _assert_fp8_equal(ours_e._columnwise_data, theirs_e._columnwise_data.cpu())
        _assert_scales_equal(ours_e._columnwise_scale_inv,
                             theirs_e._columnwise_scale_inv.cpu())
        _assert_fp8_equal(ours_e._columnwise_data, data_ref)
        _assert_scales_equal(ours_e._columnwise_scale_inv, scale_ref)


@pytest.mark.parametrize("splits,h,out", [
    ([64, 0, 128, 48], 2048, 1024),
    ([256, 512, 16, 0, 1024, 32, 96, 64], 7168, 2048),
])
def test_grouped_fp8_linear_kernel_path_equals_dequantize_path(kernel_calls, splits, h, out):
    """`grouped_fp8_linear` forward + backward with the columnwise copy by the kernel and by
    dequantize + `split_quantize`: the GEMMs get the same operands, so the outputs agree (bit
    for bit unless a GEMM changes its reduction order; printed)."""
    from megatron_deepep.megatron import te_experts

    gl = _grouped(len(splits), h, out)
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(sum(splits), h, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(sum(splits), out, device="cuda", generator=gen).bfloat16()
    results = {}
    for method in ("kernel", "dequantize"):
        gl.fp8_columnwise = method
        xi = x.clone().requires_grad_(True)
        with _autocast():
            y = te_experts.grouped_fp8_linear(gl, _Wire.apply(xi), splits)
        y.backward(dy)
        results[method] = (y.detach(), xi.grad, [w.grad.clone() for w in _weights(gl)])
        for w in _weights(gl):
            w.grad = None
    assert len(kernel_calls) == 1
    (y1, dx1, w1), (y2, dx2, w2) = results["kernel"], results["dequantize"]
    wgrad_equal = all(torch.equal(a, b) for a, b in zip(w1, w2))
    print(f"\nsplits {splits} H {h}: kernel vs dequantize path: forward equal "
          f"{torch.equal(y1, y2)}, dgrad equal {torch.equal(dx1, dx2)}, wgrad bit-equal "
          f"{wgrad_equal}, max wgrad rel {max(_rel(a, b) for a, b in zip(w1, w2)):.1e}")
    # Same operands (bit-equal: test_columnwise_kernel_equals_te_split_quantize); the GEMMs
    # are not promised to be bitwise deterministic, so equal up to their reduction order.
    for a, b in [(y1, y2), (dx1, dx2)] + list(zip(w1, w2)):
        assert _rel(a, b) < 1e-6


def test_columnwise_time_kernel_against_dequantize():
    """The wgrad's columnwise copy at the bench shape (N 8192, top-6, 64 experts, H 4096):
    the kernel against dequantize + TE's split_quantize. Both give the same bits per expert,
    and the kernel (one pass, FP8 in and out) takes less GPU time than the two-step path
    (828 against 1250 µs when measured, `benchmarks/h200_2026-12-04_moe_layer.md`). GPU (CUDA
    events) and host time per call are printed."""
    from megatron_deepep.megatron import te_experts
    from tests.gpu.test_fp8_columnwise_gpu import BENCH_EXPERTS, BENCH_HIDDEN, bench_rows
    from tests.gpu.test_fp8_gpu import _assert_fp8_equal, _assert_scales_equal

    hidden, num_experts = BENCH_HIDDEN, BENCH_EXPERTS
    splits, rows, _, x, s = bench_rows()
    x = x.view(torch.float8_e4m3fn)
    gpu_us, outputs = {}, {}
    for method in ("kernel", "dequantize"):
        call = _call(splits, method)
        outputs[method] = te_experts.columnwise_operands(x, s, call)
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        gpu, host = [], []
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            start.record()
            te_experts.columnwise_operands(x, s, call)
            end.record()
            host.append((time.perf_counter() - t0) * 1e6)
            end.synchronize()
            gpu.append(start.elapsed_time(end) * 1e3)
        gpu_us[method] = sorted(gpu)[5]
        print(f"\ncolumnwise copy by {method:10s} (M {rows[-1]}, H {hidden}, E {num_experts}): "
              f"GPU {gpu_us[method]:7.1f} us, host {sorted(host)[5]:7.1f} us per call")
    assert len(outputs["kernel"]) == len(outputs["dequantize"]) == num_experts
    for ours_e, theirs_e in zip(outputs["kernel"], outputs["dequantize"]):
        assert ours_e._columnwise_data.shape == theirs_e._columnwise_data.shape
        _assert_fp8_equal(ours_e._columnwise_data, theirs_e._columnwise_data.cpu())
        _assert_scales_equal(ours_e._columnwise_scale_inv, theirs_e._columnwise_scale_inv.cpu())
    assert gpu_us["kernel"] < gpu_us["dequantize"], gpu_us


# ---- Megatron MoELayer ---------------------------------------------------------------------------


def _moe_layer(hidden, ffn, num_experts, topk, fp8_experts, fp8_dispatch):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_deepep.bench.layer_variants import te_moe_layer
    from megatron_deepep.megatron.options import set_default_options

    set_default_options(transport="auto", fp8_dispatch=fp8_dispatch)
    config = TransformerConfig(
        num_layers=2, hidden_size=hidden, ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn,
        num_attention_heads=8, num_moe_experts=num_experts, moe_router_topk=topk,
        moe_token_dispatcher_type="deepep", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, moe_router_dtype="fp32", add_bias_linear=False,
        gradient_accumulation_fusion=False, params_dtype=torch.bfloat16, bf16=True,
        moe_grouped_gemm=True, fp8="e4m3", fp8_recipe="blockwise",
        moe_router_padding_for_quantization=True)
    layer, _ = te_moe_layer(config, num_experts, fp8_experts)
    return layer.cuda()


def _run_layer(layer, x, grad, context=None):
    """`(output, input grad, {parameter: grad})` of one forward (under `context()`, TE's
    blockwise FP8 autocast by default) and backward of `sum(output * grad)`."""
    xi = x.clone().requires_grad_(True)
    with (context or _autocast)():
        out, _ = layer(xi)
    (out.float() * grad.float()).sum().backward()
    return out.detach(), xi.grad, {n: p.grad.detach().clone() for n, p in layer.named_parameters()
                                   if p.grad is not None}


@pytest.mark.parametrize("hidden,ffn,num_experts,topk", [(1024, 512, 8, 2), (2048, 1024, 16, 6)])
def test_moe_layer_fp8_experts_match_te_grouped_mlp(megatron_env, monkeypatch, kernel_calls,
                                                    hidden, ffn, num_experts, topk):
    """`FP8GroupedMLP` (columnwise copy by the kernel) against `TEGroupedMLP` within the
    tolerances above, and against itself with the two-step columnwise path (within 1e-5)."""
    from megatron_deepep.megatron import te_experts

    calls = []
    original = te_experts.grouped_fp8_linear

    def counting(module, x, splits):
        calls.append(list(splits))
        return original(module, x, splits)

    monkeypatch.setattr(te_experts, "grouped_fp8_linear", counting)
    ours = _moe_layer(hidden, ffn, num_experts, topk, fp8_experts=True, fp8_dispatch="blockwise")
    ref = _moe_layer(hidden, ffn, num_experts, topk, fp8_experts=False, fp8_dispatch="off")
    assert type(ours.experts).__name__ == "FP8GroupedMLP" and ours.experts.takes_fp8_rows
    assert type(ref.experts).__name__ == "TEGroupedMLP"
    ref.load_state_dict(ours.state_dict())
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(256, 2, hidden, device="cuda", generator=gen).bfloat16()
    grad = torch.randn(256, 2, hidden, device="cuda", generator=gen).bfloat16()
    ours.train()
    ref.train()
    o1, g1, p1 = _run_layer(ours, x, grad)
    assert len(calls) == 1, "the FP8 rows did not reach the FP8 experts"
    assert all(m % te_experts.ROW_ALIGNMENT == 0 for m in calls[0])
    o2, g2, p2 = _run_layer(ref, x, grad)
    groups = {}
    for name in p1:
        key = "fc1" if "linear_fc1" in name else "fc2" if "linear_fc2" in name else name
        groups[key] = max(groups.get(key, 0.0), _rel(p1[name], p2[name]))
    print(f"\nMoELayer H {hidden} E {num_experts} top-{topk}: output rel {_rel(o1, o2):.2e}, "
          f"input grad rel {_rel(g1, g2):.2e}; max grad rel: "
          + ", ".join(f"{k} {v:.2e}" for k, v in sorted(groups.items())))
    assert _rel(o1, o2) < TOL_SAME
    assert _rel(g1, g2) < 5e-2
    assert p1.keys() == p2.keys()
    for name in p1:
        tol = TOL_WGRAD if "linear_fc1" in name else 5e-2
        assert _rel(p1[name], p2[name]) < tol, name
    assert len(kernel_calls) == 1, "the columnwise copy did not come from the kernel"
    ours.zero_grad(set_to_none=True)
    ours.experts.linear_fc1.fp8_columnwise = "dequantize"
    o3, g3, p3 = _run_layer(ours, x, grad)
    assert len(kernel_calls) == 1 and len(calls) == 2
    worst = max(_rel(p1[name], p3[name]) for name in p1)
    print(f"  kernel vs dequantize columnwise path: output rel {_rel(o1, o3):.1e}, input grad "
          f"rel {_rel(g1, g3):.1e}, max grad rel {worst:.1e}")
    assert _rel(o1, o3) < 1e-5 and _rel(g1, g3) < 1e-5 and worst < 1e-5


def _step(layer, x, grad):
    layer.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_(True)
    with _autocast():
        out, _ = layer(xi)
    out.backward(grad)


def test_moe_layer_timing(megatron_env):
    """Forward + backward of one MoE layer (H 4096, 64 experts, top-6, 8192 tokens) in three
    variants with the same weights: their outputs and input gradients agree within the FP8
    tolerances (`TOL_SAME`; the FP8 rows differ from bf16 by their quantization) and their
    times within 1.5x of each other (they run the same GEMMs: 13.64 / 13.25 / 13.30 ms when
    measured, `benchmarks/h200_2026-12-04_moe_layer.md`; a variant that doubles is a
    regression). Printed too."""
    hidden, ffn, num_experts, topk, tokens = 4096, 1024, 64, 6, 8192
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(tokens, 1, hidden, device="cuda", generator=gen).bfloat16()
    grad = torch.randn(tokens, 1, hidden, device="cuda", generator=gen).bfloat16()
    results, runs, weights = {}, {}, None
    for name, fp8_experts, dispatch in [("deepep bf16 -> TEGroupedMLP", False, "off"),
                                        ("deepep fp8 dequantized -> TEGroupedMLP", False,
                                         "blockwise"),
                                        ("deepep fp8 -> FP8GroupedMLP", True, "blockwise")]:
        layer = _moe_layer(hidden, ffn, num_experts, topk, fp8_experts, dispatch)
        if weights is None:
            weights = {k: v.clone() for k, v in layer.state_dict().items()}
        else:
            layer.load_state_dict(weights)
        layer.train()
        out, x_grad, _ = _run_layer(layer, x, grad)
        assert torch.isfinite(out).all() and torch.isfinite(x_grad).all(), name
        runs[name] = (out, x_grad)
        for _ in range(3):
            _step(layer, x, grad)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            _step(layer, x, grad)
        torch.cuda.synchronize()
        results[name] = (time.perf_counter() - start) / 10 * 1e3
        del layer
        torch.cuda.empty_cache()
    print("\nMoE layer fwd+bwd (EP 1, H 4096, E 64, top-6, 8192 tokens, blockwise):")
    for name, ms in results.items():
        print(f"  {name:42s} {ms:8.2f} ms")
    (base_out, base_grad), *others = runs.values()
    for out, x_grad in others:
        assert _rel(out, base_out) < TOL_SAME and _rel(x_grad, base_grad) < 5e-2
    assert all(ms > 0 for ms in results.values())
    assert max(results.values()) < 1.5 * min(results.values()), results
