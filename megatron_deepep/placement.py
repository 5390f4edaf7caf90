"""The expert-placement planner: a placement over the EP ranks from per-expert loads.

Input: the tokens each logical expert received, `[E]`, or a history `[steps, E]` (averaged over
steps). Output: a `Plan` that puts `slots_per_rank` physical experts on each of R ranks, so that
the most loaded rank's load is small. With `num_redundant` extra slots (in total, a multiple of
R), the hottest experts get copies, as DeepSeek's EPLB does; a replicated expert's load is
assumed to split evenly over its copies.

Greedy, in three steps:
1. Replicas: each extra slot goes to the expert with the highest load per copy (at most R copies
   of one expert, one per rank).
2. Packing: longest-processing-time (LPT) with equal slot counts per rank: copies in decreasing
   load, each to the least loaded rank that has a free slot (and does not already hold a copy
   of that expert, where one can), then pairwise swaps between the worst rank and the others
   while a swap lowers the pair's maximum. With `ranks_per_node`, copies are first packed over
   nodes (slots_per_rank x ranks_per_node slots each), then over the ranks of each node, so
   node loads are balanced too.
3. Copies never raise the worst load: where the plan with copies loses to the plan without
   (the packing is a heuristic), the latter is kept, its extra slots holding copies of each
   rank's own experts (so that rank's load is unchanged).

Predicted idle share: with `rank_load[r]` the tokens rank r's experts receive,
`idle_share = 1 - mean(rank_load) / max(rank_load)`: the share of the expert phase (whose length
the worst rank sets) that the ranks spend idle, on average. The default placement is the
contiguous one: rank r owns logical experts `[r * E / R, (r + 1) * E / R)`.

Data layer: imports nothing of the package, so the command line (`tools.balance`), the
step-boundary re-placement (`tools.rebalance`) and the re-plan at checkpoint save
(`megatron.replan`) share this one planner.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence, Union

import torch

logger = logging.getLogger(__name__)

Loads = Union[torch.Tensor, Sequence[float], Sequence[Sequence[float]]]


@dataclass
class Plan:
    """An expert placement over the EP ranks and its predicted loads.

    Attributes:
        num_ranks: R, the EP ranks.
        slots_per_rank: physical experts per rank (E / R + num_redundant / R).
        physical_to_logical: `[R * slots_per_rank]`: the logical expert of each physical slot;
            rank r owns slots `[r * slots_per_rank, (r + 1) * slots_per_rank)`.
        logical_to_physical: for each logical expert, the physical slots of its copies.
        rank_load: `[R]` predicted tokens per rank under this plan.
        idle_share: `1 - mean(rank_load) / max(rank_load)` under this plan.
        default_rank_load: `[R]` tokens per rank under the contiguous default placement.
        default_idle_share: the idle share of the default placement.
    """

    num_ranks: int
    slots_per_rank: int
    physical_to_logical: List[int]
    logical_to_physical: List[List[int]]
    rank_load: List[float]
    idle_share: float
    default_rank_load: List[float]
    default_idle_share: float

    @property
    def max_load(self) -> float:
        """The worst rank's predicted load."""
        return max(self.rank_load)

    def to_dict(self) -> dict:
        """The plan as a JSON-serializable dict."""
        return asdict(self)


def idle_share(rank_load: Sequence[float]) -> float:
    """`1 - mean / max` of the rank loads (0 for all-zero loads)."""
    top = max(rank_load)
    return 0.0 if top <= 0 else 1.0 - (sum(rank_load) / len(rank_load)) / top


def average_loads(loads: Loads) -> torch.Tensor:
    """Per-expert loads `[E]` (float64) from `[E]` or a history `[steps, E]` (mean over steps)."""
    t = torch.as_tensor(loads, dtype=torch.float64)
    if t.dim() == 2:
        t = t.mean(dim=0)
    assert t.dim() == 1 and t.numel() > 0, f"loads must be [E] or [steps, E], got {tuple(t.shape)}"
    assert bool((t >= 0).all()), "loads must be non-negative"
    return t


