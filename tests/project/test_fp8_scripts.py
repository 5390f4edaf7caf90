"""CPU tier: the FP8 measurement scripts of `dev/gpu/` (fp8.sh) plan what their
header says in a dry run, fp8_profile.py's timeline splits a call's host stamps right and its
queued mode times each call it lists, host_breakdown.py's timers wrap and restore each kind of
target, and bench_rounds.py tables alternating rounds of the bench and of its queued mode."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import load_dev_gpu_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_DIR = os.path.join(ROOT, "dev", "gpu")


def _dry_run(script, *args, **env):
    full = dict(os.environ, DRY_RUN="1", **env)
    full.pop("OUT", None)
    done = subprocess.run(["bash", os.path.join(GPU_DIR, script), *args], env=full,
                          capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture
def before_dir(tmp_path):
    (tmp_path / "before" / "megatron_deepep").mkdir(parents=True)
    (tmp_path / "wheels").mkdir()
    return str(tmp_path / "wheels"), str(tmp_path / "before")


def test_fp8_timeline_and_layer_pieces_plan(before_dir):
    rc, out = _dry_run("fp8.sh", *before_dir, PIECES="timeline layer", NUM_SMS="24,132",
                       FORMATS="mxfp8_1x32,blockwise_1x128",
                       LAYER_VARIANTS="te-alltoall-fused,te-deepep-fp8-experts",
                       LAYER_ARGS="--profile 12")
    assert rc == 0, out
    timeline = next(line for line in out.splitlines() if line.startswith("dry run: timeline"))
    # The first format, the last SM budget.
    assert "fp8_profile.py --timeline --fp8 mxfp8_1x32 --num-sms 132" in timeline
    layer = next(line for line in out.splitlines() if line.startswith("dry run: layer"))
    assert "--variants te-alltoall-fused,te-deepep-fp8-experts" in layer
    assert layer.rstrip().endswith("--profile 12")


def test_fp8_unknown_piece_is_refused(before_dir):
    rc, out = _dry_run("fp8.sh", *before_dir, PIECES="timelines")
    assert rc == 2 and "unknown piece 'timelines'" in out


def test_timeline_splits_each_call_at_its_wait(capsys):
    """Sync calls of 100 µs each: 60 before the wait, 30 in it, 10 after, 5 between calls."""
    stamps, t = [], 0
    for _ in range(12):
        t += 5_000
        stamps += [("call", t), ("wait", t + 60_000), ("waited", t + 90_000),
                   ("return", t + 100_000)]
        t += 100_000
    load_dev_gpu_script("fp8_profile")._print_timeline("bf16 sync", stamps, 120.0)
    out = capsys.readouterr().out
    assert "bf16 sync: GPU 120.0 µs/call" in out
    assert ("host per call 105.0, before wait 60.0, in wait 30.0, after wait 10.0, "
            "between calls 5.0 µs") in out


def test_timeline_without_a_wait_reports_the_call_only(capsys):
    stamps = []
    for i in range(10):
        stamps += [("call", i * 50_000), ("return", i * 50_000 + 40_000)]
    load_dev_gpu_script("fp8_profile")._print_timeline("fp8 nosync", stamps, float("nan"))
    out = capsys.readouterr().out
    assert "host per call 50.0, between calls 10.0 µs" in out and "wait" not in out


class _CountingBuffer:
    """The calls `fp8_profile.queued` makes, counted by kind (dispatch: by mode)."""

    num_ranks = 1

    def __init__(self):
        self.calls = {}

    def _count(self, key):
        self.calls[key] = self.calls.get(key, 0) + 1

    def get_dispatch_layout(self, idx, num_experts):
        self._count("layout")

    def dispatch(self, x, idx=None, w=None, *, num_experts=None, num_max_recv_rows=None,
                 handle=None, fp8=None):
        mode = "cached" if handle is not None else "nosync" if num_max_recv_rows else "sync"
        self._count(f"{'bf16' if fp8 is None else fp8} {mode}")
        return None, None, "handle", None


def test_queued_times_the_layout_and_each_format_and_mode(capsys):
    """On the CPU the queued mode runs each call's warm-up and says it has no GPU time; the
    labels are the layout, then nosync and cached per format, bf16 first."""
    buf = _CountingBuffer()
    load_dev_gpu_script("fp8_profile").queued(buf, torch.zeros(2, 8), torch.zeros(2, 1), None, 4,
                                                [("bf16", None), ("mx", "mx")], calls=30)
    labels = [line.split(": ")[1] for line in capsys.readouterr().out.splitlines()]
    assert labels == ["layout", "bf16 nosync", "bf16 cached", "mx nosync", "mx cached"]
    # Three warm-up calls each; the one sync call per format makes the cached call's handle.
    assert buf.calls == {"layout": 3, "bf16 sync": 1, "bf16 nosync": 3, "bf16 cached": 3,
                         "mx sync": 1, "mx nosync": 3, "mx cached": 3}


def _after_and_before_plans(before_dir, piece, **env):
    """fp8.sh's dry-run lines of a piece that runs after, then before."""
    rc, out = _dry_run("fp8.sh", *before_dir, PIECES=piece, **env)
    assert rc == 0, out
    lines = [line for line in out.splitlines() if line.startswith(f"dry run: {piece}")]
    assert [line.split()[3] for line in lines] == ["after", "before"], out
    return lines


