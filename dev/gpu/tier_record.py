"""The GPU tier's record from the logs of `dev/gpu/tier_round.sh`: every `tests/gpu` file with its
passed / failed / error / skipped counts, each piece with its exit status, time and limit.

Each call of tier_round.sh leaves a folder (packed into `$OUT/tier_callN_logs.tar.gz`) with
`pieces.tsv` (piece, rc, seconds, limit, MPS ranks, command), `versions.txt` and one pytest log
per piece (`tier_<piece>.log`, run with `-v -rA`: a line per test as it ends, then pytest's
summary). Tests are counted once per test id, across pieces and calls; a test that fails in any
piece counts as failed.

    python dev/gpu/tier_record.py --date 2026-12-07 --benchmarks benchmarks CALL1 CALL2 CALL3

writes `benchmarks/<card>_<date>_gpu_tier.md` (the card from the calls' versions.txt: h100,
h200, ...) and copies each call's folder into `benchmarks/<card>_<date>_gpu_tier/`. Exits 1
when a test failed or errored.
"""

import argparse
import glob
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STATUSES = ("passed", "failed", "error", "skipped")
# The worse status wins when one test id appears more than once.
_RANK = {"skipped": 0, "passed": 1, "error": 2, "failed": 3}
_VERBOSE = re.compile(r"^(tests/gpu/[\w/]+\.py)::(\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (tests/gpu/[\w/]+\.py)::(\S+)")
_SKIP_COUNT = re.compile(r"^SKIPPED \[(\d+)\] (tests/gpu/[\w/]+\.py):\d+: (.*)$")
_STATUS = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "error",
           "SKIPPED": "skipped", "XFAIL": "skipped"}


@dataclass
class Piece:
    call: str
    name: str
    rc: str
    seconds: str
    limit: str
    ranks: str
    command: str
    last_line: str = ""


@dataclass
class Tier:
    tests: Dict[str, Dict[str, str]] = field(default_factory=dict)  # file -> {test id: status}
    skip_counts: Dict[str, int] = field(default_factory=dict)  # file -> unnamed skips (-rA)
    reasons: Dict[str, List[str]] = field(default_factory=dict)  # file -> skip/failure lines
    pieces_of: Dict[str, List[str]] = field(default_factory=dict)  # file -> pieces
    pieces: List[Piece] = field(default_factory=list)
    versions: List[str] = field(default_factory=list)


def gpu_test_files(root: str = ROOT) -> List[str]:
    """Every `tests/gpu/test_*.py`, as the record names them."""
    return sorted(os.path.relpath(p, root)
                  for p in glob.glob(os.path.join(root, "tests", "gpu", "test_*.py")))


def _note(tier: Tier, path: str, line: str) -> None:
    notes = tier.reasons.setdefault(path, [])
    if line not in notes:
        notes.append(line)


def parse_log(tier: Tier, text: str, piece: str) -> None:
    """Adds one pytest log's verdicts (its `-v` lines and `-rA` summary) to `tier`."""
    named_skips: Dict[str, int] = {}
    unnamed_skips: Dict[str, int] = {}
    for raw in text.splitlines():
        line = raw.rstrip()
        found: Optional[Tuple[str, str, str]] = None
        match = _VERBOSE.match(line)
        if match:
            found = (match.group(1), match.group(2), _STATUS[match.group(3)])
        match = _SUMMARY.match(line)
        if match:
            found = (match.group(2), match.group(3), _STATUS[match.group(1)])
            if found[2] in ("failed", "error"):
                _note(tier, found[0], line[:300])
        match = _SKIP_COUNT.match(line)
        if match:
            unnamed_skips[match.group(2)] = unnamed_skips.get(match.group(2), 0) + int(
                match.group(1))
            _note(tier, match.group(2), f"skipped: {match.group(3)[:240]}")
            continue
        if found is None:
            continue
        path, test_id, status = found
        tests = tier.tests.setdefault(path, {})
        if status == "skipped":
            named_skips[path] = named_skips.get(path, 0) + 1
        if test_id not in tests or _RANK[status] > _RANK[tests[test_id]]:
            tests[test_id] = status
        pieces = tier.pieces_of.setdefault(path, [])
        if piece not in pieces:
            pieces.append(piece)
    # -rA names no test in its SKIPPED lines: counted only where no line named the skips.
    for path, count in unnamed_skips.items():
        if not named_skips.get(path):
            tier.skip_counts[path] = tier.skip_counts.get(path, 0) + count
            pieces = tier.pieces_of.setdefault(path, [])
            if piece not in pieces:
                pieces.append(piece)