def default_rank_load(loads: Loads, num_ranks: int) -> List[float]:
    """Tokens per rank of the contiguous placement (rank r owns experts [r E/R, (r+1) E/R))."""
    t = average_loads(loads)
    assert t.numel() % num_ranks == 0, f"{t.numel()} experts do not split over {num_ranks} ranks"
    return t.reshape(num_ranks, -1).sum(dim=1).tolist()


def replica_counts(loads: torch.Tensor, num_redundant: int, max_copies: int) -> List[int]:
    """Copies per expert: each extra slot goes to the highest load per copy (ties: lowest id)."""
    counts = [1] * loads.numel()
    values = loads.tolist()
    for _ in range(num_redundant):
        best, best_value = -1, -1.0
        for e, v in enumerate(values):
            if counts[e] < max_copies and v / counts[e] > best_value:
                best, best_value = e, v / counts[e]
        assert best >= 0, f"{num_redundant} redundant slots exceed {max_copies} copies per expert"
        counts[best] += 1
    return counts


def _pack(items: List[tuple], num_bins: int, capacity: int,
          max_same: int = 1) -> List[List[tuple]]:
    """LPT with `capacity` items per bin, then pairwise swaps off the worst bin.

    Args:
        items: `(load, expert)` tuples, `len(items) == num_bins * capacity`.
        num_bins: bins to fill.
        capacity: items per bin.
        max_same: copies of one expert a bin should hold at most (kept where LPT can; swaps
            never break it).

    Returns:
        The items of each bin.
    """
    assert len(items) == num_bins * capacity
    bins: List[List[tuple]] = [[] for _ in range(num_bins)]
    sums = [0.0] * num_bins

    def room(b: int, expert: int) -> bool:
        return sum(e == expert for _, e in bins[b]) < max_same

    for item in sorted(items, key=lambda x: (-x[0], x[1])):
        free = [b for b in range(num_bins) if len(bins[b]) < capacity]
        fresh = [b for b in free if room(b, item[1])]
        b = min(fresh or free, key=lambda i: (sums[i], i))
        bins[b].append(item)
        sums[b] += item[0]
    improved = True
    while improved:  # each swap lowers the worst pair's maximum: terminates
        improved = False
        worst = max(range(num_bins), key=lambda i: sums[i])
        best = None
        for other in range(num_bins):
            if other == worst:
                continue
            for i, (a, ea) in enumerate(bins[worst]):
                for j, (c, ec) in enumerate(bins[other]):
                    if a <= c or ea == ec or not room(other, ea) or not room(worst, ec):
                        continue
                    pair_max = max(sums[worst] - a + c, sums[other] - c + a)
                    if pair_max < sums[worst] - 1e-12 and (best is None or pair_max < best[0]):
                        best = (pair_max, other, i, j)
        if best is not None:
            _, other, i, j = best
            a, c = bins[worst][i], bins[other][j]
            bins[worst][i], bins[other][j] = c, a
            sums[worst] += c[0] - a[0]
            sums[other] += a[0] - c[0]
            improved = True
    return bins


def _sums(bins: List[List[tuple]]) -> List[float]:
    return [sum(load for load, _ in b) for b in bins]


def _place(loads: torch.Tensor, num_ranks: int, num_redundant: int,
           ranks_per_node: Optional[int]) -> List[List[tuple]]:
    """The greedy placement: `(load, expert)` items per rank."""
    slots = (loads.numel() + num_redundant) // num_ranks
    counts = replica_counts(loads, num_redundant, num_ranks)
    items = [(loads[e].item() / c, e) for e, c in enumerate(counts) for _ in range(c)]
    if ranks_per_node is None:
        return _pack(items, num_ranks, slots)
    nodes = _pack(items, num_ranks // ranks_per_node, slots * ranks_per_node,
                  max_same=ranks_per_node)
    return [b for node in nodes for b in _pack(node, ranks_per_node, slots)]


def _pad(bins: List[List[tuple]], loads: torch.Tensor, extra: int) -> List[List[tuple]]:
    """A placement without copies plus `extra` copies per rank of that rank's hottest experts.

    All copies of an expert sit on one rank, so each rank's load stays the same.
    """
    padded = []
    for b in bins:
        experts = sorted((e for _, e in b), key=lambda e: (-loads[e].item(), e))
        copies = {e: 1 for e in experts}
        for i in range(extra):
            copies[experts[i % len(experts)]] += 1
        padded.append([(loads[e].item() / c, e) for e, c in copies.items() for _ in range(c)])
    return padded


