"""Shared fixtures of the GPU tier."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.distributed import free_port


@pytest.fixture(scope="module")
def megatron_env():
    """One rank of Megatron on GPU 0 (NCCL, model parallel 1) with the deepep dispatcher
    registered; torn down after the module."""
    pytest.importorskip("megatron.core")
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(123)
    import megatron_deepep.megatron as mdm

    mdm.register_deepep_dispatcher()
    yield
    ps.destroy_model_parallel()


@pytest.fixture
def require_nvshmem():
    """Skips the test (with the reason) unless NVSHMEM can start here through torch and its
    wheel's device library is there to link against."""
    from megatron_deepep import nvshmem_link
    from megatron_deepep.transport import nvshmem_heap
    try:
        nvshmem_heap.check_available()
        nvshmem_link.nvshmem_paths()
    except nvshmem_link.NvshmemUnavailable as exc:
        pytest.skip(str(exc))
