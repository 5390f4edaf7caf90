#!/usr/bin/env python3
"""The set-up step of `examples/run_gpt_moe.sh`: looks for GPUs, then installs what the job needs.

Standard library only (it runs before torch is installed). It says on stderr what it found (the
Python, the GPUs, the installed torch and megatron-core) and which path the job takes before it
installs anything, installs only what is missing, into this Python's environment, with pip, and
prints one line on stdout for the launcher: `<path> <number of GPUs torch sees>`, where path is

    megatron-training  GPUs and `megatron.training` (the megatron-core wheels ship it from 0.17
                       on, Python >= 3.12; or a Megatron-LM checkout in MEGATRON_LM):
                       examples/pretrain_gpt_moe.py under torchrun, EP = number of GPUs
    megatron-core      GPUs, megatron-core alone (0.16 on Python 3.10 and 3.11):
                       examples/compare_dispatchers.py under torchrun
    cpu-demo           no GPU: examples/compare_dispatchers.py --cpu, 2 gloo ranks, deepep on
                       the pure-torch reference transport beside Megatron's alltoall

    python examples/prepare_env.py              # what run_gpt_moe.sh runs
    INSTALL=0 python examples/prepare_env.py    # decide only; install nothing

What it installs when missing: torch pinned as for the tests (`TORCH_PIN`; an installed torch
is kept; without a GPU the CPU build, from PyTorch's CPU index `CPU_TORCH_INDEX`, and pip's
default torch, one line saying so, where that index cannot be reached), megatron-core in the
supported range (`MEGATRON_CORE`, with `megatron.training` where the Python allows), pyyaml
for `megatron.training`, matplotlib (the loss plot and the metrics report's PNGs), and on GPUs
this package with its `gpu` extra (NVRTC and the CUDA wheels the kernels compile and link with).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys

#: The tests' torch (README's test command, .ci/run); installed when torch is missing.
TORCH_PIN = "torch==2.13.0"
#: Without a GPU, torch comes from PyTorch's index of CPU builds: on Linux x86-64 pip's default
#: torch is the CUDA build, about 3 GB with its CUDA libraries.
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
#: Supported megatron-core releases; `megatron.training` ships in the wheels from 0.17 on, which
#: need Python >= 3.12.
MEGATRON_CORE = ">=0.16,<0.20"
MEGATRON_CORE_MIN, MEGATRON_CORE_END = (0, 16), (0, 20)
TRAINING_MIN = (0, 17)
TRAINING_PYTHON = (3, 12)
PYTHONS = ((3, 10), (3, 13))  # first and last supported
#: The one test command (README, and every hint that names it); run from the repository root.
TEST_COMMAND = ('pip install torch==2.13.0 -e ".[jit,test,megatron]" && '
                'python -m pytest -q -rs tests')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def say(message: str) -> None:
    print(f"run_gpt_moe.sh: {message}", file=sys.stderr, flush=True)


def version_tuple(version: str | None) -> tuple | None:
    """`"0.19.2"` -> `(0, 19, 2)`; leading numbers only (`"2.13.0+cpu"` -> `(2, 13, 0)`)."""
    if version is None:
        return None
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def find_gpus() -> tuple[int, str]:
    """(number of GPUs, how it was seen), from `nvidia-smi -L` and nothing that needs torch."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, "none (no nvidia-smi on PATH)"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 0, f"none (nvidia-smi failed: {exc})"
    gpus = [ln for ln in out.stdout.splitlines() if ln.startswith("GPU ")]
    if out.returncode != 0 or not gpus:
        reason = (out.stderr or out.stdout).strip().splitlines()[:1]
        return 0, "none (nvidia-smi: " + (reason[0] if reason else "no GPU listed") + ")"
    names = sorted({ln.split(":", 1)[1].split("(UUID")[0].strip() for ln in gpus})
    return len(gpus), f"{len(gpus)} x {', '.join(names)} (nvidia-smi)"


@dataclasses.dataclass
class Found:
    """What this environment has (None: not installed)."""

    python: tuple
    num_gpus: int
    torch: str | None
    megatron_core: str | None
    megatron_training: bool  # importable now (a wheel >= 0.17, or MEGATRON_LM on PYTHONPATH)
    pyyaml: str | None
    nvrtc: bool  # NVRTC loads through cuda.bindings
    matplotlib: str | None  # draws the loss plot and the metrics PNGs


