"""Logical checkpoints of Megatron's `TEGroupedMLP` under an expert map, CPU + gloo, 2 ranks.

Transformer Engine is not installed in the CPU tier: megatron-core's own TEGroupedMLP runs on
the grouped-linear stand-ins of `tests/helpers/grouped_linear.py` (TE's parameter naming and
its sharded-state-dict code). A layer with a map (copies of hot experts) saves, a layer without
loads expert for expert, and back (every copy gets its expert); SwiGLU's factory and
`singleton_local_shards` included. `--moe-single-grouped-weight` under a map is refused.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from megatron_deepep.tools import balance
from tests.helpers.distributed import run_distributed

H, E, K = 16, 4, 2


def _layer(expert_map, seed, glu):
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.helpers.grouped_linear import ColumnGroupedLinear, RowGroupedLinear

    config = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=24,
                               num_attention_heads=4, num_moe_experts=E, moe_router_topk=K,
                               expert_model_parallel_size=2, moe_token_dispatcher_type="deepep",
                               use_cpu_initialization=True, add_bias_linear=False,
                               gated_linear_unit=glu, moe_grouped_gemm=True,
                               gradient_accumulation_fusion=False)
    config.moe_mdeep_expert_map = expert_map
    submodules = MoESubmodules(experts=ModuleSpec(
        module=TEGroupedMLP,
        submodules=MLPSubmodules(linear_fc1=ColumnGroupedLinear, linear_fc2=RowGroupedLinear)))
    torch.manual_seed(seed + torch.distributed.get_rank())  # experts differ per rank
    return MoELayer(config, submodules, layer_number=1)


def _slots(layer):
    """Every rank's local experts' (fc1, fc2) weights and extra-state tags, gathered."""
    ex = layer.experts
    mine = [(getattr(ex.linear_fc1, f"weight{i}").detach().clone(),
             getattr(ex.linear_fc2, f"weight{i}").detach().clone(),
             float(ex.linear_fc1.tags[i]))
            for i in range(ex.num_local_experts)]
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, mine)
    return [s for part in parts for s in part]


def _save(layer, path, metadata):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    dist_checkpointing.save(layer.sharded_state_dict(prefix="mlp.", metadata=metadata), path,
                            sharded_strategy=strategy)


def _load(layer, path, metadata):
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(layer.sharded_state_dict(prefix="mlp.", metadata=metadata),
                                    path)
    ex = layer.experts
    for i in range(ex.num_local_experts):  # TE merges the split extra state in its own hook
        ex.linear_fc1.tags[i] = state.pop(f"mlp.experts.linear_fc1._extra_state{i or ''}")
    layer.load_state_dict({k[len("mlp."):]: v for k, v in state.items()
                           if "_extra_state" not in k}, strict=False)


def _worker(rank, world, plan_dict, tmp, glu, singleton):
    warnings.filterwarnings("ignore")
    import queue

    import megatron_deepep.megatron as mdm
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_deepep.megatron import replica_experts

    mdm.register_deepep_dispatcher(transport="reference")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    filesystem_async._results_queue = queue.Queue()
    ps.initialize_model_parallel(expert_model_parallel_size=world)
    metadata = {"singleton_local_shards": singleton}
    try:
        p2l = plan_dict["physical_to_logical"]
        mapped = _layer(plan_dict, seed=1, glu=glu)
        layout = replica_experts.layer_layout(mapped)
        assert mapped.experts.num_local_experts == len(p2l) // world and layout.replicated
        for i in range(layout.slots_per_rank):  # tag = the logical expert this slot holds
            mapped.experts.linear_fc1.tags[i] = torch.tensor([float(layout.local_logical[i])])
        physical = _slots(mapped)
        plain = _layer(None, seed=2, glu=glu)
        _save(mapped, f"{tmp}/mapped", metadata)
        _load(plain, f"{tmp}/mapped", metadata)
        logical = _slots(plain)  # contiguous: slot e holds logical expert e
        for e in range(E):
            first = physical[p2l.index(e)]
            assert torch.equal(logical[e][0], first[0]) and torch.equal(logical[e][1], first[1])
            assert logical[e][2] == float(e)
        torch.distributed.barrier()
        again = _layer(plan_dict, seed=3, glu=glu)
        _save(plain, f"{tmp}/plain", metadata)
        _load(again, f"{tmp}/plain", metadata)
        for p, (w1, w2, tag) in enumerate(_slots(again)):  # every copy gets its expert
            e = p2l[p]
            assert torch.equal(w1, logical[e][0]) and torch.equal(w2, logical[e][1]), (p, e)
            assert tag == float(e)
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("glu, singleton", [(False, False), (True, False), (True, True)])
def test_te_grouped_mlp_checkpoints_in_logical_order(tmp_path, glu, singleton):
    pytest.importorskip("psutil", reason="Megatron's checkpoint writer needs psutil")
    plan = balance.plan_placement(balance.synthetic_loads(f"zipf:{E}:1.5"), 2, num_redundant=2)
    assert any(len(s) > 1 for s in plan.logical_to_physical)
    run_distributed(2, _worker, plan.to_dict(), str(tmp_path), glu, singleton, timeout_s=240)


def test_single_grouped_weight_under_a_map_is_refused():
    from types import SimpleNamespace

    from megatron_deepep.megatron.options import DeepEPOptions, check_config

    config = SimpleNamespace(num_moe_experts=4, moe_grouped_gemm=True,
                             moe_single_grouped_weight=True)
    check_config(config, DeepEPOptions())  # no map: Megatron's business
    with pytest.raises(ValueError, match="--moe-mdeep-expert-map with "
                                         "--moe-single-grouped-weight: TEGroupedMLP"):
        check_config(config, DeepEPOptions(expert_map=[1, 0, 3, 2]))
    with pytest.raises(ValueError, match="--moe-mdeep-replan .* with --moe-single-grouped"):
        check_config(config, DeepEPOptions(replan=0))
