"""CPU tier: the GPU-harness scripts in `dev/gpu/` and the metrics tools explain every argument,
name missing dependencies, and plot metrics that make sense at EP = 1 (no bandwidth axis when no bytes cross ranks) and EP = 2;
the GPU scripts' time limit (`time_limit.sh`) leaves the Python stacks of a stalled piece in its
log, those of processes started under setsid (torchrun's workers) included."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys

import pytest
from tests.helpers import REPO_ROOT, load_dev_gpu_script

ROOT = REPO_ROOT


def _script(name: str):
    """A script of dev/gpu/ as a module, or a tool of the package (`megatron_deepep.tools`)."""
    if name in ("plot_metrics", "report"):
        return importlib.import_module(f"megatron_deepep.tools.{name}")
    return load_dev_gpu_script(name)


def _write_metrics(folder, ep_size: int, num_steps: int = 3) -> None:
    """A small metrics file as `megatron_deepep.megatron.metrics` writes it."""
    num_experts = 4 * ep_size
    with open(os.path.join(folder, "deepep_metrics_rank0.jsonl"), "w", encoding="utf-8") as f:
        for step in range(num_steps):
            layers = {}
            for layer in (1, 2):
                tokens = [10 + (e * step + layer) % 7 for e in range(num_experts)]
                per_rank = [sum(tokens[r * 4:(r + 1) * 4]) for r in range(ep_size)]
                moved = 0.0 if ep_size == 1 else 3.5e6
                layers[str(layer)] = {
                    "num_micro_batches": 1, "dispatch_ms": 0.2 + 0.01 * step,
                    "combine_ms": 0.25, "dispatch_ms_max": 0.3, "combine_ms_max": 0.3,
                    "bytes_sent": moved, "bytes_recv": moved,
                    "dispatch_GBps": moved / 0.2e-3 / 1e9, "combine_GBps": moved / 0.25e-3 / 1e9,
                    "tokens_per_expert": tokens, "tokens_per_rank": per_rank,
                    "load_imbalance": max(tokens) / (sum(tokens) / len(tokens)),
                    "rank_imbalance": 1.0, "idle_share": 0.0, "num_layers": 2}
            f.write(json.dumps({"step": step, "layers": layers}) + "\n")


@pytest.mark.parametrize("name", ["plot_metrics", "sanitize_ep1", "gpu_multi_report"])
def test_every_argument_has_help(name):
    parser = _script(name).build_parser()
    missing = [a.dest for a in parser._actions if not a.help]
    assert not missing, f"{name}.py arguments without help: {missing}"
    assert parser.description


@pytest.mark.parametrize("ep_size", [1, 2])
def test_plot_metrics_renders(tmp_path, capsys, ep_size):
    pytest.importorskip("matplotlib", reason="plot_metrics.py draws with matplotlib "
                                             "(pip install matplotlib)")
    plot_metrics = _script("plot_metrics")
    _write_metrics(tmp_path, ep_size)
    _, steps = plot_metrics.load(str(tmp_path))
    assert plot_metrics.ep_size(steps) == ep_size
    assert plot_metrics.bytes_cross_ranks(steps) == (ep_size > 1)

    texts = []
    import matplotlib.figure

    original = matplotlib.figure.Figure.savefig

    def savefig(fig, path, *args, **kwargs):  # records what each figure shows
        texts.append((os.path.basename(path), len(fig.axes),
                      [t.get_text() for ax in fig.axes for t in ax.texts],
                      [ax.get_ylabel() for ax in fig.axes]))
        return original(fig, path, *args, **kwargs)

    matplotlib.figure.Figure.savefig = savefig
    try:
        assert plot_metrics.main([str(tmp_path), "--out", str(tmp_path / "png")]) == 0
    finally:
        matplotlib.figure.Figure.savefig = original
    printed = capsys.readouterr().out
    for name in ("expert_load_heatmap.png", "comm_time_per_layer.png", "monitoring.png"):
        assert (tmp_path / "png" / name).stat().st_size > 1000
        assert name in printed
    monitoring = next(t for t in texts if t[0] == "monitoring.png")
    assert monitoring[1] == 3  # comm share, idle share, drops
    # This file predates expert timing and drops: the panels say so.
    assert "not recorded\n(no comm_share field)" in monitoring[2]
    assert "not recorded\n(no tokens_dropped field)" in monitoring[2]
    assert any("no idle_share_time field" in n for n in monitoring[2])
    comm = next(t for t in texts if t[0] == "comm_time_per_layer.png")
    _, num_axes, notes, ylabels = comm
    if ep_size == 1:
        assert num_axes == 1 and not any("GB/s" in y for y in ylabels)
        assert any("no bytes cross ranks" in n for n in notes)
    else:
        assert num_axes == 2 and any("GB/s" in y for y in ylabels) and not notes


def test_plot_metrics_without_matplotlib(tmp_path, capsys, monkeypatch):
    plot_metrics = _script("plot_metrics")
    _write_metrics(tmp_path, 1)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    assert plot_metrics.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "pip install matplotlib" in err
    assert "Traceback" not in err


def test_plot_metrics_names_the_knobs_the_readme_lists(tmp_path, capsys):
    from megatron_deepep import knobs

    assert _script("plot_metrics").main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    named = set(re.findall(r"MDEEP_[A-Z_]+", err))
    assert named == {"MDEEP_METRICS", "MDEEP_METRICS_DIR"}
    assert named <= {k.env_name for k in knobs.KNOBS.values()}
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert all(f"`{name}`" in readme for name in named)


def test_sanitize_ep1_without_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert _script("sanitize_ep1").main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err



_STALLED = r"""
import subprocess, sys
child = "def stalled_in_a_worker():\n    import time\n    time.sleep(120)\nstalled_in_a_worker()\n"
# As torchrun starts its workers: under setsid, in a process group of their own.
subprocess.Popen([sys.executable, "-c", child], start_new_session=True).wait()
"""


@pytest.mark.parametrize("script", sorted(f for f in os.listdir(os.path.join(ROOT, "dev", "gpu"))
                                          if f.endswith(".sh")))
def test_shell_scripts_parse(script):
    done = subprocess.run(["bash", "-n", os.path.join(ROOT, "dev", "gpu", script)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_time_limit_prints_the_python_stacks_of_a_stalled_piece(tmp_path):
    log = tmp_path / "piece.log"
    command = (f'BUDGET_S=100; source "{ROOT}/dev/gpu/time_limit.sh"; '
               f'run 3 "{log}" "{sys.executable}" -c "$STALLED"; echo "returned $?"; '
               f'run 30 "{tmp_path / "quick.log"}" true; echo "returned $?"')
    done = subprocess.run(["bash", "-c", command], env=dict(os.environ, STALLED=_STALLED),
                          capture_output=True, text=True, timeout=120)
    assert "returned 124" in done.stdout and "returned 0" in done.stdout, done.stdout
    assert re.search(r"rc 124, \d+ s: ", done.stdout)
    text = log.read_text()
    assert "limit reached" in text
    after = text[text.index("limit reached"):]
    assert "Fatal Python error: Aborted" in after
    assert "in stalled_in_a_worker" in after, after  # the worker's own stack


def test_gpu_scripts_share_one_wheel_preamble(tmp_path):
    """`dev/gpu/wheels.sh`: a failed install names the script and returns 2; the versions line
    names torch and what could not be imported; the scripts that source it parse."""
    wheels = os.path.join(ROOT, "dev", "gpu", "wheels.sh")
    (tmp_path / ".whl").mkdir()
    proc = subprocess.run(
        ["bash", "-c", f'source "{wheels}"; install_wheels gpu_x; echo "rc=$?"; '
                       "print_versions gpu_x"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep
                 + os.environ.get("PATH", "")))  # python3: this interpreter, with torch
    assert re.search(r"gpu_x: FAIL pip could not install \.whl/\*\.whl into \S*mdeep-site\.",
                     proc.stdout), proc.stdout
    assert "rc=2" in proc.stdout
    assert re.search(r"^gpu_x: torch \S+ cuda .* \| TE ", proc.stdout, re.M), proc.stdout
    for name in ("gpu_te.sh", "gpu_layer.sh", "gpu_graphs.sh"):
        script = os.path.join(ROOT, "dev", "gpu", name)
        assert subprocess.run(["bash", "-n", script]).returncode == 0, name
        assert 'source "$(dirname "${BASH_SOURCE[0]}")/wheels.sh"' in open(script).read(), name


def _gpu_multi(tmp_path, **env):
    """`dev/gpu/gpu_multi.sh` with `env` (a dry run unless told otherwise): (rc, stdout, OUT)."""
    out = tmp_path / "out"
    full_env = dict(os.environ, OUT=str(out), DRY_RUN="1")
    for name in ("NGPU", "PIECES", "BUDGET"):
        full_env.pop(name, None)
    full_env.update(env)
    done = subprocess.run(["bash", os.path.join(ROOT, "dev", "gpu", "gpu_multi.sh")],
                          env=full_env, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr, out


def _dry_commands(stdout: str):
    return [line for line in stdout.splitlines() if line.startswith("dry run: ")]


def test_gpu_multi_dry_run_on_8_gpus(tmp_path):
    rc, stdout, out = _gpu_multi(tmp_path, NGPU="8")
    assert rc == 0, stdout
    commands = "\n".join(_dry_commands(stdout))
    assert "--nproc-per-node 8 -m megatron_deepep.bench" in commands
    for num_ranks in (2, 4, 8):
        assert (f"env MDEEP_TEST_BACKEND=nccl MDEEP_TEST_PROCS={num_ranks} python3 -m pytest"
                in commands), commands
    assert "MDEEP_TEST_BACKEND=nccl MDEEP_TEST_NODES=2x4" in commands
    assert "test_nvlink_gpu.py" in commands and "test_parity_ep_gpu.py" in commands
    for dispatcher in ("deepep", "alltoall"):
        assert (f"DISPATCHER={dispatcher} TRAIN_ITERS=50 METRICS=1" in commands
                and "bash examples/run_gpt_moe.sh" in commands), commands
    assert "--fp8 blockwise_1x128 mxfp8_1x32" in commands and "--bench" in commands
    progress = (out / "progress").read_text()
    assert re.search(r"^\[\d+ s\] start: 7 steps \(bench tier2 tier4 tier8 internode main "
                     r"staging\)",
                     progress, re.M), progress
    assert "| step | rc | s | result |" in progress and "| tier N=8 (nccl) | 0 |" in progress


def test_gpu_multi_fits_the_pieces_to_2_gpus(tmp_path):
    rc, stdout, _ = _gpu_multi(tmp_path, NGPU="2", PIECES="bench tier tier8 main")
    commands = "\n".join(_dry_commands(stdout))
    assert "--nproc-per-node 2 -m megatron_deepep.bench" in commands
    assert "MDEEP_TEST_PROCS=2 " in commands and "MDEEP_TEST_NODES=2x1" in commands
    assert "MDEEP_TEST_PROCS=4" not in commands and "MDEEP_TEST_PROCS=8" not in commands
    # tier8 named on purpose: reported, not run; the run still says so in its exit status.
    assert "| tier N=8 (nccl) | - | 0 | not run: 8 ranks need 8 GPUs (2 or more); 2 here |" \
        in stdout
    assert rc == 0, stdout


def test_gpu_multi_runs_only_the_named_pieces_in_order(tmp_path):
    rc, stdout, _ = _gpu_multi(tmp_path, NGPU="8", PIECES="main internode")
    assert rc == 0, stdout
    names = [line.split(" (limit")[0][len("dry run: "):] for line in _dry_commands(stdout)
             if "(limit" in line]
    assert names == ["precompile", "main deepep", "main alltoall", "metrics PNGs",
                     "internode 2x4 (nccl)"], names
    assert "megatron_deepep.bench" not in stdout and "--topk 1 2 4 6 8 16" in stdout


def test_gpu_multi_skips_what_does_not_fit_the_budget(tmp_path):
    rc, stdout, out = _gpu_multi(tmp_path, NGPU="4", PIECES="bench tier4", BUDGET="10")
    assert rc == 1, stdout
    assert stdout.count("skipped (budget): ") == 3, stdout  # precompile, bench, tier4
    assert "| bench EP 4 | 99 (skipped: budget) |" in (out / "progress").read_text()


@pytest.mark.parametrize("env,message", [
    (dict(NGPU="8", PIECES="bench tier16x"), "unknown piece 'tier16x' in PIECES"),
    (dict(), "a dry run needs NGPU"),
    (dict(NGPU="1"), "needs 2 or more GPUs, found NGPU=1"),
])
def test_gpu_multi_refuses_bad_settings_before_running_anything(tmp_path, env, message):
    rc, stdout, _ = _gpu_multi(tmp_path, **env)
    assert rc == 2 and message in stdout, stdout
    assert not _dry_commands(stdout)


def test_gpu_multi_keeps_multicast_off_in_what_it_starts():
    text = open(os.path.join(ROOT, "dev", "gpu", "gpu_multi.sh"), encoding="utf-8").read()
    assert ("export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 "
            "NVSHMEM_DISABLE_NVLS=1") in text
    assert 'source "$HERE/wheels.sh"' in text and "install_wheels gpu_multi" in text


def _bench_row(ep, gbps, x_nccl):
    def op(value):
        return {"GBps_worst": value, "target_GBps_met": value >= 340,
                "target_nccl_met": None if x_nccl is None else x_nccl >= 1.1}
    variants = {f"ours {sms} SMs sync": {"wire": "bf16", "num_sms": sms,
                                         "dispatch": op(gbps * sms / 24),
                                         "combine": op(gbps * sms / 24 - 10)}
                for sms in (24, 132)}
    for v in variants.values():  # above 24 SMs the bandwidth target does not apply
        if v["num_sms"] > 24:
            v["dispatch"]["target_GBps_met"] = v["combine"]["target_GBps_met"] = None
    return {"shape": [4096, 7168, 256, 8], "ep": ep, "peers": {"variants": variants}}


def _report(*args) -> str:
    """`dev/gpu/gpu_multi_report.py ARGS`'s output, run as gpu_multi.sh runs it."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "dev", "gpu", "gpu_multi_report.py"),
                           *map(str, args)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.rstrip("\n")


