"""GPU tier: the sweep's one-GPU measurements (`sweep.measure_gpu`) on a small shape."""

from __future__ import annotations

import pytest

from megatron_deepep.tools import sweep

pytestmark = pytest.mark.gpu


def test_measurements_on_this_gpu():
    # Top-8 at H 7168 moves 0.5 GB a dispatch (350-400 µs at 24 SMs): above the per-call floor
    # a synchronous dispatch pays (150-190 µs of host wait), which top-2 does not leave.
    shape = sweep.Shape(hidden=7168, experts=32, topk=8, moe_ffn_hidden=1024, moe_layers=4)
    measured = sweep.measure_gpu(shape, 4096, [2, 8], [24, 132], [1, 8])
    assert measured["source"].startswith("measured on")
    assert measured["transport"] == "local"  # the EP = 1 kernels ran, not the reference
    kernels = measured["kernels"]
    assert len(kernels) >= 2 * 2 * 1  # top-k x wire (x SM budgets, deduplicated at the cap)
    for key, k in kernels.items():
        assert 0 < k["dispatch_us"] < 20000 and 0 < k["combine_us"] < 20000, key
    # Four times the rows take longer at the same wire and budget.
    assert kernels["8,bf16,24"]["dispatch_us"] > 1.3 * kernels["2,bf16,24"]["dispatch_us"]
    # Four times the rows per expert (2048 and 8192 rows each at EP 8): clearly longer.
    assert measured["experts"]["8,8"] > measured["experts"]["2,8"] * 1.2
    assert all(us > 0 for us in measured["experts"].values())
    # The fitted per-call model holds every measured call (three token counts per setting).
    constants = sweep.fit_constants(shape, 4096, measured)
    assert len(measured["points"]) == 2 * 2 * 3 * 3  # top-k x SMs x token counts x phases
    for point in measured["points"]:
        assert 0.75 < point["us"] / sweep.fitted_us(constants, point) < 1.33, point
    assert constants["gemm"]["tflops"] > 0
    rows = sweep.model(shape, 4096, measured, [1, 8, 16], sweep.Cluster())
    assert {r["ep"] for r in rows} == {1, 8}  # 16: no expert time measured, skipped
    for r in rows:
        if r["ep"] == 1:
            k = kernels[f"{r['topk']},{r['wire']},{r['num_sms']}"]
            assert r["dispatch_us"] == pytest.approx(k["dispatch_us"])