@dataclasses.dataclass
class Plan:
    path: str  # megatron-training, megatron-core or cpu-demo
    requirements: list  # pip install arguments; empty: nothing to install
    notes: list  # what the user should know about the choice
    torch_index: str = ""  # the index TORCH_PIN comes from ("": pip's own)


def plan(found: Found, root: str = ROOT) -> Plan:
    """What to install and which path to take, from what is found (no side effects)."""
    reqs, notes = [], []
    if found.torch is None:
        reqs.append(TORCH_PIN)
    elif found.torch.split("+")[0] != TORCH_PIN.split("==")[1]:
        notes.append(f"keeping the installed torch {found.torch} (the tests pin {TORCH_PIN})")
    core = version_tuple(found.megatron_core)
    training_python = found.python >= TRAINING_PYTHON
    will_train = found.num_gpus > 0 and (found.megatron_training or (
        training_python and (core is None or core >= TRAINING_MIN)))
    if core is not None and not MEGATRON_CORE_MIN <= core[:2] < MEGATRON_CORE_END:
        notes.append(f"megatron-core {found.megatron_core} is not supported: installing "
                     f"megatron-core{MEGATRON_CORE}")
        core = None
    if core is None and not found.megatron_training:
        if found.num_gpus > 0 and training_python:
            reqs.append(f"megatron-core>={'.'.join(map(str, TRAINING_MIN))},<"
                        f"{'.'.join(map(str, MEGATRON_CORE_END))}")
        else:
            reqs.append(f"megatron-core{MEGATRON_CORE}")
    plotting = ["matplotlib"] if found.matplotlib is None else []
    if found.num_gpus == 0:
        return Plan("cpu-demo", reqs + plotting, notes,
                    CPU_TORCH_INDEX if found.torch is None else "")
    if will_train and found.pyyaml is None:
        reqs.append("pyyaml")  # megatron.training imports it
    if reqs or not found.nvrtc:
        reqs += ["-e", f"{root}[gpu]"]
    reqs += plotting
    if not will_train:
        if training_python:
            notes.append(f"megatron-core {found.megatron_core} has no megatron.training "
                         f"(0.17+ has): pip install 'megatron-core>=0.17,<0.20' pyyaml, or set "
                         f"MEGATRON_LM=/path/to/Megatron-LM")
        else:
            notes.append(f"Python {'.'.join(map(str, found.python[:2]))} takes megatron-core "
                         f"0.16 at most, which has no megatron.training (0.17+ needs Python "
                         f">= 3.12): training on megatron-core alone; set "
                         f"MEGATRON_LM=/path/to/Megatron-LM for megatron.training")
    return Plan("megatron-training" if will_train else "megatron-core", reqs, notes)


def _python_ok(code: str) -> bool:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300)
    return done.returncode == 0


def _has_megatron_training(num_gpus: int) -> bool:
    """On GPUs: `megatron.training` imports (it is what trains); without: it is there (the CPU
    demonstration does not use it, and importing it takes seconds)."""
    if importlib.util.find_spec("megatron") is None:
        return False
    if num_gpus == 0:
        return importlib.util.find_spec("megatron.training") is not None
    return _python_ok("import megatron.training")


def look() -> Found:
    num_gpus, seen = find_gpus()
    say(f"Python {sys.version.split()[0]} ({sys.executable})")
    say(f"GPUs: {seen}")
    return Found(
        python=sys.version_info[:3], num_gpus=num_gpus, torch=installed("torch"),
        megatron_core=installed("megatron-core"),
        megatron_training=_has_megatron_training(num_gpus),
        pyyaml=installed("pyyaml") or installed("PyYAML"),
        matplotlib=installed("matplotlib"),
        nvrtc=num_gpus > 0 and _python_ok(
            "from cuda.bindings import nvrtc; assert nvrtc.nvrtcVersion()[0] == 0"))