def _last_result_line(text: str) -> str:
    """pytest's closing line ("3 passed in 12.0s"), or the log's last line (a cut piece)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.search(r"\b(passed|failed|error|errors|skipped|deselected|no tests ran)\b", line) \
                and re.search(r"\bin [\d.]+s\b", line):
            return line.strip("= ")[:200]
    return (lines[-1][:200] if lines else "(empty log)")


def read_call(tier: Tier, folder: str) -> None:
    """One call's folder: pieces.tsv, versions.txt and the pieces' logs."""
    call = os.path.basename(os.path.normpath(folder))
    versions = os.path.join(folder, "versions.txt")
    if os.path.exists(versions):
        with open(versions, encoding="utf-8", errors="replace") as f:
            tier.versions += [f"{call}: {line.rstrip()}" for line in f if line.strip()]
    table = os.path.join(folder, "pieces.tsv")
    if not os.path.exists(table):
        return
    with open(table, encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    for row in rows:
        name, rc, seconds, limit, ranks, command = (row + [""] * 6)[:6]
        piece = Piece(call, name, rc, seconds, limit, ranks, command)
        log = os.path.join(folder, f"tier_{name}.log")
        if os.path.exists(log):
            with open(log, encoding="utf-8", errors="replace") as f:
                text = f.read()
            piece.last_line = _last_result_line(text)
            parse_log(tier, text, f"{call}/{name}")
        tier.pieces.append(piece)


def card(versions: List[str]) -> str:
    """The records' prefix from the device lines of the calls' versions (as ev_card names it)."""
    device = " ".join(line for line in versions if "device:" in line)
    for name in ("H200", "H100", "B200"):
        if name in device:
            return name.lower()
    return "gpu"


def counts(tier: Tier, path: str) -> Dict[str, int]:
    """{status: count} of one file over every piece."""
    out = {status: 0 for status in STATUSES}
    for status in tier.tests.get(path, {}).values():
        out[status] += 1
    out["skipped"] += tier.skip_counts.get(path, 0)
    return out


def render(tier: Tier, files: List[str], title: str, logs_name: str = "") -> str:
    total = {status: 0 for status in STATUSES}
    rows = []
    not_run = []
    for path in files:
        c = counts(tier, path)
        for status in STATUSES:
            total[status] += c[status]
        pieces = ", ".join(tier.pieces_of.get(path, [])) or "not run"
        if not tier.pieces_of.get(path):
            not_run.append(path)
        rows.append(f"| `{path}` | {c['passed']} | {c['failed']} | {c['error']} | "
                    f"{c['skipped']} | {pieces} |")
    cut = [p for p in tier.pieces if p.rc not in ("0", "1", "5")]
    out = [f"# {title}", "",
           "Written by `dev/gpu/tier_record.py` from the logs of `dev/gpu/tier_round.sh`; each "
           "test counted once per test id (the worst verdict where it ran twice).", ""]
    if tier.versions:
        out += ["## Versions and device", "", "```"] + tier.versions + ["```", ""]
    out += ["## Every tests/gpu file", "",
            "| file | passed | failed | errors | skipped | pieces (call/piece) |",
            "|---|---:|---:|---:|---:|---|"] + rows
    out += [f"| **total** | **{total['passed']}** | **{total['failed']}** | "
            f"**{total['error']}** | **{total['skipped']}** | |", ""]
    out += ["## Pieces", "", "| call | piece | rc | s | limit s | MPS ranks | pytest's last line |",
            "|---|---|---:|---:|---:|---:|---|"]
    out += [f"| {p.call} | {p.name} | {p.rc} | {p.seconds} | {p.limit} | {p.ranks or '-'} | "
            f"{p.last_line.replace('|', '/')} |" for p in tier.pieces]
    out += ["", "Commands (each piece's, as run):", "", "```"]
    out += [f"{p.call}/{p.name}: {p.command}" for p in tier.pieces] + ["```", ""]
    notes = [(path, line) for path in files for line in tier.reasons.get(path, [])]
    if notes:
        out += ["## Failures and skips, as pytest reported them", ""]
        out += [f"- `{path}`: {line}" for path, line in notes] + [""]
    out += ["## Not run", ""]
    missing = [f"- `{path}`: no piece ran it" for path in not_run]
    missing += [f"- piece {p.call}/{p.name}: rc {p.rc} (124: cut at its {p.limit} s limit; 99: "
                "no budget left): its tests without a verdict are not counted above"
                for p in cut]
    out += (missing or ["- nothing: every file ran and every piece ended on its own"]) + [""]
    if logs_name:
        out += [f"Raw logs (`-v -rA`: each test's name and verdict, then pytest's summary): "
                f"`{logs_name}/`.", ""]
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", help="one folder per call (tier_round.sh's logs)")
    parser.add_argument("--out", help="the record (default: stdout)")
    parser.add_argument("--date", default="", help="the run's date, for the title")
    parser.add_argument("--copy-logs", default="",
                        help="copy each call's folder there (benchmarks/<card>_<date>_gpu_tier)")
    parser.add_argument("--benchmarks", default="",
                        help="the record and its logs go into this folder, named after the card")
    args = parser.parse_args(argv)
    tier = Tier()
    for folder in args.folders:
        read_call(tier, folder)
    if args.benchmarks:
        stem = os.path.join(args.benchmarks, f"{card(tier.versions)}_{args.date}_gpu_tier")
        os.makedirs(args.benchmarks, exist_ok=True)
        args.out, args.copy_logs = stem + ".md", stem
    logs_name = ""
    if args.copy_logs:
        for folder in args.folders:
            dest = os.path.join(args.copy_logs, os.path.basename(os.path.normpath(folder)))
            shutil.copytree(folder, dest, dirs_exist_ok=True)
        logs_name = os.path.basename(os.path.normpath(args.copy_logs))
    title = f"The GPU tier{' on ' + args.date if args.date else ''}: every tests/gpu file"
    text = render(tier, gpu_test_files(), title, logs_name)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    failed = any(counts(tier, path)["failed"] or counts(tier, path)["error"]
                 for path in gpu_test_files())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
