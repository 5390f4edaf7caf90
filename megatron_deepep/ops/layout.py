"""The layout kernel (cuda_src/layout.cu): per-token destination ranks, per-(rank, expert)
counts and slots, on the device; at EP = 1 also the receive layout."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import torch

from megatron_deepep.arena import Arena, ArenaPlan
from megatron_deepep.kernels import jit
from megatron_deepep.kernels.jit import I32, U32, U64, KernelArgs, Ptr
from megatron_deepep.layout import DispatchLayout, layout_fields
from megatron_deepep.ops.launch import ErrorSink, index_type_name, launch_stream

LAYOUT_THREADS = 512


# ---------------------------------------------------------------------------------------------
# Argument structs: mirrors of cuda_src/common/args.cuh (same names, same order).

class LayoutArgs(KernelArgs):
    c_name = "mdeep::LayoutArgs<int>"
    _fields_ = [
        ("topk_idx", Ptr), ("num_tokens", I32), ("num_experts", I32), ("num_ranks", I32),
        ("chunk_tokens", I32), ("num_tokens_per_expert", Ptr), ("pos_in_expert", Ptr),
        ("num_tokens_per_rank", Ptr), ("is_token_in_rank", Ptr), ("token_slot_in_rank", Ptr),
        ("slot_token", Ptr), ("state", Ptr), ("chunk_status", Ptr), ("chunk_counts", Ptr),
        ("timeout_ns", U64), ("error_claim", Ptr), ("error_record", Ptr), ("rank", I32),
        ("recv_tokens_per_expert", Ptr), ("recv_padded", Ptr), ("recv_row_start", Ptr),
        ("recv_src_offset", Ptr), ("recv_tokens_per_rank", Ptr), ("host_info", Ptr),
        ("alignment", I32), ("max_recv_rows", I32), ("host_epoch", U32)]


# The layout kernel keeps per-chunk bitmaps in shared memory: at most this many 32-bit words of
# expert bitmaps, so that they, the rank bitmaps and the counts stay within 48 KB.
LAYOUT_BITMAP_WORDS = 9216
LAYOUT_MAX_CHUNK_ENTRIES = 2 * LAYOUT_THREADS  # kEntriesPerThread in layout.cu
LAYOUT_MAX_COUNTS = 5 * LAYOUT_THREADS  # kCountsPerThread: experts plus ranks


# Entries per layout block by default: 512 measured fastest on H200 at the bench shapes
# (7.8 / 7.6 / 6.9 µs against 8.1 / 7.9 / 7.7 µs at 1024).
LAYOUT_CHUNK_ENTRIES = LAYOUT_THREADS


def layout_chunk_tokens(num_experts: int, num_topk: int,
                        max_entries: int = LAYOUT_CHUNK_ENTRIES) -> int:
    """Tokens per block of the layout kernel: as many as fit `max_entries` entries (at most
    the kernel's LAYOUT_MAX_CHUNK_ENTRIES) and its bitmap limit."""
    fit = LAYOUT_BITMAP_WORDS // num_experts  # words per expert, stride included
    largest = fit if fit % 2 else fit - 1  # the most words whose odd stride still fits
    words_per_expert = max(1, min(max_entries // 32, largest))
    return max(1, 32 * words_per_expert // num_topk)


def _bitmap_stride(words_per_expert: int) -> int:
    """Words between two experts' bitmaps in the layout kernel (odd: no bank conflicts)."""
    return words_per_expert | 1


class _LayoutWorkspace:
    """The layout kernel's state between launches, for one stream: an epoch word and a
    finished-blocks counter, a status word per chunk and its published counts
    (`[chunks, 2, experts + ranks rounded up to 4]` int32, 16-byte aligned rows: the kernel sums
    them 4 at a time). Zeroed once; grown (zeroed again) when a call needs more chunks or counts.
    One per stream, since two layouts running at once would share it."""

    def __init__(self):
        self.tensor = None
        self.max_chunks = self.max_counts = 0
        self.addresses = (0, 0, 0)

    def get(self, num_chunks: int, num_counts: int, device, stream):
        """(state, chunk_status, chunk_counts) addresses for a launch of `num_chunks` blocks on
        `stream` (a `jit.RawStream`)."""
        count_stride = -(-num_counts // 4) * 4  # the kernel's half row of counts
        if num_chunks > self.max_chunks or count_stride > self.max_counts:
            self.max_chunks = max(num_chunks, 2 * self.max_chunks, 64)
            self.max_counts = max(count_stride, self.max_counts)
            counts_offset = -(-(2 + self.max_chunks) // 4) * 4  # 16-byte aligned
            # Zeroed on the kernel's own stream: ordered before it with no host wait, so a
            # workspace can also be made while a CUDA graph captures that stream.
            launch_stream = torch.cuda.ExternalStream(stream.cuda_stream, device=device)
            with torch.cuda.stream(launch_stream):
                self.tensor = torch.zeros(counts_offset + self.max_chunks * 2 * self.max_counts,
                                          dtype=torch.int32, device=device)
            base = self.tensor.data_ptr()
            self.addresses = (base, base + 4 * 2, base + 4 * counts_offset)
        return self.addresses


_layout_workspaces: dict = {}


@functools.lru_cache(maxsize=256)
def layout_plan(num_tokens: int, num_topk: int, num_experts: int, num_ranks: int) -> ArenaPlan:
    """The arena of one `DispatchLayout` (the layout kernel writes every array)."""
    return ArenaPlan(layout_fields(num_tokens, num_topk, num_experts, num_ranks))


@functools.lru_cache(maxsize=256)
def _layout_launch(num_tokens: int, num_topk: int, num_experts: int, num_ranks: int,
                   chunk_tokens: Optional[int]) -> Tuple[int, int, int]:
    """(tokens per chunk, chunks, shared-memory bytes) of one layout launch."""
    max_chunk_tokens = layout_chunk_tokens(num_experts, num_topk, LAYOUT_MAX_CHUNK_ENTRIES)
    if chunk_tokens is None:
        chunk_tokens = layout_chunk_tokens(num_experts, num_topk)
    elif not 1 <= chunk_tokens <= max_chunk_tokens:
        raise ValueError(f"chunk_tokens={chunk_tokens} is outside [1, {max_chunk_tokens}] for "
                         f"{num_experts} experts and top-{num_topk}")
    num_chunks = max(1, -(-num_tokens // chunk_tokens))
    shared_words = (num_experts * _bitmap_stride(-(-chunk_tokens * num_topk // 32))
                    + num_ranks * (-(-chunk_tokens // 32)) + num_experts + num_ranks)
    return chunk_tokens, num_chunks, 4 * shared_words


@dataclasses.dataclass
class LocalRecv:
    """EP = 1: the layout kernel also writes the receive layout notify would (no notify runs).

    Attributes:
        recv: the arena holding the `handle.recv_fields` arrays.
        host_info_ptr: the mapped `HostInfo` the host polls.
        alignment: segment alignment in rows.
        max_recv_rows: the caller's row bound, -1 for none.
        epoch: the epoch published to the host.
    """

    recv: Arena
    host_info_ptr: int
    alignment: int
    max_recv_rows: int
    epoch: int

    def fields(self) -> dict:
        """The `LayoutArgs` fields of the receive layout."""
        a = self.recv.address
        return dict(recv_tokens_per_expert=a("num_recv_tokens_per_expert"),
                    recv_padded=a("tokens_per_expert"), recv_row_start=a("expert_row_start"),
                    recv_src_offset=a("src_expert_offset"),
                    recv_tokens_per_rank=a("num_recv_tokens_per_rank"),
                    host_info=self.host_info_ptr, alignment=self.alignment,
                    max_recv_rows=self.max_recv_rows, host_epoch=self.epoch & 0xFFFFFFFF)


# No EP = 1 receive layout (recv_tokens_per_expert null: the kernel writes none).
_NO_LOCAL_RECV = dict(recv_tokens_per_expert=0, recv_padded=0, recv_row_start=0,
                      recv_src_offset=0, recv_tokens_per_rank=0, host_info=0, alignment=1,
                      max_recv_rows=-1, host_epoch=0)


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, rank: int,
           errors: ErrorSink, timeout_ns: int = 10**10, chunk_tokens: Optional[int] = None,
           arena: Optional[Arena] = None, local_recv: Optional[LocalRecv] = None
           ) -> DispatchLayout:
    """`DispatchLayout` of `topk_idx [N, K]` (see layout.py), computed by layout.cu.

    Args:
        chunk_tokens: tokens per block; defaults to `layout_chunk_tokens` (512 entries); tests
            and probes may pass any size up to the kernel's limit.
        arena: where the layout's arrays go (an allocation that holds `layout_plan`'s fields,
            e.g. with the dispatch's receive arrays); a new one by default.
        local_recv: at EP = 1, the receive layout to write too (notify is then skipped).
    """
    num_tokens, num_topk = topk_idx.shape
    if num_experts + num_ranks > LAYOUT_MAX_COUNTS:
        raise ValueError(f"num_experts={num_experts} with {num_ranks} ranks exceeds the layout "
                         f"kernel's {LAYOUT_MAX_COUNTS} experts plus ranks")
    dev = topk_idx.device
    if arena is None:
        arena = layout_plan(num_tokens, num_topk, num_experts, num_ranks).allocate(dev)
    chunk_tokens, num_chunks, shared_bytes = _layout_launch(num_tokens, num_topk, num_experts,
                                                            num_ranks, chunk_tokens)
    stream = launch_stream()
    workspace = _layout_workspaces.get((dev.index, stream.cuda_stream))
    if workspace is None:
        workspace = _layout_workspaces[(dev.index, stream.cuda_stream)] = _LayoutWorkspace()
    state, status, counts = workspace.get(num_chunks, num_experts + num_ranks, dev, stream)
    a = arena.address
    kernel = jit.get_kernel("layout.cu", "layout_kernel", [index_type_name(topk_idx), num_topk])
    args = LayoutArgs.fill(
        topk_idx=topk_idx.data_ptr(), num_tokens=num_tokens, num_experts=num_experts,
        num_ranks=num_ranks, chunk_tokens=chunk_tokens,
        num_tokens_per_expert=a("num_tokens_per_expert"), pos_in_expert=a("pos_in_expert"),
        num_tokens_per_rank=a("num_tokens_per_rank"), is_token_in_rank=a("is_token_in_rank"),
        token_slot_in_rank=a("token_slot_in_rank"), slot_token=a("slot_token"), state=state,
        chunk_status=status, chunk_counts=counts, timeout_ns=timeout_ns,
        error_claim=errors.claim, error_record=errors.record, rank=rank,
        **(local_recv.fields() if local_recv is not None else _NO_LOCAL_RECV))
    kernel.launch(num_chunks, LAYOUT_THREADS, args, stream, shared_mem=shared_bytes)
    return DispatchLayout.from_arena(arena)
