"""A load-balance planner: an expert placement over the EP ranks from recorded per-expert loads.

Input: the tokens each logical expert received, `[E]`, or a history `[steps, E]` (averaged over
steps). Output: a `Plan` that puts `slots_per_rank` physical experts on each of R ranks, so that
the most loaded rank's load is small. With `num_redundant` extra slots (in total, a multiple of
R), the hottest experts get copies, as DeepSeek's EPLB does; a replicated expert's load is
assumed to split evenly over its copies.

Greedy, in two steps:
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

Predicted idle share (the figure printed before and after): with `rank_load[r]` the tokens
rank r's experts receive, `idle_share = 1 - mean(rank_load) / max(rank_load)`: the share of the
expert phase (whose length the worst rank sets) that the ranks spend idle, on average. (The
dispatcher's metrics log `1 - min / max`, the least loaded rank's idle share; both are 0 when
the loads are equal.) The default placement is the contiguous one: rank r owns logical experts
`[r * E / R, (r + 1) * E / R)`.

Command line (no GPU)::

    python -m megatron_deepep.tools.balance --loads deepep_metrics_rank0.jsonl --ranks 8
    --redundant 8
    python -m megatron_deepep.tools.balance --synthetic zipf:64:1.2 --ranks 8 --json plan.json

`--loads` reads a JSON file (a list `[E]` or `[steps, E]`, or an object with a
`tokens_per_expert` list) or the dispatcher's metrics JSON lines
(`{"step": s, "layers": {"<layer>": {"tokens_per_expert": [...]}}}` per line; the field is
`tokens_per_expert`, all E experts in the order of the placement the run used; a run under an
expert map also writes `physical_to_logical`, and the copies' counts are added back to their
logical experts). Each layer gets its own plan.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Union

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


def synthetic_loads(spec: str, num_tokens: int = 1_000_000) -> torch.Tensor:
    """Synthetic loads `[E]` from `zipf:E:alpha`, `hot:E:factor` or `uniform:E`.

    Args:
        spec: `zipf:E:alpha` (expert i gets a share proportional to 1 / (i + 1) ** alpha),
            `hot:E:factor` (expert 0 gets `factor` times the others' load) or `uniform:E`.
        num_tokens: the total load.

    Returns:
        `[E]` float64 loads summing to `num_tokens`.
    """
    kind, *args = spec.split(":")
    num_experts = int(args[0])
    if kind == "zipf":
        weights = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** float(args[1])
    elif kind == "hot":
        weights = torch.ones(num_experts, dtype=torch.float64)
        weights[0] = float(args[1])
    elif kind == "uniform":
        weights = torch.ones(num_experts, dtype=torch.float64)
    else:
        raise ValueError(f"unknown synthetic spec {spec!r} (zipf:E:alpha, hot:E:factor, uniform:E)")
    return weights / weights.sum() * num_tokens


def logical_loads(tokens_per_slot: Sequence[float],
                  physical_to_logical: Optional[Sequence[int]] = None) -> List[float]:
    """Per logical expert loads from per physical slot counts (a run under an expert map):
    the copies of an expert add up. Without a map the counts are returned as they are."""
    if physical_to_logical is None:
        return list(tokens_per_slot)
    assert len(physical_to_logical) == len(tokens_per_slot), \
        f"{len(tokens_per_slot)} counts for {len(physical_to_logical)} physical slots"
    out = [0.0] * (max(physical_to_logical) + 1)
    for load, e in zip(tokens_per_slot, physical_to_logical):
        out[e] += load
    return out


def read_loads(path: str, layer: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Per-layer load histories `[steps, E]` from a JSON file or metrics JSON lines.

    Args:
        path: `.json` (a list `[E]` / `[steps, E]`, or an object with `tokens_per_expert`) or
            `.jsonl` (the dispatcher's metrics lines, field `layers.<layer>.tokens_per_expert`).
        layer: keep only this layer (a key of `layers`); all layers when None.

    Returns:
        Layer name -> `[steps, E]` float64 (a `.json` file gives layer "0").
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".jsonl"):
        rows: Dict[str, List[List[float]]] = {}
        for line in text.splitlines():
            if not line.strip():
                continue
            for name, values in json.loads(line).get("layers", {}).items():
                if layer is None or name == str(layer):
                    rows.setdefault(name, []).append(logical_loads(
                        values["tokens_per_expert"], values.get("physical_to_logical")))
        assert rows, f"{path}: no tokens_per_expert" + (f" for layer {layer}" if layer else "")
        return {k: torch.tensor(v, dtype=torch.float64) for k, v in rows.items()}
    data = json.loads(text)
    if isinstance(data, dict):
        data = data["tokens_per_expert"]
    t = torch.tensor(data, dtype=torch.float64)
    return {"0": t if t.dim() == 2 else t.unsqueeze(0)}


def format_plan(name: str, plan: Plan) -> str:
    """A short text report of one plan: idle share before and after, and the placement."""
    lines = [f"layer {name}: worst-rank load {max(plan.default_rank_load):.1f} -> "
             f"{plan.max_load:.1f}; predicted idle share (1 - mean/max) "
             f"{plan.default_idle_share:.2%} (contiguous) -> {plan.idle_share:.2%} (plan)"]
    s = plan.slots_per_rank
    for r in range(plan.num_ranks):
        experts = plan.physical_to_logical[r * s:(r + 1) * s]
        lines.append(f"  rank {r}: load {plan.rank_load[r]:.1f} experts {experts}")
    return "\n".join(lines)


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_deepep.tools.balance",
                                description="Plan an expert placement over EP ranks from "
                                            "recorded per-expert loads (no GPU).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--loads", metavar="FILE",
                     help="loads: .json ([E], [steps, E] or {tokens_per_expert: ...}) or the "
                          "dispatcher's metrics .jsonl (field layers.<layer>.tokens_per_expert)")
    src.add_argument("--synthetic", metavar="SPEC",
                     help="synthetic loads: zipf:E:alpha, hot:E:factor or uniform:E")
    p.add_argument("--ranks", type=int, required=True, help="EP ranks R (E a multiple of R)")
    p.add_argument("--redundant", type=int, default=0,
                   help="extra slots in total for copies of hot experts (a multiple of R)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per node, to balance node loads too")
    p.add_argument("--layer", default=None, help="plan only this layer of a .jsonl file")
    p.add_argument("--json", metavar="OUT", default=None, help="write the plans here as JSON")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Plan]:
    """The command line; returns the plans by layer."""
    args = _parse(argv)
    if args.synthetic:
        histories = {"0": synthetic_loads(args.synthetic).unsqueeze(0)}
    else:
        histories = read_loads(args.loads, args.layer)
    plans = {name: plan_placement(h, args.ranks, args.redundant, args.ranks_per_node)
             for name, h in sorted(histories.items(), key=lambda kv: (len(kv[0]), kv[0]))}
    for name, plan in plans.items():
        sys.stdout.write(format_plan(name, plan) + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"layers": {k: v.to_dict() for k, v in plans.items()}}, f, indent=1)
    return plans


if __name__ == "__main__":
    main()
