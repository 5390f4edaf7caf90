"""Expert copies on different EP ranks under Megatron's own DDP and optimizer (a worker).

EP = 2 with the map `[0, 1, 2 | 0, 3, 1]`: experts 0 and 1 have a copy on each rank (at
different local slots for expert 1). The layer is wrapped in Megatron's
`DistributedDataParallel` (the plugin's `finish_grad_sync` sums the copies' `main_grad`s over
the EP group) and stepped by `get_megatron_optimizer`'s bf16 Adam with gradient clipping, with
the ordinary and with the distributed optimizer (one expert data-parallel rank: served). Each
rank routes its own tokens. After every `finalize_model_grads` the copies' `main_grad`s, and
after every step their weights, are gathered over gloo and must be bit-identical across the
ranks. Here on 2 gloo ranks with the reference transport; tests/gpu/test_replica_experts_gpu.py
runs the same worker on the GPU (2 processes sharing it, the NVLink kernels).
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytest.importorskip("megatron.core")

H, E, K, STEPS = 64, 4, 2, 4
MAP = [0, 1, 2, 0, 3, 1]  # rank 0 holds experts 0, 1, 2; rank 1 holds 0, 3, 1
EP = 2
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples")


def _layer(device):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.helpers.distributed import cpu_group

    config = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=128,
                               num_attention_heads=4, num_moe_experts=E, moe_router_topk=K,
                               expert_model_parallel_size=EP, moe_token_dispatcher_type="deepep",
                               add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
                               use_cpu_initialization=device == "cpu",
                               gradient_accumulation_fusion=False)
    config.moe_mdeep_expert_map = {"physical_to_logical": MAP}
    submodules = MoESubmodules(experts=ModuleSpec(
        module=SequentialMLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)))
    # Experts differ per rank (so the start's copy-in is exercised); the router is broadcast.
    seed = 1234 + torch.distributed.get_rank()
    torch.manual_seed(seed)
    if device != "cpu":  # built on the GPU: the copy-in at build runs on the EP group's device
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    layer = MoELayer(config, submodules, layer_number=1).to(device)
    router = layer.router.weight.data.cpu()
    torch.distributed.broadcast(router, 0, group=cpu_group())
    layer.router.weight.data.copy_(router)
    return layer, config


def _slots(layer, grads=False):
    """This rank's local slots as flat tensors on the host: weights, or `main_grad`s."""
    return [torch.cat([(p.main_grad if grads else p.detach()).reshape(-1).cpu()
                       for p in m.parameters()])
            for m in layer.experts.local_experts]


def _physical(layer, grads=False):
    """Every rank's slots, gathered over gloo: `[EP * S]` flat tensors in physical order."""
    from tests.helpers.distributed import cpu_group

    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, _slots(layer, grads), group=cpu_group())
    return [t for part in parts for t in part]


def _check_copies(layer, what, grads=False):
    physical = _physical(layer, grads)
    for e in (0, 1):
        first, *others = [p for p, x in enumerate(MAP) if x == e]
        for p in others:
            assert torch.equal(physical[p], physical[first]), f"{what}: expert {e} slot {p}"
        if grads:
            assert physical[first].abs().sum() > 0, f"{what}: expert {e} saw no token"


def ddp_worker(rank, world, distributed_optimizer, device, transport):
    """Builds the mapped layer under DDP and the Megatron optimizer; steps; checks the copies."""
    warnings.filterwarnings("ignore")
    import megatron_deepep.megatron as mdm
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_deepep.megatron import replica_experts
    from tests.megatron import test_parity_matrix as matrix
    from tests.megatron.test_parity_ep import _drop_buffers

    assert world == EP
    if device == "cpu":
        matrix._install_cpu_stand_ins()
        _allow_optimizer_on_cpu()
    else:
        from tests.helpers.distributed import use_rank_device

        use_rank_device(rank)
    mdm.register_deepep_dispatcher(transport=transport)
    ps.initialize_model_parallel(expert_model_parallel_size=EP)
    try:
        layer, config = _layer(device)
        layout = replica_experts.layer_layout(layer)
        slots = len(MAP) // EP
        assert layer.num_local_experts == slots and layout.replicated == [0, 1]
        assert layout.local_logical == MAP[rank * slots:(rank + 1) * slots]
        _check_copies(layer, "start")  # copied in from the first copy at build
        ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                                  grad_reduce_in_fp32=True), layer)
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, clip_grad=1.0,
                            use_distributed_optimizer=distributed_optimizer), [ddp])
        kinds = {type(o).__name__ for o in opt.chained_optimizers}  # dense and expert params
        assert ("DistributedOptimizer" in kinds) == distributed_optimizer, kinds
        gen = torch.Generator().manual_seed(100 + rank)  # each rank routes its own tokens
        for step in range(STEPS):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            x = torch.randn(64, 1, H, generator=gen).to(device=device, dtype=torch.bfloat16)
            out, _ = ddp(x)
            out.float().pow(2).mean().backward()
            finalize_model_grads([ddp])
            _check_copies(layer, f"main_grad at step {step}", grads=True)
            ok, _, _ = opt.step()
            assert ok, step
            _check_copies(layer, f"weights after step {step}")
    finally:
        ps.destroy_model_parallel()
        _drop_buffers()  # NVLink Buffers are freed collectively, before the ranks exit


def _allow_optimizer_on_cpu():
    """Lets `get_megatron_optimizer` and its grad clipping run on the CPU in this rank: the
    example's redirect of their `device='cuda'` buffers, and CUDA type names for the checks."""
    sys.path.insert(0, EXAMPLES)
    from replan_resume import allow_megatron_optimizer_on_cpu

    allow_megatron_optimizer_on_cpu()
    tensor_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):  # the optimizer and clipping check for CUDA types
        name = tensor_type(self, *args, **kwargs)
        if args or kwargs or self.is_cuda:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_copies_on_two_ranks_stay_identical_under_megatron_ddp(distributed_optimizer):
    run_distributed(EP, ddp_worker, distributed_optimizer, "cpu", "reference", timeout_s=120)
