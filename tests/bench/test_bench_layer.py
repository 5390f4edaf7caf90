"""CPU tier: `python -m megatron_deepep.bench.layer --cpu` runs every variant of both tables on a
tiny shape (H 64, 8 experts, top-2, 64 tokens) with the reference transport, and reports what it
could not run (CUDA graphs, Transformer Engine) with the reason; `GroupedMMExperts` computes
what a per-expert loop computes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from tests.helpers import REPO_ROOT

pytest.importorskip("megatron.core")

ROOT = REPO_ROOT


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One `--cpu --te` run in a subprocess (it initializes torch.distributed and Megatron)."""
    out = tmp_path_factory.mktemp("bench_layer") / "layer.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MDEEP_RANK_CAPACITY_FACTOR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_deepep.bench.layer", "--cpu", "--te", "--iters", "3",
         "--shapes", "64,64,8,2,128", "--host-profile", "4", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())


def test_rows_of_both_dispatchers_have_finite_times(cpu_run):
    _, report = cpu_run
    rows = {r["variant"]: r for r in report["rows"] if r["table"] == "A"}
    for name in ("alltoall", "deepep-sync", "deepep-syncfree"):
        row = rows[name]
        assert "error" not in row, row
        assert row["shape"] == [64, 64, 8, 2, 128]
        assert math.isfinite(row["fwd_bwd_ms"]) and row["fwd_bwd_ms"] > 0, row
        assert math.isfinite(row["host_ms"]) and row["host_ms"] > 0, row
        assert row["experts"]
    assert rows["alltoall"]["ratio_to_alltoall"] == pytest.approx(1.0)
    assert rows["deepep-sync"]["dispatcher"] == "deepep"
    assert rows["deepep-syncfree"]["num_max_recv_rows"] == 64 * 2  # factor 1 at EP = 1
    # The transport that ran, recorded per row: the reference on the CPU, none for alltoall.
    assert rows["deepep-sync"]["transport"] == rows["deepep-syncfree"]["transport"] == \
        "reference"
    assert rows["alltoall"]["transport"] is None
    assert report["environment"]["device"] == "cpu"


def test_graph_and_te_rows_are_skipped_with_a_reason(cpu_run):
    stdout, report = cpu_run
    rows = {r["variant"]: r for r in report["rows"]}
    assert "GPU" in rows["deepep-syncfree-graph"]["skipped"]
    te_rows = [r for r in report["rows"] if r["table"] == "B"]
    assert {r["variant"] for r in te_rows} == {"te-alltoall-fused", "te-alltoall",
                                                "te-deepep-bf16",
                                                "te-deepep-fp8-dequant", "te-deepep-fp8-experts",
                                                "te-deepep-fp8-experts-dequant-colwise"}
    assert all(r.get("skipped") for r in te_rows), te_rows
    table = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| table | variant | shape")
    for name in ("alltoall (unfused)", "alltoall (fused permute)", "deepep-sync (reference)",
                 "deepep-syncfree (reference)", "deepep-syncfree-graph"):
        assert any(f"| {name} |" in line for line in table), name
    assert any("skipped: CUDA graphs need a GPU" in line for line in table)


def test_both_alltoall_baselines_have_rows(cpu_run):
    """Megatron's alltoall runs twice, labelled: with TE's fused permute (skipped on the CPU,
    saying why) and without it (timed, the ratio column's reference)."""
    stdout, report = cpu_run
    rows = {r["variant"]: r for r in report["rows"]}
    assert rows["alltoall-fused"]["label"] == "alltoall (fused permute)"
    assert rows["alltoall"]["label"] == "alltoall (unfused)"
    assert rows["te-alltoall-fused"]["label"] == "te-alltoall (fused permute)"
    assert "fused permute" in rows["alltoall-fused"]["skipped"]
    assert "GPU" in rows["alltoall-fused"]["skipped"]
    assert "ratio_to_alltoall_fused" not in rows["deepep-sync"]  # no fused time to divide by
    fused = [line for line in stdout.splitlines() if "| alltoall (fused permute) |" in line]
    assert len(fused) == 1 and "skipped: Transformer Engine's fused permute" in fused[0]
    head = [line for line in stdout.splitlines() if line.startswith("| table |")][0]
    assert "x alltoall (unfused) | x alltoall (fused permute) |" in head


