"""The load-balance planner (`megatron_deepep.tools.balance`) on synthetic skewed loads (CPU
only)."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys

import pytest
import torch

from megatron_deepep.tools import balance
from megatron_deepep.tools.balance import plan_placement, synthetic_loads

#: Cases where the greedy plan (no redundancy) equals the brute-force optimum (checked below).
OPTIMAL_CASES = [
    ("zipf:6:1.0", 3), ("zipf:6:2.0", 3), ("hot:6:10", 3), ("uniform:6", 3), ("zipf:8:1.2", 4),
    ("zipf:8:0.6", 2), ("zipf:9:0.8", 3), ("hot:8:3", 4),
    ([5, 5, 4, 3, 3, 2], 3), ([9, 7, 6, 5, 4, 1], 2), ([10, 1, 1, 1, 1, 1, 1, 8], 4),
]
#: The worst ratio greedy / optimum asserted on random small cases (LPT's classic bound).
BOUND = 4.0 / 3.0


def _partitions(items, size):
    """Every partition of `items` into groups of `size` (unordered groups)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        left = [x for x in rest if x not in others]
        for tail in _partitions(left, size):
            yield [(first,) + others] + tail


def _optimum(loads, num_ranks):
    """The smallest worst-rank load over all equal-size placements (no redundancy)."""
    size = len(loads) // num_ranks
    return min(max(sum(loads[i] for i in group) for group in part)
               for part in _partitions(list(range(len(loads))), size))


def _loads(spec):
    return synthetic_loads(spec).tolist() if isinstance(spec, str) else [float(v) for v in spec]


