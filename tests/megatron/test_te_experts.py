"""`megatron.te_experts` without Transformer Engine: spec rewriting, reasons, quantizer settings.

The GEMMs themselves run in tests/gpu/test_te_experts_gpu.py (dev/gpu/gpu_te.sh).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import pytest

from megatron_deepep.megatron import te_experts as X


class TEGroupedMLP:
    pass


class TEColumnParallelGroupedLinear:
    pass


class TERowParallelGroupedLinear:
    pass


class MoELayer:
    pass


class Ours(TEGroupedMLP):
    pass


class OursFc1(TEColumnParallelGroupedLinear):
    pass


@dataclasses.dataclass
class ModuleSpec:  # megatron-core <= 0.16 (dataclass: module, params, submodules)
    module: Any
    params: dict = dataclasses.field(default_factory=dict)
    submodules: Any = None


@dataclasses.dataclass
class MLPSubmodules:
    linear_fc1: Any = None
    linear_fc2: Any = None
    activation_func: Optional[Any] = None


@dataclasses.dataclass
class MoESubmodules:
    experts: Any = None
    shared_experts: Any = None


@dataclasses.dataclass
class Layer:
    mlp: Any = None
    sizes: tuple = (1, 2)
    derived: int = dataclasses.field(default=0, init=False)


MAPPING = {TEGroupedMLP: Ours, TEColumnParallelGroupedLinear: OursFc1}


def test_replace_classes_in_a_module_spec_tree():
    shared = ModuleSpec(module=object,
                        submodules=MLPSubmodules(linear_fc1=TERowParallelGroupedLinear))
    experts = ModuleSpec(module=TEGroupedMLP, submodules=MLPSubmodules(
        linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear))
    spec = ModuleSpec(module=object, submodules=Layer(mlp=ModuleSpec(
        module=MoELayer, submodules=MoESubmodules(experts=experts, shared_experts=shared))))
    new = X.replace_classes(spec, MAPPING)
    moe = new.submodules.mlp.submodules
    assert moe.experts.module is Ours
    assert moe.experts.submodules.linear_fc1 is OursFc1
    assert moe.experts.submodules.linear_fc2 is TERowParallelGroupedLinear
    assert moe.shared_experts is shared  # untouched parts are shared, not copied
    assert spec.submodules.mlp.submodules.experts.module is TEGroupedMLP  # input unchanged
    assert X.replace_classes(shared, MAPPING) is shared


def test_replace_classes_in_partial_builders():
    """megatron-core 0.17+: `partial(MoELayer, submodules=MoESubmodules(experts=partial(...)))`."""
    experts = functools.partial(TEGroupedMLP, submodules=MLPSubmodules(
        linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear))
    spec = [functools.partial(MoELayer, 3, submodules=MoESubmodules(experts=experts)),
            {"dense": TERowParallelGroupedLinear}]
    new = X.replace_classes(spec, MAPPING)
    built = new[0]
    assert built.func is MoELayer and built.args == (3,)
    assert built.keywords["submodules"].experts.func is Ours
    assert built.keywords["submodules"].experts.keywords["submodules"].linear_fc1 is OursFc1
    assert new[1] is spec[1]


def test_splits_reason():
    assert X.splits_reason([0, 16, 32, 4096]) == ""
    reason = X.splits_reason([16, 8, 3])
    assert "2 experts" in reason and "expert 1: 8" in reason
    assert "--moe-router-padding-for-quantization" in reason


class _Q:
    def __init__(self, p2=True, eps=0.0):
        self.power_2_scale, self.amax_epsilon = p2, eps


class _F:
    def __init__(self, name):
        self.name = name


class Float8BlockScaling:
    def __init__(self, fmt="E4M3", backward_override=None, x_dim=1):
        self.fp8_format = _F(fmt)
        self.fp8_quant_fwd_inp = _Q()
        self.fp8_quant_fwd_weight = _Q(True, 1e-6)
        self.fp8_quant_bwd_grad = _Q(False)
        self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim = \
            x_dim, 2, 1
        self.backward_override = backward_override


class MXFP8BlockScaling:
    fp8_format = _F("E4M3")


def test_quantizer_settings_follow_the_recipe():
    s = X.quantizer_settings(Float8BlockScaling("HYBRID"))
    assert s["input"] == dict(fp8_dtype="e4m3", amax_epsilon=0.0, force_pow_2_scales=True,
                              block_scaling_dim=1)
    assert s["weight"] == dict(fp8_dtype="e4m3", amax_epsilon=1e-6, force_pow_2_scales=True,
                               block_scaling_dim=2)
    assert s["grad"] == dict(fp8_dtype="e5m2", amax_epsilon=0.0, force_pow_2_scales=False,
                             block_scaling_dim=1)
    assert X.quantizer_settings(Float8BlockScaling("E4M3"))["grad"]["fp8_dtype"] == "e4m3"


def test_recipe_reason():
    assert X.recipe_reason(Float8BlockScaling()) == ""
    assert "Float8BlockScaling (1x128) only" in X.recipe_reason(MXFP8BlockScaling())
    assert "x_block_scaling_dim" in X.recipe_reason(Float8BlockScaling(x_dim=2))
    recipe = Float8BlockScaling(backward_override="dequantized")
    assert "backward_override" in X.recipe_reason(recipe)
    assert X.recipe_reason(None)


class _Fc1:
    use_bias, single_grouped_weight, tp_size = False, False, 1

    def __init__(self):
        import torch
        self.weight0 = torch.nn.Parameter(torch.zeros(4, 4))


def test_fc1_reason():
    fc1 = _Fc1()
    assert X.fc1_reason(fc1, [16, 0], Float8BlockScaling()) == ""
    assert "multiple of 16" in X.fc1_reason(fc1, [16, 8], Float8BlockScaling())
    fc1.use_bias = True
    assert "biases" in X.fc1_reason(fc1, [16], Float8BlockScaling())


def test_experts_flag():
    class E:
        takes_fp8_rows = True

    assert X.experts_take_fp8_rows(E()) is True
    assert X.experts_take_fp8_rows(object()) is False
    assert X.experts_take_fp8_rows(None) is False


class GroupedLinear:  # TE's class name; Megatron's TE wrappers derive from it
    pass


class _TEGroupedFc1(GroupedLinear):
    pass


def test_experts_that_refuse_quantized_rows():
    class TEGroupedMLPLike:
        linear_fc1 = _TEGroupedFc1()

    class FP8Like(TEGroupedMLPLike):
        takes_fp8_rows = True

    class SequentialLike:
        linear_fc1 = object()

    reason = X.experts_refuse_fp8_reason(TEGroupedMLPLike())
    assert "GroupedLinear" in reason and "with_fp8_experts" in reason
    assert X.experts_refuse_fp8_reason(FP8Like()) == ""
    assert X.experts_refuse_fp8_reason(SequentialLike()) == ""
    assert X.experts_refuse_fp8_reason(None) == ""


def test_dispatcher_asks_the_experts(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron_deepep.fp8 import formats as F
    from megatron_deepep.megatron import dispatcher as D
    from megatron_deepep.megatron import options

    class Layer:
        def __init__(self, experts):
            self.experts = experts

    class FP8Experts:
        takes_fp8_rows = True
        linear_fc1 = _TEGroupedFc1()

    class TEExperts:
        linear_fc1 = _TEGroupedFc1()

    d = D.DeepEPTokenDispatcher.__new__(D.DeepEPTokenDispatcher)
    d._layer_ref, d.drop_and_pad, d.tp_size = None, False, 1
    d.options = options.DeepEPOptions(fp8_dispatch="blockwise")
    assert d._experts() is None
    seen = []
    monkeypatch.setattr(D, "fp8_handoff", lambda fmt, training, pad, experts_make_columnwise:
                        seen.append(experts_make_columnwise) or (True, ""))
    layer = Layer(FP8Experts())
    d.bind_layer(layer)
    assert d._fp8_spec().output == "fp8" and seen == [True]
    layer.experts = TEExperts()
    spec = d._fp8_spec()
    assert spec.fmt == F.BLOCKWISE_1x128 and spec.output == "bf16" and seen == [True]


# ---- GroupedFP8Linear's plumbing against a fake TE ----------------------------------------------
# The fake GEMM checks the operand usages TE's `CanonicalizeGemmInput` requires for each layout
# (Hopper: TN only, "columnwise" data is the transpose) and computes in fp32 from unquantized
# values, so forward and gradients must equal the exact products of the dequantized rows.

class _FakeStorage:
    def __init__(self, values, rowwise, columnwise, role):
        self.values, self.rowwise, self.columnwise, self.role = values, rowwise, columnwise, role

    def update_usage(self, rowwise_usage=None, columnwise_usage=None):
        if columnwise_usage:
            assert self.role == "weight", "only 2D-scaled weights derive columnwise data"
            self.columnwise = True


class _FakeQuantizer:
    def __init__(self, dtype, *, rowwise, columnwise, amax_epsilon=0.0, force_pow_2_scales=True,
                 block_scaling_dim=2):
        self.dtype, self.rowwise_usage, self.columnwise_usage = dtype, rowwise, columnwise
        self.block_scaling_dim, self.internal = block_scaling_dim, False

    def copy(self):
        q = _FakeQuantizer(self.dtype, rowwise=self.rowwise_usage,
                           columnwise=self.columnwise_usage,
                           block_scaling_dim=self.block_scaling_dim)
        q.internal = self.internal
        return q

    def __call__(self, tensor):
        assert self.block_scaling_dim == 2 and self.internal
        return _FakeStorage(tensor.float(), self.rowwise_usage, self.columnwise_usage, "weight")


def _fake_split_quantize(tensor, splits, quantizers):
    assert len(splits) == len(quantizers) and all(q.internal for q in quantizers)
    assert all(q.block_scaling_dim == 1 for q in quantizers)
    parts = tensor.float().split(list(splits))
    return [_FakeStorage(p, q.rowwise_usage, q.columnwise_usage, "act")
            for p, q in zip(parts, quantizers)]


def _fake_grouped_gemm(A, B, out, quantization_params, out_dtype, layout="TN", m_splits=None,
                       gelu=False, grad=False, accumulate=False, bias=None, use_bias=False,
                       use_split_accumulator=False, D_dtype=None, single_output=False):
    import torch

    need_a = "rowwise" if layout[0] == "T" else "columnwise"
    need_b = "columnwise" if layout[1] == "T" else "rowwise"
    results = []
    for a, b in zip(A, B):
        assert getattr(a, need_a), f"{layout}: A lacks its {need_a} data"
        assert getattr(b, need_b), f"{layout}: B lacks its {need_b} data"
        if layout == "TN":
            results.append(b.values @ a.values.t())
        elif layout == "NN":
            results.append(b.values @ a.values)
        else:
            results.append(b.values.t() @ a.values)
    if single_output:
        out[0].copy_(torch.cat(results).to(out[0].dtype))
    else:
        for o, r in zip(out, results):
            o.add_(r.to(o.dtype)) if accumulate else o.copy_(r.to(o.dtype))
    return out, None, None


@pytest.fixture
def fake_te_gemm(monkeypatch):
    import sys
    import types

    import torch

    from megatron_deepep.fp8 import formats as F
    from megatron_deepep.fp8 import te_bridge

    tex = types.SimpleNamespace(DType=types.SimpleNamespace(kFloat8E4M3=7, kFloat8E5M2=8),
                                split_quantize=_fake_split_quantize)
    fbt = types.SimpleNamespace(Float8BlockQuantizer=_FakeQuantizer)
    cpp = types.SimpleNamespace(general_grouped_gemm=_fake_grouped_gemm)
    monkeypatch.setitem(sys.modules, "transformer_engine_torch", tex)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.tensor.float8_blockwise_tensor",
                        fbt)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.cpp_extensions", cpp)
    # The wire tensor is played by bf16 rows; from_te_tensor quantizes them like the sender.
    monkeypatch.setattr(te_bridge, "from_te_tensor",
                        lambda x: F.quantize(x.detach(), F.BLOCKWISE_1x128))

    def split_rowwise(x_fp8, scales, splits, fmt, dtype):
        rows = F.dequantize(x_fp8, scales, fmt).float().split(list(splits))
        return [_FakeStorage(r, True, False, "act") for r in rows]

    monkeypatch.setattr(te_bridge, "split_rowwise", split_rowwise)
    monkeypatch.setattr(te_bridge, "active_recipe", lambda: Float8BlockScaling())
    monkeypatch.setattr(te_bridge, "te_available", lambda: (True, ""))
    return torch


class _Module:
    def __init__(self, num, out, hidden, fuse=False):
        import torch

        gen = torch.Generator().manual_seed(5)
        self.num_gemms, self.fuse_wgrad_accumulation = num, fuse
        for i in range(num):
            w = torch.randn(out, hidden, generator=gen).bfloat16()
            setattr(self, f"weight{i}", torch.nn.Parameter(w))

    def weights(self):
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]


@pytest.mark.parametrize("fuse", [False, True])
def test_grouped_fp8_linear_plumbing(fake_te_gemm, fuse):
    torch = fake_te_gemm
    from megatron_deepep.fp8 import formats as F

    splits, hidden, out = [16, 0, 32, 48], 256, 64
    module = _Module(len(splits), out, hidden, fuse)
    if fuse:
        for w in module.weights():
            w.main_grad = torch.ones(out, hidden)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(sum(splits), hidden, generator=gen).bfloat16().requires_grad_(True)
    dy = torch.randn(sum(splits), out, generator=gen).bfloat16()
    y = X.grouped_fp8_linear(module, x, splits)
    y.backward(dy)

    xq = F.dequantize(*F.quantize(x.detach(), F.BLOCKWISE_1x128), F.BLOCKWISE_1x128).float()
    rows = list(zip(xq.split(splits), dy.float().split(splits), module.weights()))
    want_y = torch.cat([xe @ w.float().t() for xe, _, w in rows])
    want_dx = torch.cat([ge @ w.float() for _, ge, w in rows])
    torch.testing.assert_close(y.float(), want_y, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x.grad.float(), want_dx, rtol=1e-2, atol=1e-2)
    for xe, ge, w in rows:
        want_w = ge.t() @ xe
        if fuse:
            assert w.grad_added_to_main_grad
            torch.testing.assert_close(w.main_grad, want_w + 1, rtol=1e-2, atol=5e-2)
        else:
            torch.testing.assert_close(w.grad.float(), want_w, rtol=1e-2, atol=5e-2)


@pytest.mark.parametrize("method", ["kernel", "dequantize"])
def test_columnwise_method_picks_the_wgrad_operand(fake_te_gemm, monkeypatch, method):
    """The knob (or the layer's `fp8_columnwise`) picks how the wgrad's columnwise copy is made;
    both give the same weight gradients; the kernel path runs where `columnwise_reason` allows
    (here, stood in by the pure-torch reference)."""
    torch = fake_te_gemm
    from megatron_deepep.fp8 import columnwise as C
    from megatron_deepep.fp8 import formats as F
    from megatron_deepep.fp8 import te_bridge

    used = []

    def by_kernel(x_fp8, scales, call):
        used.append("kernel")
        settings = call.settings["input"]
        C.reference(x_fp8, scales, call.splits, power_2_scale=settings["force_pow_2_scales"],
                    amax_epsilon=settings["amax_epsilon"])  # what the kernel computes
        rows = F.dequantize(x_fp8, scales, call.fmt).float().split(call.splits)
        return [_FakeStorage(r, False, True, "act") for r in rows]

    monkeypatch.setattr(X, "_columnwise_by_kernel", by_kernel)
    monkeypatch.setattr(te_bridge, "columnwise_reason", lambda x: "")
    monkeypatch.setenv("MDEEP_FP8_COLUMNWISE", method)
    splits, grads = [16, 0, 48], {}
    for name in ("knob", "attribute"):
        module = _Module(len(splits), 32, 256)
        if name == "attribute":  # the layer's attribute outranks the knob
            module.fp8_columnwise = "dequantize" if method == "kernel" else "kernel"
        x = torch.randn(sum(splits), 256, generator=torch.Generator().manual_seed(3)).bfloat16()
        X.grouped_fp8_linear(module, x.requires_grad_(True), splits).sum().backward()
        grads[name] = [w.grad for w in module.weights()]
    other = "dequantize" if method == "kernel" else "kernel"
    assert used == [m for m in (method, other) if m == "kernel"]
    for a, b in zip(grads["knob"], grads["attribute"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_columnwise_method_rejects_unknown_values(monkeypatch):
    assert X.columnwise_method("dequantize") == "dequantize"
    monkeypatch.setenv("MDEEP_FP8_COLUMNWISE", "fast")
    with pytest.raises(ValueError, match="MDEEP_FP8_COLUMNWISE='fast'"):
        X.columnwise_method()
    monkeypatch.delenv("MDEEP_FP8_COLUMNWISE")
    assert X.columnwise_method() == "kernel"


def test_weights_are_quantized_once_per_step(fake_te_gemm, monkeypatch):
    """As TE under Megatron: the first micro-batch of a step quantizes the weights, the others
    reuse them; a new step (after the optimizer) quantizes again; None never caches."""
    torch = fake_te_gemm
    quantized = []
    call = _FakeQuantizer.__call__
    monkeypatch.setattr(_FakeQuantizer, "__call__",
                        lambda self, t: quantized.append(t.data_ptr()) or call(self, t))
    module = _Module(2, 32, 128)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(32, 128, generator=gen).bfloat16().requires_grad_(True)

    def micro_batch():
        y = X.grouped_fp8_linear(module, x, [16, 16])
        y.float().sum().backward()
        module.is_first_microbatch = False  # what FP8ColumnParallelGroupedLinear does after
        return y.detach()

    module.is_first_microbatch = True
    first = [micro_batch() for _ in range(3)]
    assert len(quantized) == 2, "one quantization per weight for the three micro-batches"
    assert all(torch.equal(y, first[0]) for y in first)
    with torch.no_grad():  # the optimizer step, then the schedule's next first micro-batch
        for w in module.weights():
            w.mul_(2)
    module.is_first_microbatch = True
    second = micro_batch()
    assert len(quantized) == 4
    torch.testing.assert_close(second.float(), 2 * first[0].float(), rtol=2e-2, atol=2e-2)
    module.is_first_microbatch = None  # no caching (Megatron's disable_parameter_transpose_cache)
    X.grouped_fp8_linear(module, x, [16, 16])
    X.grouped_fp8_linear(module, x, [16, 16])
    assert len(quantized) == 8
    module.is_first_microbatch, module.disable_parameter_transpose_cache = False, True
    X.grouped_fp8_linear(module, x, [16, 16])
    assert len(quantized) == 10


def test_grouped_fp8_linear_without_grad(fake_te_gemm):
    torch = fake_te_gemm
    module = _Module(2, 32, 128)
    x = torch.randn(32, 128).bfloat16()
    with torch.no_grad():
        y = X.grouped_fp8_linear(module, x, [16, 16])
    assert y.shape == (32, 32) and not y.requires_grad


# ---- FP8GroupedMLP / FP8ColumnParallelGroupedLinear decisions, on fake megatron-core bases -------

class _Rows:
    """A quantized-tensor stand-in: `dequantize()` gives plain rows."""

    def __init__(self, rows, wire):
        self.rows, self.wire = rows, wire

    def dequantize(self, dtype=None):
        return self.rows


@pytest.fixture
def fake_bases(monkeypatch):
    import sys
    import types

    import torch

    from megatron_deepep.fp8 import te_bridge

    class TEColumnParallelGroupedLinear(torch.nn.Module):
        def __init__(self, num, splits_ok=True):
            super().__init__()
            self.num_gemms, self.use_bias, self.single_grouped_weight, self.tp_size = num, 0, 0, 1
            for i in range(num):
                setattr(self, f"weight{i}", torch.nn.Parameter(torch.zeros(4, 4)))

        def forward(self, x, m_splits):
            return ("te", x), None

    class TEGroupedMLP(torch.nn.Module):
        def __init__(self, fc1):
            super().__init__()
            self.linear_fc1 = fc1
            self.config = types.SimpleNamespace(moe_apply_probs_on_input=False)

        def forward(self, x, tokens_per_expert, probs):
            return self.linear_fc1(x, tokens_per_expert.tolist())

    te_ext = types.SimpleNamespace(TEColumnParallelGroupedLinear=TEColumnParallelGroupedLinear)
    experts = types.SimpleNamespace(TEGroupedMLP=TEGroupedMLP)
    monkeypatch.setitem(sys.modules, "megatron.core.extensions.transformer_engine", te_ext)
    monkeypatch.setitem(sys.modules, "megatron.core.transformer.moe.experts", experts)
    X.fp8_expert_classes.cache_clear()
    monkeypatch.setattr(te_bridge, "is_wire_tensor", lambda x: getattr(x, "wire", False))
    monkeypatch.setattr(te_bridge, "active_recipe", lambda: Float8BlockScaling())
    monkeypatch.setattr(X, "grouped_fp8_linear", lambda module, x, splits: ("fp8", splits))
    yield X.fp8_expert_classes()
    X.fp8_expert_classes.cache_clear()


def test_fp8_experts_decide_per_call(fake_bases):
    import torch

    mlp_cls, fc1_cls = fake_bases
    mlp = mlp_cls(fc1_cls(3))
    assert mlp.takes_fp8_rows
    rows = torch.ones(48, 4)
    probs = torch.ones(48)
    # Wire rows, aligned splits: the FP8 grouped GEMM.
    out, bias = mlp(_Rows(rows, wire=True), torch.tensor([16, 0, 32]), probs)
    assert out == ("fp8", [16, 0, 32]) and bias is None
    # Misaligned splits: dequantized, TE's GroupedLinear path.
    (kind, x), _ = mlp(_Rows(rows, wire=True), torch.tensor([8, 8, 32]), probs)
    assert kind == "te" and x is rows
    # Another quantized tensor (MXFP8): dequantized, never handed to GroupedLinear as is.
    (kind, x), _ = mlp(_Rows(rows, wire=False), torch.tensor([16, 0, 32]), probs)
    assert kind == "te" and x is rows
    # Plain rows: untouched.
    (kind, x), _ = mlp(rows, torch.tensor([16, 0, 32]), probs)
    assert kind == "te" and x is rows
    # Expert biases: dequantized.
    mlp.linear_fc1.use_bias = True
    (kind, x), _ = mlp(_Rows(rows, wire=True), torch.tensor([16, 0, 32]), probs)
    assert kind == "te" and x is rows


def test_with_fp8_experts_swaps_the_fake_classes(fake_bases):
    import functools
    import sys

    mlp_cls, fc1_cls = fake_bases
    base_mlp = sys.modules["megatron.core.transformer.moe.experts"].TEGroupedMLP
    base_fc1 = sys.modules["megatron.core.extensions.transformer_engine"]\
        .TEColumnParallelGroupedLinear
    spec = functools.partial(MoELayer, submodules=MoESubmodules(experts=functools.partial(
        base_mlp, submodules=MLPSubmodules(linear_fc1=base_fc1))))
    new = X.with_fp8_experts(spec)
    experts = new.keywords["submodules"].experts
    assert experts.func is mlp_cls
    assert experts.keywords["submodules"].linear_fc1 is fc1_cls
    with pytest.raises(ValueError, match="no TEGroupedMLP"):
        X.with_fp8_experts(functools.partial(MoELayer))
