"""CPU tier: the NVSHMEM heap's errors say what is missing and how to fall back."""

from __future__ import annotations

import pytest
import torch

from megatron_deepep.kernels import nvshmem_link
from megatron_deepep.kernels.nvshmem_link import NvshmemUnavailable
from megatron_deepep.transport import nvshmem_heap


def test_torch_calls_exist_in_this_torch():
    # The Python names nvshmem_heap relies on (torch >= 2.11); a rename must fail here, not on
    # a GPU machine.
    symm_mem = nvshmem_heap._symm_mem()
    assert callable(symm_mem.set_backend) and callable(symm_mem.empty)


def test_torch_built_without_nvshmem_says_so(monkeypatch):
    monkeypatch.delattr(torch._C._distributed_c10d, "_nvshmemx_cumodule_init", raising=False)
    with pytest.raises(NvshmemUnavailable, match="built without NVSHMEM.*transport='reference'"):
        nvshmem_link.init_module(0)


def test_no_cuda_names_the_fallback(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NvshmemUnavailable, match="transport='reference'"):
        nvshmem_heap.SymmetricHeap(0)


def test_torch_without_nvshmem_names_what_is_missing(monkeypatch):
    import torch.distributed._symmetric_memory as symm_mem
    monkeypatch.delattr(symm_mem, "set_backend")
    with pytest.raises(NvshmemUnavailable) as info:
        nvshmem_heap._symm_mem()
    assert "set_backend" in str(info.value) and "transport='reference'" in str(info.value)


def test_nvshmem_library_missing_names_pip_packages(monkeypatch):
    import torch.distributed._symmetric_memory as symm_mem
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(symm_mem, "is_nvshmem_available", lambda: False)
    monkeypatch.setattr(torch._C._distributed_c10d, "_nvshmemx_cumodule_init", lambda m: None,
                        raising=False)
    with pytest.raises(NvshmemUnavailable) as info:
        nvshmem_heap.check_available()
    assert "pip install nvidia-nvshmem-cu13" in str(info.value)
    assert "transport='reference'" in str(info.value)


@pytest.mark.parametrize("block, expected", [(0, 1 << 30), (100 << 20, 1 << 30),
                                             (513 << 20, 3 << 29), (int(2.0e9), 5 << 29),
                                             (int(9.45e9), 19 << 29)])
def test_heap_bytes_for_a_block(block, expected):
    """Block + 512 MiB headroom in 512 MiB granules, never below NVSHMEM's 1 GiB default."""
    assert nvshmem_heap.heap_bytes_for(block) == expected


def test_an_unset_heap_size_is_set_before_nvshmem_starts(monkeypatch):
    """A job without the templates' NVSHMEM_SYMMETRIC_SIZE gets one sized for its block; a set
    value is kept; once this process allocated symmetric memory (NVSHMEM read its size), the
    variable is left alone."""
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE", raising=False)
    monkeypatch.setattr(nvshmem_heap, "_started", False)
    block = int(2.0e9)  # ring staging at 8 x 8 nodes, DeepSeek-V3's shape
    assert nvshmem_heap.heap_limit() == 1 << 30
    assert nvshmem_heap.size_heap_for(block) == 5 << 29
    assert nvshmem_heap.heap_limit() == 5 << 29 > block
    assert nvshmem_heap.size_heap_for(4 * block) is None  # set now: kept
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "2G")
    assert nvshmem_heap.size_heap_for(block) is None and nvshmem_heap.heap_limit() == 2 << 30
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE")
    monkeypatch.setattr(nvshmem_heap, "_started", True)
    assert nvshmem_heap.size_heap_for(block) is None
    assert nvshmem_heap.heap_limit() == 1 << 30
