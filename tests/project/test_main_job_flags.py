"""CPU tier: the main job's own flags (`bash examples/run_gpt_moe.sh ...`), checked before the
environment is probed: `-h` / `--help`, `--moe-token-dispatcher-type` (the user's value wins, a
bad one is one line naming the choices, exit 2), `--flag=value`; and its CPU torch comes from
PyTorch's CPU index, or pip's default with one line where that index cannot be reached."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "examples", "run_gpt_moe.sh")
sys.path.insert(0, os.path.join(REPO_ROOT, "examples"))
import megatron_flags  # noqa: E402  (examples/megatron_flags.py)
import prepare_env  # noqa: E402  (examples/prepare_env.py)

HAS_MEGATRON = importlib.util.find_spec("megatron") is not None


def _job(*flags, **env):
    """Runs the main job with nothing installed (INSTALL=0) and `env` over this one's."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("MDEEP_")}
    full.update(PYTHONPATH=REPO_ROOT, INSTALL="0", PYTHON=sys.executable, **env)
    return subprocess.run(["bash", SCRIPT, *flags], env=full, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_prints_the_usage_and_exits_0(flag):
    done = _job("--num-experts", "8", flag)
    assert done.returncode == 0, done.stderr
    assert "--moe-token-dispatcher-type" in done.stdout and "alltoall" in done.stdout
    assert "bash examples/run_gpt_moe.sh" in done.stdout
    assert not any(line.startswith("#") for line in done.stdout.splitlines()), done.stdout
    assert "GPUs:" not in done.stderr  # nothing was probed


@pytest.mark.parametrize("flags", [["--moe-token-dispatcher-type", "deeepep"],
                                   ["--moe-token-dispatcher-type=DeepEP"]])
def test_a_bad_dispatcher_is_one_line_naming_the_choices(flags):
    done = _job(*flags)
    assert done.returncode == 2
    lines = (done.stdout + done.stderr).strip().splitlines()
    value = flags[-1].split("=")[-1]
    assert lines == [f"run_gpt_moe.sh: --moe-token-dispatcher-type {value!r}: expected one of "
                     f"deepep, alltoall, alltoall-fused; did you mean deepep?"], lines


def test_a_bad_dispatcher_variable_is_named():
    done = _job(DISPATCHER="all2all")
    assert done.returncode == 2
    assert done.stderr.strip().startswith("run_gpt_moe.sh: DISPATCHER='all2all': expected one "
                                          "of deepep, alltoall"), done.stderr


def test_the_flag_wins_over_the_variable_and_leaves_the_others():
    dispatcher, rest, note = megatron_flags.job_flags(
        ["--num-experts=8", "--moe-token-dispatcher-type", "alltoall", "--swiglu"], "deepep")
    assert (dispatcher, rest) == ("alltoall", ["--num-experts", "8", "--swiglu"])
    assert note == "--moe-token-dispatcher-type alltoall from the command line (over " \
                   "DISPATCHER=deepep)"
    assert megatron_flags.job_flags([], "") == ("deepep", [], "")


def test_flag_equals_value_is_one_flag():
    assert megatron_flags.split(["--num-experts=8", "--swiglu", "--lr", "1e-3"]) == [
        ("--num-experts", "8"), ("--swiglu", True), ("--lr", "1e-3")]


@pytest.mark.skipif(not HAS_MEGATRON, reason="needs megatron-core")
def test_flag_equals_value_reaches_the_config():
    flags = megatron_flags.parse(["--num-experts=16", "--moe-router-topk=4",
                                  "--moe-token-dispatcher-type=alltoall"])
    assert flags.args == {"num_experts": 16, "topk": 4}
    assert "moe_token_dispatcher_type" not in flags.config  # each run sets its own
    assert flags.dropped[0][0] == "--moe-token-dispatcher-type"


@pytest.mark.skipif(not HAS_MEGATRON, reason="needs megatron-core")
def test_a_mistyped_flag_is_refused_before_the_environment_is_probed():
    done = _job("--num-expert=8")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(
        "run_gpt_moe.sh: --num-expert is no TransformerConfig field"), done.stderr
    assert "GPUs:" not in done.stderr, done.stderr  # prepare_env.py never ran


@pytest.mark.skipif(not HAS_MEGATRON, reason="needs megatron-core")
def test_the_main_job_takes_the_dispatcher_flag_on_the_cpu(tmp_path):
    done = _job("--moe-token-dispatcher-type=alltoall", OUT=str(tmp_path), CPU_TRAIN_ITERS="2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "run_gpt_moe.sh: --moe-token-dispatcher-type alltoall from the command line" \
        in done.stderr.splitlines()
    assert "[alltoall] step" in done.stdout and "[deepep] step" in done.stdout, done.stdout


def _found(**kw):
    base = dict(python=(3, 11, 7), num_gpus=0, torch=None, megatron_core="0.16.1",
                megatron_training=False, pyyaml=None, nvrtc=False, matplotlib="3.10.0")
    base.update(kw)
    return prepare_env.Found(**base)


def test_without_a_gpu_torch_comes_from_the_cpu_index():
    assert prepare_env.plan(_found()).torch_index == prepare_env.CPU_TORCH_INDEX
    assert prepare_env.plan(_found(num_gpus=8)).torch_index == ""
    assert prepare_env.plan(_found(torch="2.13.0+cpu")).torch_index == ""


@pytest.mark.parametrize("unreachable", ["", "Name or service not known"])
def test_the_cpu_torch_install_and_its_fallback(monkeypatch, capsys, unreachable):
    calls = []
    monkeypatch.setattr(prepare_env, "index_unreachable", lambda url: unreachable)
    monkeypatch.setattr(prepare_env, "_pip", calls.append)
    prepare_env.pip_install(prepare_env.plan(_found()))
    said = capsys.readouterr().err.strip().splitlines()
    if not unreachable:
        assert calls == [[prepare_env.TORCH_PIN, "--index-url", prepare_env.CPU_TORCH_INDEX]]
    else:
        assert calls == [[prepare_env.TORCH_PIN]]
        assert said[0] == (f"run_gpt_moe.sh: PyTorch's CPU index {prepare_env.CPU_TORCH_INDEX} "
                           f"cannot be reached (Name or service not known): installing pip's "
                           f"default {prepare_env.TORCH_PIN} (on Linux x86-64 the CUDA build, "
                           f"about 3 GB)")
        assert len(said) == 2  # and the install line


def test_an_unreachable_index_is_said_not_raised():
    assert prepare_env.index_unreachable("http://127.0.0.1:9", timeout_s=5.0) != ""


def test_a_missing_expert_map_is_one_line_naming_the_variable():
    done = _job(MDEEP_EXPERT_MAP="/nonexistent/plan.json")
    assert done.returncode == 2
    assert (done.stdout + done.stderr).strip().splitlines() == [
        "megatron_deepep: MDEEP_EXPERT_MAP='/nonexistent/plan.json': cannot read that file (No "
        "such file or directory)"], done.stderr
