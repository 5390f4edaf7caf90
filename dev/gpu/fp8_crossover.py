"""The SM budget from which the quantizing EP = 1 FP8 expand should stage rows: the default of
`MDEEP_FP8_ROW_STAGE_MIN_SMS`, from a sweep of both paths.

The sweep (`dev/gpu/tier_round.sh`, piece `fp8-crossover`) runs `fp8_profile.py --queued` over
SM budgets once with `MDEEP_FP8_ROW_STAGE_MIN_SMS=0` (the row stage at every budget) and once
with a threshold above every budget (registers at every budget), alternating, ROUNDS times; each
run's output follows a line `== path row_stage` or `== path registers`. Per budget and path the
figure is the least over the rounds of the FP8 calls' summed µs (each format's no-sync and cached
dispatch, calls queued: GPU time only). The default is the threshold T (a budget of the sweep,
or none) whose choice, registers below T and the row stage from T up, costs the least summed
over the budgets; where the paths cross once, that is the first budget where the row stage is
no slower.

    python dev/gpu/fp8_crossover.py LOG [LOG ...]
    python dev/gpu/fp8_crossover.py --sweep --rounds 2 --num-sms 24,48,132 --log LOG  # GPU
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

PATHS = ("registers", "row_stage")
_HEADER = re.compile(r"^== path (registers|row_stage)\b")
_LINE = re.compile(r"^fp8_profile queued: (\d+) SMs (\S+) (nosync|cached): GPU ([\d.]+) µs/call$")

# {path: {budget: {call: [µs per round]}}}
Sweep = Dict[str, Dict[int, Dict[str, List[float]]]]


def parse(texts: List[str]) -> Sweep:
    """The FP8 calls' µs per path, budget and call ("blockwise_1x128 nosync") from the logs."""
    sweep: Sweep = {path: {} for path in PATHS}
    for text in texts:
        path = None
        for line in text.splitlines():
            header = _HEADER.match(line)
            if header:
                path = header.group(1)
                continue
            match = _LINE.match(line.strip())
            if match and path is not None and match.group(2) != "bf16":
                sms, fmt, mode, us = match.groups()
                sweep[path].setdefault(int(sms), {}).setdefault(f"{fmt} {mode}", []).append(
                    float(us))
    return sweep


def least_sums(sweep: Sweep) -> Dict[int, Dict[str, float]]:
    """{budget: {path: summed least µs}} over the budgets both paths ran with the same calls."""
    table = {}
    for sms in sorted(set(sweep["registers"]) & set(sweep["row_stage"])):
        calls = set(sweep["registers"][sms]) & set(sweep["row_stage"][sms])
        if calls:
            table[sms] = {path: sum(min(sweep[path][sms][c]) for c in calls) for path in PATHS}
    return table


def choose(table: Dict[int, Dict[str, float]]) -> Tuple[Optional[int], float]:
    """(threshold, its summed µs): None means registers at every budget measured."""
    budgets = sorted(table)
    best: Tuple[Optional[int], float] = (None, float("inf"))
    for threshold in budgets + [None]:
        cost = sum(table[b]["row_stage" if threshold is not None and b >= threshold
                            else "registers"] for b in budgets)
        if cost < best[1] - 1e-9:
            best = (threshold, cost)
    return best


def render(table: Dict[int, Dict[str, float]]) -> str:
    lines = ["| SMs | registers µs | row stage µs | row stage / registers |",
             "|---:|---:|---:|---:|"]
    for sms, cell in sorted(table.items()):
        lines.append(f"| {sms} | {cell['registers']:.1f} | {cell['row_stage']:.1f} | "
                     f"{cell['row_stage'] / cell['registers']:.3f} |")
    return "\n".join(lines)


# The knob's value per path: 0 stages rows at every budget; one above any GPU's SM count never.
KNOB_VALUE = {"row_stage": "0", "registers": "100000"}


def sweep(rounds: int, budgets: str, log: str) -> None:
    """Runs fp8_profile.py --queued over `budgets` once per path and round (alternating, each
    path a process of its own: the knob is read once per process) into `log`."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp8_profile.py")
    with open(log, "w", encoding="utf-8") as out:
        for i in range(1, rounds + 1):
            for path in PATHS:
                out.write(f"== path {path} round {i}\n")
                out.flush()
                env = dict(os.environ, MDEEP_FP8_ROW_STAGE_MIN_SMS=KNOB_VALUE[path])
                done = subprocess.run([sys.executable, script, "--queued", "--num-sms", budgets],
                                      env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
                out.write(f"== exit {done.returncode}\n")


def main(argv: List[str]) -> int:
    if argv[:1] == ["--sweep"]:
        opts = dict(zip(argv[1::2], argv[2::2]))
        log = opts.get("--log", "fp8_crossover_runs.log")
        sweep(int(opts.get("--rounds", "2")), opts.get("--num-sms", "24,48,132"), log)
        argv = [log]
    if not argv:
        print(__doc__.strip().splitlines()[-2].strip(), file=sys.stderr)
        return 2
    texts = []
    for name in argv:
        with open(name, encoding="utf-8") as f:
            texts.append(f.read())
    table = least_sums(parse(texts))
    if not table:
        print("fp8_crossover: no budget with both paths measured in the logs")
        return 1
    print("FP8 calls' summed GPU µs (each format's no-sync and cached dispatch, calls queued; "
          "least of the rounds)")
    print(render(table))
    threshold, cost = choose(table)
    if threshold is None:
        print(f"registers are no slower at every budget measured ({min(table)}-{max(table)} "
              f"SMs): set MDEEP_FP8_ROW_STAGE_MIN_SMS above {max(table)}")
    else:
        print(f"default: MDEEP_FP8_ROW_STAGE_MIN_SMS={threshold} (registers below "
              f"{threshold} SMs, the row stage from it up; {cost:.1f} µs summed over the "
              "budgets)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
