"""CPU tier: the NVSHMEM heap's errors say what is missing and how to fall back."""

from __future__ import annotations

import pytest
import torch

from megatron_deepep import nvshmem_link
from megatron_deepep.nvshmem_link import NvshmemUnavailable
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
