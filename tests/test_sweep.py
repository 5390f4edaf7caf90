"""`python -m megatron_deepep.sweep` on CPU: the model part with assumed kernel rates."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_deepep import sweep
from megatron_deepep.internode_model import bf16_row_bytes, fp8_row_bytes


def _run(capsys, *argv):
    result = sweep.main(list(argv))
    return result, capsys.readouterr().out


def test_cpu_run_says_it_assumes_and_recommends(capsys):
    result, out = _run(capsys, "--family", "mixtral", "--nodes", "1,2", "--assume")
    assert "ASSUMED rates, no GPU measurement" in out and "NOTE: no GPU measurement" in out
    assert "recommended (top-2): EP" in out
    pick = result["recommended"]
    assert pick["expert_state_gb"] <= 0.6 * 141
    smaller = [r for r in result["rows"] if r["ep"] < pick["ep"] and r["topk"] == 2]
    assert all(r["expert_state_gb"] > 0.6 * 141 for r in smaller)


def test_model_at_ep1_is_the_measurement_and_links_scale_with_bytes(capsys):
    result, _ = _run(capsys, "--family", "deepseek_v3", "--nodes", "1,8", "--assume",
                     "--num-sms", "24,132", "--topks", "4,8")
    kernels = result["measurements"]["kernels"]
    rows = result["rows"]
    for r in rows:
        k = kernels[f"{r['topk']},{r['wire']},{r['num_sms']}"]
        if r["ep"] == 1:  # nothing crosses a link: the kernel time itself
            assert r["dispatch_us"] == pytest.approx(k["dispatch_us"])
            assert r["combine_us"] == pytest.approx(k["combine_us"])
    # Across nodes the network sets the link time: FP8 rows are its byte ratio of bf16's.
    ratio = fp8_row_bytes(7168) / bf16_row_bytes(7168)
    by = {(r["topk"], r["ep"], r["routing"], r["wire"], r["num_sms"]): r for r in rows}
    for (topk, ep, routing, wire, sms), r in by.items():
        if wire != "bf16" or ep != 64:
            continue
        f8 = by[(topk, ep, routing, "fp8", sms)]
        link_bf16 = r["dispatch_us"] - kernels[f"{topk},bf16,{sms}"]["dispatch_us"]
        link_fp8 = f8["dispatch_us"] - kernels[f"{topk},fp8,{sms}"]["dispatch_us"]
        assert link_fp8 == pytest.approx(link_bf16 * ratio, rel=1e-6)
    # Node-limited routing (M = 4 of 8 nodes) crosses the network less than uniform routing.
    uni = by[(8, 64, "uniform", "bf16", 132)]
    lim = by[(8, 64, "node-limited M=4", "bf16", 132)]
    assert lim["net_rows_per_token"] < uni["net_rows_per_token"] <= 8
    assert lim["comm_share"] < uni["comm_share"]
    # More nodes, more comm per expert time (uniform routing, same wire and SMs).
    shares = [by[(8, ep, "uniform", "bf16", 132)]["comm_share"] for ep in (1, 2, 4, 8, 64)]
    assert shares == sorted(shares)
    # Top-4 moves fewer rows than top-8.
    assert by[(4, 64, "uniform", "bf16", 132)]["dispatch_us"] < uni["dispatch_us"]


def test_measurements_round_trip_and_custom_shape(tmp_path, capsys):
    first, _ = _run(capsys, "--hidden", "1024", "--experts", "16", "--topk", "2",
                    "--moe-ffn-hidden", "512", "--nodes", "1,2", "--assume", "--out",
                    str(tmp_path))
    saved = json.loads((tmp_path / "sweep.json").read_text())
    assert saved["recommended"] == first["recommended"]
    again, out = _run(capsys, "--hidden", "1024", "--experts", "16", "--topk", "2",
                      "--moe-ffn-hidden", "512", "--nodes", "1,2", "--measurements",
                      str(tmp_path / "sweep.json"), "--nic-gbps", "25")
    assert again["measurements"] == first["measurements"]
    slower = {(r["ep"], r["wire"], r["num_sms"]): r["comm_share"] for r in again["rows"]}
    for r in first["rows"]:
        key = (r["ep"], r["wire"], r["num_sms"])
        if r["nodes"] > 1:
            assert slower[key] > r["comm_share"]
        else:
            assert slower[key] == pytest.approx(r["comm_share"])
    with pytest.raises(SystemExit):
        sweep.main(["--hidden", "1024"])


def test_command_line_help():
    proc = subprocess.run([sys.executable, "-m", "megatron_deepep.sweep", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--nic-gbps" in proc.stdout and "--family" in proc.stdout


def test_check_compares_measured_with_assumed():
    shape = sweep.FAMILIES["mixtral"]
    assumed = sweep.assumed_measurements(shape, 4096, [2], [24], [1, 2], 650.0)
    measured = {"kernels": {k: {"dispatch_us": 2 * v["dispatch_us"],
                                "combine_us": v["combine_us"]}
                            for k, v in assumed["kernels"].items()},
                "experts": {k: 0.5 * v for k, v in assumed["experts"].items()}}
    text = sweep.format_check(measured, assumed)
    assert "top-2 bf16, SMs 24: dispatch 2.00, combine 1.00" in text
    assert "expert GEMMs: 0.50-0.50 over 2" in text
