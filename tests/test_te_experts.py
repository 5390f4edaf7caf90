"""`megatron.te_experts` without Transformer Engine: spec rewriting, reasons, quantizer settings.

The GEMMs themselves run in tests/gpu/test_te_experts_gpu.py (scripts/gpu_te.sh).
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


def test_dispatcher_asks_the_experts():
    pytest.importorskip("megatron.core")
    from megatron_deepep.megatron import dispatcher as D

    class Layer:
        class experts:
            takes_fp8_rows = True

    d = D.DeepEPTokenDispatcher.__new__(D.DeepEPTokenDispatcher)
    d._layer_ref = None
    assert d._experts_take_fp8_rows() is False
    layer = Layer()
    d.bind_layer(layer)
    assert d._experts_take_fp8_rows() is True
