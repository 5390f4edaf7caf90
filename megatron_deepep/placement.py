"""The expert-placement planner: a placement over the EP ranks from per-expert loads.

Input: the tokens each logical expert received, `[E]`, or a history `[steps, E]` (averaged over
steps). Output: a `Plan` that puts `slots_per_rank` physical experts on each of R ranks, so that
the most loaded rank's load is small. With `num_redundant` extra slots (in total, a multiple of
R), experts get copies, as DeepSeek's EPLB does; a replicated expert's load is assumed to split
evenly over its copies.

Every plan is loadable: each rank holds `(E + num_redundant) / R` slots, every logical expert
at least one of them, and no rank two copies of one expert (such a copy adds no balance, and
a checkpoint cannot be loaded into it). So an expert has at most R copies, and at most
`E * (R - 1)` extra slots can be filled; more is a `ValueError`.

Greedy, in three steps, tried for a few splits of the extra slots (the best plan is kept):
1. Copies: k extra slots go one by one to the expert with the highest load per copy (at most
   R copies); the other `num_redundant - k` go to the coldest experts (lowest load per copy),
   where a copy changes the rank loads least. k = `num_redundant` is DeepSeek's rule; smaller
   k serve loads where hot copies cannot be packed well on distinct ranks.
2. Packing: longest-processing-time (LPT) with equal slot counts per rank: experts in
   decreasing load per copy, each copy to the least loaded rank with a free slot that does not
   hold the expert yet, unless that would leave the remaining copies no way to fill the free
   slots on distinct ranks (checked exactly, Gale-Ryser): then to the ranks with the most free
   slots. Then pairwise swaps between the worst rank and the others while a swap lowers the
   pair's maximum. With `ranks_per_node`, copies are first packed over nodes, at most
   `ranks_per_node` copies of an expert per node, then over the ranks of each node.
3. Without copies, the contiguous placement is a candidate too, so a plan never predicts a
   worse rank than it.

Predicted idle share: with `rank_load[r]` the tokens rank r's experts receive,
`idle_share = 1 - mean(rank_load) / max(rank_load)`: the share of the expert phase (whose length
the worst rank sets) that the ranks spend idle, on average. The default placement is the
contiguous one: rank r owns logical experts `[r * E / R, (r + 1) * E / R)`.

Data layer: imports nothing of the package, so the command line (`tools.balance`), the
step-boundary re-placement (`tools.rebalance`) and the re-plan at checkpoint save
(`megatron.replan`) share this one planner.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

logger = logging.getLogger(__name__)

Loads = Union[torch.Tensor, Sequence[float], Sequence[Sequence[float]]]
#: One packed copy: `(load per copy, logical expert)`.
Item = Tuple[float, int]


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
    """Per-expert loads `[E]` (float64) from `[E]` or a history `[steps, E]` (mean over steps).

    Raises:
        ValueError: another shape, no experts, or a negative or non-finite load.
    """
    t = torch.as_tensor(loads, dtype=torch.float64)
    if t.dim() == 2:
        t = t.mean(dim=0)
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"loads must be [E] or [steps, E] with E >= 1, got "
                         f"{tuple(torch.as_tensor(loads).shape)}")
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise ValueError("loads must be finite and non-negative")
    return t


def check_request(num_experts: int, num_ranks: int, num_redundant: int = 0,
                  ranks_per_node: Optional[int] = None) -> None:
    """Refuses a placement no plan can give.

    Raises:
        ValueError: E not a multiple of R, extra slots not a non-negative multiple of R, more
            extra slots than `E * (R - 1)` (one copy of an expert per rank), or R not a multiple
            of `ranks_per_node`; naming the numbers.
    """
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts do not split over {num_ranks} EP ranks "
                         f"(the experts must be a multiple of the ranks)")
    check_extra_slots(num_redundant, num_ranks, num_experts)
    if ranks_per_node and ranks_per_node < num_ranks and num_ranks % ranks_per_node:
        raise ValueError(f"{num_ranks} EP ranks do not split into nodes of {ranks_per_node}")


def check_extra_slots(num_redundant: int, num_ranks: int,
                      num_experts: Optional[int] = None) -> None:
    """Refuses extra slots (for copies of experts) that no plan can fill.

    Raises:
        ValueError: not a non-negative multiple of R, or (E given) more than `E * (R - 1)`
            (one copy of an expert per rank); naming the numbers.
    """
    if num_redundant < 0 or num_redundant % num_ranks:
        raise ValueError(f"{num_redundant} extra slots: must be a non-negative multiple of the "
                         f"{num_ranks} EP ranks (every rank holds the same slot count)")
    most = None if num_experts is None else num_experts * (num_ranks - 1)
    if most is not None and num_redundant > most:
        raise ValueError(f"{num_redundant} extra slots exceed the {most} copies that "
                         f"{num_experts} experts can have over {num_ranks} EP ranks (one copy "
                         f"of an expert per rank: at most E x (R - 1) = {most} extra slots)")


def default_rank_load(loads: Loads, num_ranks: int) -> List[float]:
    """Tokens per rank of the contiguous placement (rank r owns experts [r E/R, (r+1) E/R))."""
    t = average_loads(loads)
    check_request(t.numel(), num_ranks)
    return t.reshape(num_ranks, -1).sum(dim=1).tolist()


def replica_counts(loads: torch.Tensor, num_redundant: int, max_copies: int,
                   hottest: Optional[int] = None) -> List[int]:
    """Copies per expert: `hottest` extra slots (default: all) go one by one to the highest
    load per copy (ties: lowest id), the rest to the lowest load per copy (ties: fewest copies,
    lowest id); no expert gets more than `max_copies`.

    Raises:
        ValueError: more extra slots than `E * (max_copies - 1)`, naming the numbers.
    """
    num_experts = loads.numel()
    if num_redundant > num_experts * (max_copies - 1):
        raise ValueError(f"{num_redundant} extra slots exceed the "
                         f"{num_experts * (max_copies - 1)} copies that {num_experts} experts "
                         f"can have at {max_copies} copies each")
    counts, values = [1] * num_experts, loads.tolist()
    hottest = num_redundant if hottest is None else hottest
    hot = [(-v, e) for e, v in enumerate(values) if max_copies > 1]  # by load per copy
    heapq.heapify(hot)
    for _ in range(hottest):
        _, e = heapq.heappop(hot)
        counts[e] += 1
        if counts[e] < max_copies:
            heapq.heappush(hot, (-values[e] / counts[e], e))
    cold = [(v / counts[e], counts[e], e) for e, v in enumerate(values) if counts[e] < max_copies]
    heapq.heapify(cold)
    for _ in range(num_redundant - hottest):
        _, _, e = heapq.heappop(cold)
        counts[e] += 1
        if counts[e] < max_copies:
            heapq.heappush(cold, (values[e] / counts[e], counts[e], e))
    return counts


def _fits(free: List[int], copies_left: List[int], max_same: int) -> bool:
    """Whether experts with `copies_left` copies can fill bins with `free` slots, at most
    `max_same` copies of one expert per bin (Gale-Ryser: the k fullest bins never need more
    than the experts can give them, `sum min(copies, max_same * k)`)."""
    if sum(free) != sum(copies_left):
        return False
    most = max(copies_left, default=0)
    at_least = [0] * (most + 2)  # at_least[j]: experts with >= j copies left
    for c in copies_left:
        at_least[c] += 1
    for j in range(most - 1, 0, -1):
        at_least[j] += at_least[j + 1]
    prefix = [0]  # prefix[j] = sum over experts of min(copies, j)
    for j in range(1, most + 1):
        prefix.append(prefix[-1] + at_least[j])
    room = 0
    for k, f in enumerate(sorted(free, reverse=True), start=1):
        room += f
        if room > prefix[min(max_same * k, most)]:
            return False
    return True


def _pack(groups: List[Tuple[float, int, int]], num_bins: int, capacity: int,
          max_same: int = 1) -> List[List[Item]]:
    """LPT with `capacity` copies per bin and at most `max_same` copies of one expert per bin,
    then pairwise swaps off the worst bin.

    Args:
        groups: `(load per copy, expert, copies)`, `capacity * num_bins` copies in all.
        num_bins: bins to fill.
        capacity: copies per bin.
        max_same: copies of one expert a bin may hold (1: ranks; ranks per node: nodes).

    Returns:
        The `(load, expert)` items of each bin.
    """
    assert sum(c for _, _, c in groups) == num_bins * capacity
    bins: List[List[Item]] = [[] for _ in range(num_bins)]
    sums = [0.0] * num_bins
    order = sorted(groups, key=lambda g: (-g[0], g[1]))
    copies_left = [c for _, _, c in order]
    for i, (load, expert, count) in enumerate(order):
        copies_left[i] = 0
        free = [capacity - len(b) for b in bins]
        chosen = _choose(free, sums, count, max_same)
        after = list(free)
        for b in chosen:
            after[b] -= 1
        if not _fits(after, copies_left, max_same):  # keep the rest placeable
            chosen = _choose(free, sums, count, max_same, fullest_first=True)
        for b in chosen:
            bins[b].append((load, expert))
            sums[b] += load
    _swap_off_worst(bins, sums, max_same)
    return bins


def _choose(free: List[int], sums: List[float], count: int, max_same: int,
            fullest_first: bool = False) -> List[int]:
    """`count` bins for the copies of one expert, one at a time (at most `max_same` in one
    bin): the least loaded bin with a free slot, or with `fullest_first` the bin with the most
    free slots left (ties: least loaded), which keeps any placeable rest placeable."""
    free, taken, chosen = list(free), [0] * len(free), []
    for _ in range(count):
        open_ = [b for b in range(len(free)) if free[b] > 0 and taken[b] < max_same]
        b = min(open_, key=lambda b: (-free[b] if fullest_first else 0, sums[b], b))
        free[b] -= 1
        taken[b] += 1
        chosen.append(b)
    return chosen


def _swap_off_worst(bins: List[List[Item]], sums: List[float], max_same: int) -> None:
    """Swaps one copy of the worst bin with one of another bin while that lowers the pair's
    maximum (each swap lowers it: terminates); never more than `max_same` of one expert in a
    bin."""
    held = [Counter(e for _, e in b) for b in bins]
    while True:
        worst = max(range(len(bins)), key=lambda i: sums[i])
        best = None
        for other in range(len(bins)):
            if other == worst:
                continue
            for i, (a, ea) in enumerate(bins[worst]):
                if held[other][ea] >= max_same:
                    continue
                for j, (c, ec) in enumerate(bins[other]):
                    if a <= c or ea == ec or held[worst][ec] >= max_same:
                        continue
                    pair_max = max(sums[worst] - a + c, sums[other] - c + a)
                    if pair_max < sums[worst] - 1e-12 and (best is None or pair_max < best[0]):
                        best = (pair_max, other, i, j)
        if best is None:
            return
        _, other, i, j = best
        (a, ea), (c, ec) = bins[worst][i], bins[other][j]
        bins[worst][i], bins[other][j] = (c, ec), (a, ea)
        sums[worst] += c - a
        sums[other] += a - c
        held[worst][ea] -= 1
        held[worst][ec] += 1
        held[other][ec] -= 1
        held[other][ea] += 1


def _sums(bins: List[List[Item]]) -> List[float]:
    return [sum(load for load, _ in b) for b in bins]


def _place(loads: torch.Tensor, counts: List[int], num_ranks: int,
           ranks_per_node: Optional[int]) -> List[List[Item]]:
    """The greedy packing of `counts` copies per expert: `(load, expert)` items per rank."""
    slots = sum(counts) // num_ranks
    groups = [(loads[e].item() / c, e, c) for e, c in enumerate(counts)]
    if ranks_per_node is None:
        return _pack(groups, num_ranks, slots)
    nodes = _pack(groups, num_ranks // ranks_per_node, slots * ranks_per_node,
                  max_same=ranks_per_node)
    out = []
    for node in nodes:
        copies = {}
        for load, e in node:
            copies[e] = (load, copies.get(e, (load, 0))[1] + 1)
        out += _pack([(load, e, c) for e, (load, c) in copies.items()], ranks_per_node, slots)
    return out


def _pad(bins: List[List[Item]], loads: torch.Tensor, extra_per_rank: int) -> List[List[Item]]:
    """A placement without copies plus `extra_per_rank` copies on every rank: round by round,
    the least loaded rank first, each takes a copy of an expert it does not hold, the one that
    leaves the lowest worst rank (ties: the least added load); then swaps off the worst rank.
    """
    held = [sorted(e for _, e in b) for b in bins]
    holders: List[List[int]] = [[] for _ in range(loads.numel())]
    for r, experts in enumerate(held):
        for e in experts:
            holders[e].append(r)
    holding = [set(h) for h in holders]
    values = loads.tolist()
    sums = [sum(values[e] / len(holders[e]) for e in experts) for experts in held]

    def worst_after(r: int, e: int, by_load: List[int]) -> Tuple[float, float, int]:
        c = len(holders[e])
        added, dropped = values[e] / (c + 1), values[e] / c - values[e] / (c + 1)
        others = max((sums[x] - dropped for x in holders[e]), default=0.0)
        top = next((x for x in by_load if x != r and x not in holding[e]), None)
        if top is not None:
            others = max(others, sums[top])
        return max(others, sums[r] + added), added, e

    for _ in range(extra_per_rank):
        for r in sorted(range(len(held)), key=lambda r: (sums[r], r)):
            by_load = sorted(range(len(held)), key=lambda x: -sums[x])
            e = min((e for e in range(len(values)) if r not in holding[e]),
                    key=lambda e: worst_after(r, e, by_load))
            c = len(holders[e])
            for x in holders[e]:
                sums[x] -= values[e] / c - values[e] / (c + 1)
            sums[r] += values[e] / (c + 1)
            held[r].append(e)
            holders[e].append(r)
            holding[e].add(r)
    padded = [[(values[e] / len(holders[e]), e) for e in experts] for experts in held]
    _swap_off_worst(padded, _sums(padded), 1)
    return padded


def _hot_copy_splits(num_redundant: int) -> List[int]:
    """The numbers of extra slots given to hot experts that the planner tries (all of them
    first; at most 11 splits, so large plans stay fast)."""
    picks = {num_redundant, 0, 1, num_redundant - 1}
    picks.update(num_redundant * i // 8 for i in range(1, 8))
    return sorted((k for k in picks if 0 <= k <= num_redundant), reverse=True)


def plan_placement(loads: Loads, num_ranks: int, num_redundant: int = 0,
                   ranks_per_node: Optional[int] = None) -> Plan:
    """Computes an expert placement that keeps the worst rank's load small.

    Args:
        loads: tokens per logical expert, `[E]`, or a history `[steps, E]` (averaged).
        num_ranks: R, the EP ranks; E must be a multiple of R.
        num_redundant: extra physical slots in total for copies; a multiple of R (equal slot
            counts per rank) and at most `E * (R - 1)` (one copy of an expert per rank).
        ranks_per_node: ranks per node, to balance node loads too (R a multiple of it).

    Returns:
        The `Plan`: `(E + num_redundant) / R` slots per rank, every expert held, no expert
        twice on a rank.

    Raises:
        ValueError: an impossible request (`check_request`) or bad loads, naming the numbers.
    """
    t = average_loads(loads)
    num_experts = t.numel()
    check_request(num_experts, num_ranks, num_redundant, ranks_per_node)
    if not ranks_per_node or ranks_per_node >= num_ranks:
        ranks_per_node = None
    best: Optional[List[List[Item]]] = None
    tried = set()
    for hot in _hot_copy_splits(num_redundant):
        counts = replica_counts(t, num_redundant, num_ranks, hottest=hot)
        if tuple(counts) in tried:
            continue
        tried.add(tuple(counts))
        bins = _place(t, counts, num_ranks, ranks_per_node)
        if best is None or max(_sums(bins)) < max(_sums(best)) * (1 - 1e-12):
            best = bins
    # Candidates that start from no copies: the contiguous placement (where greedy packing
    # loses to it) and the plan without copies, each with its extra slots padded.
    base = _place(t, [1] * num_experts, num_ranks, ranks_per_node)
    contiguous = [[(t[e].item(), e) for e in range(r * num_experts // num_ranks,
                                                   (r + 1) * num_experts // num_ranks)]
                  for r in range(num_ranks)]
    for start in (base, contiguous):
        bins = _pad(start, t, num_redundant // num_ranks) if num_redundant else start
        if max(_sums(bins)) < max(_sums(best)) * (1 - 1e-12):
            best = bins
    physical_to_logical: List[int] = []
    logical_to_physical: List[List[int]] = [[] for _ in range(num_experts)]
    for rank_items in best:
        for _, e in sorted(rank_items, key=lambda x: x[1]):
            logical_to_physical[e].append(len(physical_to_logical))
            physical_to_logical.append(e)
    rank_load = _sums(best)
    default = default_rank_load(t, num_ranks)
    plan = Plan(num_ranks=num_ranks, slots_per_rank=len(best[0]),
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