def _check_shape(plan, num_experts, num_ranks, num_redundant, distinct=True):
    assert len(plan.physical_to_logical) == num_experts + num_redundant
    assert plan.slots_per_rank * num_ranks == num_experts + num_redundant
    assert sorted(set(plan.physical_to_logical)) == list(range(num_experts))
    for e, slots in enumerate(plan.logical_to_physical):
        assert slots and all(plan.physical_to_logical[p] == e for p in slots)
        ranks = [p // plan.slots_per_rank for p in slots]
        assert not distinct or len(set(ranks)) == len(ranks), f"expert {e} twice: {ranks}"


@pytest.mark.parametrize("spec,num_ranks", OPTIMAL_CASES)
def test_greedy_equals_brute_force_optimum(spec, num_ranks):
    loads = _loads(spec)
    plan = plan_placement(loads, num_ranks)
    _check_shape(plan, len(loads), num_ranks, 0)
    assert plan.max_load == pytest.approx(_optimum(loads, num_ranks), rel=1e-9)


def test_greedy_within_bound_on_random_cases():
    rng = random.Random(0)
    worst = 1.0
    for num_experts, num_ranks in [(6, 3), (6, 2), (8, 4), (8, 2), (9, 3)]:
        for _ in range(60):
            loads = [float(rng.randint(0, 100)) for _ in range(num_experts)]
            if sum(loads) == 0:
                continue
            plan = plan_placement(loads, num_ranks)
            worst = max(worst, plan.max_load / _optimum(loads, num_ranks))
    assert worst <= BOUND


@pytest.mark.parametrize("spec", ["zipf:16:1.2", "zipf:32:0.8", "hot:16:20", "uniform:16"])
@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_redundancy_never_increases_worst_load(spec, num_ranks):
    loads = synthetic_loads(spec)
    base = plan_placement(loads, num_ranks)
    assert base.max_load <= max(base.default_rank_load) + 1e-6
    for copies in (1, 2):
        plan = plan_placement(loads, num_ranks, num_redundant=copies * num_ranks)
        # Copies on distinct ranks change loads even where they do not help: within 1e-4.
        assert plan.max_load <= base.max_load * (1 + 1e-4)
        _check_shape(plan, loads.numel(), num_ranks, copies * num_ranks)
        assert sum(plan.rank_load) == pytest.approx(loads.sum().item())


def test_redundancy_never_increases_worst_load_random():
    rng = random.Random(1)
    for num_ranks in (2, 4, 8):
        for num_experts in (2 * num_ranks, 4 * num_ranks):
            for _ in range(10):
                loads = [rng.paretovariate(1.2) for _ in range(num_experts)]
                base = plan_placement(loads, num_ranks).max_load
                for copies in (1, 2):
                    plan = plan_placement(loads, num_ranks, num_redundant=copies * num_ranks)
                    # With more than half the experts on every rank, the one-copy-per-rank
                    # rule can force a worse plan (4 experts, 2 ranks, 3 slots each).
                    if 2 * plan.slots_per_rank <= num_experts:
                        assert plan.max_load <= base * (1 + 1e-4)  # see above
                    assert plan.slots_per_rank * num_ranks == num_experts + copies * num_ranks


def test_hot_expert_is_replicated_and_split():
    loads = synthetic_loads("hot:8:13")  # expert 0: 13 / 20 of the tokens
    plan = plan_placement(loads, 4, num_redundant=4)
    assert len(plan.logical_to_physical[0]) >= 4
    assert plan.idle_share < 0.1 < plan.default_idle_share


def test_default_idle_share_hand_computed():
    plan = plan_placement([4, 2, 1, 1], 2)
    assert plan.default_rank_load == [6.0, 2.0]
    assert plan.default_idle_share == pytest.approx(1 - 4 / 6)  # mean 4, max 6
    assert plan.rank_load == [5.0, 3.0] or plan.rank_load == [4.0, 4.0]
    assert plan.max_load == 5.0  # {4, 1} / {2, 1}: the best with two experts per rank
    assert plan.idle_share == pytest.approx(1 - 4 / 5)
    assert balance.idle_share([3, 3, 3]) == 0.0


def test_history_is_averaged():
    history = torch.tensor([[4.0, 0.0, 2.0, 2.0], [0.0, 4.0, 2.0, 2.0]])
    plan = plan_placement(history, 2)
    assert plan.default_rank_load == [4.0, 4.0]
    assert plan.idle_share == 0.0


@pytest.mark.parametrize("ranks_per_node", [None, 2])
def test_nodes_balanced(ranks_per_node):
    loads = synthetic_loads("zipf:16:1.2")
    plan = plan_placement(loads, 4, num_redundant=4, ranks_per_node=ranks_per_node)
    _check_shape(plan, 16, 4, 4)
    node_loads = [sum(plan.rank_load[:2]), sum(plan.rank_load[2:])]
    assert max(node_loads) / min(node_loads) < 1.05
    assert plan.idle_share < 0.05 < plan.default_idle_share


def test_permute_expert_weights_round_trips():
    weights = torch.randn(8, 3, 5)
    plan = plan_placement(synthetic_loads("zipf:8:1.5"), 4, num_redundant=4)
    physical = balance.permute_expert_weights(weights, plan)
    assert physical.shape == (12, 3, 5)
    for e, slots in enumerate(plan.logical_to_physical):
        for p in slots:
            assert torch.equal(physical[p], weights[e])
    first = torch.tensor([slots[0] for slots in plan.logical_to_physical])
    assert torch.equal(physical[first], weights)


def test_cli_synthetic_and_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    plans = balance.main(["--synthetic", "zipf:16:1.2", "--ranks", "4", "--redundant", "4",
                          "--ranks-per-node", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert "contiguous" in text and "rank 3:" in text
    data = json.loads(out.read_text())
    assert data["layers"]["0"]["physical_to_logical"] == plans["0"].physical_to_logical


def test_cli_reads_metrics_jsonl(tmp_path, capsys):
    path = tmp_path / "deepep_metrics_rank0.jsonl"
    lines = [{"step": s, "layers": {"1": {"tokens_per_expert": [8, 4, 2, 2], "idle_share": 0},
                                    "2": {"tokens_per_expert": [1, 1, 1, 1]}}}
             for s in range(3)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    plans = balance.main(["--loads", str(path), "--ranks", "2"])
    assert set(plans) == {"1", "2"}
    assert plans["1"].default_idle_share == pytest.approx(1 - 8 / 12)
    assert plans["1"].max_load == 10.0
    assert "layer 2:" in capsys.readouterr().out
    only = balance.main(["--loads", str(path), "--ranks", "2", "--layer", "2"])
    assert set(only) == {"2"}


def test_cli_help_lists_every_argument():
    result = subprocess.run([sys.executable, "-m", "megatron_deepep.tools.balance", "--help"],
                            capture_output=True, text=True, check=True)
    for flag in ("--loads", "--synthetic", "--ranks", "--redundant", "--ranks-per-node",
                 "--layer", "--json"):
        assert flag in result.stdout