def test_gpu_multi_report_bench(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps([_bench_row(8, 345.0, 1.2)]))
    line = _report("bench", path)
    assert line.startswith("EP 8: >= 340 GB/s (<= 24 SMs) 1/2 met, >= 1.1x NCCL 4/4 met"), line
    assert "(4096, 7168, 256, 8) 24 SMs dispatch 345 / combine 335 GB/s" in line
    path.write_text(json.dumps([_bench_row(2, 100.0, None)]))
    assert "NCCL not measured" in _report("bench", path)
    assert _report("bench", tmp_path / "none.json").startswith("no ")


def test_gpu_multi_report_pytest_and_training(tmp_path):
    log = tmp_path / "tier.log"
    log.write_text("PASSED tests/gpu/test_nvlink_gpu.py::test_a[2]\n"
                   "FAILED tests/gpu/test_nvlink_gpu.py::test_b[2] - AssertionError\n"
                   "1 failed, 6 passed, 2 skipped in 95.20s (0:01:35)\n")
    assert _report("pytest", log) == ("1 failed, 6 passed, 2 skipped; failed: "
                                      "test_nvlink_gpu.py::test_b[2]")
    log.write_text("collected 7 items\ntime_limit.sh: 240 s limit reached: SIGABRT\n")
    assert "no pytest summary" in _report("pytest", log)

    def train(path, losses, ms=100.0):
        path.write_text("".join(
            f" [2026-01-01 00:00:{i:02d}] iteration {i:8d}/{len(losses):8d} | elapsed time per "
            f"iteration (ms): {ms + i:.1f} | lm loss: {loss:.6E} |\n"
            for i, loss in enumerate(losses, start=1)))
        return str(path)

    deepep = train(tmp_path / "deepep.log", [10.478, 9.0, 7.5, 6.0, 5.5, 4.0])
    alltoall = train(tmp_path / "alltoall.log", [10.478, 9.0, 7.5, 6.0, 5.4, 4.01], ms=90.0)
    lines = _report("main", deepep, alltoall).splitlines()
    assert lines[0] == "loss it1 10.4780 it6 4.0000, median step 105.0 ms"  # its 4-6
    assert lines[1] == "loss it1 10.4780 it6 4.0100, median step 95.0 ms"
    assert lines[2] == "max |loss difference| 0.1000 (it5) over 6 iterations"
    assert _report("main", tmp_path / "missing.log").endswith("no iteration with an lm loss")


