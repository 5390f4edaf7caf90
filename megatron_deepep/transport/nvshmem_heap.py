"""NVSHMEM's host side for the network leg: bootstrap, the symmetric heap, module init.

torch's symmetric memory with the NVSHMEM backend starts NVSHMEM (through the default process
group's store) at the first symmetric allocation and owns the heap, so nothing here needs an
NVSHMEM install step or a compiled extension:

1. `SymmetricHeap(device)` selects the NVSHMEM backend (`symm_mem.set_backend("NVSHMEM")`).
2. `heap.empty(shape, dtype)` allocates on the symmetric heap (`symm_mem.empty`). Allocation is
   collective: every PE makes the same allocations, same sizes, same order. The tensor's
   `data_ptr()` is a symmetric address valid for the device API on every PE.
3. kernels come from `nvshmem_link.get_kernel`, which links, loads and inits their module
   (`torch._C._distributed_c10d._nvshmemx_cumodule_init`: fills its NVSHMEM device state).

Never call `symm_mem.rendezvous` (nor torch's NVSHMEM collectives, which need it): it splits an
NVSHMEM team, and in NVSHMEM's limited several-processes-per-GPU mode (how the tests model nodes
on one GPU) a team split, host barrier or host collective exits the process. The control plane
runs over torch.distributed instead.

Errors say what is missing (a torch without NVSHMEM symmetric memory, the NVSHMEM wheel, CUDA)
and how to fall back: transport='reference' works everywhere.
"""

from __future__ import annotations

import logging
import os
import re
from typing import List, Optional, Sequence, Union

import torch

from megatron_deepep.kernels.nvshmem_link import (PIP_PACKAGES, NvshmemUnavailable,
                                                 check_host_library, cumodule_init)

logger = logging.getLogger(__name__)

_FALLBACK = "or use transport='reference', which works without NVSHMEM"


def _symm_mem():
    """torch's symmetric-memory module, checked for every call this module makes.

    Raises:
        NvshmemUnavailable: this torch has no NVSHMEM symmetric memory (the message names what
            is missing, the torch version and the fallback).
    """
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as exc:
        raise NvshmemUnavailable(
            f"megatron_deepep: torch {torch.__version__} has no symmetric memory "
            f"(torch.distributed._symmetric_memory: {exc}); the internode transport needs "
            f"torch >= 2.11 built for CUDA 13 with NVSHMEM, {_FALLBACK}.") from exc
    missing = [f"symm_mem.{name}" for name in ("set_backend", "get_backend", "empty",
                                                "is_nvshmem_available")
               if not hasattr(symm_mem, name)]
    if missing:
        raise NvshmemUnavailable(
            f"megatron_deepep: torch {torch.__version__} lacks {missing} (NVSHMEM symmetric "
            f"memory); the internode transport needs torch >= 2.11 built for CUDA 13 with "
            f"NVSHMEM, {_FALLBACK}.")
    return symm_mem


def check_available() -> None:
    """Raises unless this process can use NVSHMEM through torch (CUDA, torch's NVSHMEM
    support, the NVSHMEM library at run time).

    Raises:
        NvshmemUnavailable: what is missing, what to install, and the fallback; or a host
            library that does not suit the device library (`nvshmem_link.check_host_library`).
    """
    if not torch.cuda.is_available():
        raise NvshmemUnavailable(
            f"megatron_deepep: the internode transport runs CUDA kernels, but torch "
            f"{torch.__version__} sees no CUDA device; {_FALLBACK}.")
    symm_mem = _symm_mem()
    cumodule_init()
    if not symm_mem.is_nvshmem_available():
        raise NvshmemUnavailable(
            f"megatron_deepep: torch {torch.__version__} cannot load NVSHMEM (is the "
            f"nvidia-nvshmem-cu13 wheel installed, matching torch's CUDA?). Install "
            f"`pip install {PIP_PACKAGES}`, {_FALLBACK}.")
    # The host library torch loaded bootstraps NVSHMEM and holds the heap: its release must
    # suit the device library the kernels link against (both named if not).
    check_host_library()


