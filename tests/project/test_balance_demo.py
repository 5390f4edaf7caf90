"""`examples/balance_demo.py` on CPU: 4 gloo ranks, contiguous vs re-placement with copies.

Its line is parsed and its figures asserted: the contiguous placement leaves the worst rank's
count-based idle share >= 0.2, re-placement brings it to <= 0.02, and the two runs' losses
agree to fp32 rounding (the model is the same).
"""

from __future__ import annotations

import importlib.util
import os

from tests.helpers.distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "examples", "balance_demo.py")


def load_demo():
    """The demo as a module (examples/ is no package)."""
    spec = importlib.util.spec_from_file_location("balance_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_line(line: str) -> dict:
    """Parses the demo's line and asserts the thresholds; returns the figures."""
    figures = load_demo().parse_line(line)
    assert figures["before"] >= 0.2, line
    assert figures["after"] <= 0.02, line
    assert figures["loss_diff"] <= 1e-5, line
    return figures


def _worker(rank, world, argv, out_path):
    line = load_demo().run(rank, world, argv)
    if rank == 0:
        with open(out_path, "w", encoding="utf-8") as f:
            f.write(line + "\n")


def test_balance_demo_line(tmp_path):
    """The line's thresholds; its metrics lines render into a report that marks the
    re-placements and shows the idle share falling after the first."""
    import re
    import subprocess
    import sys

    out = tmp_path / "line.txt"
    metrics = tmp_path / "metrics"
    run_distributed(4, _worker, ["--metrics-dir", str(metrics)], str(out), timeout_s=300)
    lines = out.read_text().splitlines()
    assert len(lines) == 1
    check_line(lines[0])
    report = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "megatron_deepep.tools.report", str(metrics),
                           "--out", str(report)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    text = report.read_text(encoding="utf-8")
    assert "re-placed</text>" in text
    rows = re.findall(r"<tr><td>1</td><td>(\d+)</td><td>([0-9.]+)%</td><td>([0-9.]+)%</td>",
                      text)
    assert rows and int(rows[0][0]) == 5  # the first plan ends step 4
    assert float(rows[0][1]) > 20 and float(rows[0][2]) < 10  # 1 - min/max, before / after


def test_parse_line_refuses_other_text():
    import pytest

    demo = load_demo()
    assert demo.parse_line("balance demo: idle share before 0.728, after 0.010; "
                           "max |loss difference| 2.2e-08") == {
        "before": 0.728, "after": 0.010, "loss_diff": 2.2e-08}
    with pytest.raises(ValueError, match="not a balance demo line"):
        demo.parse_line("balance demo: idle share before 0.7")
