"""The symmetric NVLink buffer: one raw `cudaMalloc` per rank, mapped by every peer via CUDA IPC.

An IPC handle maps a whole allocation, so the buffer never comes from torch's caching allocator.
Handles travel with `all_gather_object` over the EP group, so any backend works (NCCL in real
runs, gloo when several ranks share one GPU in tests).
"""

from __future__ import annotations

import ctypes
import logging
from typing import List

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_IPC_LAZY_ENABLE_PEER_ACCESS = 1
_HOST_ALLOC_MAPPED = 2


class SymmetricBuffer:
    """`num_bytes` of device memory on every rank, addressable by every peer.

    Args:
        group: the EP process group.
        num_bytes: bytes per rank (same on every rank; checked).

    Attributes:
        peer_bases: `[R]`, int64 on the device: the address of every rank's buffer as this rank
            sees it (its own included).
    """

    def __init__(self, group, num_bytes: int):
        import cupy
        self._rt = cupy.cuda.runtime
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_bytes = num_bytes
        self.ptr = self._rt.malloc(num_bytes)
        self._opened: List[int] = []
        self._rt.memset(self.ptr, 0, num_bytes)  # flags start at epoch 0, once for the lifetime
        self._rt.deviceSynchronize()
        handle = bytes(self._rt.ipcGetMemHandle(self.ptr))
        infos = [None] * self.num_ranks
        dist.all_gather_object(infos, (handle, num_bytes), group=group)
        sizes = [info[1] for info in infos]
        if len(set(sizes)) != 1:
            self._rt.free(self.ptr)
            raise ValueError(f"ranks disagree on the buffer size (per-rank bytes {sizes}): "
                             "every rank must declare the same num_max_tokens_per_rank, hidden "
                             "and num_topk")
        bases = []
        for r, (peer_handle, _) in enumerate(infos):
            if r == self.rank:
                bases.append(self.ptr)
            else:
                base = self._rt.ipcOpenMemHandle(peer_handle, _IPC_LAZY_ENABLE_PEER_ACCESS)
                self._opened.append(base)
                bases.append(base)
        self.peer_bases = torch.tensor(bases, dtype=torch.int64, device=self.device)
        logger.debug("rank %d mapped %d peer buffers of %d bytes", self.rank, len(bases),
                     num_bytes)

    def destroy(self) -> None:
        """Unmaps the peers, waits for every rank to do the same, then frees (collective)."""
        if self.ptr is None:
            return
        self._rt.deviceSynchronize()
        for base in self._opened:
            self._rt.ipcCloseMemHandle(base)
        self._opened = []
        dist.barrier(group=self.group)
        self._rt.free(self.ptr)
        self.ptr = None


def _device_pointer_of_host(host_ptr: int) -> int:
    """The device address of mapped pinned memory (equal to the host address under UVA)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return host_ptr
    err, device_ptr = cudart.cudaHostGetDevicePointer(host_ptr, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostGetDevicePointer failed: {err}")
    return int(device_ptr)


class MappedHostArray:
    """Pinned host memory the GPU writes through a mapped pointer and the host reads directly.

    Args:
        num_int32: size in 32-bit words.
    """

    def __init__(self, num_int32: int):
        import cupy
        self._rt = cupy.cuda.runtime
        self.host_ptr = self._rt.hostAlloc(num_int32 * 4, _HOST_ALLOC_MAPPED)
        ctypes.memset(self.host_ptr, 0, num_int32 * 4)
        self.device_ptr = _device_pointer_of_host(self.host_ptr)
        self.words = np.ctypeslib.as_array((ctypes.c_int32 * num_int32).from_address(
            self.host_ptr))

    def destroy(self) -> None:
        if self.host_ptr is not None:
            self._rt.freeHost(self.host_ptr)
            self.host_ptr = None
