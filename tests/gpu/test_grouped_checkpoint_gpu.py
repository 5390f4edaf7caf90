"""Logical checkpoints of a real `TEGroupedMLP` (Transformer Engine's grouped linears) on one GPU.

EP = 1 with the map `[2, 0, 3, 1]` (one rank holds no two copies of an expert, so EP = 1 maps
are permutations): a layer with the map saves through dist_checkpointing and a layer without
loads expert for expert; the reverse puts every expert back in its slot. Plain and gated
(SwiGLU factory) fc1. The CPU tier runs the same path with copies over two ranks on stand-ins
(`tests/megatron/test_grouped_checkpoint.py`).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.marks import TE_GPU

pytestmark = TE_GPU

H, E, K = 64, 4, 2
MAP = [2, 0, 3, 1]


def _layer(expert_map, glu, seed):
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelGroupedLinear,
        TERowParallelGroupedLinear,
    )
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=128,
                               num_attention_heads=4, num_moe_experts=E, moe_router_topk=K,
                               moe_token_dispatcher_type="deepep", add_bias_linear=False,
                               moe_grouped_gemm=True, gated_linear_unit=glu, bf16=True,
                               params_dtype=torch.bfloat16, gradient_accumulation_fusion=False)
    config.moe_mdeep_expert_map = None if expert_map is None else {"physical_to_logical":
                                                                   expert_map}
    submodules = MoESubmodules(experts=ModuleSpec(
        module=TEGroupedMLP, submodules=MLPSubmodules(linear_fc1=TEColumnParallelGroupedLinear,
                                                      linear_fc2=TERowParallelGroupedLinear)))
    torch.manual_seed(seed)
    return MoELayer(config, submodules, layer_number=1).cuda()


def _weights(layer):
    ex = layer.experts
    return [(getattr(ex.linear_fc1, f"weight{i}").detach().clone(),
             getattr(ex.linear_fc2, f"weight{i}").detach().clone())
            for i in range(ex.num_local_experts)]


def _round_trip(source, target, path):
    from megatron.core import dist_checkpointing

    path.mkdir()
    dist_checkpointing.save(source.sharded_state_dict(prefix="mlp."), str(path))
    state = dist_checkpointing.load(target.sharded_state_dict(prefix="mlp."), str(path))
    target.load_state_dict({k[len("mlp."):]: v for k, v in state.items()}, strict=False)


@pytest.mark.parametrize("glu", [False, True])
def test_te_grouped_mlp_map_and_no_map_read_each_other(megatron_env, tmp_path, glu):
    mapped = _layer(MAP, glu, seed=1)
    assert mapped.experts.num_local_experts == len(MAP)
    plain = _layer(None, glu, seed=2)
    _round_trip(mapped, plain, tmp_path / "mapped")
    physical, logical = _weights(mapped), _weights(plain)
    for e in range(E):
        first = physical[MAP.index(e)]
        assert torch.equal(logical[e][0], first[0]) and torch.equal(logical[e][1], first[1])
    again = _layer(MAP, glu, seed=3)
    _round_trip(plain, again, tmp_path / "plain")
    for p, (w1, w2) in enumerate(_weights(again)):
        assert torch.equal(w1, logical[MAP[p]][0]) and torch.equal(w2, logical[MAP[p]][1]), p