DEFAULT_HEAP_BYTES = 1 << 30  # NVSHMEM's default NVSHMEM_SYMMETRIC_SIZE
HEAP_HEADROOM = 512 << 20     # NVSHMEM's own allocations and torch's symmetric-memory bookkeeping
HEAP_GRANULE = 512 << 20      # NVSHMEM_CUMEM_GRANULARITY's default
# Set by this process's first symmetric allocation: NVSHMEM has started and read its heap size.
_started = False
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_heap_size(text: str) -> int:
    """Bytes of an NVSHMEM size setting ("1073741824", "2G", "512m", "1.5GB").

    Raises:
        ValueError: not a size.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(?:i?[bB])?\s*", text)
    if match is None:
        raise ValueError(f"NVSHMEM_SYMMETRIC_SIZE={text!r} is not a size (e.g. 2G or 2147483648)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def heap_limit() -> int:
    """Bytes of symmetric heap NVSHMEM gives each PE: NVSHMEM_SYMMETRIC_SIZE, else its
    default (1 GiB)."""
    text: Optional[str] = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
    return DEFAULT_HEAP_BYTES if not text else parse_heap_size(text)


def heap_bytes_for(block_bytes: int) -> int:
    """NVSHMEM_SYMMETRIC_SIZE for a symmetric block of `block_bytes` per PE: plus headroom for
    NVSHMEM and torch, in whole 512 MiB granules, never below NVSHMEM's 1 GiB default."""
    granules = -(-(block_bytes + HEAP_HEADROOM) // HEAP_GRANULE)
    return max(DEFAULT_HEAP_BYTES, granules * HEAP_GRANULE)


def size_heap_for(block_bytes: int) -> Optional[int]:
    """Sets NVSHMEM_SYMMETRIC_SIZE to `heap_bytes_for(block_bytes)` when it is unset and NVSHMEM
    has not started in this process (it reads the size once, at the first symmetric
    allocation), so that a job without the Slurm templates' setting just works. Every PE of the
    group must call it with the same block (the heap is symmetric).

    Returns:
        The bytes set, or None where the variable was set already or NVSHMEM has started.
    """
    if os.environ.get("NVSHMEM_SYMMETRIC_SIZE") or _started:
        return None
    size = heap_bytes_for(block_bytes)
    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(size)
    return size


def use_nvshmem_backend(device: torch.device) -> None:
    """Makes torch's symmetric memory allocate through NVSHMEM on `device` (idempotent).

    Raises:
        NvshmemUnavailable: NVSHMEM cannot be used here.
        RuntimeError: another backend already allocated symmetric memory in this process (the
            backend cannot change after the first allocation).
    """
    check_available()
    symm_mem = _symm_mem()
    current = symm_mem.get_backend(device)
    if current == "NVSHMEM":
        return
    try:
        symm_mem.set_backend("NVSHMEM")
    except Exception as exc:
        raise RuntimeError(
            f"megatron_deepep: cannot switch torch's symmetric memory to NVSHMEM (backend on "
            f"{device}: {current}): {exc}. The backend is fixed by the first symmetric "
            f"allocation of the process; create the internode transport before anything else "
            f"allocates symmetric memory, {_FALLBACK}.") from exc


class SymmetricHeap:
    """Tensors on NVSHMEM's symmetric heap, for the network leg's send and receive buffers.

    Args:
        device: the CUDA device of this PE (default: the current one).

    Every PE must make the same `empty` calls in the same order (allocation is collective).
    The heap keeps every tensor it made alive until `destroy()`, so kernels in flight never see
    their buffers freed.
    """

    def __init__(self, device: Union[torch.device, int, None] = None):
        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", device) if isinstance(device, int) else \
            torch.device(device)
        use_nvshmem_backend(self.device)
        self._tensors: List[torch.Tensor] = []

    def empty(self, shape: Union[int, Sequence[int]], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized symmetric tensor (collective: every PE, same shape and dtype).

        Raises:
            RuntimeError: the allocation failed (the heap is full: NVSHMEM_SYMMETRIC_SIZE sets
                its size; or NVSHMEM failed to start).
        """
        if self._tensors is None:
            raise RuntimeError("megatron_deepep: SymmetricHeap used after destroy()")
        global _started
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        _started = True  # the attempt starts NVSHMEM (or failed to): its size is read
        try:
            tensor = _symm_mem().empty(shape, dtype=dtype, device=self.device)
        except Exception as exc:
            raise RuntimeError(
                f"megatron_deepep: NVSHMEM symmetric allocation of {list(shape)} {dtype} on "
                f"{self.device} failed: {exc}. If NVSHMEM failed to start, its log above says "
                f"why; if the heap is full, raise NVSHMEM_SYMMETRIC_SIZE; {_FALLBACK}."
                ) from exc
        self._tensors.append(tensor)
        return tensor

    def zeros(self, shape: Union[int, Sequence[int]], dtype: torch.dtype) -> torch.Tensor:
        """`empty`, zeroed on the current stream."""
        return self.empty(shape, dtype).zero_()

    def destroy(self) -> None:
        """Drops the heap's references (idempotent). Only host-local: never a collective or an
        NVSHMEM host call, which limited several-processes-per-GPU mode forbids."""
        self._tensors = None
