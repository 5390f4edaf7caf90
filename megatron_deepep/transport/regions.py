"""Byte layout of one rank's symmetric buffer (mirrors `cuda_src/common/buffer.cuh`).

    [0, META)              Meta: epoch flags written by peers, per-source count rows
                           (two halves, by the epoch's parity)
    [META, +WORKSPACE)     Workspace: block counters and the error claim (local only)
    dispatch rows          [R][N_max] rows of `row_stride` bytes (align16(H * 2))
    dispatch metadata      [R][N_max] slot records of `meta_stride` bytes (align16(4 + 12 K))
    combine rows           [R][N_max] partial rows of `row_stride` bytes
    combine weights        [R][N_max] K floats of `weight_stride` bytes (align16(4 K))
    dispatch flags         [R][N_max] u32: the epoch of the dispatch that filled each slot
    combine flags          [R][N_max] u32: the epoch of the combine that filled each slot

Region [s][j] of rank r's buffer is written only by source s, so writers never collide.
"""

from __future__ import annotations

import dataclasses

import torch

MAX_RANKS = 8
MAX_LOCAL_EXPERTS = 256
COUNT_STRIDE = 8 + MAX_LOCAL_EXPERTS
# Notify's count rows come in two halves chosen by the epoch's parity (buffer.cuh's
# `counts_half`).
COUNT_HALVES = 2
META_BYTES = (8 * MAX_RANKS) * 4 + COUNT_HALVES * MAX_RANKS * COUNT_STRIDE * 4  # sizeof(Meta)
WORKSPACE_BYTES = 4096
PAGE = 4096


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def row_stride(hidden: int) -> int:
    """Bytes of one staged row of `hidden` 2-byte elements (16-byte aligned)."""
    return _align(hidden * 2, 16)


def meta_stride(num_topk: int) -> int:
    """Bytes of one `SlotMeta` (common/buffer.cuh): token, then K local experts, positions and
    weights."""
    return _align(4 + 12 * num_topk, 16)


def weight_stride(num_topk: int) -> int:
    """Bytes of K fp32 routing-weight values."""
    return _align(4 * num_topk, 16)


@dataclasses.dataclass(frozen=True)
class BufferRegions:
    """Offsets and strides for a buffer sized for (R, N_max, H, K)."""

    num_ranks: int
    max_tokens: int
    hidden: int
    num_topk: int

    @property
    def row_stride(self) -> int:
        return row_stride(self.hidden)

    @property
    def meta_stride(self) -> int:
        return meta_stride(self.num_topk)

    @property
    def weight_stride(self) -> int:
        return weight_stride(self.num_topk)

    @property
    def workspace(self) -> int:
        return _align(META_BYTES, PAGE)

    def _slots(self) -> int:
        return self.num_ranks * self.max_tokens

    @property
    def dispatch_rows(self) -> int:
        return _align(self.workspace + WORKSPACE_BYTES, PAGE)

    @property
    def dispatch_meta(self) -> int:
        return _align(self.dispatch_rows + self._slots() * self.row_stride, PAGE)

    @property
    def combine_rows(self) -> int:
        return _align(self.dispatch_meta + self._slots() * self.meta_stride, PAGE)

    @property
    def combine_weights(self) -> int:
        return _align(self.combine_rows + self._slots() * self.row_stride, PAGE)

    @property
    def dispatch_flags(self) -> int:
        return _align(self.combine_weights + self._slots() * self.weight_stride, PAGE)

    @property
    def combine_flags(self) -> int:
        return _align(self.dispatch_flags + self._slots() * 4, PAGE)

    @property
    def num_bytes(self) -> int:
        """Total bytes: ~ 2 R N_max (2 H + 24) plus a few pages."""
        return _align(self.combine_flags + self._slots() * 4, 2 << 20)

    def as_device_struct(self, device) -> torch.Tensor:
        """The `Regions` struct of buffer.cuh as 10 int64 words on `device`."""
        words = [self.dispatch_rows, self.dispatch_meta, self.combine_rows, self.combine_weights,
                 self.dispatch_flags, self.combine_flags, self.row_stride, self.meta_stride,
                 self.weight_stride, (self.workspace << 32) | self.max_tokens]
        return torch.tensor(words, dtype=torch.int64, device=device)
