"""CPU tier: `examples/pretrain_gpt_moe.py` against the installed `megatron.training`.

It ships in the megatron-core wheels from 0.17 on (Python >= 3.12): CI's Python 3.12 leg runs
these with 0.19.x; with 0.16 (the 3.11 leg) the model tests skip (the launcher parsing runs
everywhere). In a fresh interpreter: the
launchers' own flags (one GPU) parse and validate with ours added, the example's call binds to
this version's `pretrain`, and its model provider builds the GPT-MoE (on the CPU) with
`DeepEPTokenDispatcher` in every MoE layer and our flag's value in the dispatcher's options.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from tests.helpers import REPO_ROOT, process_failure

ROOT = REPO_ROOT

needs_training = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.training") is None,
    reason="megatron.training is not installed (megatron-core < 0.17 wheel, no Megatron-LM "
           "checkout on the path)")


LAUNCHERS = ("run_gpt_moe.sh", "slurm_gpt_moe.sbatch")


def launcher_flags(launcher: str = "run_gpt_moe.sh", num_gpus: int = 1,
                   out: str = "runs/test") -> list:
    """The Megatron flags `examples/<launcher>` passes to the example, on `num_gpus` GPUs of one
    node (shell defaults filled in)."""
    with open(os.path.join(ROOT, "examples", launcher)) as f:
        text = f.read().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines()
                if "pretrain_gpt_moe.py" in ln and not ln.lstrip().startswith("#"))
    line = re.split(r'pretrain_gpt_moe\.py"?', line, maxsplit=1)[1]
    line = re.split(r'"\$\{METRIC_FLAGS\[@\]\}"|" 2>&1', line, maxsplit=1)[0]
    values = {"NGPU": num_gpus, "GPUS_PER_NODE": num_gpus, "NNODES": 1, "EP": num_gpus,
              "DISPATCHER": "deepep", "OUT": out}

    def arithmetic(match):  # $((4 * NGPU)) and the like: products of numbers and names
        product = 1
        for factor in match.group(1).split("*"):
            factor = factor.strip()
            product *= int(values.get(factor, factor))
        return str(product)

    line = re.sub(r"\$\(\((.*?)\)\)", arithmetic, line)
    line = re.sub(r"\$\{([A-Z_]+):-(\d+)\}", lambda m: m.group(2), line)  # ${TRAIN_ITERS:-50}
    line = re.sub(r"\$\{?([A-Z_]+)\}?", lambda m: str(values[m.group(1)]), line)
    return shlex.split(line)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_launcher_flags_are_read_from_the_script(launcher):
    flags = launcher_flags(launcher, num_gpus=2)
    assert flags[flags.index("--moe-token-dispatcher-type") + 1] == "deepep"
    assert flags[flags.index("--expert-model-parallel-size") + 1] == "2"
    assert flags[flags.index("--global-batch-size") + 1] == "8"
    assert "--no-rope-fusion" in flags and "--no-persist-layer-norm" in flags
    assert not any("$" in flag for flag in flags), flags


_CHILD = r"""
import importlib.util, inspect, json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch
import torch.distributed as dist

spec = importlib.util.spec_from_file_location("pretrain_gpt_moe", sys.argv[1])
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
from megatron.training import training

sys.argv = ["pretrain_gpt_moe.py"] + json.loads(sys.argv[2])
report = {"config_container": example.uses_config_container(training.pretrain)}
call_args, call_kwargs = example.pretrain_call(training.pretrain)  # what main() passes
inspect.signature(training.pretrain).bind(*call_args, **call_kwargs)
if report["config_container"]:
    from megatron.training.global_vars import get_args
    args = get_args()
else:  # this pretrain parses the flags itself
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables
    args = parse_args(call_kwargs["extra_args_provider"])
    validate_args(args, call_kwargs["args_defaults"])
    set_global_variables(args)
report["dispatcher_type"] = args.moe_token_dispatcher_type
report["moe_mdeep_num_sms"] = args.moe_mdeep_num_sms

dist.init_process_group("gloo", rank=0, world_size=1)
from megatron.core import parallel_state
parallel_state.initialize_model_parallel()
args.use_cpu_initialization = True
model = example.model_provider(pre_process=True, post_process=True)
dispatchers = [m.token_dispatcher for m in model.modules() if hasattr(m, "token_dispatcher")]
report["dispatchers"] = [type(d).__name__ for d in dispatchers]
report["num_sms"] = sorted({d.options.num_sms for d in dispatchers})
print("REPORT " + json.dumps(report))
"""


def build_in_child(flags: list, port: int) -> dict:
    """Parses `flags` with the example's arguments and builds its model in a fresh one-rank
    interpreter (`_CHILD`); returns the child's report."""
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", _CHILD,
                           os.path.join(ROOT, "examples", "pretrain_gpt_moe.py"),
                           json.dumps(flags)], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")]
    assert done.returncode == 0 and lines, process_failure(done)
    return json.loads(lines[-1][len("REPORT "):])


@needs_training
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_example_parses_binds_and_builds_the_model(launcher, tmp_path):
    flags = launcher_flags(launcher, out=str(tmp_path))
    flags += ["--moe-mdeep-num-sms", "16", "--use-cpu-initialization"]
    flags.remove("--bf16")  # the CPU build; the flag itself is checked by the parse above
    report = build_in_child(flags, 29617)
    assert report["dispatcher_type"] == "deepep"
    assert report["moe_mdeep_num_sms"] == 16
    assert report["dispatchers"] == ["DeepEPTokenDispatcher"] * 4  # one per MoE layer
    assert report["num_sms"] == [16]


_HELPERS_CHILD = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("pretrain_gpt_moe", sys.argv[1])
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
skipped = example.use_prebuilt_dataset_helpers()
from megatron.core.datasets.utils import compile_helpers  # what megatron.training calls
compile_helpers()
print("HELPERS skipped=%s" % skipped)
"""


@needs_training
def test_example_start_up_does_not_build_prebuilt_dataset_helpers():
    """The wheels ship `helpers_cpp` built but not its Makefile: Megatron's start-up `make` fails
    and exits training (seen on the H200 with 0.19.2), unless the example skips the build."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", _HELPERS_CHILD,
                           os.path.join(ROOT, "examples", "pretrain_gpt_moe.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "HELPERS skipped=" in done.stdout
