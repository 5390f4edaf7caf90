"""Expert copies under Megatron's own DDP and optimizer on one GPU (EP = 1, the local kernels).

A map `[0, 0, 1, 2, 3]` holds expert 0 twice on the one rank. Wrapped in Megatron's
`DistributedDataParallel` (the plugin's `finish_grad_sync` sums the copies' `main_grad`s) and
stepped by `get_megatron_optimizer`'s bf16 Adam with gradient clipping, the two copies stay
bit-identical over several steps, with the ordinary and with the distributed optimizer (one
expert data-parallel rank: served).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

H, E, K = 64, 4, 2
MAP = [0, 0, 1, 2, 3]


def _layer():
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=128,
                               num_attention_heads=4, num_moe_experts=E, moe_router_topk=K,
                               moe_token_dispatcher_type="deepep", add_bias_linear=False,
                               bf16=True, params_dtype=torch.bfloat16,
                               gradient_accumulation_fusion=False)
    config.moe_mdeep_expert_map = {"physical_to_logical": MAP}
    submodules = MoESubmodules(experts=ModuleSpec(
        module=SequentialMLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)))
    return MoELayer(config, submodules, layer_number=1).cuda(), config


def _copies(layer):
    return [torch.cat([p.detach().reshape(-1) for p in m.parameters()])
            for m in layer.experts.local_experts[:2]]


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_copies_stay_identical_under_megatron_ddp_and_optimizer(megatron_env,
                                                                distributed_optimizer):
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_deepep.megatron import replica_experts

    torch.manual_seed(0)
    layer, config = _layer()
    assert layer.num_local_experts == len(MAP)
    assert replica_experts.layer_layout(layer).replicated == [0]
    first, second = _copies(layer)
    assert torch.equal(first, second)  # the copies start equal
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                              grad_reduce_in_fp32=True), layer)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0,
                        use_distributed_optimizer=distributed_optimizer), [ddp])
    for step in range(4):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        x = torch.randn(256, 1, H, device="cuda", dtype=torch.bfloat16)
        out, _ = ddp(x)
        out.float().pow(2).mean().backward()
        finalize_model_grads([ddp])
        grads = [torch.cat([p.main_grad.reshape(-1) for p in m.parameters()])
                 for m in layer.experts.local_experts[:2]]
        assert torch.equal(grads[0], grads[1]), step  # summed into both copies
        assert grads[0].abs().sum() > 0
        opt.step()
        first, second = _copies(layer)
        assert torch.equal(first, second), f"copies differ after step {step}"