def test_ratios_against_each_alltoall_baseline():
    from megatron_deepep.bench import layer as bench_layer

    rows = [{"table": "A", "variant": "alltoall-fused", "shape": [1], "fwd_bwd_ms": 2.0},
            {"table": "A", "variant": "alltoall", "shape": [1], "fwd_bwd_ms": 4.0},
            {"table": "A", "variant": "deepep-sync", "shape": [1], "fwd_bwd_ms": 1.0}]
    bench_layer._add_ratios(rows)
    assert rows[2]["ratio_to_alltoall"] == 0.25
    assert rows[2]["ratio_to_alltoall_fused"] == 0.5
    assert rows[0]["ratio_to_alltoall"] == 0.5


def test_grouped_mm_experts_match_a_loop_over_experts():
    from types import SimpleNamespace

    from megatron_deepep.megatron.grouped_experts import GroupedMMExperts, grouped_mm_reason

    reason = grouped_mm_reason("cpu")
    if reason:
        pytest.skip(reason)
    config = SimpleNamespace(hidden_size=64, moe_ffn_hidden_size=32, gated_linear_unit=True,
                             activation_func=torch.nn.functional.silu,
                             params_dtype=torch.float32, init_method_std=0.1,
                             use_cpu_initialization=True)
    torch.manual_seed(0)
    experts = GroupedMMExperts(3, config).to(torch.bfloat16)
    counts = torch.tensor([5, 0, 11])
    rows = torch.randn(16, 64).bfloat16()
    probs = torch.rand(16)
    out, bias = experts(rows, counts, probs)
    assert bias is None and out.shape == (16, 64)
    start, want = 0, []
    for e, n in enumerate(counts.tolist()):
        h = rows[start:start + n].float() @ experts.weight1[e].float()
        gate, up = h.chunk(2, dim=-1)
        h = torch.nn.functional.silu(gate) * up * probs[start:start + n, None]
        want.append(h.bfloat16().float() @ experts.weight2[e].float())
        start += n
    torch.testing.assert_close(out.float(), torch.cat(want), rtol=3e-2, atol=3e-2)


def test_every_argument_has_help():
    from megatron_deepep.bench.layer import build_parser

    parser = build_parser()
    assert not [a.dest for a in parser._actions if not a.help]


def test_kernel_tables_list_each_profiled_row():
    from megatron_deepep.bench import layer as bench_layer

    rows = [{"table": "B", "variant": "te-alltoall", "shape": [8, 16, 4, 2, 8],
             "top_kernels": [{"name": "gemm_kernel", "us_per_call": 12.5, "share": 0.5}]},
            {"table": "B", "variant": "te-deepep-bf16", "shape": [8, 16, 4, 2, 8]}]
    text = bench_layer.kernel_tables(rows)
    assert text.splitlines() == ["B te-alltoall 8,16,4,2,8: top kernels (us/call, share)",
                                 "       12.5  50.0%  gemm_kernel"]
    # A watched kernel below the top ones says its rank; the total closes the block.
    rows[0]["top_kernels"].append({"name": "void columnwise_from_rowwise<true>(...)",
                                   "us_per_call": 0.5, "share": 0.02, "rank": 17,
                                   "watched": True})
    rows[0]["kernel_us_per_call"] = 25.0
    assert bench_layer.kernel_tables(rows).splitlines()[2:] == [
        "        0.5   2.0%  void columnwise_from_rowwise<true>(...) (rank 17)",
        "       25.0          total kernel time per call"]


def test_host_profile_names_the_functions_that_take_host_time(cpu_run):
    stdout, report = cpu_run
    ran = [r for r in report["rows"] if "fwd_bwd_ms" in r]
    assert ran and all(len(r["top_host"]) == 4 for r in ran)
    for r in ran:
        own = [e["us_per_call"] for e in r["top_host"]]
        assert own == sorted(own, reverse=True) and own[0] > 0
        assert all(e["cum_us_per_call"] >= e["us_per_call"] - 1e-6 for e in r["top_host"])
    assert "top host functions (own us/call, calls/call, cumulative us/call)" in stdout