PATHS = {
    "megatron-training": "train the GPT-MoE with megatron.training (examples/pretrain_gpt_moe.py)",
    "megatron-core": "train the GPT-MoE on megatron-core alone "
                     "(examples/compare_dispatchers.py)",
    "cpu-demo": "no GPU, so a CPU run: the tiny GPT-MoE (or the model of the flags given), a "
                "few steps on 2 gloo ranks, deepep (reference transport) beside alltoall",
}


def index_unreachable(url: str, timeout_s: float = 15.0) -> str:
    """Why the package index at `url` does not answer ("" when it does)."""
    import urllib.request

    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout_s):
            return ""
    except (OSError, ValueError) as exc:  # urllib's URLError and HTTPError are OSErrors
        return str(getattr(exc, "reason", None) or exc)


def _pip(args: list) -> None:
    cmd = [sys.executable, "-m", "pip", "install", *args]
    done = subprocess.run(cmd, stdout=sys.stderr)  # stdout carries only the result line
    if done.returncode != 0:
        say(f"pip failed (exit {done.returncode}): {' '.join(cmd)}\n    In a system Python pip "
            "may refuse to install: make a virtual environment first, e.g. python3 -m venv "
            ".venv && . .venv/bin/activate, then run bash examples/run_gpt_moe.sh again.")
        raise SystemExit(1)


def pip_install(todo: Plan) -> None:
    """Installs `todo.requirements`; TORCH_PIN first from `todo.torch_index` when it answers."""
    requirements = list(todo.requirements)
    if todo.torch_index and TORCH_PIN in requirements:
        why = index_unreachable(todo.torch_index)
        if not why:
            say(f"installing {TORCH_PIN}, the CPU build, from {todo.torch_index}")
            _pip([TORCH_PIN, "--index-url", todo.torch_index])
            requirements.remove(TORCH_PIN)
        else:
            say(f"PyTorch's CPU index {todo.torch_index} cannot be reached ({why}): installing "
                f"pip's default {TORCH_PIN} (on Linux x86-64 the CUDA build, about 3 GB)")
    if not requirements:
        return
    big = TORCH_PIN in requirements and not todo.torch_index
    say("installing: " + " ".join(requirements) + (
        f"\n    (torch is not installed: pip's {TORCH_PIN} for Linux x86-64 is the CUDA build, "
        "about 3 GB with its CUDA libraries, unless pip finds a local wheel)" if big else ""))
    _pip(requirements)


def torch_gpus() -> int:
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, "
                           "torch.cuda.device_count() if torch.cuda.is_available() else 0)"],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        say("torch does not import:\n" + done.stderr[-2000:])
        raise SystemExit(1)
    version, count = done.stdout.split()[-2:]
    say(f"torch {version} sees {count} CUDA device(s)")
    return int(count)


def main() -> int:
    if not PYTHONS[0] <= sys.version_info[:2]:
        say(f"Python {sys.version.split()[0]} is too old: this package needs Python "
            f"{PYTHONS[0][0]}.{PYTHONS[0][1]} or newer")
        return 2
    if sys.version_info[:2] > PYTHONS[1]:
        say(f"Python {sys.version.split()[0]} is newer than the last tested one "
            f"({PYTHONS[1][0]}.{PYTHONS[1][1]}): trying anyway")
    found = look()
    say(f"installed: torch {found.torch or '-'}, megatron-core {found.megatron_core or '-'}"
        f"{' (megatron.training importable)' if found.megatron_training else ''}")
    todo = plan(found)
    say(f"path: {todo.path}: {PATHS[todo.path]}")
    for note in todo.notes:
        say(note)
    if todo.requirements:
        if os.environ.get("INSTALL", "1") == "0":
            say("INSTALL=0: not installing " + " ".join(todo.requirements))
        else:
            pip_install(todo)
    else:
        say("nothing to install")
    num_gpus = torch_gpus()
    path = todo.path
    if path != "cpu-demo" and num_gpus == 0:
        say("nvidia-smi lists GPUs but torch sees none (a CPU build of torch, or "
            "CUDA_VISIBLE_DEVICES?): running the CPU demonstration instead")
        path = "cpu-demo"
    if path == "megatron-training" and not _python_ok("import megatron.training"):
        say("megatron.training does not import: training on megatron-core alone")
        path = "megatron-core"
    print(path, num_gpus)
    return 0


if __name__ == "__main__":
    sys.exit(main())
