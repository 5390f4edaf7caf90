"""Property test of both planners (`placement.plan_placement`, `megatron.replan.plan_layer`)
over thousands of random load vectors, EP sizes and slot counts (CPU only).

Every rule is written here, not taken from the project's validators: a plan holds
`E + extra` slots, the same count on every rank, every logical expert at least once, no expert
twice on one rank; its predicted loads are the ones its map gives; without copies it is never
worse than the contiguous placement; a re-plan either keeps the placement in force exactly or
gains at least the minimum; impossible requests raise a `ValueError` naming the numbers.
"""

from __future__ import annotations

import logging
import random
import time

import pytest

from megatron_deepep import placement
from megatron_deepep.megatron import replan

logger = logging.getLogger(__name__)

SEEDS = range(4)
CASES_PER_SEED = 350
RANKS = (1, 2, 3, 4, 6, 8)


def _loads(rng: random.Random, num_experts: int) -> list:
    kind = rng.randrange(6)
    if kind == 0:
        return [float(rng.randint(0, 1000)) for _ in range(num_experts)]
    if kind == 1:
        return [rng.paretovariate(1.1) for _ in range(num_experts)]
    if kind == 2:  # ties
        return [float(rng.choice((0, 5, 5, 10))) for _ in range(num_experts)]
    if kind == 3:  # one hot expert, the rest cold or idle
        loads = [float(rng.randint(0, 3)) for _ in range(num_experts)]
        loads[rng.randrange(num_experts)] = 1000.0
        return loads
    if kind == 4:
        return [0.0] * num_experts
    return [rng.random() for _ in range(num_experts)]


def _extra_slots(rng: random.Random, num_experts: int, num_ranks: int) -> int:
    most = num_experts * (num_ranks - 1) // num_ranks  # extra slots per rank at most
    return num_ranks * rng.choice([0, 0, 1, most, rng.randint(0, most)] if most else [0])


def _rank_loads(loads, physical_to_logical, num_ranks):
    copies = {e: physical_to_logical.count(e) for e in set(physical_to_logical)}
    s = len(physical_to_logical) // num_ranks
    return [sum(loads[e] / copies[e] for e in physical_to_logical[r * s:(r + 1) * s])
            for r in range(num_ranks)]


def _idle(rank_loads):
    top = max(rank_loads)
    return 0.0 if top <= 0 else 1.0 - sum(rank_loads) / len(rank_loads) / top


def _check_loadable(physical_to_logical, num_experts, num_ranks, num_slots):
    """The rules a resume needs, as this test states them."""
    assert len(physical_to_logical) == num_slots and num_slots % num_ranks == 0
    assert all(isinstance(e, int) and 0 <= e < num_experts for e in physical_to_logical)
    assert set(physical_to_logical) == set(range(num_experts)), "an expert is not held"
    s = num_slots // num_ranks
    for r in range(num_ranks):
        held = physical_to_logical[r * s:(r + 1) * s]
        assert len(set(held)) == len(held), f"rank {r} holds an expert twice: {held}"


