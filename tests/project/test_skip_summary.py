"""CPU tier: on a machine without a CUDA GPU the GPU tier's skips are one summary line (how
many, and why), not one line per test."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO_ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here: GPU tests run")
def test_gpu_skips_fold_into_one_summary_line():
    files = ["tests/gpu/test_layout_gpu.py", "tests/gpu/test_te_gpu.py",
             "tests/gpu/test_fp8_gpu.py"]  # marked by the conftest, by TE_GPU, by their own
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           *files], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert done.returncode == 0, done.stdout[-3000:]
    lines = [line for line in done.stdout.splitlines() if "GPU" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("SKIPPED [") and "tests/conftest.py" in lines[0]
    assert "needs a CUDA GPU" in lines[0] and "python -m pytest -m gpu tests/gpu" in lines[0]
