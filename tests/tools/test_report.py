"""`python -m megatron_deepep.tools.report`: one offline HTML report of a run's metrics, checked by
its content."""

from __future__ import annotations

import base64
import html.parser
import json
import os
import re
import subprocess
import sys
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
COMMAND = [sys.executable, "-m", "megatron_deepep.tools.report"]
EXAMPLE = os.path.join(ROOT, "benchmarks", "h200_2026-12-03_training_ep1")


def _run(*args):
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True,
                          timeout=120)


class _Checker(html.parser.HTMLParser):
    """Collects tags; checks that svg/table/figure elements close."""

    VOID = {"meta", "img", "line", "circle", "polyline", "br", "rect"}

    def __init__(self):
        super().__init__()
        self.stack, self.tags, self.fetches = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for name, value in attrs:
            if name in ("src", "href") and value and not value.startswith("data:"):
                self.fetches.append(value)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)
        for name, value in attrs:
            if name in ("src", "href") and value and not value.startswith("data:"):
                self.fetches.append(value)

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        assert self.stack and self.stack[-1] == tag, (tag, self.stack[-3:])
        self.stack.pop()


def _check_offline(text):
    checker = _Checker()
    checker.feed(text)
    checker.close()
    assert checker.stack == [], checker.stack
    assert checker.fetches == [], checker.fetches  # nothing loaded from anywhere
    assert "script" not in checker.tags and "link" not in checker.tags
    for uri in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", text):
        assert base64.b64decode(uri).startswith(b"\x89PNG\r\n\x1a\n")
    return checker


def test_renders_the_example_run(tmp_path):
    out = tmp_path / "report.html"
    proc = _run(EXAMPLE, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    text = out.read_text(encoding="utf-8")
    checker = _check_offline(text)
    assert "20 steps (1&ndash;20), 4 MoE layer(s), EP = 1, 8 experts" in text
    assert len(re.findall(r"data:image/png;base64,", text)) == 4  # one heatmap per layer
    assert checker.tags.count("svg") >= 2
    assert "comm share not recorded" in text  # this run predates expert timing
    assert "no bytes crossed ranks" in text
    # The first step's compile (478 ms) is drawn on the top edge, not scaling the chart.
    assert "drawn on the top edge" in text
    steps = [json.loads(l) for l in open(os.path.join(EXAMPLE, "deepep_metrics_rank0.jsonl"))]
    median_dispatch = sorted(s["layers"]["2"]["dispatch_ms"] for s in steps)[9:11]
    want = (median_dispatch[0] + median_dispatch[1]) / 2
    assert f"<td>2</td><td>{want:.3f}</td>" in text


def _write(folder, rank, layers, ep=2, steps=30):
    with open(os.path.join(folder, f"deepep_metrics_rank{rank}.jsonl"), "w") as f:
        for step in range(1, steps + 1):
            entry = {}
            for layer in layers:
                share = 0.1 if layer == 1 else 0.35
                entry[str(layer)] = {
                    "dispatch_ms": 0.5, "combine_ms": 0.5, "expert_ms": 1.0 / share,
                    "comm_share": share, "bytes_sent": 4e6, "bytes_recv": 4e6,
                    "dispatch_GBps": 8.0, "combine_GBps": 8.0, "load_imbalance": 1.2,
                    "tokens_per_expert": [10 + (step * e) % 5 for e in range(8)],
                    "tokens_per_rank": [40, 45][:ep], "idle_share": 0.11,
                    "idle_share_time": 0.2, "tokens_dropped": 2, "expert_ms_per_rank": [3, 4]}
            f.write(json.dumps({"step": step, "layers": entry}) + "\n")


def test_renders_every_file_and_the_new_fields(tmp_path):
    _write(tmp_path, 0, [1, 2])
    _write(tmp_path, 8, [1, 2])  # a data-parallel replica
    _write(tmp_path, 16, [3])  # another pipeline stage
    proc = _run(str(tmp_path), "--comm-share-limit", "30")
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "report.html").read_text(encoding="utf-8")
    _check_offline(text)
    assert "3 file(s), 30 steps" in text and "3 MoE layer(s), EP = 2" in text
    assert "limit 30%" in text
    assert text.count("<tr class=high>") == 2  # layers 2 and 3 at 35% > 30%
    assert "from time: 1 - min/max rank expert time" in text
    assert "<th>rank 1</th>" in text and "<b>4.000</b>" in text  # the slower rank
    assert "dispatch GB/s" in text and "no bytes crossed" not in text
    assert "180 (token, expert) entries dropped" in text  # 2 per layer per step, 3 layers
    for name in ("deepep_metrics_rank0.jsonl", "deepep_metrics_rank8.jsonl",
                 "deepep_metrics_rank16.jsonl"):
        assert name in text