def plan_placement(loads: Loads, num_ranks: int, num_redundant: int = 0,
                   ranks_per_node: Optional[int] = None) -> Plan:
    """Computes an expert placement that keeps the worst rank's load small.

    Args:
        loads: tokens per logical expert, `[E]`, or a history `[steps, E]` (averaged).
        num_ranks: R, the EP ranks; E must be a multiple of R.
        num_redundant: extra physical slots in total for copies of the hottest experts; a
            multiple of R (equal slot counts per rank). Never raises the worst load above
            the plan without copies: where the greedy plan with copies would, that plan is
            kept and the extra slots hold copies of each rank's own experts.
        ranks_per_node: ranks per node, to balance node loads too (R a multiple of it).

    Returns:
        The `Plan`.
    """
    t = average_loads(loads)
    num_experts = t.numel()
    assert num_experts % num_ranks == 0, \
        f"{num_experts} experts do not split over {num_ranks} ranks"
    assert num_redundant >= 0 and num_redundant % num_ranks == 0, \
        f"num_redundant={num_redundant} must be a non-negative multiple of {num_ranks} ranks"
    if ranks_per_node and ranks_per_node < num_ranks:
        assert num_ranks % ranks_per_node == 0, \
            f"{num_ranks} ranks do not split into nodes of {ranks_per_node}"
    else:
        ranks_per_node = None
    bins = _place(t, num_ranks, num_redundant, ranks_per_node)
    if num_redundant:
        # Greedy packing with copies can lose to the plan without copies; then keep that plan
        # and fill each rank's extra slots with copies of its own experts (loads unchanged).
        base = _place(t, num_ranks, 0, ranks_per_node)
        if max(_sums(base)) < max(_sums(bins)):
            logger.info("copies do not lower the worst load here: plan without copies kept")
            bins = _pad(base, t, num_redundant // num_ranks)
    physical_to_logical: List[int] = []
    logical_to_physical: List[List[int]] = [[] for _ in range(num_experts)]
    for rank_items in bins:
        for _, e in sorted(rank_items, key=lambda x: x[1]):
            logical_to_physical[e].append(len(physical_to_logical))
            physical_to_logical.append(e)
    rank_load = _sums(bins)
    default = default_rank_load(t, num_ranks)
    plan = Plan(num_ranks=num_ranks, slots_per_rank=len(bins[0]),
                physical_to_logical=physical_to_logical,
                logical_to_physical=logical_to_physical, rank_load=rank_load,
                idle_share=idle_share(rank_load), default_rank_load=default,
                default_idle_share=idle_share(default))
    logger.debug("plan over %d ranks: idle share %.4f -> %.4f", num_ranks,
                 plan.default_idle_share, plan.idle_share)
    return plan


def permute_expert_weights(weights: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Reorders a per-expert tensor (dim 0 = logical expert) into the plan's physical order.

    Args:
        weights: `[E, ...]`, any dtype and device.
        plan: the placement.

    Returns:
        `[R * slots_per_rank, ...]`: row p is `weights[plan.physical_to_logical[p]]` (replicas
        are copies).
    """
    assert weights.shape[0] == len(plan.logical_to_physical), \
        f"weights have {weights.shape[0]} experts, the plan {len(plan.logical_to_physical)}"
    index = torch.tensor(plan.physical_to_logical, dtype=torch.long, device=weights.device)
    return weights.index_select(0, index)


def predicted_idle_share(loads: torch.Tensor, physical_to_logical: Sequence[int],
                         num_ranks: int) -> float:
    """`1 - mean / max` of the rank loads a placement gives `loads [E]` (copies split evenly)."""
    copies = [0] * loads.numel()
    for e in physical_to_logical:
        copies[e] += 1
    slots = len(physical_to_logical) // num_ranks
    rank_load = [sum(loads[e].item() / copies[e] for e in physical_to_logical[r * slots:
                                                                             (r + 1) * slots])
                 for r in range(num_ranks)]
    return idle_share(rank_load)