def test_breakdown_piece_plans_both_sides(before_dir):
    lines = _after_and_before_plans(before_dir, "breakdown", NUM_SMS="24,132",
                                    BREAKDOWN_SIDES="after before")
    assert all("host_breakdown.py --fp8 blockwise_1x128 --num-sms 132" in line
               for line in lines)
    assert before_dir[1] in lines[1] and before_dir[1] not in lines[0]


def test_ncu_piece_takes_extra_arguments(before_dir):
    lines = _after_and_before_plans(before_dir, "ncu", NCU_SMS="24",
                                    NCU_EXTRA="--metrics a.sum,b.avg --section X")
    for line in lines:
        assert "--section MemoryWorkloadAnalysis --metrics a.sum,b.avg --section X" in line
        assert line.rstrip().endswith("--num-sms 24")


def test_breakdown_timers_wrap_functions_methods_and_classmethods():
    """Each kind of target is timed while enabled, counted per call, and put back as it was;
    a target this package lacks (an older tree) is skipped, not an error."""
    import megatron_deepep.arena as arena
    import megatron_deepep.validate as validate

    breakdown = load_dev_gpu_script("host_breakdown")
    originals = (validate.__dict__["check_int"], arena.ArenaPlan.__dict__["allocate"],
                 arena.ArenaFields.__dict__["from_arena"])
    timers = breakdown.Timers()
    assert timers.patch("megatron_deepep.validate", "check_int")
    assert timers.patch("megatron_deepep.arena", "ArenaPlan.allocate")
    assert timers.patch("megatron_deepep.arena", "ArenaFields.from_arena")
    assert not timers.patch("megatron_deepep.arena", "ArenaPlan.no_such_method")
    assert not timers.patch("megatron_deepep.validate", "no_such_function")
    try:
        plan = arena.ArenaPlan([("a", (4,), torch.int32)])
        validate.check_int("n", 3, low=0)  # not counted: the timers are off
        timers.enabled = True
        validate.check_int("n", 3, low=0)
        made = plan.allocate("cpu")
        arena.ArenaFields.from_arena(made)
        timers.enabled = False
        assert dict(timers.count) == {"check_int": 1, "ArenaPlan.allocate": 1,
                                      "ArenaFields.from_arena": 1}
        assert all(ns > 0 for ns in timers.ns.values())
    finally:
        timers.unpatch()
    assert (validate.__dict__["check_int"], arena.ArenaPlan.__dict__["allocate"],
            arena.ArenaFields.__dict__["from_arena"]) == originals


def test_fp8_rounds_piece_alternates_sides_and_tables_them(before_dir):
    rc, out = _dry_run("fp8.sh", *before_dir, PIECES="rounds", ROUNDS="2")
    assert rc == 0, out
    runs = [line for line in out.splitlines() if line.startswith("dry run: round ")]
    assert [line.split("(")[0].split()[-2:] for line in runs] == [
        ["1", "after"], ["1", "before"], ["2", "after"], ["2", "before"]]
    assert all("python3 -P -m megatron_deepep.bench" in line and "--profile" in line
               for line in runs)
    assert before_dir[1] in runs[1] and before_dir[1] not in runs[0]
    table = next(line for line in out.splitlines() if "rounds table:" in line)
    assert table.count("after=") == table.count("before=") == 2


