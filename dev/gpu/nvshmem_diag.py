"""NVSHMEM's own messages in a run's log, for a record: which transports it set up, its first
warnings and errors, and its last lines (where it stopped, or that it finished), beside pytest's
verdict. Lines are quoted as NVSHMEM wrote them, each once (the `host:pid:tid [pe]` prefix left
out when comparing, so eight PEs saying one thing count once).

    python dev/gpu/nvshmem_diag.py LOG [--first 8] [--last 8]
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Dict, List

# A line NVSHMEM wrote: its debug prefix ("NVSHMEM INFO", "NVSHMEM WARN", ...), its source
# locations ("src/host/transport/transport.cpp:275: ..."), or its bare "WARN:" lines.
_NVSHMEM = re.compile(r"NVSHMEM (INFO|WARN|ERROR|TRACE)|(^|/)src/(host|device|modules)/\S+:\d+|"
                      r"^WARN: |nvshmem[a-z_]*:\d+:|nvshmemi?_\w+ failed"
                      r"|NVSHMEM_\w+ .*(fail|error)",
                      re.IGNORECASE)
_PREFIX = re.compile(r"^\S+:\d+:\d+ \[\d+\] ")
_PROBLEM = re.compile(r"WARN|ERROR|fail|non-zero status|abort|exiting|unable|cannot|not found",
                      re.IGNORECASE)
_TRANSPORT = re.compile(r"transport|P2P|UCX|proxy|remote", re.IGNORECASE)
_VERDICT = re.compile(r"\b(passed|failed|error|errors|skipped)\b.* in [\d.]+s|limit reached|"
                      r"Timeout|rank \d+ failed")


def nvshmem_lines(text: str) -> List[str]:
    """NVSHMEM's lines of `text`, in order, each message once."""
    seen, out = set(), []
    for raw in text.splitlines():
        line = raw.rstrip()
        if not _NVSHMEM.search(line):
            continue
        key = re.sub(r"\d+", "N", _PREFIX.sub("", line))
        if key not in seen:
            seen.add(key)
            out.append(line)
    return out


def summarize(text: str, first: int = 8, last: int = 8) -> Dict[str, List[str]]:
    lines = nvshmem_lines(text)
    return {
        "transports": [line for line in lines if _TRANSPORT.search(line)][:first],
        "problems": [line for line in lines if _PROBLEM.search(line)][:first],
        "last": lines[-last:],
        "verdict": [line.strip() for line in text.splitlines() if _VERDICT.search(line)][-3:],
        "count": [str(len(lines))],
    }


def render(name: str, parts: Dict[str, List[str]]) -> str:
    out = [f"NVSHMEM's own messages in `{name}` ({parts['count'][0]} distinct lines):"]
    for key, title in (("transports", "transports and the proxy"),
                       ("problems", "first warnings and errors"),
                       ("last", "last lines: where it stopped, or that it finished")):
        out.append(f"- {title}:" + ("" if parts[key] else " none"))
        if parts[key]:
            out += ["```"] + [line[:300] for line in parts[key]] + ["```"]
    out.append("- the run's verdict: " + ("; ".join(v[:200] for v in parts["verdict"])
                                          or "none (no pytest summary in the log)"))
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log")
    parser.add_argument("--first", type=int, default=8)
    parser.add_argument("--last", type=int, default=8)
    args = parser.parse_args(argv)
    with open(args.log, encoding="utf-8", errors="replace") as f:
        text = f.read()
    sys.stdout.write(render(args.log.rsplit("/", 1)[-1], summarize(text, args.first, args.last)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
