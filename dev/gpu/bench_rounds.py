"""One table from alternating bench rounds: each dispatch variant's least µs per side.

`dev/gpu/fp8.sh`'s `rounds` piece runs `python -m megatron_deepep.bench` ROUNDS times per side
(after, before, after, ...) on the same machine; hosts drift within a call, so the least of the
rounds is the figure and every round's value is printed beside it. FP8 rows also get their ratio
to bf16's row of the same SM budget and mode (least against least).

The same for alternating `fp8_profile.py --queued` runs (the `queued` piece), given their logs
instead: each line "fp8_profile queued: 132 SMs blockwise_1x128 nosync: GPU 115.8 µs/call" is
one call's GPU time with the calls queued; the table has each call's least µs per side.

Usage:
    python dev/gpu/bench_rounds.py after=OUT/round1_after/bench.json before=... after=...
    python dev/gpu/bench_rounds.py after=OUT/fp8_queued1_after.log before=... after=...
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


Rounds = Dict[str, List[float]]  # {side: [µs per round]}


def _existing(pairs: List[Tuple[str, str]]):
    """The (side, path) pairs whose file exists; a note on stderr for each other one (a round
    its budget skipped, or one that failed)."""
    for side, path in pairs:
        if os.path.exists(path):
            yield side, path
        else:
            sys.stderr.write(f"bench_rounds.py: no {path}; left out\n")


def collect(pairs: List[Tuple[str, str]]) -> Dict[str, Rounds]:
    """{variant: {side: [dispatch µs per round]}} from (side, bench.json path) pairs."""
    table: Dict[str, Rounds] = collections.defaultdict(lambda: collections.defaultdict(list))
    for side, path in _existing(pairs):
        with open(path) as f:
            rows = json.load(f)
        for entry in rows:
            shape = ",".join(str(v) for v in entry["shape"])
            for key, res in entry["variants"].items():
                if "dispatch_us" in res:
                    table[f"{shape} {key}"][side].append(res["dispatch_us"])
    return table


def _cell(values, base) -> str:
    """One side's cell: the least of `values` (µs per round), its ratio to the least of `base`
    (bf16's rounds) when given, then every round; "-" without rounds."""
    if not values:
        return "-"
    cell = f"{min(values):.1f}"
    if base:
        cell += f" ({min(values) / min(base):.2f})"
    return cell + " [" + " ".join(f"{v:.1f}" for v in values) + "]"


def render(table: Dict[str, Rounds], sides: List[str]) -> str:
    """A markdown table: per variant and side, the least µs, its ratio to bf16 (FP8 rows) and
    every round's µs."""
    def bf16_of(variant: str) -> str:
        shape, key = variant.split(" ", 1)
        match = _OURS.match(key)
        return f"{shape} ours {match.group(1)} SMs {match.group(2)}" if match else ""

    lines = ["| variant | " + " | ".join(sides) + " |", "|---|" + "---:|" * len(sides)]
    for variant, by_side in table.items():
        bf16 = table.get(bf16_of(variant), {}) if " fp8 " in variant else {}
        cells = [_cell(by_side.get(side), bf16.get(side)) for side in sides]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


_QUEUED = re.compile(r"^fp8_profile queued: (\d+ SMs) (.+): GPU ([\d.]+) µs/call$")


def collect_queued(pairs: List[Tuple[str, str]]) -> Dict[Tuple[str, str], Rounds]:
    """{(SMs, call): {side: [µs per round]}} from (side, `--queued` log path) pairs."""
    table: Dict[Tuple[str, str], Rounds] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    for side, path in _existing(pairs):
        with open(path) as f:
            for line in f:
                match = _QUEUED.match(line.strip())
                if match:
                    sms, call, us = match.groups()
                    table[(sms, call)][side].append(float(us))
    return table


def render_queued(table: Dict[Tuple[str, str], Rounds], sides: List[str]) -> str:
    """A markdown table: per SM budget and call, each side's least µs (with its ratio to
    bf16's call of the same mode for the other formats) and every round's µs."""
    lines = ["| SMs | call | " + " | ".join(sides) + " |", "|---|---|" + "---:|" * len(sides)]
    for (sms, call), by_side in table.items():
        name, _, mode = call.rpartition(" ")
        bf16 = table.get((sms, f"bf16 {mode}"), {}) if name not in ("bf16", "") else {}
        cells = [_cell(by_side.get(side), bf16.get(side)) for side in sides]
        lines.append(f"| {sms} | {call} | " + " | ".join(cells) + " |")
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
    if all(path.endswith(".log") for _, path in pairs):
        sys.stdout.write("GPU µs per call, calls queued, least of the rounds (FP8 / bf16 of the "
                         "same SMs and mode) [each round]\n"
                         + render_queued(collect_queued(pairs), sides) + "\n")
        return 0
    sys.stdout.write("least µs of the rounds (FP8 / bf16 of the same SMs and mode) "
                     "[each round]\n" + render(collect(pairs), sides) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
