"""A load-balance planner: an expert placement over the EP ranks from recorded per-expert loads.

The planner itself (`plan_placement`, `Plan`, the predicted idle share) is
`megatron_deepep.placement`, re-exported here; this module adds the load files, synthetic loads
and the command line. The dispatcher's metrics log `1 - min / max` of the rank loads (the least
loaded rank's idle share); the planner predicts `1 - mean / max` (both are 0 for equal loads).

Command line (no GPU)::

    python -m megatron_deepep.tools.balance --loads deepep_metrics_rank0.jsonl --ranks 8
    --redundant 8
    python -m megatron_deepep.tools.balance --synthetic zipf:64:1.2 --ranks 8 --json plan.json

`--loads` reads a JSON file (a list `[E]` or `[steps, E]`, a re-plan file, or an object with a
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
from typing import Dict, List, Optional, Sequence

import torch

# The planner lives in the data layer (`megatron.replan` plans at checkpoint save with it);
# these names stay importable from here.
from megatron_deepep.placement import (  # noqa: F401
    Loads,
    Plan,
    average_loads,
    check_request,
    default_rank_load,
    idle_share,
    permute_expert_weights,
    plan_placement,
    predicted_idle_share,
    replica_counts,
)

logger = logging.getLogger(__name__)


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
        path: `.json` (a list `[E]` / `[steps, E]`, an object with `tokens_per_expert`, or a
            re-plan file `mdeep_expert_plan.json`: `layers.<layer>.loads`) or
            `.jsonl` (the dispatcher's metrics lines, field `layers.<layer>.tokens_per_expert`).
        layer: keep only this layer (a key of `layers`); all layers when None.

    Returns:
        Layer name -> `[steps, E]` float64 (a `.json` list gives layer "0").
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
    if isinstance(data, dict) and isinstance(data.get("layers"), dict):  # a re-plan file
        return {str(k): torch.tensor([v["loads"]], dtype=torch.float64)
                for k, v in data["layers"].items()}
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


def _parser() -> argparse.ArgumentParser:
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
    return p


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Plan]:
    """The command line; returns the plans by layer. An impossible request (`--redundant`
    not a multiple of `--ranks` or more than E x (R - 1), E not a multiple of R) exits with
    status 2 and a message naming the numbers."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.synthetic:
        histories = {"0": synthetic_loads(args.synthetic).unsqueeze(0)}
    else:
        histories = read_loads(args.loads, args.layer)
    try:
        plans = {name: plan_placement(h, args.ranks, args.redundant, args.ranks_per_node)
                 for name, h in sorted(histories.items(), key=lambda kv: (len(kv[0]), kv[0]))}
    except ValueError as exc:
        parser.error(f"--ranks {args.ranks} --redundant {args.redundant}: {exc}")
    for name, plan in plans.items():
        sys.stdout.write(format_plan(name, plan) + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"layers": {k: v.to_dict() for k, v in plans.items()}}, f, indent=1)
    return plans


if __name__ == "__main__":
    main()
