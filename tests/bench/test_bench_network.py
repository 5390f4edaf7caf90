"""CPU tier: `python -m megatron_deepep.bench.network` explains itself and refuses a CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


def test_help_names_every_argument():
    out = subprocess.run([sys.executable, "-m", "megatron_deepep.bench.network", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for flag in ("--nodes", "--ranks-per-node", "--sizes-kib", "--rounds", "--warmup",
                 "--blocks", "--out"):
        assert flag in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU machine")
def test_without_a_gpu_it_says_what_to_run():
    done = subprocess.run([sys.executable, "-m", "megatron_deepep.bench.network"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "python -m pytest -q -rs tests" in done.stderr
