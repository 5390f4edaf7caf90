"""`examples/balance_demo.py` on GPU: the same two runs with the GPU transports (`auto`: the
NVLink kernels for the 4 ranks), CUDA tensors for the model, the same thresholds as the CPU
test (`tests/project/test_balance_demo.py`)."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed, tier_backend
from tests.project.test_balance_demo import check_line, load_demo

pytestmark = pytest.mark.gpu


def _worker(rank, world, out_path):
    from tests.helpers.distributed import use_rank_device

    use_rank_device(rank)
    line = load_demo().run(rank, world, ["--device", "cuda"])
    if rank == 0:
        with open(out_path, "w", encoding="utf-8") as f:
            f.write(line + "\n")


def test_balance_demo_on_gpu(tmp_path):
    out = tmp_path / "line.txt"
    run_distributed(4, _worker, str(out), backend=tier_backend(), timeout_s=600)
    check_line(out.read_text().strip())
