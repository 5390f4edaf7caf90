"""Expert copies on different EP ranks under Megatron's own DDP and optimizer, on the GPU.

EP = 2 with the map `[0, 1, 2 | 0, 3, 1]` (one copy of an expert per rank: experts 0 and 1
have a copy on each rank, expert 1 at different local slots), 2 processes sharing the GPU (gloo
is the control plane, the NVLink kernels move the tokens; `MDEEP_TEST_BACKEND=nccl`: one process
per GPU). Wrapped in Megatron's `DistributedDataParallel` (the plugin's `finish_grad_sync` sums
the copies' `main_grad`s over the EP group) and stepped by `get_megatron_optimizer`'s bf16 Adam
with gradient clipping, the copies' `main_grad`s after every `finalize_model_grads` and their
weights after every step, gathered over gloo, are bit-identical across the ranks over several
steps, with the ordinary and with the distributed optimizer (one expert data-parallel rank:
served). The worker is tests/megatron/test_replica_experts_ddp.py's, which the CPU tier runs with
the reference transport.
"""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed, tier_backend

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_copies_on_two_ranks_stay_identical_under_megatron_ddp_and_optimizer(
        distributed_optimizer):
    pytest.importorskip("megatron.core")
    from tests.megatron.test_replica_experts_ddp import EP, ddp_worker

    run_distributed(EP, ddp_worker, distributed_optimizer, "cuda", "auto",
                    backend=tier_backend(), timeout_s=300)