def test_gpu_multi_report_staging(tmp_path):
    """One line per staging from multinode_check's JSON (its shape as an earlier sweep wrote
    it on the H200)."""
    point = {"tokens": 4096, "hidden": 7168, "wire": "bf16", "network_bytes_per_rank": 58548224}
    doc = {"setup": {"staging": {"name": "ring (512 slots)", "mode": "ring", "ring_slots": 512,
                                 "net_chunks": 0}},
           "sweep": [dict(point, phase="dispatch", us=7189.55, gbps_per_rank=8.1435),
                     dict(point, phase="combine", us=9144.0, gbps_per_rank=6.4029)]}
    path = tmp_path / "staging_ring.json"
    path.write_text(json.dumps(doc))
    assert _report("staging", path) == ("ring (512 slots): 4096x7168 dispatch 7190 us (8.1 "
                                        "GB/s); 4096x7168 combine 9144 us (6.4 GB/s)")
    doc["setup"].pop("staging")
    doc["sweep"] = []
    path.write_text(json.dumps(doc))
    assert _report("staging", path) == "staging not recorded: no sweep"
    assert _report("staging", tmp_path / "none.json").startswith("no ")


def test_gpu_multi_staging_piece_times_each_staging_over_real_gpus(tmp_path):
    rc, stdout, _ = _gpu_multi(tmp_path, NGPU="4", PIECES="staging")
    assert rc == 0, stdout
    commands = _dry_commands(stdout)[1:]  # after the wheels
    assert "--internode" in commands[0], commands  # precompile: every staging auto may pick
    knobs = ["MDEEP_INTERNODE_STAGING=full python3",
             "MDEEP_INTERNODE_STAGING=ring MDEEP_INTERNODE_NET_RING_CHUNKS=0 python3",
             "MDEEP_INTERNODE_STAGING=ring MDEEP_INTERNODE_NET_RING_CHUNKS=8 python3"]
    for command, knob in zip(commands[1:], knobs):
        assert knob in command and "--spawn 4 --num-ranks-per-node 2 --skip-check" in command
    assert len(commands) == 4
    rc, stdout, _ = _gpu_multi(tmp_path, NGPU="3", PIECES="staging")
    assert "| staging | - | 0 | not run: 2 virtual nodes need an even number of GPUs (3) |" \
        in stdout
