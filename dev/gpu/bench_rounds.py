"""One table from alternating bench rounds: each dispatch variant's least µs per side.

`dev/gpu/fp8.sh`'s `rounds` piece runs `python -m megatron_deepep.bench` ROUNDS times per side
(after, before, after, ...) on the same machine; hosts drift within a call, so the least of the
rounds is the figure and every round's value is printed beside it. FP8 rows also get their ratio
to bf16's row of the same SM budget and mode (least against least).

Usage:
    python dev/gpu/bench_rounds.py after=OUT/round1_after/bench.json before=... after=...
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
from typing import Dict, List, Tuple

# "ours 24 SMs fp8 blockwise_1x128 nosync" -> ("24", "nosync"); bf16's rows lack "fp8 NAME".
_OURS = re.compile(r"^ours (\d+) SMs (?:fp8 \S+ )?(\w+)$")


def collect(pairs: List[Tuple[str, str]]) -> Dict[str, Dict[str, List[float]]]:
    """{variant: {side: [dispatch µs per round]}} from (side, bench.json path) pairs."""
    table: Dict[str, Dict[str, List[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    for side, path in pairs:
        if not os.path.exists(path):  # a round its budget skipped, or one that failed
            sys.stderr.write(f"bench_rounds.py: no {path}; left out\n")
            continue
        with open(path) as f:
            rows = json.load(f)
        for entry in rows:
            shape = ",".join(str(v) for v in entry["shape"])
            for key, res in entry["variants"].items():
                if "dispatch_us" in res:
                    table[f"{shape} {key}"][side].append(res["dispatch_us"])
    return table


def render(table: Dict[str, Dict[str, List[float]]], sides: List[str]) -> str:
    """A markdown table: per variant and side, the least µs, its ratio to bf16 (FP8 rows) and
    every round's µs."""
    def bf16_of(variant: str) -> str:
        shape, key = variant.split(" ", 1)
        match = _OURS.match(key)
        return f"{shape} ours {match.group(1)} SMs {match.group(2)}" if match else ""

    lines = ["| variant | " + " | ".join(sides) + " |", "|---|" + "---:|" * len(sides)]
    for variant, by_side in table.items():
        cells = []
        for side in sides:
            values = by_side.get(side)
            if not values:
                cells.append("-")
                continue
            cell = f"{min(values):.1f}"
            base = table.get(bf16_of(variant), {}).get(side)
            if " fp8 " in variant and base:
                cell += f" ({min(values) / min(base):.2f})"
            cells.append(cell + " [" + " ".join(f"{v:.1f}" for v in values) + "]")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: List[str]) -> int:
    pairs = []
    for arg in argv:
        side, sep, path = arg.partition("=")
        if not sep:
            sys.stderr.write(f"bench_rounds.py: expected SIDE=PATH, got {arg!r}\n")
            return 2
        pairs.append((side, path))
    if not pairs:
        sys.stderr.write(__doc__)
        return 2
    sides = list(dict.fromkeys(side for side, _ in pairs))
    sys.stdout.write("least µs of the rounds (FP8 / bf16 of the same SMs and mode) "
                     "[each round]\n" + render(collect(pairs), sides) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
