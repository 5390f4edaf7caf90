"""One summary line per piece of `dev/gpu/gpu_multi.sh`, read from its outputs.

    python dev/gpu/gpu_multi_report.py bench bench_ep8.json
    python dev/gpu/gpu_multi_report.py pytest tier_n8.log
    python dev/gpu/gpu_multi_report.py main main_deepep.log main_alltoall.log
    python dev/gpu/gpu_multi_report.py staging staging_ring.json

`bench`: the EP > 1 targets met (>= 340 GB/s per direction with <= 24 SMs; >= 1.1x NCCL's
all_to_all_single of the same bytes) over every variant and op, and the worst rank's bf16 GB/s
at the smallest SM budget per shape. `pytest`: the counts of pytest's last line and the failed
tests. `main`: per training log, the lm loss at the first and last iteration and the median
time per iteration (iterations after the first 3: warm-up and compiles); with two logs, the
largest loss difference over the iterations both logged. `staging`: the staging a
`python -m megatron_deepep.tools.multinode_check --json` sweep ran and its dispatch and combine µs
and GB/s per rank
at each point. A missing or unreadable file gives a
line that says so (exit status 0: the summary table is printed whatever a piece left).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from typing import Dict, List, Optional, Tuple

ITERATION = re.compile(r"iteration\s+(\d+)/")
LM_LOSS = re.compile(r"lm loss: ([0-9.Ee+-]+)")
STEP_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
WARMUP_ITERATIONS = 3  # not counted in the median step time
PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _read_json(path: str) -> Tuple[object, Optional[str]]:
    """(the parsed file, None), or (None, the line that says why it could not be read)."""
    text = _read(path)
    if text is None:
        return None, f"no {path}"
    try:
        return json.loads(text), None
    except ValueError as exc:
        return None, f"{path} is not JSON ({exc})"


def bench_line(path: str) -> str:
    """The bench's targets and bf16 GB/s from its bench.json (rows of `megatron_deepep.bench`)."""
    rows, problem = _read_json(path)
    if problem:
        return problem
    counts = {"GBps": [0, 0], "nccl": [0, 0]}  # [met, measured]
    shapes = []
    for row in rows:
        peers = row.get("peers")
        if peers is None:
            continue
        for figures in peers["variants"].values():
            for op in ("dispatch", "combine"):
                fig = figures.get(op)
                for key, name in (("GBps", "target_GBps_met"), ("nccl", "target_nccl_met")):
                    if fig is not None and fig.get(name) is not None:
                        counts[key][0] += bool(fig[name])
                        counts[key][1] += 1
        bf16 = [v for v in peers["variants"].values() if v["wire"] == "bf16"]
        if bf16:
            fewest = min(v["num_sms"] for v in bf16)
            best = {op: max((v[op]["GBps_worst"] for v in bf16
                             if v["num_sms"] == fewest and op in v), default=0.0)
                    for op in ("dispatch", "combine")}
            shapes.append(f"{tuple(row['shape'])} {fewest} SMs dispatch {best['dispatch']:.0f} / "
                          f"combine {best['combine']:.0f} GB/s")
    if not shapes:
        return f"EP {rows[0]['ep'] if rows else '?'}: no EP > 1 figures in {path}"
    nccl = (f"{counts['nccl'][0]}/{counts['nccl'][1]} met" if counts["nccl"][1]
            else "NCCL not measured")
    return (f"EP {rows[0]['ep']}: >= 340 GB/s (<= 24 SMs) {counts['GBps'][0]}/"
            f"{counts['GBps'][1]} met, >= 1.1x NCCL {nccl}; best bf16 (worst rank): "
            + "; ".join(shapes))


def pytest_line(path: str) -> str:
    """pytest's counts (its last line that has them) and the failed tests."""
    text = _read(path)
    if text is None:
        return f"no {path}"
    counts = ""
    for line in reversed(text.splitlines()):
        found = PYTEST_COUNT.findall(line)
        if found and " in " in line:
            counts = ", ".join(f"{n} {what}" for n, what in found)
            break
    failed = sorted({os.path.basename(m.group(1)) + (m.group(2) or "") for m in
                     re.finditer(r"^(?:FAILED|ERROR) ([^:\s]+)(::\S+)?", text, re.M)})
    line = counts or "no pytest summary (stopped early?)"
    if "limit reached" in text:
        line += " (time limit reached)"
    return line + (f"; failed: {', '.join(failed)}" if failed else "")


def staging_line(path: str) -> str:
    """The staging and the sweep's figures of a `python -m megatron_deepep.tools.multinode_check
    --json` file."""
    doc, problem = _read_json(path)
    if problem:
        return problem
    staging = (doc.get("setup") or {}).get("staging") or {}
    points = [f"{p['tokens']}x{p['hidden']} {p['phase']} {p['us']:.0f} us "
              f"({p['gbps_per_rank']:.1f} GB/s)" for p in doc.get("sweep", [])]
    return f"{staging.get('name', 'staging not recorded')}: " + ("; ".join(points) or "no sweep")


def training(path: str) -> Tuple[Dict[int, float], List[float]]:
    """Loss per iteration and step times (ms, after the warm-up) of a Megatron training log."""
    losses: Dict[int, float] = {}
    times: List[float] = []
    for line in (_read(path) or "").splitlines():
        iteration, loss = ITERATION.search(line), LM_LOSS.search(line)
        if iteration is None or loss is None:
            continue
        step = int(iteration.group(1))
        losses[step] = float(loss.group(1))
        ms = STEP_MS.search(line)
        if ms is not None and step > WARMUP_ITERATIONS:
            times.append(float(ms.group(1)))
    return losses, times


def main_lines(paths: List[str]) -> List[str]:
    """One line per training log; with two, the largest loss difference between them."""
    lines, runs = [], []
    for path in paths:
        losses, times = training(path)
        runs.append(losses)
        if not losses:
            lines.append(f"{path}: no iteration with an lm loss")
            continue
        first, last = min(losses), max(losses)
        median = f"{statistics.median(times):.1f} ms" if times else "-"
        lines.append(f"loss it{first} {losses[first]:.4f} it{last} {losses[last]:.4f}, median "
                     f"step {median}")
    if len(runs) == 2 and runs[0] and runs[1]:
        common = sorted(set(runs[0]) & set(runs[1]))
        if common:
            worst = max(common, key=lambda i: abs(runs[0][i] - runs[1][i]))
            lines.append(f"max |loss difference| {abs(runs[0][worst] - runs[1][worst]):.4f} "
                         f"(it{worst}) over {len(common)} iterations")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python dev/gpu/gpu_multi_report.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("kind", choices=["bench", "pytest", "main", "staging"],
                        help="what the files are: the bench's JSON, a pytest log, training "
                             "logs (one per dispatcher), or a multinode_check JSON")
    parser.add_argument("paths", nargs="+", help="the files to summarize")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.kind == "bench":
        print(bench_line(args.paths[0]))
    elif args.kind == "pytest":
        print(pytest_line(args.paths[0]))
    elif args.kind == "staging":
        print(staging_line(args.paths[0]))
    else:
        print("\n".join(main_lines(args.paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