def _random_map(rng: random.Random, num_experts: int, num_ranks: int, extra: int) -> list:
    """A loadable placement with `extra` slots of copies (what a run may have in force)."""
    experts = list(range(num_experts))
    rng.shuffle(experts)
    own = num_experts // num_ranks
    out = []
    for r in range(num_ranks):
        held = experts[r * own:(r + 1) * own]
        held += rng.sample([e for e in range(num_experts) if e not in held], extra // num_ranks)
        out += sorted(held)
    return out


def _check_plan(loads, num_ranks, extra, ranks_per_node):
    plan = placement.plan_placement(loads, num_ranks, extra, ranks_per_node)
    num_experts = len(loads)
    _check_loadable(plan.physical_to_logical, num_experts, num_ranks, num_experts + extra)
    assert plan.slots_per_rank == (num_experts + extra) // num_ranks
    for e, slots in enumerate(plan.logical_to_physical):
        assert slots and all(plan.physical_to_logical[p] == e for p in slots)
    expected = _rank_loads(loads, plan.physical_to_logical, num_ranks)
    assert plan.rank_load == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert plan.idle_share == pytest.approx(_idle(expected), abs=1e-9)
    if extra == 0:
        contiguous = [sum(loads[r * num_experts // num_ranks:(r + 1) * num_experts // num_ranks])
                      for r in range(num_ranks)]
        assert max(expected) <= max(contiguous) * (1 + 1e-9) + 1e-9


def _check_replan(rng, loads, num_ranks, extra):
    num_experts = len(loads)
    in_force = _extra_slots(rng, num_experts, num_ranks)
    current = _random_map(rng, num_experts, num_ranks, in_force)
    entry = replan.plan_layer(loads, current, num_ranks, extra)
    p2l = entry["physical_to_logical"]
    before = _idle(_rank_loads(loads, current, num_ranks))
    after = _idle(_rank_loads(loads, p2l, num_ranks))
    if entry["kept"]:
        assert p2l == current
    else:
        _check_loadable(p2l, num_experts, num_ranks, num_experts + extra)
        assert before - after >= replan.MIN_GAIN - 1e-9, (before, after)
    assert entry["idle_share"] == pytest.approx(after, abs=1e-9)
    assert entry["idle_share_before"] == pytest.approx(before, abs=1e-9)


def _check_refused(rng, num_experts, num_ranks):
    most = num_experts * (num_ranks - 1)
    bad = rng.choice([most + num_ranks, -num_ranks] + ([num_ranks + 1] if num_ranks > 1 else []))
    loads = _loads(rng, num_experts)
    with pytest.raises(ValueError, match=str(bad)):
        placement.plan_placement(loads, num_ranks, bad)
    with pytest.raises(ValueError, match=rf"--moe-mdeep-replan .*{bad}"):
        replan.plan_layer(loads, list(range(num_experts)), num_ranks, bad)


@pytest.mark.parametrize("seed", SEEDS)
def test_both_planners_give_loadable_plans(seed):
    rng = random.Random(seed)
    start, cases = time.perf_counter(), 0
    for _ in range(CASES_PER_SEED):
        num_ranks = rng.choice(RANKS)
        num_experts = num_ranks * rng.randint(1, 6)
        loads = _loads(rng, num_experts)
        extra = _extra_slots(rng, num_experts, num_ranks)
        nodes = [d for d in range(1, num_ranks) if num_ranks % d == 0]
        ranks_per_node = rng.choice(nodes) if nodes and rng.random() < 0.3 else None
        _check_plan(loads, num_ranks, extra, ranks_per_node)
        _check_replan(rng, loads, num_ranks, extra)
        _check_refused(rng, num_experts, num_ranks)
        cases += 3
    logger.info("seed %d: %d planner cases in %.2f s", seed, cases,
                time.perf_counter() - start)


def test_known_cases_are_loadable_and_keep_below_the_minimum():
    plan = placement.plan_placement([557, 49, 465, 477, 82, 412], 2, 4)
    _check_loadable(plan.physical_to_logical, 6, 2, 10)
    # A plan that gains less than the minimum keeps the placement in force, even where the
    # slot count would change (contiguous, 4 slots, asked for 2 extra).
    entry = replan.plan_layer([50.0, 52.0, 49.0, 51.0], [0, 1, 2, 3], 2, 2)
    assert entry["kept"] and entry["physical_to_logical"] == [0, 1, 2, 3]
    assert entry["idle_share_before"] - entry["planned_idle_share"] < replan.MIN_GAIN
    with pytest.raises(ValueError, match=r"4 extra slots exceed the 2 copies that 2 experts"):
        placement.plan_placement([1.0, 2.0], 2, 4)


def test_plan_layers_share_one_slot_count():
    rng = random.Random(7)
    for _ in range(200):
        num_ranks = rng.choice((2, 4))
        num_experts = num_ranks * rng.randint(1, 4)
        extra = num_ranks * rng.randint(0, num_experts * (num_ranks - 1) // num_ranks)
        in_force = list(range(num_experts))
        merged = {str(k): {"loads": _loads(rng, num_experts), "num_ranks": num_ranks,
                           "physical_to_logical": in_force} for k in range(1, 4)}
        layers = replan.plan_layers(merged, extra)
        counts = {len(v["physical_to_logical"]) for v in layers.values()}
        assert len(counts) == 1, layers
        (num_slots,) = counts
        for k, v in layers.items():
            _check_loadable(v["physical_to_logical"], num_experts, num_ranks, num_slots)
            loads = merged[k]["loads"]
            before = _idle(_rank_loads(loads, in_force, num_ranks))
            assert _idle(_rank_loads(loads, v["physical_to_logical"], num_ranks)) \
                <= before + 1e-9
