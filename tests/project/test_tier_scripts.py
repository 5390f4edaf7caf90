"""CPU tier: the GPU tier's plan (`dev/gpu/tier_round.sh`, dry run) fits three calls and covers
every tests/gpu file; the record writer counts each file's verdicts from `-v -rA` logs; the FP8
crossover tool picks the knob's default from a sweep; NVSHMEM's messages are quoted from a log."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.helpers import REPO_ROOT, load_dev_gpu_script

README_SHAPES = ("2x1", "2x2", "3x2", "2x3", "4x2", "2x4")


@pytest.fixture(scope="module")
def plan():
    done = subprocess.run(["bash", "dev/gpu/tier_round.sh", "dev"], cwd=REPO_ROOT,
                          env=dict(os.environ, DRY_RUN="1"), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_every_call_fits_its_budget(plan):
    sums = [int(s) for s in re.findall(r"^  sum: (\d+) s of 570 s$", plan, re.M)]
    assert len(sums) == 3 and all(s <= 570 for s in sums), sums
    for call in plan.split("call ")[1:]:  # pieces at once count once, at their longest limit
        groups = re.findall(r"^  \S+: limit (\d+) s", call, re.M)
        assert sum(map(int, groups)) + 40 == int(re.search(r"sum: (\d+) s", call).group(1))


def test_each_call_precompiles_before_its_multi_process_pieces(plan):
    for call in plan.split("call ")[1:]:
        first = re.findall(r"^  (\S+): limit", call, re.M)[0]
        assert first.startswith("precompile"), call
    assert "megatron_deepep.tools.precompile --topk 1 2 4 6 8 16 --index-dtype int64" in plan


def test_the_plan_covers_the_tier(plan):
    files = sorted(os.listdir(os.path.join(REPO_ROOT, "tests", "gpu")))
    missing = [f for f in files if f.startswith("test_") and f"tests/gpu/{f}" not in plan]
    assert not missing, f"tests/gpu files no piece runs: {missing}"
    for n in (2, 3, 4, 8):
        assert f"MDEEP_TEST_PROCS={n} python3 -m pytest" in plan, n
    for shape in README_SHAPES:
        assert f"MDEEP_TEST_NODES={shape} python3 -m pytest" in plan, shape
    assert "small_ring or (small_net_ring and not 3x2)" in plan and "small_net_ring and 3x2" in plan
    assert "MDEEP_TEST_PROCS=1,2 python3 -m pytest -m gpu -v -rA -p no:cacheprovider " \
           "--durations=10 tests/gpu/test_fp8_dispatch_gpu.py" in plan
    assert plan.count("-v -rA") == plan.count("python3 -m pytest")


def test_the_readme_shapes_are_the_plans():
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert all(shape in readme for shape in README_SHAPES[1:])


def test_extra_pieces_and_an_over_budget_plan(tmp_path):
    env = dict(os.environ, DRY_RUN="1", CALL="3", EXTRA="fp8-crossover proxy")
    done = subprocess.run(["bash", "dev/gpu/tier_round.sh", "dev"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "OVER the budget" in done.stdout, done.stdout
    assert "fp8_crossover.py --sweep" in done.stdout and "PROXY_SHAPES=2x1" in done.stdout
    env.update(PIECES="graphs", EXTRA="fp8-crossover")
    done = subprocess.run(["bash", "dev/gpu/tier_round.sh", "dev"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "sum: 240 s of 570 s" in done.stdout, done.stdout


LOG_A = """\
tests/gpu/test_layout_gpu.py::test_a[1] PASSED                                [ 25%]
tests/gpu/test_layout_gpu.py::test_a[2] PASSED                                [ 50%]
tests/gpu/test_te_gpu.py::test_te SKIPPED (needs Transformer Engine)          [ 75%]
tests/gpu/test_hazards_gpu.py::test_h FAILED                                  [100%]
=========================== short test summary info ============================
PASSED tests/gpu/test_layout_gpu.py::test_a[1]
PASSED tests/gpu/test_layout_gpu.py::test_a[2]
SKIPPED [1] tests/gpu/test_te_gpu.py:47: needs Transformer Engine
FAILED tests/gpu/test_hazards_gpu.py::test_h - AssertionError: rows differ
=========== 1 failed, 2 passed, 1 skipped in 12.34s ===========
"""
LOG_B = """\
tests/gpu/test_layout_gpu.py::test_a[1] PASSED                                [ 50%]
time_limit.sh: 80 s limit reached: SIGABRT to its Python processes (their stacks follow)
"""
LOG_C = """\
....s                                                                   [100%]
=========================== short test summary info ============================
PASSED tests/gpu/test_fp8_gpu.py::test_x[a]
PASSED tests/gpu/test_fp8_gpu.py::test_x[b]
SKIPPED [2] tests/gpu/test_fp8_gpu.py:12: needs a CUDA GPU
=========== 2 passed, 2 skipped in 1.00s ===========
"""


def _call(folder, logs):
    folder.mkdir()
    (folder / "versions.txt").write_text("device: NVIDIA H100 80GB HBM3, 81559 MiB\n")
    rows = []
    for name, (rc, text) in logs.items():
        (folder / f"tier_{name}.log").write_text(text)
        rows.append(f"{name}\t{rc}\t12\t80\t2\tpython3 -m pytest ...")
    (folder / "pieces.tsv").write_text("\n".join(rows) + "\n")


def test_the_record_counts_every_file(tmp_path):
    record = load_dev_gpu_script("tier_record")
    _call(tmp_path / "call1", {"a": ("1", LOG_A), "c": ("0", LOG_C)})
    _call(tmp_path / "call2", {"b": ("124", LOG_B)})
    out = tmp_path / "record.md"
    rc = record.main([str(tmp_path / "call1"), str(tmp_path / "call2"), "--out", str(out),
                      "--date", "2026-12-07"])
    text = out.read_text()
    assert rc == 1  # a failure
    for path in record.gpu_test_files():
        assert f"| `{path}` |" in text, path
    assert "| `tests/gpu/test_layout_gpu.py` | 2 | 0 | 0 | 0 | call1/a, call2/b |" in text
    assert "| `tests/gpu/test_hazards_gpu.py` | 0 | 1 | 0 | 0 | call1/a |" in text
    assert "| `tests/gpu/test_te_gpu.py` | 0 | 0 | 0 | 1 | call1/a |" in text
    assert "| `tests/gpu/test_fp8_gpu.py` | 2 | 0 | 0 | 2 | call1/c |" in text
    assert "| `tests/gpu/test_nvlink_gpu.py` | 0 | 0 | 0 | 0 | not run |" in text
    assert "AssertionError: rows differ" in text and "needs Transformer Engine" in text
    assert "piece call2/b: rc 124" in text and "`tests/gpu/test_nvlink_gpu.py`: no piece" in text
    assert "1 failed, 2 passed, 1 skipped in 12.34s" in text


def test_the_record_names_its_file_after_the_card(tmp_path):
    record = load_dev_gpu_script("tier_record")
    _call(tmp_path / "call1", {"c": ("0", LOG_C)})
    rc = record.main([str(tmp_path / "call1"), "--benchmarks", str(tmp_path / "bench"),
                      "--date", "2026-12-07"])
    assert rc == 0
    assert (tmp_path / "bench" / "h100_2026-12-07_gpu_tier.md").exists()
    assert (tmp_path / "bench" / "h100_2026-12-07_gpu_tier" / "call1" / "tier_c.log").exists()


def _sweep_log(registers, row_stage):
    lines = []
    for path, values in (("registers", registers), ("row_stage", row_stage)):
        lines.append(f"== path {path} round 1")
        for sms, us in values.items():
            lines.append(f"fp8_profile queued: {sms} SMs bf16 nosync: GPU 999.0 µs/call")
            for call in ("blockwise_1x128 nosync", "mxfp8_1x32 cached"):
                lines.append(f"fp8_profile queued: {sms} SMs {call}: GPU {us} µs/call")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("registers,row_stage,expected", [
    ({24: 200, 40: 150, 48: 140, 64: 130, 132: 125}, {24: 230, 40: 155, 48: 135, 64: 118,
                                                       132: 112}, 48),
    ({24: 200, 132: 125}, {24: 190, 132: 110}, 24),
    ({24: 200, 132: 110}, {24: 230, 132: 125}, None),
])
def test_the_crossover_is_where_the_row_stage_stops_losing(tmp_path, registers, row_stage,
                                                           expected):
    tool = load_dev_gpu_script("fp8_crossover")
    sweep = tool.parse([_sweep_log(registers, row_stage)])
    table = tool.least_sums(sweep)
    assert sorted(table) == sorted(registers)
    assert table[24]["registers"] == 2 * registers[24]  # two FP8 calls; bf16 left out
    assert tool.choose(table)[0] == expected


def test_the_crossover_takes_the_least_of_the_rounds(tmp_path, capsys):
    tool = load_dev_gpu_script("fp8_crossover")
    log = tmp_path / "runs.log"
    log.write_text(_sweep_log({24: 200, 132: 130}, {24: 300, 132: 140})
                   + _sweep_log({24: 210, 132: 131}, {24: 250, 132: 100}))
    assert tool.main([str(log)]) == 0
    out = capsys.readouterr().out
    assert "| 132 | 260.0 | 200.0 | 0.769 |" in out
    assert "default: MDEEP_FP8_ROW_STAGE_MIN_SMS=132" in out


NVSHMEM_LOG = """\
collecting ... collected 1 item
host:101:101 [0] NVSHMEM INFO PE 0 (process) affinity to 16 CPUs
host:102:102 [1] NVSHMEM INFO PE 1 (process) affinity to 16 CPUs
host:101:101 [0] NVSHMEM INFO P2P disabled by NVSHMEM_DISABLE_P2P
host:101:101 [0] NVSHMEM INFO remote transport ucx selected
/build/src/host/transport/transport.cpp:275: init failed for transport: ucx
WARN: init failed for remote transport: ucx
unrelated line
FAILED tests/gpu/test_internode_gpu.py::test_internode_matches_reference[2x1]
========== 1 failed in 30.0s ==========
"""


def test_nvshmem_messages_are_quoted(tmp_path):
    tool = load_dev_gpu_script("nvshmem_diag")
    parts = tool.summarize(NVSHMEM_LOG)
    assert parts["count"] == ["5"]  # the two PEs' affinity lines are one message
    assert parts["transports"] == [
        "host:101:101 [0] NVSHMEM INFO P2P disabled by NVSHMEM_DISABLE_P2P",
        "host:101:101 [0] NVSHMEM INFO remote transport ucx selected",
        "/build/src/host/transport/transport.cpp:275: init failed for transport: ucx",
        "WARN: init failed for remote transport: ucx"]
    assert parts["problems"][-1] == "WARN: init failed for remote transport: ucx"
    assert parts["last"][-1] == "WARN: init failed for remote transport: ucx"
    assert parts["verdict"][-1] == "========== 1 failed in 30.0s =========="
    text = tool.render("tier_2x1.log", parts)
    assert "unrelated line" not in text and "NVSHMEM's own messages in `tier_2x1.log`" in text
