"""GPU tier: Megatron's MoELayer with `deepep` at EP = R (R processes sharing the GPU, the
NVLink kernels) equals the same layer at EP = 1 (the local kernels) on the same tokens and
weights: outputs, input and router gradients, and every expert's weight gradient (the worker of
tests/test_parity_ep.py). R from `MDEEP_TEST_PROCS` (1 is skipped: nothing to compare). Needs
megatron-core (scripts/gpu_parity.sh installs the wheel from .whl/).
"""

from __future__ import annotations

import pytest

from megatron_deepep import knobs
from tests.distributed import run_distributed
from tests.test_parity_ep import ep_worker

pytestmark = pytest.mark.gpu

NUM_PROCS = [n for n in knobs.get("TEST_PROCS") if n > 1]


@pytest.mark.parametrize("num_procs", NUM_PROCS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_layer_at_ep_r_matches_ep_1(num_procs, dtype):
    run_distributed(num_procs, ep_worker, dtype, "cuda", "auto", timeout_s=300)
