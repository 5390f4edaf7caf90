"""The dispatcher's logical-to-physical expert map (a `balance` plan applied at restart).

On 2 gloo ranks with the reference transport: a layer routed through a plan's map, whose experts
hold the plan's permuted weights (`balance.permute_expert_weights`), gives the same output and
the same gradients as the unmapped layer with the original weights; with redundant copies too.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from megatron_deepep.tools import balance
from megatron_deepep.megatron.options import physical_to_logical_for_layer
from tests.helpers.distributed import run_distributed

H = 16
E = 8
K = 2


def _routing(num_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.softmax(torch.randn(num_tokens, E, generator=gen) * 2, dim=-1)
    _, idx = torch.topk(scores, K, dim=1)
    routing_map = torch.zeros(num_tokens, E, dtype=torch.bool).scatter(1, idx, True)
    return scores * routing_map, routing_map


def _layer(dispatcher, x, routing_map, probs, weights):
    """The six hooks around per-slot linear experts (weights indexed by physical slot)."""
    h, p = dispatcher.dispatch_preprocess(x, routing_map, probs)
    h, p = dispatcher.token_dispatch(h, p)
    rows, tokens_per_expert, pp = dispatcher.dispatch_postprocess(h, p)
    outs = []
    for slot, chunk, cp in zip(dispatcher.local_expert_indices,
                               torch.split(rows, tokens_per_expert.tolist()),
                               torch.split(pp, tokens_per_expert.tolist())):
        outs.append((chunk @ weights[slot]) * cp.unsqueeze(1))
    y = torch.cat(outs) if outs else rows.new_zeros(0, H)
    out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(y)))
    return out, tokens_per_expert


def _worker(rank, world_size, plan_dicts):
    warnings.filterwarnings("ignore")
    import megatron_deepep.megatron as mdm
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    mdm.register_deepep_dispatcher(transport="reference")
    ps.initialize_model_parallel(expert_model_parallel_size=world_size)
    try:
        for plan_dict in plan_dicts:
            _case(rank, world_size, balance.Plan(**plan_dict), get_default_pg_collection())
    finally:
        ps.destroy_model_parallel()


def _case(rank, world_size, plan, pg):
    """The unmapped layer with the logical weights against the mapped one with the plan's."""
    import copy

    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_deepep.megatron import DeepEPTokenDispatcher

    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4,
                               num_moe_experts=E, moe_router_topk=K,
                               expert_model_parallel_size=world_size,
                               moe_token_dispatcher_type="deepep", use_cpu_initialization=True,
                               add_bias_linear=False)
    mapped_config = copy.copy(config)
    mapped_config.moe_mdeep_expert_map = plan.to_dict()  # the option's config field
    gen = torch.Generator().manual_seed(7)
    weights = torch.randn(E, H, H, generator=gen) / math.sqrt(H)
    physical_weights = balance.permute_expert_weights(weights, plan)

    num_local, slots = E // world_size, plan.slots_per_rank
    plain = DeepEPTokenDispatcher(num_local, list(range(rank * num_local,
                                                        (rank + 1) * num_local)),
                                  config=config, pg_collection=pg)
    mapped = DeepEPTokenDispatcher(slots, list(range(rank * slots, (rank + 1) * slots)),
                                   config=mapped_config, pg_collection=pg)

    num_tokens = 24 if rank == 0 else 13
    probs, routing_map = _routing(num_tokens, seed=rank)
    x = torch.randn(num_tokens, 1, H, generator=gen)
    grad = torch.randn(num_tokens, 1, H, generator=gen)
    results = []
    for dispatcher, w in ((plain, weights), (mapped, physical_weights)):
        xa, pa = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        out, tpe = _layer(dispatcher, xa, routing_map, pa, w)
        out.backward(grad)
        results.append((out.detach(), xa.grad, pa.grad, tpe))
    (out0, gx0, gp0, _), (out1, gx1, gp1, tpe1) = results
    torch.testing.assert_close(out1, out0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gp1, gp0, rtol=1e-5, atol=1e-5)
    assert tpe1.numel() == slots
    assert mapped.physical_to_logical == plan.physical_to_logical
    assert plain.physical_to_logical is None
    # The mapped layer's slots received the routed entries of their logical experts.
    counts = routing_map.sum(0).long()
    torch.distributed.all_reduce(counts)
    for local, slot in enumerate(range(rank * slots, (rank + 1) * slots)):
        e = plan.physical_to_logical[slot]
        if len(plan.logical_to_physical[e]) == 1:
            assert tpe1[local].item() == counts[e].item()


