"""Shared fixtures of the GPU tier."""

from __future__ import annotations

import importlib.util
import warnings

import pytest


@pytest.fixture(autouse=True)
def _restore_dispatcher_defaults():
    """Each test starts from the option defaults the one before it found: a test's
    `set_default_options(...)` (e.g. FP8 dispatch) must not reach the next test's layers.
    Without megatron-core there are no options to restore (and the package cannot import):
    the kernel tests run all the same."""
    if importlib.util.find_spec("megatron") is None:
        yield
        return
    from megatron_deepep.megatron import options

    saved = dict(options._REGISTERED_OPTIONS)
    yield
    options._REGISTERED_OPTIONS.clear()
    options._REGISTERED_OPTIONS.update(saved)


@pytest.fixture(scope="module")
def megatron_env():
    """One rank of Megatron on GPU 0 (NCCL, model parallel 1) with the deepep dispatcher
    registered; torn down after the module."""
    pytest.importorskip("megatron.core")
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps

    from megatron_deepep.bench.layer_variants import init_megatron

    init_megatron("cuda")  # NCCL, TP = EP = 1, Megatron's CUDA seeds, deepep registered
    yield
    ps.destroy_model_parallel()


@pytest.fixture
def require_nvshmem():
    """Skips the test (with the reason) unless NVSHMEM can start here through torch and its
    wheel's device library is there to link against."""
    from megatron_deepep.kernels import nvshmem_link
    from megatron_deepep.transport import nvshmem_heap
    try:
        nvshmem_heap.check_available()
        nvshmem_link.nvshmem_paths()
    except nvshmem_link.NvshmemUnavailable as exc:
        pytest.skip(str(exc))
