"""GPU tier: Megatron's MoELayer with `deepep` at EP = R (R processes sharing the GPU, the
NVLink kernels) equals the same layer at EP = 1 (the local kernels) on the same tokens and
weights: outputs, input and router gradients, and every expert's weight gradient (the worker of
tests/megatron/test_parity_ep.py). R from `MDEEP_TEST_PROCS` (1 is skipped: nothing to compare);
with
`MDEEP_TEST_BACKEND=nccl` one process per GPU, Megatron's groups over NCCL. Needs
megatron-core (dev/gpu/gpu_parity.sh installs the wheel from .whl/).
"""

from __future__ import annotations

import pytest

from megatron_deepep import knobs
from tests.helpers import knobs as test_knobs
from tests.helpers.distributed import run_distributed, tier_backend
from tests.megatron.test_parity_ep import ep_worker

pytestmark = pytest.mark.gpu

NUM_PROCS = [n for n in test_knobs.get("TEST_PROCS") if n > 1]


def _both_dtypes(rank, world):
    for dtype in ("bf16", "fp32"):
        ep_worker(rank, world, dtype, "cuda", "auto")


@pytest.mark.parametrize("num_procs", NUM_PROCS)
def test_layer_at_ep_r_matches_ep_1(num_procs):
    """bf16 and fp32 layers, one job per R."""
    run_distributed(num_procs, _both_dtypes, backend=tier_backend(), timeout_s=300)
