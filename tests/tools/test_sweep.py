"""`python -m megatron_deepep.tools.sweep` on CPU: the model part with assumed kernel rates."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from megatron_deepep.tools import sweep
from megatron_deepep.tools.internode_model import bf16_row_bytes, fp8_row_bytes


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
    proc = subprocess.run([sys.executable, "-m", "megatron_deepep.tools.sweep", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--nic-gbps" in proc.stdout and "--family" in proc.stdout


#: Known constants for the synthetic GPU run below (Mixtral's shape): some with a floor that
#: holds the smallest calls (host-bound), some without; rates that are not the defaults'.
TRUE_KERNEL = {("dispatch_bf16", 24): sweep.KernelCost(40.0, 22.0, 70.0, 1680.0),
               ("dispatch_bf16", 132): sweep.KernelCost(30.0, 0.0, 30.0, 3960.0),
               ("dispatch_fp8", 24): sweep.KernelCost(45.0, 20.0, 55.0, 1320.0),
               ("dispatch_fp8", 132): sweep.KernelCost(35.0, 12.0, 15.0, 1980.0),
               ("combine", 24): sweep.KernelCost(12.0, 18.0, 80.0, 1920.0),
               ("combine", 132): sweep.KernelCost(8.0, 0.0, 32.0, 4224.0)}
TRUE_GEMM = (520.0, 96.0)


def synthetic_gpu_run(shape, tokens, topks=(2,), sms_list=(24, 132), eps=(1, 2, 4, 8)):
    """What `measure_gpu` returns, made from `TRUE_KERNEL` and `TRUE_GEMM`."""
    points, kernels = [], {}
    for topk in topks:
        for num_sms in sms_list:
            for n in sweep.fit_token_counts(tokens):
                times = {}
                for phase, wire in (("dispatch", "bf16"), ("dispatch", "fp8"),
                                    ("combine", "bf16")):
                    key = sweep.phase_key(phase, wire)
                    num_bytes = sweep.kernel_bytes(phase, wire, n, topk, shape.hidden)
                    times[key] = TRUE_KERNEL[(key, num_sms)].us(num_bytes, num_sms)
                    points.append({"phase": key, "topk": topk, "num_sms": num_sms,
                                   "tokens": n, "bytes": num_bytes, "us": times[key]})
                if n == tokens:
                    for wire in sweep.WIRES:
                        kernels[f"{topk},{wire},{num_sms}"] = {
                            "dispatch_us": times[f"dispatch_{wire}"],
                            "combine_us": times["combine"]}
    experts = {f"{topk},{ep}": sweep.assumed_expert_us(shape, tokens, topk, ep, *TRUE_GEMM)
               for topk in topks for ep in eps}
    return {"source": "measured on a synthetic GPU (132 SMs)", "fp8_format": "blockwise_1x128",
            "kernels": kernels, "experts": experts, "points": points}


def test_fit_recovers_known_constants_and_the_check_is_one():
    shape = sweep.FAMILIES["mixtral"]
    measured = synthetic_gpu_run(shape, 4096)
    constants = sweep.fit_constants(shape, 4096, measured)
    for (phase, num_sms), true in TRUE_KERNEL.items():
        got = sweep.KernelCost(**constants["kernels"][phase][str(num_sms)])
        rate = min(true.cap_gbps, true.gbps_per_sm * num_sms)
        assert got.fixed_us == pytest.approx(true.fixed_us, rel=1e-6, abs=1e-6), phase
        assert got.fixed_us + got.floor_us == pytest.approx(true.fixed_us + true.floor_us,
                                                            rel=1e-6), (phase, num_sms)
        assert min(got.cap_gbps, got.gbps_per_sm * num_sms) == pytest.approx(rate, rel=1e-6)
    assert constants["gemm"]["tflops"] == pytest.approx(TRUE_GEMM[0], rel=1e-6)
    assert constants["gemm"]["half_rate_rows"] == pytest.approx(TRUE_GEMM[1], rel=1e-6)
    text = sweep.format_check(shape, 4096, measured, constants, 650.0)
    check = [ln for ln in text.splitlines() if ln.startswith("  top-")]
    assert len(check) == 4  # top-2 x bf16/fp8 x 24/132 SMs
    for line in check:
        fitted = [float(v) for v in re.findall(r"(?:dispatch|combine) ([\d. ]+) \[", line)[0]
                  .split() + re.findall(r"combine ([\d. ]+) \[", line)[0].split()]
        assert fitted and all(v == 1.0 for v in fitted), line
    assert "expert GEMMs: 1.00-1.00 [" in text


def test_fit_is_a_line_without_a_floor_and_keeps_noise_small():
    points = [{"bytes": b, "us": (20.0 + b / 2e6) * (1 + 0.01 * (-1) ** i)}
              for i, b in enumerate([1e7, 3e7, 1e8, 3e8])]
    cost = sweep.fit_kernel_cost(points, 100)
    assert cost.floor_us == pytest.approx(0.0, abs=1.0)
    assert cost.cap_gbps == pytest.approx(2000.0, rel=0.03)
    assert all(cost.us(p["bytes"], 100) / p["us"] == pytest.approx(1.0, abs=0.02)
               for p in points)


def test_gpu_run_output_says_what_is_measured_and_what_assumed(tmp_path, capsys):
    shape = sweep.FAMILIES["mixtral"]
    measured = synthetic_gpu_run(shape, 4096)
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"measurements": measured}))
    result, out = _run(capsys, "--family", "mixtral", "--nodes", "1", "--num-sms", "24,132",
                       "--measurements", str(path))
    assert "model constants: kernels MEASURED, measured on a synthetic GPU" in out
    assert "expert GEMMs MEASURED" in out and "links ASSUMED (parameters)" in out
    assert re.search(r"dispatch_bf16 SMs  24: 40\.0 us \+ max\(22\.0 us, bytes / 1680 "
                     r"GB/s\)  \[25\.0 us", out)
    assert "check: measured / model time" in out
    assert result["constants"]["kernels"]["combine"]["132"]["fixed_us"] == pytest.approx(8.0)
    # An older measurements file (no calibration points): the constants are the defaults.
    del measured["points"]
    path.write_text(json.dumps({"measurements": measured}))
    result, out = _run(capsys, "--family", "mixtral", "--nodes", "1", "--num-sms", "24,132",
                       "--measurements", str(path))
    assert "ASSUMED (these measurements hold no calibration points" in out
    assert "check:" not in out and result["constants"] is None


def test_measurements_of_the_reference_transport_are_refused(tmp_path, capsys):
    measured = synthetic_gpu_run(sweep.FAMILIES["mixtral"], 4096)
    path = tmp_path / "sweep.json"
    for ran in ("local", "local,nvlink"):
        path.write_text(json.dumps({"measurements": dict(measured, transport=ran)}))
        _run(capsys, "--family", "mixtral", "--nodes", "1", "--measurements", str(path))
    path.write_text(json.dumps({"measurements": dict(measured, transport="reference")}))
    with pytest.raises(ValueError, match=r"--measurements .*sweep.json: the reference "
                                         r"transport ran .* no GB/s"):
        sweep.main(["--family", "mixtral", "--nodes", "1", "--measurements", str(path)])


def test_assumed_kernel_times_have_a_fixed_cost_and_a_floor():
    # Few bytes: the floor; many: bytes over the rate, plus the fixed cost either way.
    few = sweep.assumed_kernel_us("combine", "bf16", 16, 2, 1024, 132)
    cost = sweep.ASSUMED_KERNEL["combine"]
    assert few == pytest.approx(cost.fixed_us + cost.floor_us)
    many = sweep.assumed_kernel_us("dispatch", "bf16", 4096, 8, 7168, 24)
    num_bytes = sweep.kernel_bytes("dispatch", "bf16", 4096, 8, 7168)
    bf16 = sweep.ASSUMED_KERNEL["dispatch_bf16"]
    assert many == pytest.approx(bf16.fixed_us + num_bytes / (bf16.gbps_per_sm * 24 * 1e3))


def test_a_flat_fit_is_capped_at_the_fastest_hbm():
    """Host-bound calls (time independent of the bytes) fit a fixed cost, not free bytes: the
    rate is capped, so a shape with 100x the bytes costs more."""
    points = [{"bytes": b, "us": 95.0 + d} for b, d in ((1e6, 0.5), (2e6, -0.4), (4e6, 0.2))]
    cost = sweep.fit_kernel_cost(points, 132)
    assert cost.cap_gbps == sweep.MAX_FIT_GBPS
    for p in points:
        assert 0.97 < cost.us(p["bytes"], 132) / p["us"] < 1.03
    assert cost.us(4e8, 132) > cost.us(4e6, 132) + 40.0
