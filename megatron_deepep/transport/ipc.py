"""The symmetric NVLink buffer: one raw `cudaMalloc` per rank, mapped by every peer via CUDA IPC.

An IPC handle maps a whole allocation, so the buffer never comes from torch's caching allocator.
Handles travel with `all_gather_object` over the EP group, so any backend works: gloo (several
ranks sharing one GPU in tests) sends the pickled bytes from host memory; NCCL (one process per
GPU, real runs) sends them as a uint8 tensor on the current CUDA device (torch's object
collectives pick the device of the group's backend), so each rank must have made its own GPU
current first, as torchrun jobs do from LOCAL_RANK; the buffer is allocated there too.
"""

from __future__ import annotations

import ctypes
import logging
from typing import List

import numpy as np
import torch
import torch.distributed as dist

from megatron_deepep.kernels.cuda_calls import cu_check

logger = logging.getLogger(__name__)

_IPC_HANDLE_BYTES = 64  # CUDA_IPC_HANDLE_SIZE


def _runtime():
    from cuda.bindings import runtime
    return runtime


def _handle_bytes(handle) -> bytes:
    """The 64 bytes of a `cudaIpcMemHandle_t` (to send to peers)."""
    return ctypes.string_at(handle.getPtr(), _IPC_HANDLE_BYTES)


def _handle_of(data: bytes):
    """A `cudaIpcMemHandle_t` holding the 64 bytes a peer sent."""
    if len(data) != _IPC_HANDLE_BYTES:
        raise ValueError(f"an IPC handle has {_IPC_HANDLE_BYTES} bytes, got {len(data)}")
    handle = _runtime().cudaIpcMemHandle_t()
    ctypes.memmove(handle.getPtr(), data, _IPC_HANDLE_BYTES)
    return handle


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
        rt = _runtime()
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_bytes = num_bytes
        self.ptr = int(cu_check(rt.cudaMalloc(num_bytes), f"cudaMalloc({num_bytes} bytes)"))
        self._opened: List[int] = []
        # Flags start at epoch 0, once for the lifetime.
        cu_check(rt.cudaMemset(self.ptr, 0, num_bytes), "cudaMemset(symmetric buffer)")
        cu_check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        handle = _handle_bytes(cu_check(rt.cudaIpcGetMemHandle(self.ptr), "cudaIpcGetMemHandle"))
        infos = [None] * self.num_ranks
        dist.all_gather_object(infos, (handle, num_bytes), group=group)
        sizes = [info[1] for info in infos]
        if len(set(sizes)) != 1:
            cu_check(rt.cudaFree(self.ptr), "cudaFree(symmetric buffer)")
            raise ValueError(f"ranks disagree on the buffer size (per-rank bytes {sizes}): "
                             "every rank must declare the same num_max_tokens_per_rank, hidden "
                             "and num_topk")
        bases = []
        for r, (peer_handle, _) in enumerate(infos):
            if r == self.rank:
                bases.append(self.ptr)
            else:
                base = int(cu_check(rt.cudaIpcOpenMemHandle(
                    _handle_of(peer_handle), rt.cudaIpcMemLazyEnablePeerAccess),
                    f"cudaIpcOpenMemHandle(rank {r}'s buffer)"))
                self._opened.append(base)
                bases.append(base)
        self.peer_bases = torch.tensor(bases, dtype=torch.int64, device=self.device)
        logger.debug("rank %d mapped %d peer buffers of %d bytes", self.rank, len(bases),
                     num_bytes)

    def destroy(self) -> None:
        """Unmaps the peers, waits for every rank to do the same, then frees (collective)."""
        if self.ptr is None:
            return
        rt = _runtime()
        cu_check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        for base in self._opened:
            cu_check(rt.cudaIpcCloseMemHandle(base), "cudaIpcCloseMemHandle")
        self._opened = []
        dist.barrier(group=self.group)
        cu_check(rt.cudaFree(self.ptr), "cudaFree(symmetric buffer)")
        self.ptr = None


class MappedHostArray:
    """Pinned host memory the GPU writes through a mapped pointer and the host reads directly.

    Args:
        num_int32: size in 32-bit words.
    """

    def __init__(self, num_int32: int):
        rt = _runtime()
        num_bytes = num_int32 * 4
        self.host_ptr = int(cu_check(rt.cudaHostAlloc(num_bytes, rt.cudaHostAllocMapped),
                                     f"cudaHostAlloc({num_bytes} bytes, mapped)"))
        ctypes.memset(self.host_ptr, 0, num_bytes)
        # The device address of the mapping (equal to the host address under UVA).
        self.device_ptr = int(cu_check(rt.cudaHostGetDevicePointer(self.host_ptr, 0),
                                       "cudaHostGetDevicePointer"))
        self.words = np.ctypeslib.as_array((ctypes.c_int32 * num_int32).from_address(
            self.host_ptr))

    def destroy(self) -> None:
        if self.host_ptr is not None:
            cu_check(_runtime().cudaFreeHost(self.host_ptr), "cudaFreeHost")
            self.host_ptr = None
