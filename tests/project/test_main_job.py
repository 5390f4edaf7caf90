"""CPU tier: the README's main job (`bash examples/run_gpt_moe.sh`) and its one test command.

`examples/prepare_env.py` picks the path and what to install from what it finds (checked here on
made-up environments: no side effects); the CPU demonstration trains the tiny GPT-MoE with
`deepep` (reference transport) and `alltoall` on 2 gloo ranks and prints matching losses; every
hint that names a test command names the README's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from tests.helpers import REPO_ROOT, process_failure

ROOT = REPO_ROOT


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples",
                                                                     name + ".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


prepare = _load("prepare_env")


def _found(**kw):
    base = dict(python=(3, 11, 7), num_gpus=0, torch=None, megatron_core=None,
                megatron_training=False, pyyaml=None, nvrtc=False, matplotlib="3.10.0")
    base.update(kw)
    return prepare.Found(**base)


def test_fresh_cpu_machine_installs_the_pinned_torch_and_megatron_core_for_the_demo():
    todo = prepare.plan(_found())
    assert todo.path == "cpu-demo"
    assert todo.requirements == [prepare.TORCH_PIN, "megatron-core" + prepare.MEGATRON_CORE]


@pytest.mark.parametrize("num_gpus", [0, 8])
def test_the_main_job_installs_matplotlib_so_it_plots(num_gpus):
    everything = dict(python=(3, 12, 1), torch="2.13.0", megatron_core="0.19.2",
                      megatron_training=True, pyyaml="6.0", nvrtc=True)
    todo = prepare.plan(_found(num_gpus=num_gpus, matplotlib=None, **everything))
    assert todo.requirements == ["matplotlib"]  # nothing else: it was all there


def test_cpu_machine_with_everything_installs_nothing():
    todo = prepare.plan(_found(torch="2.13.0+cpu", megatron_core="0.16.1"))
    assert (todo.path, todo.requirements, todo.notes) == ("cpu-demo", [], [])


@pytest.mark.parametrize("python", [(3, 12, 1), (3, 13, 0)])
def test_gpu_with_a_new_python_trains_with_megatron_training(python):
    todo = prepare.plan(_found(python=python, num_gpus=8), root="/repo")
    assert todo.path == "megatron-training"
    assert todo.requirements == [prepare.TORCH_PIN, "megatron-core>=0.17,<0.20", "pyyaml",
                                 "-e", "/repo[gpu]"]


@pytest.mark.parametrize("python", [(3, 10, 13), (3, 11, 7)])
def test_gpu_with_an_older_python_trains_on_megatron_core_alone_and_says_why(python):
    todo = prepare.plan(_found(python=python, num_gpus=1), root="/repo")
    assert todo.path == "megatron-core"
    assert todo.requirements == [prepare.TORCH_PIN, "megatron-core>=0.16,<0.20",
                                 "-e", "/repo[gpu]"]
    assert any("megatron.training" in note and "MEGATRON_LM" in note for note in todo.notes)


def test_gpu_with_a_megatron_lm_checkout_trains_with_it_and_keeps_the_users_torch():
    todo = prepare.plan(_found(num_gpus=2, torch="2.11.0+cu130", megatron_training=True,
                               pyyaml="6.0", nvrtc=True))
    assert (todo.path, todo.requirements) == ("megatron-training", [])
    assert any("keeping the installed torch 2.11.0+cu130" in note for note in todo.notes)


def test_gpu_with_megatron_core_016_on_python_312_stays_and_names_the_upgrade():
    todo = prepare.plan(_found(python=(3, 12, 1), num_gpus=1, torch="2.13.0",
                               megatron_core="0.16.1", nvrtc=True))
    assert (todo.path, todo.requirements) == ("megatron-core", [])
    assert any("megatron-core>=0.17" in note for note in todo.notes)


def test_unsupported_megatron_core_is_replaced_by_a_supported_one():
    todo = prepare.plan(_found(torch="2.13.0", megatron_core="0.15.3"))
    assert todo.requirements == ["megatron-core" + prepare.MEGATRON_CORE]
    assert any("0.15.3 is not supported" in note for note in todo.notes)


def test_missing_nvrtc_on_a_gpu_installs_the_gpu_extra_only():
    todo = prepare.plan(_found(python=(3, 12, 1), num_gpus=1, torch="2.13.0",
                               megatron_core="0.19.2", megatron_training=True, pyyaml="6.0"),
                        root="/repo")
    assert todo.requirements == ["-e", "/repo[gpu]"]


def _readme_test_command():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    block = text[text.index("```bash"):]
    block = block[:block.index("```", 3)]
    lines = [ln for ln in block.splitlines() if "pytest" in ln]
    assert len(lines) == 1, lines
    return lines[0].strip()


def test_one_test_command_everywhere():
    """The README's test command is prepare_env's, uses its torch pin, and is the one every
    hint in examples/ prints; .ci/run installs the same torch."""
    command = _readme_test_command()
    assert command == prepare.TEST_COMMAND
    assert prepare.TORCH_PIN in command
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert prepare.TORCH_PIN in f.read()
    hints = []
    examples = os.path.join(ROOT, "examples")
    for folder, _, files in sorted(os.walk(examples)):
        for name in sorted(files):
            if name == "prepare_env.py":  # defines TEST_COMMAND (compared above)
                continue
            with open(os.path.join(folder, name), errors="replace") as f:
                hints += [(name, m)
                          for m in re.findall(r"[^'\n]*python -m pytest[^'\n]*", f.read())]
    for module in ("run.py", "network.py"):  # the benchmarks' no-GPU hints
        with open(os.path.join(ROOT, "megatron_deepep", "bench", module)) as f:
            text = f.read().replace('" "', "").replace('\\"', '"')
        hints += [(module, m) for m in re.findall(r"pip install torch[^'\n]*pytest[^'\n]*", text)]
    assert hints, "run_gpt_moe.sh names the test command"
    for name, hint in hints:
        assert prepare.TEST_COMMAND in hint, (name, hint)


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_cpu_demo_trains_deepep_beside_alltoall_with_the_same_losses(tmp_path):
    """... and writes the dispatcher's metrics on the CPU too (`MDEEP_METRICS=1
    MDEEP_METRICS_DIR`: one JSON line per step, deepep's run only)."""
    import json

    env = dict(os.environ, OMP_NUM_THREADS="1", MDEEP_METRICS="1",
               MDEEP_METRICS_DIR=str(tmp_path / "metrics"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         os.path.join(ROOT, "examples", "compare_dispatchers.py"), "--cpu", "--steps", "4",
         "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, process_failure(done)
    table = done.stdout[done.stdout.index("LM loss per step"):].splitlines()
    assert table[1].split() == ["step", "deepep", "alltoall", "|diff|"]
    rows = [ln.split() for ln in table[2:6]]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    losses = [(float(r[1]), float(r[2])) for r in rows]
    assert all(abs(a - b) < 1e-3 for a, b in losses), losses
    assert losses[-1][0] < losses[0][0]  # it learns
    lines = (tmp_path / "metrics" / "deepep_metrics_rank0.jsonl").read_text().splitlines()
    steps = [json.loads(ln) for ln in lines]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert {"comm_share", "idle_share_time", "tokens_dropped"} <= set(steps[0]["layers"]["1"])
    # The default runs name Megatron's fused-permute alltoall too; on the CPU it says why not.
    assert "alltoall (fused permute): skipped: Transformer Engine's fused permute" in done.stdout
    summary = json.loads((tmp_path / "step_times.json").read_text())
    assert list(summary["skipped"]) == ["alltoall-fused"]
    assert summary["labels"] == {"deepep": "deepep", "alltoall": "alltoall (unfused)",
                                 "alltoall-fused": "alltoall (fused permute)"}


def test_comparison_runs_alltoall_with_and_without_fused_permute(monkeypatch):
    """`--dispatchers` defaults to deepep and both alltoall baselines; the fused one is planned
    where TE's fused permute can run and skipped with the reason where it cannot."""
    example = _load("compare_dispatchers")
    args = example.parse_args([])
    assert example.run_names(args) == ["deepep", "alltoall-fused", "alltoall"]
    monkeypatch.setattr("megatron_deepep.megatron.baselines.permute_fusion_reason",
                        lambda device="cuda": f"no TE on {device}")
    runs, skipped = example.plan_runs(args)
    assert runs == ["deepep", "alltoall"] and skipped == {"alltoall-fused": "no TE on cuda"}
    monkeypatch.setattr("megatron_deepep.megatron.baselines.permute_fusion_reason",
                        lambda device="cuda": "")
    assert example.plan_runs(args) == (["deepep", "alltoall-fused", "alltoall"], {})
    results = {"deepep": ([3.0, 2.0], [0.01, 0.01]), "alltoall-fused": ([3.0, 2.2], [0.02] * 2),
               "alltoall": ([3.3, 2.0], [0.03] * 2)}
    summary = example.summarize(results, 2, 0, 1, "fake", {})
    assert summary["labels"]["alltoall-fused"] == "alltoall (fused permute)"
    diffs = summary["loss_diff_vs_first"]
    assert diffs["alltoall-fused"]["max_abs_loss_diff"] == pytest.approx(0.2)
    assert diffs["alltoall"]["max_rel_loss_diff"] == pytest.approx(0.1)


def test_cpu_comparison_alternates_the_order_and_pools_the_rounds():
    """`--cpu` runs two rounds, the second in reverse order, so that a load drifting during the
    comparison weighs on both dispatchers; the first round's warm-up steps are left out by
    `summarize`, later rounds' here."""
    example = _load("compare_dispatchers")
    assert example.parse_args(["--cpu"]).rounds == 2 and example.parse_args([]).rounds == 1
    assert example.round_orders(["deepep", "alltoall"], 3) == [
        ["deepep", "alltoall"], ["alltoall", "deepep"], ["deepep", "alltoall"]]
    first = ([3.0, 2.0, 1.0], [9.0, 1.0, 2.0])
    second = ([3.0, 2.0, 1.0], [8.0, 3.0, 4.0])
    losses, times = example.pool_rounds([first, second], warmup_steps=1)
    assert losses == first[0] and times == [9.0, 1.0, 2.0, 3.0, 4.0]
    summary = example.summarize({"deepep": (losses, times)}, 3, 1, 2, "cpu")
    assert summary["median_step_time_ms"]["deepep"] == pytest.approx(2500.0)
    with pytest.raises(SystemExit):
        example.parse_args(["--rounds", "0"])


def test_run_gpt_moe_maps_alltoall_fused_to_megatrons_flag():
    with open(os.path.join(ROOT, "examples", "run_gpt_moe.sh")) as f:
        text = f.read()
    assert 'DISPATCHER=alltoall PERMUTE_FLAGS=(--moe-permute-fusion)' in text
    assert '"${METRIC_FLAGS[@]}" "${PERMUTE_FLAGS[@]}" "$@"' in text


def test_supported_megatron_core_range_is_the_readmes():
    low, end = prepare.MEGATRON_CORE_MIN, prepare.MEGATRON_CORE_END
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert f"megatron-core {low[0]}.{low[1]} to {end[0]}.{end[1] - 1}" in text
    assert prepare.MEGATRON_CORE == f">={low[0]}.{low[1]},<{end[0]}.{end[1]}"
    with open(os.path.join(ROOT, "setup.py")) as f:  # the megatron extra: the same range
        assert f'"megatron-core{prepare.MEGATRON_CORE}"' in f.read()