def test_a_side_module_runs_from_its_own_package(tmp_path):
    """Why fp8.sh runs each side's modules with `python3 -P -m`: plain `-m` puts the working
    directory (here the repository) first on sys.path, ahead of the side's PYTHONPATH."""
    side = tmp_path / "megatron_deepep"
    side.mkdir()
    (side / "__init__.py").write_text("")
    (side / "whereami.py").write_text("print(__file__)")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run([sys.executable, "-P", "-m", "megatron_deepep.whereami"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith(str(tmp_path)), done.stderr
    shadowed = subprocess.run([sys.executable, "-m", "megatron_deepep.whereami"], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=60)
    assert shadowed.returncode != 0  # the repository's package, which has no such module


def _bench_json(path, sync_us, fp8_us):
    variants = {"ours 24 SMs sync": {"dispatch_us": sync_us},
                "ours 24 SMs fp8 blockwise_1x128 sync": {"dispatch_us": fp8_us,
                                                          "fp8": "blockwise_1x128"},
                "megatron alltoall": {"error": "not run"}}
    path.parent.mkdir(parents=True)
    path.write_text(__import__("json").dumps([{"shape": [64, 128, 8, 2], "variants": variants}]))
    return str(path)


def test_bench_rounds_takes_each_sides_least_and_the_fp8_ratio(tmp_path, capsys):
    rounds = load_dev_gpu_script("bench_rounds")
    args = [f"after={_bench_json(tmp_path / 'a1' / 'bench.json', 400.0, 250.0)}",
            f"before={_bench_json(tmp_path / 'b1' / 'bench.json', 380.0, 260.0)}",
            f"after={_bench_json(tmp_path / 'a2' / 'bench.json', 375.0, 240.0)}",
            f"before={tmp_path / 'b2' / 'bench.json'}"]  # a round that never wrote its file
    assert rounds.main(args) == 0
    out = capsys.readouterr()
    assert "| variant | after | before |" in out.out
    # FP8's least over bf16's least of the same side: 240 / 375 and 260 / 380.
    assert "| 64,128,8,2 ours 24 SMs fp8 blockwise_1x128 sync | 240.0 (0.64) [250.0 240.0] | " \
           "260.0 (0.68) [260.0] |" in out.out
    assert "| 64,128,8,2 ours 24 SMs sync | 375.0 [400.0 375.0] | 380.0 [380.0] |" in out.out
    assert "alltoall" not in out.out and "left out" in out.err
    assert rounds.main(["no-equals-sign"]) == 2


def test_fp8_queued_piece_runs_each_side_at_each_sm_budget_and_tables_them(before_dir):
    rc, out = _dry_run("fp8.sh", *before_dir, PIECES="queued", ROUNDS="2", NUM_SMS="24,132")
    assert rc == 0, out
    runs = [line for line in out.splitlines()
            if line.startswith("dry run: queued ") and "table:" not in line]
    assert [line.split("(")[0].split()[-3:] for line in runs] == [
        [str(i), side, sms] for i in (1, 2) for side in ("after", "before")
        for sms in ("24", "132")]
    assert all("fp8_profile.py --queued" in line for line in runs)
    assert all((before_dir[1] in line) == (" before " in line) for line in runs)
    table = next(line for line in out.splitlines() if "queued table:" in line)
    assert table.count("after=") == table.count("before=") == 4
    assert "fp8_queued2_before_132.log" in table


def test_bench_rounds_tables_queued_logs_with_the_fp8_ratio(tmp_path, capsys):
    rounds = load_dev_gpu_script("bench_rounds")
    logs = []
    for name, (layout, bf16, fp8) in {"a1": (9.1, 375.0, 240.0), "b1": (9.3, 380.0, 260.0),
                                      "a2": (9.4, 376.0, 232.5)}.items():
        path = tmp_path / f"{name}.log"
        path.write_text(f"fp8_profile queued: 24 SMs layout: GPU {layout} µs/call\n"
                        f"fp8_profile queued: 24 SMs bf16 nosync: GPU {bf16} µs/call\n"
                        "some other line\n"
                        f"fp8_profile queued: 24 SMs mx nosync: GPU {fp8} µs/call\n")
        logs.append(str(path))
    args = [f"after={logs[0]}", f"before={logs[1]}", f"after={logs[2]}",
            f"before={tmp_path / 'b2.log'}"]  # a round that never wrote its log
    assert rounds.main(args) == 0
    out = capsys.readouterr()
    assert "| SMs | call | after | before |" in out.out
    assert "| 24 SMs | layout | 9.1 [9.1 9.4] | 9.3 [9.3] |" in out.out
    # FP8's least over bf16's least of the same side and mode: 232.5 / 375 and 260 / 380.
    assert "| 24 SMs | mx nosync | 232.5 (0.62) [240.0 232.5] | 260.0 (0.68) [260.0] |" in out.out
    assert "| 24 SMs | bf16 nosync | 375.0 [375.0 376.0] | 380.0 [380.0] |" in out.out
    assert "left out" in out.err


def test_more_sides_run_between_after_and_before(before_dir, tmp_path):
    (tmp_path / "mid" / "megatron_deepep").mkdir(parents=True)
    rc, out = _dry_run("fp8.sh", *before_dir, PIECES="queued rounds", ROUNDS="1",
                       NUM_SMS="132", MORE_SIDES=f"mid={tmp_path / 'mid'}")
    assert rc == 0, out
    for kind in ("queued", "round"):
        runs = [line for line in out.splitlines()
                if line.startswith(f"dry run: {kind} 1 ") and "table:" not in line]
        assert [line.split()[4] for line in runs] == ["after", "mid", "before"], out
        assert str(tmp_path / "mid") in runs[1]
    assert all("mid=" in line for line in out.splitlines() if "table:" in line)
    rc, out = _dry_run("fp8.sh", *before_dir, PIECES="rounds", MORE_SIDES="no-dir")
    assert rc == 2 and "MORE_SIDES wants NAME=DIR" in out