def test_help_and_missing_metrics(tmp_path):
    proc = _run("--help")
    assert proc.returncode == 0 and "offline" in proc.stdout and "--out" in proc.stdout
    proc = _run(str(tmp_path))
    assert proc.returncode == 2 and "no deepep_metrics_rank*.jsonl" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_every_argument_has_help():
    import importlib

    module = importlib.import_module("megatron_deepep.tools.report")
    parser = module.build_parser()
    assert not [a.dest for a in parser._actions if not a.help] and parser.description


def test_marks_replacements_with_idle_share_before_and_after(tmp_path):
    """A run whose expert map changed at step 11: the chart marks it and the table gives the
    idle share before (steps 1-10) and after (11-20)."""
    with open(os.path.join(tmp_path, "deepep_metrics_rank0.jsonl"), "w") as f:
        for step in range(1, 21):
            after = step >= 11
            f.write(json.dumps({"step": step, "layers": {"1": {
                "dispatch_ms": 0.5, "combine_ms": 0.5, "expert_ms": 2.0, "comm_share": 0.5,
                "tokens_per_expert": [10, 10, 10, 10], "tokens_per_rank": [20, 20],
                "idle_share": 0.01 if after else 0.5, "idle_share_time": 0.02 if after else 0.4,
                "physical_to_logical": [0, 1, 2, 3] if after else [3, 2, 1, 0]}}}) + "\n")
    proc = _run(str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "report.html").read_text(encoding="utf-8")
    _check_offline(text)
    assert "re-placed</text>" in text
    assert ("<tr><td>1</td><td>11</td><td>50.0%</td><td>1.0%</td><td>40.0%</td><td>2.0%</td>"
            "</tr>") in text
    _write(tmp_path, 0, [1])  # no map: no re-placement
    _run(str(tmp_path))
    assert "No re-placement recorded" in (tmp_path / "report.html").read_text(encoding="utf-8")


def test_pngs_beside_the_report_with_every_field(tmp_path):
    """With matplotlib the one command also draws the PNG figures, the monitoring one with
    comm share, idle share from time and drops; the old sample says what it lacks."""
    import pytest

    pytest.importorskip("matplotlib", reason="the PNG figures need matplotlib")
    _write(tmp_path, 0, [1, 2])
    proc = _run(str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    names = ("expert_load_heatmap.png", "comm_time_per_layer.png", "monitoring.png")
    for name in names:
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG" and name in proc.stdout
    old = tmp_path / "old"
    old.mkdir()
    proc = _run(EXAMPLE, "--out", str(old / "report.html"))
    assert proc.returncode == 0, proc.stderr
    assert all((old / name).stat().st_size > 1000 for name in names)
    proc = _run(str(tmp_path), "--no-png", "--out", str(tmp_path / "only.html"))
    assert proc.returncode == 0 and ".png" not in proc.stdout


def test_without_matplotlib_one_line_and_the_html(tmp_path, monkeypatch, capsys):
    import sys as _sys

    from megatron_deepep.tools import report as module

    _write(tmp_path, 0, [1])
    monkeypatch.setitem(_sys.modules, "matplotlib", None)
    assert module.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [str(tmp_path / "report.html"),
                   "report.py: PNG figures not drawn: matplotlib is not installed (pip install "
                   "matplotlib); the HTML report above has every chart"]