def _switch_worker(rank, world_size, plan_dicts):
    """A dispatcher switched to another map at a step boundary (`set_physical_to_logical`)
    routes as one built with that map; its metrics line records the new map."""
    warnings.filterwarnings("ignore")
    import copy

    import megatron_deepep.megatron as mdm
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_deepep.megatron import DeepEPTokenDispatcher, metrics

    mdm.register_deepep_dispatcher(transport="reference")
    ps.initialize_model_parallel(expert_model_parallel_size=world_size)
    try:
        first, second = (balance.Plan(**p) for p in plan_dicts)
        pg = get_default_pg_collection()
        config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4,
                                   num_moe_experts=E, moe_router_topk=K,
                                   expert_model_parallel_size=world_size,
                                   moe_token_dispatcher_type="deepep",
                                   use_cpu_initialization=True, add_bias_linear=False)
        config.moe_mdeep_metrics = True
        mapped = copy.copy(config)
        mapped.moe_mdeep_expert_map = first.to_dict()
        slots = first.slots_per_rank
        d = DeepEPTokenDispatcher(slots, list(range(rank * slots, (rank + 1) * slots)),
                                  config=mapped, pg_collection=pg)
        ref = copy.copy(mapped)
        ref.moe_mdeep_expert_map = second.to_dict()
        fresh = DeepEPTokenDispatcher(slots, list(range(rank * slots, (rank + 1) * slots)),
                                      config=ref, pg_collection=pg)
        gen = torch.Generator().manual_seed(11)
        weights = torch.randn(E, H, H, generator=gen) / math.sqrt(H)
        probs, routing_map = _routing(20, seed=rank)
        x = torch.randn(20, 1, H, generator=gen)
        assert d.physical_to_logical == first.physical_to_logical
        d.set_physical_to_logical(second.physical_to_logical)
        assert d.physical_to_logical == second.physical_to_logical
        out, tpe = _layer(d, x, routing_map, probs,
                          balance.permute_expert_weights(weights, second))
        want, want_tpe = _layer(fresh, x, routing_map, probs,
                                balance.permute_expert_weights(weights, second))
        assert torch.equal(out, want) and torch.equal(tpe, want_tpe)
        result = metrics.flush()
        (m,) = [v for v in result.values() if v["physical_to_logical"] ==
                second.physical_to_logical][:1]
        assert sum(m["tokens_per_logical_expert"]) == sum(m["tokens_per_expert"])
        with pytest.raises(ValueError, match="set_physical_to_logical has 3 physical slots"):
            d.set_physical_to_logical([0, 1, 2])
    finally:
        ps.destroy_model_parallel()


def test_dispatcher_switches_map_at_a_step_boundary():
    loads = balance.synthetic_loads(f"zipf:{E}:1.3")
    plans = [balance.plan_placement(loads, 2, num_redundant=2),
             balance.plan_placement(balance.synthetic_loads(f"hot:{E}:6"), 2, num_redundant=2)]
    assert plans[0].physical_to_logical != plans[1].physical_to_logical
    run_distributed(2, _switch_worker, [p.to_dict() for p in plans], timeout_s=150)


def test_mapped_layer_matches_unmapped_layer_with_permuted_weights():
    loads = balance.synthetic_loads(f"zipf:{E}:1.3")
    plans = [balance.plan_placement(loads, 2, num_redundant=n) for n in (0, 2)]
    for plan in plans:
        assert plan.physical_to_logical != list(range(E))  # a real placement
    assert plans[1].slots_per_rank == E // 2 + 1  # with copies
    run_distributed(2, _worker, [p.to_dict() for p in plans], timeout_s=150)


def test_expert_map_option_reads_balance_json(tmp_path):
    plans = {"3": balance.plan_placement(balance.synthetic_loads("zipf:8:1.0"), 2),
             "5": balance.plan_placement(balance.synthetic_loads("hot:8:5"), 2)}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"layers": {k: v.to_dict() for k, v in plans.items()}}))
    assert physical_to_logical_for_layer(str(path), 5) == plans["5"].physical_to_logical
    with pytest.raises(ValueError, match="no plan for layer 4"):
        physical_to_logical_for_layer(str(path), 4)
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"layers": {"0": plans["3"].to_dict()}}))
    assert physical_to_logical_for_layer(str(one), 9) == plans["3"].physical_to_logical
    assert physical_to_logical_for_layer([1, 0], None) == [1, 0]
    assert physical_to_logical_for_layer(None, 1) is None
    with pytest.raises(ValueError, match="expert-map"):
        physical_to_logical_for_layer({"physical_to_logical": "x"}, 1)


def test_map_topk_to_physical_spreads_copies():
    from megatron_deepep.megatron.dispatcher import (
        logical_to_physical_table,
        map_topk_to_physical,
    )

    table, copies = logical_to_physical_table([2, 0, 1, 0], 3)  # expert 0 in slots 1 and 3
    idx = torch.tensor([[0, 2], [0, -1], [1, 0], [0, 0]])
    got = map_topk_to_physical(idx, table, copies)
    assert got.tolist() == [[1, 0], [3, -1], [2, 1], [3, 3]]
    with pytest.raises(ValueError, match="no physical slot"):
        logical_to_physical_table([0, 0], 2)


def test_balance_folds_mapped_counts_back_to_logical_experts(tmp_path):
    plan = balance.plan_placement(balance.synthetic_loads("zipf:8:1.0"), 2, num_redundant=2)
    logical = [80.0, 40, 30, 20, 10, 8, 6, 4]
    per_slot = [logical[e] / len(plan.logical_to_physical[e]) for e in plan.physical_to_logical]
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"step": 1, "layers": {"2": {
        "tokens_per_expert": per_slot, "physical_to_logical": plan.physical_to_logical}}}) + "\n")
    loads = balance.read_loads(str(path))
    assert loads["2"].tolist() == [logical]
