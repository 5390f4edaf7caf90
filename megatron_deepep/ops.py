"""One thin typed wrapper per CUDA operation: picks template arguments and launches.

The only module that calls `jit`. Callers (the transports) have validated the user's
arguments; wrappers here assert internal invariants (dtypes, contiguity) and pass raw pointers.
Every launch goes on the torch stream that is current when it is called.

Every kernel takes one argument struct (`cuda_src/common/args.cuh`); the `KernelArgs`
subclasses below mirror them field by field and are filled by name (a missing field is an
error). tests/test_kernel_args.py compiles their sizes and offsets against the CUDA side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from typing import Callable, Optional, Sequence, Tuple

import torch

from megatron_deepep import jit, nvshmem_link
from megatron_deepep.arena import Arena, ArenaPlan
from megatron_deepep.jit import F32, I32, I64, U32, U64, KernelArgs, Ptr
from megatron_deepep.layout import DispatchLayout, layout_fields

LAYOUT_THREADS = 512
NOTIFY_THREADS = 256
COMM_THREADS = 512


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


class NotifyArgs(KernelArgs):
    c_name = "mdeep::NotifyArgs"
    _fields_ = [
        ("peer_bases", Ptr), ("rank", I32), ("num_ranks", I32), ("epoch_word", Ptr),
        ("num_tokens_per_rank", Ptr), ("num_tokens_per_expert", Ptr), ("num_local", I32),
        ("hidden", I32), ("num_topk", I32), ("alignment", I32), ("max_recv_rows", I32),
        ("num_recv_tokens_per_rank", Ptr), ("num_recv_tokens_per_expert", Ptr),
        ("tokens_per_expert", Ptr), ("expert_row_start", Ptr), ("src_expert_offset", Ptr),
        ("host_info", Ptr), ("host_epoch", U32), ("timeout_ns", U64), ("error_claim", Ptr),
        ("error_record", Ptr)]


class DispatchSendArgs(KernelArgs):
    c_name = "mdeep::DispatchSendArgs<long long>"
    _fields_ = [
        ("x", Ptr), ("x_scales", Ptr), ("num_tokens", I32), ("hidden", I32),
        ("amax_epsilon", F32), ("topk_idx", Ptr), ("topk_weights", Ptr), ("pos_in_expert", Ptr),
        ("is_token_in_rank", Ptr), ("token_slot_in_rank", Ptr), ("peer_bases", Ptr),
        ("regions", Ptr), ("rank", I32), ("num_ranks", I32), ("num_local", I32),
        ("epoch_word", Ptr),
        ("timeout_ns", U64), ("error_claim", Ptr), ("error_record", Ptr)]


class DispatchRecvArgs(KernelArgs):
    c_name = "mdeep::DispatchRecvArgs<int>"
    _fields_ = [
        ("recv_x", Ptr), ("recv_scales", Ptr), ("recv_weights", Ptr), ("max_rows", I32),
        ("hidden", I32), ("num_recv_tokens_per_rank", Ptr), ("num_recv_tokens_per_expert", Ptr),
        ("expert_row_start", Ptr), ("src_expert_offset", Ptr), ("slot_rows", Ptr), ("x", Ptr),
        ("x_scales", Ptr), ("amax_epsilon", F32), ("topk_idx", Ptr), ("topk_weights", Ptr),
        ("pos_in_expert", Ptr), ("slot_token", Ptr), ("num_tokens", I32), ("peer_bases", Ptr),
        ("regions", Ptr), ("rank", I32), ("num_ranks", I32), ("num_local", I32),
        ("epoch_word", Ptr),
        ("timeout_ns", U64), ("error_claim", Ptr), ("error_record", Ptr)]


class DispatchLocalArgs(KernelArgs):
    c_name = "mdeep::DispatchLocalArgs<long long>"
    _fields_ = [
        ("recv_x", Ptr), ("recv_scales", Ptr), ("recv_weights", Ptr), ("max_rows", I32),
        ("hidden", I32), ("num_recv_tokens_per_expert", Ptr), ("expert_row_start", Ptr),
        ("slot_rows", Ptr), ("x", Ptr), ("x_scales", Ptr), ("amax_epsilon", F32),
        ("topk_idx", Ptr), ("topk_weights", Ptr), ("pos_in_expert", Ptr),
        ("token_slot_in_rank", Ptr), ("num_tokens", I32), ("num_local", I32), ("host_info", Ptr),
        ("tokens_per_expert", Ptr), ("host_epoch", U32)]


class CombineSendArgs(KernelArgs):
    c_name = "mdeep::CombineSendArgs"
    _fields_ = [
        ("y", Ptr), ("num_int4", I32), ("recv_weights", Ptr), ("grad_row_weights", Ptr),
        ("slot_rows", Ptr), ("num_recv_tokens_per_rank", Ptr), ("peer_bases", Ptr),
        ("regions", Ptr), ("rank", I32), ("num_ranks", I32), ("epoch_word", Ptr),
        ("timeout_ns", U64), ("error_claim", Ptr), ("error_record", Ptr)]


class CombineReduceArgs(KernelArgs):
    c_name = "mdeep::CombineReduceArgs"
    _fields_ = [
        ("out", Ptr), ("out_weights", Ptr), ("num_tokens", I32), ("num_int4", I32), ("y", Ptr),
        ("recv_weights", Ptr), ("grad_row_weights", Ptr), ("slot_rows", Ptr),
        ("is_token_in_rank", Ptr), ("token_slot_in_rank", Ptr), ("peer_bases", Ptr),
        ("regions", Ptr), ("rank", I32), ("num_ranks", I32), ("epoch_word", Ptr),
        ("timeout_ns", U64), ("error_claim", Ptr), ("error_record", Ptr)]


class CombineLocalArgs(KernelArgs):
    c_name = "mdeep::CombineLocalArgs"
    _fields_ = [
        ("out", Ptr), ("out_weights", Ptr), ("num_tokens", I32), ("num_int4", I32), ("y", Ptr),
        ("recv_weights", Ptr), ("grad_row_weights", Ptr), ("slot_rows", Ptr),
        ("token_slot_in_rank", Ptr)]


class QuantizeArgs(KernelArgs):
    c_name = "mdeep::QuantizeArgs<float>"
    _fields_ = [("x", Ptr), ("q", Ptr), ("scales", Ptr), ("num_tokens", I32), ("hidden", I32),
                ("amax_epsilon", F32)]


class DequantizeArgs(KernelArgs):
    c_name = "mdeep::DequantizeArgs<float>"
    _fields_ = [("q", Ptr), ("scales", Ptr), ("out", Ptr), ("num_tokens", I32),
                ("hidden", I32)]


class ColumnwiseArgs(KernelArgs):
    c_name = "mdeep::ColumnwiseArgs"
    _fields_ = [("q", Ptr), ("scales", Ptr), ("token_stride", I64), ("block_stride", I64),
                ("row_offsets", Ptr), ("col_data", Ptr), ("col_scales", Ptr),
                ("num_experts", I32), ("num_rows", I32), ("hidden", I32), ("scale_cols", I32),
                ("num_blocks", I32), ("amax_epsilon", F32)]


class FillArgs(KernelArgs):
    c_name = "mdeep::FillArgs"
    _fields_ = [("dst", Ptr), ("num_int4", I64)]


class FanOutArgs(KernelArgs):
    c_name = "mdeep::FanOutArgs"
    _fields_ = [("src", Ptr), ("dst_rows", Ptr), ("dst", Ptr), ("num_rows", I32),
                ("num_int4", I32), ("fan_out", I32)]


class FanInArgs(KernelArgs):
    c_name = "mdeep::FanInArgs"
    _fields_ = [("src", Ptr), ("src_rows", Ptr), ("dst", Ptr), ("num_rows", I32),
                ("num_int4", I32)]


class PeerCopyArgs(KernelArgs):
    c_name = "mdeep::PeerCopyArgs"
    _fields_ = [("src", Ptr), ("peer_bases", Ptr), ("num_int4_per_peer", I64), ("rank", I32),
                ("num_ranks", I32)]


class LegArgs(KernelArgs):
    c_name = "mdeep::LegArgs"
    _fields_ = [("recv", Ptr), ("send", Ptr), ("signals", Ptr), ("bytes", I64),
                ("expected", U64), ("timeout_ns", U64), ("peer", I32), ("source", I32),
                ("error_claim", Ptr), ("error_record", Ptr), ("info", Ptr)]


class InternodeArgs(KernelArgs):
    c_name = "mdeep::InternodeArgs"
    _fields_ = [
        ("heap", Ptr), ("notify_recv", I64), ("notify_send", I64), ("signals", I64),
        ("flags", I64), ("net_send", I64), ("net_recv", I64), ("stage_rows", I64),
        ("stage_meta", I64), ("comb_stage", I64), ("comb_send", I64), ("comb_recv", I64),
        ("row_stride", I64), ("record_stride", I64), ("meta_stride", I64),
        ("weight_stride", I64), ("max_tokens", I32), ("chunk_tokens", I32), ("rank", I32),
        ("num_ranks", I32), ("ranks_per_node", I32), ("num_nodes", I32), ("pe_of_rank", Ptr),
        ("epoch_word", Ptr), ("timeout_ns", U64), ("error_claim", Ptr), ("error_record", Ptr),
        ("block_counters", Ptr), ("chunks_seen", Ptr), ("topk_idx", Ptr),
        ("topk_weights", Ptr), ("pos_in_expert", Ptr), ("num_tokens_per_rank", Ptr),
        ("num_tokens_per_expert", Ptr), ("is_token_in_rank", Ptr),
        ("token_slot_in_rank", Ptr), ("num_tokens_per_node", Ptr),
        ("token_slot_in_node", Ptr), ("node_slot_token", Ptr), ("num_tokens", I32),
        ("num_experts", I32), ("num_local", I32), ("hidden", I32), ("num_topk", I32),
        ("alignment", I32), ("max_recv_rows", I32), ("num_recv_tokens_per_rank", Ptr),
        ("num_recv_tokens_per_expert", Ptr), ("tokens_per_expert", Ptr),
        ("expert_row_start", Ptr), ("src_expert_offset", Ptr), ("fwd_count", Ptr),
        ("fwd_slots", Ptr), ("slot_rows", Ptr), ("host_info", Ptr), ("host_epoch", U32),
        ("x", Ptr),
        ("recv_x", Ptr), ("recv_weights", Ptr), ("max_rows", I32), ("y", Ptr), ("out", Ptr),
        ("out_weights", Ptr), ("grad_row_weights", Ptr), ("x_scales", Ptr),
        ("recv_scales", Ptr), ("amax_epsilon", F32), ("wire_bytes", I64),
        ("ring_words", I64), ("ring_seen", Ptr), ("ring_base", Ptr), ("ring_slots", I32),
        ("net_words", I64), ("net_counters", I64), ("rail_counts", I64), ("net_sent", Ptr),
        ("net_chunks", I32)]


# Sources whose kernels call NVSHMEM's device API: nvshmem_link builds them (tests/
# test_nvshmem_link.py links them in the CPU tier), not the plain NVRTC path.
NVSHMEM_SOURCES = ("internode_leg.cu", "internode.cu")

INTERNODE_KERNELS = ("internode_node_layout", "internode_notify", "internode_dispatch_send",
                     "internode_forward", "internode_dispatch_recv", "internode_combine_send",
                     "internode_combine_forward", "internode_combine_reduce")
# Ring staging (MDEEP_INTERNODE_STAGING=ring) adds these; it shares node layout, notify, send and
# reduce with the full staging's kernels.
INTERNODE_RING_KERNELS = ("internode_ring_count", "internode_ring_dispatch",
                          "internode_ring_combine")
# The network ring (MDEEP_INTERNODE_NET_RING_CHUNKS, on top of ring staging) adds these; it shares
# node layout and notify, and replaces every other kernel.
INTERNODE_NET_KERNELS = ("internode_net_dispatch", "internode_net_combine")

# Every kernel's argument struct (checked against the CUDA kernels by the CPU tests).
KERNEL_ARGS = {
    ("layout.cu", "layout_kernel"): LayoutArgs, ("notify.cu", "notify_kernel"): NotifyArgs,
    ("dispatch.cu", "dispatch_send"): DispatchSendArgs,
    ("dispatch.cu", "dispatch_recv"): DispatchRecvArgs,
    ("dispatch.cu", "dispatch_local"): DispatchLocalArgs,
    ("combine.cu", "combine_send"): CombineSendArgs,
    ("combine.cu", "combine_reduce"): CombineReduceArgs,
    ("combine.cu", "combine_local"): CombineLocalArgs,
    ("fp8.cu", "quantize_blockwise"): QuantizeArgs, ("fp8.cu", "quantize_mxfp8"): QuantizeArgs,
    ("fp8.cu", "dequantize_blockwise"): DequantizeArgs,
    ("fp8.cu", "dequantize_mxfp8"): DequantizeArgs,
    ("fp8_columnwise.cu", "columnwise_from_rowwise"): ColumnwiseArgs,
    ("ceiling.cu", "fill_kernel"): FillArgs, ("ceiling.cu", "fan_out_copy"): FanOutArgs,
    ("ceiling.cu", "fan_in_sum"): FanInArgs, ("ceiling.cu", "peer_copy"): PeerCopyArgs,
    ("internode_leg.cu", "internode_leg_send"): LegArgs,
    ("internode_leg.cu", "internode_leg_wait"): LegArgs,
    **{("internode.cu", name): InternodeArgs
       for name in INTERNODE_KERNELS + INTERNODE_RING_KERNELS + INTERNODE_NET_KERNELS},
}


def addr(tensor: Optional[torch.Tensor]) -> int:
    """A tensor's device address as a kernel argument (0 for None)."""
    return 0 if tensor is None else tensor.data_ptr()


def _index_type(t: torch.Tensor) -> str:
    return "long long" if t.dtype == torch.int64 else "int"


_launch = threading.local()


@contextlib.contextmanager
def launch_on(stream):
    """Kernels launched inside go to `stream`; tensors are still allocated on the current stream
    (so a synchronous call needs no `record_stream`)."""
    previous = getattr(_launch, "stream", None)
    _launch.stream = stream
    try:
        yield
    finally:
        _launch.stream = previous


def on_launch_stream():
    """A context that makes `launch_on`'s stream torch's current one (a no-op outside
    `launch_on`): torch ops the kernels depend on, such as the transports' epoch advance, must
    run on the stream the kernels go to."""
    stream = getattr(_launch, "stream", None)
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _stream():
    """The stream kernels go to now: `launch_on`'s, else the current one as a raw handle
    (building a torch Stream object per launch costs tens of µs)."""
    stream = getattr(_launch, "stream", None)
    return stream if stream is not None else jit.current_raw_stream()


class ErrorSink:
    """Where kernels record the first error: a device claim word and a host-mapped record."""

    def __init__(self, claim_ptr: int, record_ptr: int):
        self.claim, self.record = int(claim_ptr), int(record_ptr)


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


def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, rank: int,
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
    stream = _stream()
    workspace = _layout_workspaces.get((dev.index, stream.cuda_stream))
    if workspace is None:
        workspace = _layout_workspaces[(dev.index, stream.cuda_stream)] = _LayoutWorkspace()
    state, status, counts = workspace.get(num_chunks, num_experts + num_ranks, dev, stream)
    a = arena.address
    kernel = jit.get_kernel("layout.cu", "layout_kernel", [_index_type(topk_idx), num_topk])
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


def notify(peer_bases: torch.Tensor, rank: int, num_ranks: int, epoch_word: int,
           lay: DispatchLayout, num_local: int, hidden: int, num_topk: int, alignment: int,
           max_recv_rows: int, recv: Arena, host_info_ptr: int, host_epoch: int, timeout_ns: int,
           errors: ErrorSink) -> None:
    """Exchanges counts with every peer and writes the receive layout (the `recv_fields`
    arrays of `recv`) on the device. `epoch_word`: the address of the device word holding the
    call's epoch (the transport advances it before the call); `host_info_ptr` (non-zero for a
    synchronous call): where the row count is published with `host_epoch`."""
    kernel = jit.get_kernel("notify.cu", "notify_kernel")
    a = recv.address
    args = NotifyArgs.fill(
        peer_bases=peer_bases.data_ptr(), rank=rank, num_ranks=num_ranks,
        epoch_word=epoch_word, num_tokens_per_rank=lay.address("num_tokens_per_rank"),
        num_tokens_per_expert=lay.address("num_tokens_per_expert"), num_local=num_local,
        hidden=hidden, num_topk=num_topk, alignment=alignment, max_recv_rows=max_recv_rows,
        num_recv_tokens_per_rank=a("num_recv_tokens_per_rank"),
        num_recv_tokens_per_expert=a("num_recv_tokens_per_expert"),
        tokens_per_expert=a("tokens_per_expert"), expert_row_start=a("expert_row_start"),
        src_expert_offset=a("src_expert_offset"), host_info=host_info_ptr,
        host_epoch=host_epoch & 0xFFFFFFFF, timeout_ns=timeout_ns, error_claim=errors.claim,
        error_record=errors.record)
    kernel.launch(1, NOTIFY_THREADS, args, _stream())


def _wire(fp8) -> tuple:
    """(kFmt, kDequant, amax_epsilon) of an optional `Fp8Dispatch`."""
    if fp8 is None:
        return 0, False, 0.0
    return fp8.wire_code, fp8.dequantize, float(fp8.fmt.amax_epsilon)


def dispatch_send(x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                  topk_weights: Optional[torch.Tensor], lay: DispatchLayout, cached: bool,
                  fp8, peer_bases: torch.Tensor, regions: torch.Tensor, rank: int,
                  num_ranks: int, num_local: int, epoch_word: int, num_sms: int, timeout_ns: int,
                  errors: ErrorSink) -> None:
    """Writes every token row (quantized when `fp8` is given) into each peer's staging region.

    `x` is `[N, H]` bf16, or e4m3 data with its `x_scales` (pre-quantized); `fp8` an
    `Fp8Dispatch` or None.
    """
    num_tokens, hidden = x.shape
    fmt, _, amax_epsilon = _wire(fp8)
    kernel = jit.get_kernel("dispatch.cu", "dispatch_send",
                            [topk_idx.shape[1], cached, _index_type(topk_idx), fmt])
    args = DispatchSendArgs.fill(
        x=x.data_ptr(), x_scales=addr(x_scales), num_tokens=num_tokens, hidden=hidden,
        amax_epsilon=amax_epsilon, topk_idx=topk_idx.data_ptr(),
        topk_weights=addr(topk_weights), pos_in_expert=lay.address("pos_in_expert"),
        is_token_in_rank=lay.address("is_token_in_rank"),
        token_slot_in_rank=lay.address("token_slot_in_rank"),
        peer_bases=peer_bases.data_ptr(), regions=regions.data_ptr(), rank=rank,
        num_ranks=num_ranks, num_local=num_local, epoch_word=epoch_word,
        timeout_ns=timeout_ns, error_claim=errors.claim, error_record=errors.record)
    kernel.launch(num_sms, COMM_THREADS, args, _stream())


def dispatch_recv(recv_x: torch.Tensor, recv_scales: Optional[torch.Tensor],
                  recv_weights: Optional[torch.Tensor], recv: Arena, x: torch.Tensor,
                  x_scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                  topk_weights: Optional[torch.Tensor], lay: DispatchLayout, cached: bool,
                  fp8, peer_bases: torch.Tensor, regions: torch.Tensor, rank: int,
                  num_ranks: int, num_local: int, epoch_word: int, num_sms: int, timeout_ns: int,
                  errors: ErrorSink) -> None:
    """Expands staged rows (and this rank's own tokens) into the expert-major `recv_x`.

    `recv_x` is `[M, H]` bf16, or e4m3 rows with `recv_scales` when `fp8` keeps FP8; `recv`
    holds the dispatch's `recv_fields` arrays (`slot_rows` written unless `cached`).
    """
    fmt, dequant, amax_epsilon = _wire(fp8)
    kernel = jit.get_kernel("dispatch.cu", "dispatch_recv",
                            [topk_idx.shape[1], cached, _index_type(topk_idx), fmt, dequant])
    a = recv.address
    args = DispatchRecvArgs.fill(
        recv_x=recv_x.data_ptr(), recv_scales=addr(recv_scales),
        recv_weights=addr(recv_weights), max_rows=recv_x.shape[0], hidden=recv_x.shape[1],
        num_recv_tokens_per_rank=a("num_recv_tokens_per_rank"),
        num_recv_tokens_per_expert=a("num_recv_tokens_per_expert"),
        expert_row_start=a("expert_row_start"), src_expert_offset=a("src_expert_offset"),
        slot_rows=a("slot_rows"), x=x.data_ptr(), x_scales=addr(x_scales),
        amax_epsilon=amax_epsilon, topk_idx=topk_idx.data_ptr(),
        topk_weights=addr(topk_weights), pos_in_expert=lay.address("pos_in_expert"),
        slot_token=lay.address("slot_token"), num_tokens=x.shape[0],
        peer_bases=peer_bases.data_ptr(), regions=regions.data_ptr(), rank=rank,
        num_ranks=num_ranks, num_local=num_local, epoch_word=epoch_word,
        timeout_ns=timeout_ns, error_claim=errors.claim, error_record=errors.record)
    kernel.launch(num_sms, COMM_THREADS, args, _stream())


def dispatch_local(recv_x: torch.Tensor, recv_scales: Optional[torch.Tensor],
                   recv_weights: Optional[torch.Tensor], recv: Arena, x: torch.Tensor,
                   x_scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                   topk_weights: Optional[torch.Tensor], lay: DispatchLayout, cached: bool,
                   fp8, num_local: int, num_sms: int, after_layout: bool = False,
                   host_info_ptr: int = 0, host_epoch: int = 0) -> None:
    """EP = 1: expands `x [N, H]` into the expert-major `recv_x` with no protocol; the same
    outputs as `dispatch_recv` on one rank (`recv_weights` and `recv`'s `slot_rows` written
    unless `cached`, which reads `slot_rows`). `after_layout`: the previous kernel on this
    stream is the layout kernel of `lay`, so the launch may overlap its end (the kernel reads
    only `x`, complete before that layout began, until the layout has finished).
    `host_info_ptr` (a synchronous call launched before its host wait): the kernel publishes
    `recv`'s receive layout there with `host_epoch` once the layout has finished."""
    fmt, dequant, amax_epsilon = _wire(fp8)
    kernel = jit.get_kernel("dispatch.cu", "dispatch_local",
                            [topk_idx.shape[1], cached, _index_type(topk_idx), fmt, dequant])
    threads = 1024 if fmt == 0 else COMM_THREADS  # DispatchLocalThreads in dispatch.cu
    stage_bytes = _dispatch_stage_bytes(x.shape[1], threads) if fmt == 0 and not cached else 0
    a = recv.address
    args = DispatchLocalArgs.fill(
        recv_x=recv_x.data_ptr(), recv_scales=addr(recv_scales),
        recv_weights=addr(recv_weights), max_rows=recv_x.shape[0], hidden=recv_x.shape[1],
        num_recv_tokens_per_expert=a("num_recv_tokens_per_expert"),
        expert_row_start=a("expert_row_start"), slot_rows=a("slot_rows"), x=x.data_ptr(),
        x_scales=addr(x_scales), amax_epsilon=amax_epsilon, topk_idx=topk_idx.data_ptr(),
        topk_weights=addr(topk_weights), pos_in_expert=lay.address("pos_in_expert"),
        token_slot_in_rank=lay.address("token_slot_in_rank"), num_tokens=x.shape[0],
        num_local=num_local, host_info=host_info_ptr, tokens_per_expert=a("tokens_per_expert"),
        host_epoch=host_epoch & 0xFFFFFFFF)
    kernel.launch(num_sms, threads, args, _stream(), shared_mem=stage_bytes,
                  programmatic=after_layout)


# Dynamic shared memory per dispatch_local block for staging its warps' first rows (227 KB is
# sm_90's most per block; the kernel's own shared memory is static and small).
DISPATCH_STAGE_MAX_BYTES = 224 * 1024


def _dispatch_stage_bytes(hidden: int, threads: int) -> int:
    """Bytes a bf16 dispatch_local stages per block: the part of each warp's first row
    (`hidden` bf16) past the chunk it holds in registers (copy.cuh's 32 x 8 words), whole
    words per lane, within DISPATCH_STAGE_MAX_BYTES."""
    warps, first_chunk_words = threads // 32, 32 * 8
    words = max(hidden // 8 - first_chunk_words, 0)
    words_per_lane = min(-(-words // 32), DISPATCH_STAGE_MAX_BYTES // (warps * 32 * 16))
    return warps * words_per_lane * 32 * 16


# Row dtypes of dispatch and combine: kDtype of combine.cu. Dispatch copies bytes (a row of any
# of them travels as bf16 words of the same bytes: `as_wire_rows`).
ROW_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
ROW_DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def row_dtype_code(t: torch.Tensor) -> int:
    """combine.cu's kDtype for rows of `t`'s dtype."""
    code = ROW_DTYPE_CODES.get(t.dtype)
    assert code is not None, f"rows of {t.dtype} (the transports accept {list(ROW_DTYPE_CODES)})"
    return code


def as_wire_rows(x: torch.Tensor) -> torch.Tensor:
    """`x [N, H]` (a `ROW_DTYPE_CODES` dtype, contiguous, rows of 16-byte multiples) as the bf16
    rows `[N, H * x.element_size() / 2]` of the same bytes, which the dispatch kernels copy."""
    return x if x.dtype == torch.bfloat16 else x.view(torch.bfloat16)


def _num_int4(rows: torch.Tensor) -> int:
    return rows.shape[1] * rows.element_size() // 16


def combine_send(y: torch.Tensor, handle, weighted: bool,
                 grad_row_weights: Optional[torch.Tensor], peer_bases: torch.Tensor,
                 regions: torch.Tensor, rank: int, num_ranks: int, epoch_word: int, num_sms: int,
                 timeout_ns: int, errors: ErrorSink) -> None:
    """Sends one fp32-accumulated partial row (rounded to y's dtype) per received slot back to
    its source rank. `y` is `[M, H]` of a `ROW_DTYPE_CODES` dtype."""
    kernel = jit.get_kernel("combine.cu", "combine_send",
                            [handle.num_topk, weighted, grad_row_weights is not None,
                             row_dtype_code(y)])
    args = CombineSendArgs.fill(
        y=y.data_ptr(), num_int4=_num_int4(y),
        recv_weights=handle.recv_weights.data_ptr(), grad_row_weights=addr(grad_row_weights),
        slot_rows=handle.address("slot_rows"),
        num_recv_tokens_per_rank=handle.address("num_recv_tokens_per_rank"),
        peer_bases=peer_bases.data_ptr(), regions=regions.data_ptr(), rank=rank,
        num_ranks=num_ranks, epoch_word=epoch_word, timeout_ns=timeout_ns,
        error_claim=errors.claim, error_record=errors.record)
    kernel.launch(num_sms, COMM_THREADS, args, _stream())


def combine_reduce(out: torch.Tensor, out_weights: Optional[torch.Tensor], y: torch.Tensor,
                   handle, weighted: bool, grad_row_weights: Optional[torch.Tensor],
                   peer_bases: torch.Tensor, regions: torch.Tensor, rank: int, num_ranks: int,
                   epoch_word: int, num_sms: int, timeout_ns: int, errors: ErrorSink) -> None:
    """Sums every token's partials over ranks in fp32 into `out [N, H]` (y's dtype)."""
    assert out.dtype == y.dtype, (out.dtype, y.dtype)
    kernel = jit.get_kernel("combine.cu", "combine_reduce",
                            [handle.num_topk, weighted, grad_row_weights is not None,
                             row_dtype_code(y)])
    lay = handle.layout
    args = CombineReduceArgs.fill(
        out=out.data_ptr(), out_weights=addr(out_weights), num_tokens=out.shape[0],
        num_int4=_num_int4(out), y=y.data_ptr(),
        recv_weights=handle.recv_weights.data_ptr(), grad_row_weights=addr(grad_row_weights),
        slot_rows=handle.address("slot_rows"), is_token_in_rank=lay.address("is_token_in_rank"),
        token_slot_in_rank=lay.address("token_slot_in_rank"), peer_bases=peer_bases.data_ptr(),
        regions=regions.data_ptr(), rank=rank, num_ranks=num_ranks, epoch_word=epoch_word,
        timeout_ns=timeout_ns, error_claim=errors.claim, error_record=errors.record)
    kernel.launch(num_sms, COMM_THREADS, args, _stream())


def combine_local(out: torch.Tensor, out_weights: Optional[torch.Tensor], y: torch.Tensor,
                  handle, weighted: bool, grad_row_weights: Optional[torch.Tensor],
                  num_sms: int) -> None:
    """EP = 1: every token's rows of `y` summed into `out [N, H]`, no protocol; the same values
    as `combine_reduce` on one rank."""
    assert out.dtype == y.dtype, (out.dtype, y.dtype)
    kernel = jit.get_kernel("combine.cu", "combine_local",
                            [handle.num_topk, weighted, grad_row_weights is not None,
                             row_dtype_code(y)])
    threads = 1024 if handle.num_topk <= 8 else 512  # CombineLocalThreads in combine.cu
    args = CombineLocalArgs.fill(
        out=out.data_ptr(), out_weights=addr(out_weights), num_tokens=out.shape[0],
        num_int4=_num_int4(out), y=y.data_ptr(),
        recv_weights=handle.recv_weights.data_ptr(), grad_row_weights=addr(grad_row_weights),
        slot_rows=handle.address("slot_rows"),
        token_slot_in_rank=handle.layout.address("token_slot_in_rank"))
    kernel.launch(num_sms, threads, args, _stream())


# (kFmt, kDequant) pairs of dispatch_recv beyond bf16: every FP8 wire format, kept or dequantized.
FP8_RECV_VARIANTS = [(fmt, dequant) for fmt in (1, 2, 3) for dequant in (False, True)]


def kernel_names(num_topk: int, fp8: bool = False,
                 row_dtypes: Sequence[str] = ("bf16",)) -> dict:
    """Every instantiation a top-k needs, per source file (for compile checks and warm-up).

    Args:
        num_topk: K.
        fp8: list the FP8 dispatch variants instead of the bf16 ones for dispatch.cu.
        row_dtypes: the row dtypes (`ROW_DTYPE_NAMES` keys) to list combine kernels for
            (dispatch copies bytes: one set of dispatch kernels serves every dtype).
    """
    codes = [ROW_DTYPE_CODES[ROW_DTYPE_NAMES[name]] for name in row_dtypes]
    names = {"layout.cu": [], "notify.cu": ["notify_kernel"], "dispatch.cu": [],
             "combine.cu": []}
    send_fmts = (1, 2, 3) if fp8 else (0,)
    recv_variants = FP8_RECV_VARIANTS if fp8 else [(0, False)]
    for index_type in ("long long", "int"):
        names["layout.cu"].append(f"layout_kernel<{index_type}, {num_topk}>")
        for cached in ("false", "true"):
            prefix = f"{num_topk}, {cached}, {index_type}"
            names["dispatch.cu"] += [f"dispatch_send<{prefix}, {fmt}>" for fmt in send_fmts]
            names["dispatch.cu"] += [f"{kind}<{prefix}, {fmt}, {str(dq).lower()}>"
                                     for kind in ("dispatch_recv", "dispatch_local")
                                     for fmt, dq in recv_variants]
    for weighted in ("false", "true"):
        for with_weights in ("false", "true"):
            for kind in ("combine_send", "combine_reduce", "combine_local"):
                names["combine.cu"] += [f"{kind}<{num_topk}, {weighted}, {with_weights}, {code}>"
                                        for code in codes]
    return names


def warm_up(num_topks, row_dtypes: Sequence[str] = ("bf16",)) -> None:
    """Compiles (or loads from the disk cache) every kernel the given top-k values and row
    dtypes (`ROW_DTYPE_NAMES` keys) need."""
    for num_topk in num_topks:
        for source, exprs in kernel_names(num_topk, row_dtypes=row_dtypes).items():
            for expr in exprs:
                name, _, args = expr.partition("<")
                jit.get_kernel(source, name, [a.strip() for a in args.rstrip(">").split(",")]
                               if args else [])


# ---------------------------------------------------------------------------------------------
# Standalone FP8 quantize / dequantize (cuda_src/fp8.cu): the GPU versions of
# `fp8.formats.quantize` / `dequantize`, bit for bit.

def quantize_rows(x: torch.Tensor, fmt, num_warps: int = 8
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """`fp8.formats.quantize` on the GPU.

    Args:
        x: `[num_tokens, hidden]`, torch.bfloat16, contiguous, on a CUDA device.
        fmt: the wire format (`fp8.formats.Fp8Format`).
        num_warps: warps per CTA (the kernels' template knob).

    Returns:
        `(x_fp8 [num_tokens, hidden] e4m3, scales [num_tokens, num_blocks])` as `quantize`
        returns them, on x's device, computed on the current stream.
    """
    from megatron_deepep.fp8.formats import ScaleKind

    _check_bf16_rows(x)
    num_tokens, hidden = x.shape
    x_fp8 = torch.empty_like(x, dtype=torch.float8_e4m3fn)
    scales = torch.empty(num_tokens, fmt.num_blocks(hidden), dtype=fmt.scale_dtype,
                         device=x.device)
    if fmt.scale_kind is ScaleKind.FP32_SCALE_INV:
        kernel = jit.get_kernel("fp8.cu", "quantize_blockwise", [num_warps, fmt.power_2_scale])
    else:
        kernel = jit.get_kernel("fp8.cu", "quantize_mxfp8", [num_warps])
    args = QuantizeArgs.fill(x=x.data_ptr(), q=x_fp8.data_ptr(), scales=scales.data_ptr(),
                             num_tokens=num_tokens, hidden=hidden,
                             amax_epsilon=float(fmt.amax_epsilon))
    _launch_fp8(kernel, num_tokens, hidden, num_warps, args)
    return x_fp8, scales


def dequantize_rows(x_fp8: torch.Tensor, scales: torch.Tensor, fmt,
                    num_warps: int = 8) -> torch.Tensor:
    """`fp8.formats.dequantize` on the GPU; returns `[num_tokens, hidden]` bf16."""
    from megatron_deepep.fp8.formats import ScaleKind

    if x_fp8.dim() != 2:
        raise ValueError(f"x_fp8 must be 2-D, got shape {tuple(x_fp8.shape)}")
    num_tokens, hidden = x_fp8.shape
    if tuple(scales.shape) != (num_tokens, fmt.num_blocks(hidden)):
        raise ValueError(f"scales: expected shape {(num_tokens, fmt.num_blocks(hidden))}, got "
                         f"{tuple(scales.shape)}")
    if scales.dtype != fmt.scale_dtype or not (x_fp8.is_contiguous() and scales.is_contiguous()):
        raise ValueError(f"scales must be contiguous {fmt.scale_dtype} (got {scales.dtype}) and "
                         "x_fp8 contiguous")
    out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=x_fp8.device)
    name = ("dequantize_blockwise" if fmt.scale_kind is ScaleKind.FP32_SCALE_INV
            else "dequantize_mxfp8")
    kernel = jit.get_kernel("fp8.cu", name, [num_warps])
    args = DequantizeArgs.fill(q=x_fp8.data_ptr(), scales=scales.data_ptr(),
                               out=out.data_ptr(), num_tokens=num_tokens, hidden=hidden)
    _launch_fp8(kernel, num_tokens, hidden, num_warps, args)
    return out


def _check_bf16_rows(x: torch.Tensor) -> None:
    if x.dim() != 2 or not x.is_cuda or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 2-D bf16 CUDA tensor, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")


def _launch_fp8(kernel, num_tokens: int, hidden: int, num_warps: int, args) -> None:
    total_warps = num_tokens * math.ceil(hidden / 128)  # one per (token, 128-column chunk)
    if total_warps == 0:
        return
    kernel.launch(math.ceil(total_warps / num_warps), 32 * num_warps, args, _stream())


# ---------------------------------------------------------------------------------------------
# The columnwise (128x1) copy of rowwise FP8 rows per expert (cuda_src/fp8_columnwise.cu): the
# GPU version of `fp8.columnwise.reference`, bit for bit, in its packed layout.

COLUMNWISE_THREADS = 256  # kColumnwiseWarps * 32 in fp8_columnwise.cu
COLUMNWISE_TILE = 128  # columns per CTA


def columnwise_from_rowwise(x_fp8: torch.Tensor, scales: torch.Tensor,
                            row_offsets: torch.Tensor, num_blocks: int, *,
                            power_2_scale: bool = True, amax_epsilon: float = 0.0
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each expert's columnwise 128x1 FP8 copy of its rowwise 1x128 FP8 rows, in one kernel.

    Args:
        x_fp8: `[M, H]` torch.float8_e4m3fn (or its torch.uint8 bytes), contiguous, CUDA, rows
            grouped by expert; H % 16 == 0 (TE's FP8 GEMM rule).
        scales: `[M, ceil(H / 128)]` torch.float32 rowwise scale_inv, any strides (the wire's
            contiguous scales, or TE's GEMM-ready buffer seen as `buffer[:, :M].t()`).
        row_offsets: `[E + 1]` torch.int32, contiguous, on x's device: expert e's rows are
            `[row_offsets[e], row_offsets[e + 1])` (read on the device only).
        num_blocks: token blocks of all experts, `sum(ceil(m_e / 128))` (`fp8.columnwise.layout`;
            a larger bound works, the extra CTAs exit).
        power_2_scale, amax_epsilon: the columnwise quantizer's settings.

    Returns:
        `(col_data [H * M] torch.uint8, col_scales [num_blocks, round_up(H, 4)] torch.float32)`
        in `fp8.columnwise`'s packed layout: expert e's `[H, m_e]` data at `H * row_offsets[e]`,
        its `[ceil(m_e / 128), round_up(H, 4)]` scales from its first token block's row.
        Computed on the current stream.

    Raises:
        ValueError: an argument of the wrong shape, dtype, layout or device (named).
    """
    from megatron_deepep.fp8.columnwise import scale_columns

    _check_columnwise_args(x_fp8, scales, row_offsets, num_blocks)
    num_rows, hidden = x_fp8.shape
    col_data = torch.empty(hidden * num_rows, dtype=torch.uint8, device=x_fp8.device)
    col_scales = torch.empty(num_blocks, scale_columns(hidden), dtype=torch.float32,
                             device=x_fp8.device)
    num_tiles = math.ceil(hidden / COLUMNWISE_TILE)
    if num_blocks == 0 or num_tiles == 0:
        return col_data, col_scales
    kernel = jit.get_kernel("fp8_columnwise.cu", "columnwise_from_rowwise",
                            [bool(power_2_scale)])
    args = ColumnwiseArgs.fill(
        q=x_fp8.data_ptr(), scales=scales.data_ptr(), token_stride=scales.stride(0),
        block_stride=scales.stride(1), row_offsets=row_offsets.data_ptr(),
        col_data=col_data.data_ptr(), col_scales=col_scales.data_ptr(),
        num_experts=row_offsets.numel() - 1, num_rows=num_rows, hidden=hidden,
        scale_cols=col_scales.shape[1], num_blocks=num_blocks, amax_epsilon=float(amax_epsilon))
    kernel.launch(num_blocks * num_tiles, COLUMNWISE_THREADS, args, _stream())
    return col_data, col_scales


def _check_columnwise_args(x_fp8: torch.Tensor, scales: torch.Tensor,
                           row_offsets: torch.Tensor, num_blocks: int) -> None:
    if x_fp8.dim() != 2 or x_fp8.dtype not in (torch.float8_e4m3fn, torch.uint8) \
            or not x_fp8.is_contiguous() or x_fp8.data_ptr() % 16:
        raise ValueError(f"x_fp8 must be a contiguous, 16-byte aligned 2-D float8_e4m3fn (or "
                         f"uint8) tensor, got {x_fp8.dtype} {tuple(x_fp8.shape)}")
    num_rows, hidden = x_fp8.shape
    if hidden % 16:
        raise ValueError(f"x_fp8: hidden {hidden} is not a multiple of 16 (TE's FP8 GEMM rule)")
    expected = (num_rows, math.ceil(hidden / 128))
    if tuple(scales.shape) != expected or scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32 {expected}, got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    if row_offsets.dim() != 1 or row_offsets.numel() < 1 or row_offsets.dtype != torch.int32 \
            or not row_offsets.is_contiguous():
        raise ValueError(f"row_offsets must be a contiguous 1-D int32 tensor [E + 1], got "
                         f"{row_offsets.dtype} {tuple(row_offsets.shape)}")
    if not (x_fp8.device == scales.device == row_offsets.device) or x_fp8.device.type != "cuda":
        raise ValueError(f"x_fp8, scales and row_offsets must be on one CUDA device, got "
                         f"{x_fp8.device}, {scales.device}, {row_offsets.device}")
    if num_blocks < 0 or num_rows >= 2 ** 31 or hidden * num_rows >= 2 ** 62:
        raise ValueError(f"num_blocks {num_blocks} / shape {tuple(x_fp8.shape)} out of range")


# ---------------------------------------------------------------------------------------------
# Ceiling kernels for the benchmark (cuda_src/ceiling.cu).

def fill(dst: torch.Tensor, num_blocks: int) -> None:
    """`fill_kernel`: zeroes `dst` (contiguous, a multiple of 16 bytes) with 16-byte stores,
    `num_blocks` blocks of 256 threads."""
    args = FillArgs.fill(dst=dst.data_ptr(), num_int4=dst.numel() * dst.element_size() // 16)
    jit.get_kernel("ceiling.cu", "fill_kernel").launch(num_blocks, 256, args, _stream())


def fan_out_copy(src: torch.Tensor, dst_rows: torch.Tensor, dst: torch.Tensor, fan_out: int,
                 num_blocks: int) -> None:
    """`fan_out_copy`: row n of `src [N, H]` written to rows `dst_rows[n * fan_out + k]` of
    `dst` (int32, -1 skips), `num_blocks` blocks of 512 threads."""
    args = FanOutArgs.fill(src=src.data_ptr(), dst_rows=dst_rows.data_ptr(),
                           dst=dst.data_ptr(), num_rows=src.shape[0],
                           num_int4=src.shape[1] * src.element_size() // 16, fan_out=fan_out)
    jit.get_kernel("ceiling.cu", "fan_out_copy").launch(num_blocks, 512, args, _stream())


def fan_in_sum(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor,
               num_blocks: int) -> None:
    """`fan_in_sum`: row n of `dst` = the fp32 sum of the 8 rows `src_rows [N, 8]` (int32,
    -1 skips) of `src [M, H]` bf16, `num_blocks` blocks of 512 threads."""
    args = FanInArgs.fill(src=src.data_ptr(), src_rows=src_rows.data_ptr(),
                          dst=dst.data_ptr(), num_rows=src_rows.shape[0],
                          num_int4=src.shape[1] * src.element_size() // 16)
    jit.get_kernel("ceiling.cu", "fan_in_sum").launch(num_blocks, 512, args, _stream())


PEER_COPY_THREADS = 512


def peer_copy(src: torch.Tensor, peer_bases: torch.Tensor, rank: int, num_blocks: int) -> None:
    """`peer_copy`: row d of `src [R, bytes_per_peer]` (uint8, contiguous, rows of 16-byte
    multiples) written into slot `rank` of rank d's symmetric buffer, for every d != rank;
    `peer_bases [R]` int64 on the device (`SymmetricBuffer.peer_bases`), each buffer at least
    `R * bytes_per_peer` bytes. `num_blocks` blocks of 512 threads, spread over the peers."""
    num_ranks, bytes_per_peer = src.shape
    assert src.dtype == torch.uint8 and src.is_contiguous() and bytes_per_peer % 16 == 0, (
        f"src must be contiguous uint8 rows of 16-byte multiples, got {src.dtype} "
        f"{tuple(src.shape)}")
    assert peer_bases.dtype == torch.int64 and peer_bases.numel() == num_ranks
    args = PeerCopyArgs.fill(src=src.data_ptr(), peer_bases=peer_bases.data_ptr(),
                             num_int4_per_peer=bytes_per_peer // 16, rank=rank,
                             num_ranks=num_ranks)
    jit.get_kernel("ceiling.cu", "peer_copy").launch(num_blocks, PEER_COPY_THREADS, args,
                                                     _stream())


# ---------------------------------------------------------------------------------------------
# The network leg (NVSHMEM-linked kernels: nvshmem_link builds and loads them).

LEG_SEND_THREADS = 256


def internode_leg_send(recv: torch.Tensor, send: torch.Tensor, signals: torch.Tensor,
                       peer: int, num_blocks: int, errors: ErrorSink) -> None:
    """Puts `send [bytes]` uint8 into slot [my PE] of PE `peer`'s symmetric `recv
    [num_pes * bytes]` in `num_blocks` chunks, each adding 1 to the peer's `signals [num_pes]`
    int64 word of this PE; `peer` < 0 sends nothing."""
    args = LegArgs.fill(recv=recv.data_ptr(), send=send.data_ptr(), signals=signals.data_ptr(),
                        bytes=send.numel(), expected=0, timeout_ns=0, peer=peer, source=-1,
                        error_claim=errors.claim, error_record=errors.record, info=0)
    nvshmem_link.get_kernel("internode_leg.cu", "internode_leg_send").launch(
        num_blocks, LEG_SEND_THREADS, args, _stream())


def internode_leg_wait(signals: torch.Tensor, source: int, expected: int, timeout_ns: int,
                       errors: ErrorSink, info: torch.Tensor) -> None:
    """Waits until `signals[source] >= expected` (or records a timeout naming `source`);
    `info [2]` int64 gets (my PE, number of PEs) as the kernel saw them."""
    args = LegArgs.fill(recv=0, send=0, signals=signals.data_ptr(), bytes=0, expected=expected,
                        timeout_ns=timeout_ns, peer=-1, source=source, error_claim=errors.claim,
                        error_record=errors.record, info=info.data_ptr())
    nvshmem_link.get_kernel("internode_leg.cu", "internode_leg_wait").launch(
        1, 32, args, _stream())


# ---------------------------------------------------------------------------------------------
# The internode transport (cuda_src/internode.cu; NVSHMEM-linked). Every kernel takes the same
# `InternodeArgs`; the transport fills the fields of the call (`fields`: every name of
# InternodeArgs) and each wrapper picks the template arguments and the grid. All kernels of one
# (top-k, topk_idx dtype) are linked into one module on first use (one link, one module init).

INTERNODE_THREADS = 512
INTERNODE_NOTIFY_THREADS = 256  # one thread per local expert (kMaxLocalExperts)
INTERNODE_FIELDS = tuple(name for name, _ in InternodeArgs._fields_)


def internode_expressions(num_topk: int, index_type: str, fp8=None) -> Tuple[str, ...]:
    """The dispatch kernels of the internode transport for one top-k, topk_idx index type ("int"
    or "long long") and wire format (`fp8`: an `Fp8Dispatch` or None): one linked module."""
    fmt, dequant, _ = _wire(fp8)
    k, idx, both = num_topk, index_type, ("false", "true")
    dq = jit.render_template_arg(dequant)
    return (("internode_node_layout", "internode_notify", f"internode_forward<{k}>")
            + tuple(f"internode_dispatch_send<{k}, {c}, {idx}, {fmt}>" for c in both)
            + tuple(f"internode_dispatch_recv<{k}, {c}, {fmt}, {dq}>" for c in both))


def internode_combine_expressions(num_topk: int, row_dtype: int) -> Tuple[str, ...]:
    """The combine kernels of the internode transport for one top-k and row dtype code
    (`ROW_DTYPE_CODES`): one linked module."""
    k, dt, both = num_topk, row_dtype, ("false", "true")
    return (tuple(f"internode_combine_send<{k}, {w}, {g}, {dt}>" for w in both for g in both)
            + tuple(f"internode_combine_forward<{k}, {g}, {dt}>" for g in both)
            + tuple(f"internode_combine_reduce<{k}, {g}, {dt}>" for g in both))


def internode_ring_expressions(num_topk: int, index_type: str, fp8=None) -> Tuple[str, ...]:
    """The dispatch kernels of ring staging for one top-k, index type and wire format: node
    layout, notify and send as with full staging, then the ring count and the one kernel that
    forwards and expands (one linked module)."""
    fmt, dequant, _ = _wire(fp8)
    k, idx, both = num_topk, index_type, ("false", "true")
    dq = jit.render_template_arg(dequant)
    return (("internode_node_layout", "internode_notify", f"internode_ring_count<{k}>")
            + tuple(f"internode_dispatch_send<{k}, {c}, {idx}, {fmt}>" for c in both)
            + tuple(f"internode_ring_dispatch<{k}, {c}, {fmt}, {dq}>" for c in both))


def internode_ring_combine_expressions(num_topk: int, row_dtype: int) -> Tuple[str, ...]:
    """The combine kernels of ring staging for one top-k and row dtype code: the one kernel that
    sends the partials and sums them on the forwarder, then reduce as with full staging."""
    k, dt, both = num_topk, row_dtype, ("false", "true")
    return (tuple(f"internode_ring_combine<{k}, {w}, {g}, {dt}>" for w in both for g in both)
            + tuple(f"internode_combine_reduce<{k}, {g}, {dt}>" for g in both))


def internode_net_expressions(num_topk: int, index_type: str, fp8=None) -> Tuple[str, ...]:
    """The dispatch kernels of the network ring for one top-k, index type and wire format: node
    layout and notify as with full staging, then the one kernel that sends, forwards and expands
    (one linked module)."""
    fmt, dequant, _ = _wire(fp8)
    k, idx, both = num_topk, index_type, ("false", "true")
    dq = jit.render_template_arg(dequant)
    return (("internode_node_layout", "internode_notify")
            + tuple(f"internode_net_dispatch<{k}, {c}, {idx}, {fmt}, {dq}>" for c in both))


def internode_net_combine_expressions(num_topk: int, row_dtype: int) -> Tuple[str, ...]:
    """The combine kernel of the network ring for one top-k and row dtype code: partials, the
    forwarder's sums and the source's reduce in one kernel."""
    k, dt, both = num_topk, row_dtype, ("false", "true")
    return tuple(f"internode_net_combine<{k}, {w}, {g}, {dt}>" for w in both for g in both)


def internode_families(staging: str) -> Tuple[Callable, Callable]:
    """The (dispatch, combine) expression functions of a staging mode: "full", "ring" or "net"
    (ring staging with the network ring)."""
    return {"full": (internode_expressions, internode_combine_expressions),
            "ring": (internode_ring_expressions, internode_ring_combine_expressions),
            "net": (internode_net_expressions, internode_net_combine_expressions)}[staging]


def _internode(family: Tuple[str, ...], name: str, template_args: tuple, num_blocks: int,
               threads: int, fields: dict) -> None:
    expr = name
    if template_args:
        expr += "<" + ", ".join(jit.render_template_arg(a) for a in template_args) + ">"
    kernel = nvshmem_link.get_kernels("internode.cu", family, torch.cuda.current_device())[expr]
    kernel.launch(num_blocks, threads, InternodeArgs.fill(**fields), _stream())


def _dispatch_family(topk_idx: torch.Tensor, fp8, ring: bool = False,
                     net: bool = False) -> Tuple[str, ...]:
    expressions = internode_families("net" if net else "ring" if ring else "full")[0]
    return expressions(topk_idx.shape[1], _index_type(topk_idx), fp8)


def _combine_family(topk_idx: torch.Tensor, y: torch.Tensor,
                    ring: bool = False, net: bool = False) -> Tuple[str, ...]:
    expressions = internode_families("net" if net else "ring" if ring else "full")[1]
    return expressions(topk_idx.shape[1], row_dtype_code(y))


def internode_wire(fp8, hidden: int) -> dict:
    """The FP8 fields of `InternodeArgs` (`fp8`: an `Fp8Dispatch` or None): the wire row's bytes
    (e4m3 data then its scales, or the bf16 row) and the quantizer's epsilon."""
    _, _, amax_epsilon = _wire(fp8)
    wire_bytes = 2 * hidden if fp8 is None else fp8.fmt.bytes_per_token(hidden)
    return dict(wire_bytes=wire_bytes, amax_epsilon=amax_epsilon)


def internode_node_layout(topk_idx: torch.Tensor, fp8, num_nodes: int, fields: dict,
                          ring: bool = False, net: bool = False) -> None:
    """Node-level layout (token_slot_in_node, node_slot_token, num_tokens_per_node) from
    is_token_in_rank: one block per node. `ring` / `net`: from ring staging's / the network
    ring's module."""
    _internode(_dispatch_family(topk_idx, fp8, ring, net), "internode_node_layout", (),
               num_nodes, INTERNODE_THREADS, fields)


def internode_notify(topk_idx: torch.Tensor, fp8, fields: dict, ring: bool = False,
                     net: bool = False) -> None:
    """Counts to every PE, then this rank's receive layout and forwarding counts (`net`: also
    the rail counts, into the handle's `ring_base`)."""
    _internode(_dispatch_family(topk_idx, fp8, ring, net), "internode_notify", (), 1,
               INTERNODE_NOTIFY_THREADS, fields)


def internode_dispatch_send(topk_idx: torch.Tensor, cached: bool, fp8, num_sms: int,
                            fields: dict, ring: bool = False) -> None:
    """Packs (quantizes, for `fp8`) and puts every token once per destination node."""
    _internode(_dispatch_family(topk_idx, fp8, ring), "internode_dispatch_send",
               (topk_idx.shape[1], cached, _index_type(topk_idx), _wire(fp8)[0]), num_sms,
               INTERNODE_THREADS, fields)


def internode_forward(topk_idx: torch.Tensor, fp8, num_sms: int, fields: dict) -> None:
    """Copies every received wire row into the staging of its destination ranks in this node."""
    _internode(_dispatch_family(topk_idx, fp8), "internode_forward", (topk_idx.shape[1],),
               num_sms, INTERNODE_THREADS, fields)


def internode_dispatch_recv(topk_idx: torch.Tensor, cached: bool, fp8, num_sms: int,
                            fields: dict) -> None:
    """Expands the staged rows of every source into the expert-major recv_x (dequantized, or
    FP8 rows and scales, as `fp8` asks)."""
    fmt, dequant, _ = _wire(fp8)
    _internode(_dispatch_family(topk_idx, fp8), "internode_dispatch_recv",
               (topk_idx.shape[1], cached, fmt, dequant), num_sms, INTERNODE_THREADS, fields)


def internode_combine_send(topk_idx: torch.Tensor, y: torch.Tensor, weighted: bool,
                           with_weights: bool, num_sms: int, fields: dict) -> None:
    """One partial row per staged token (rows of `y`'s dtype), to the token's forwarder in this
    node."""
    _internode(_combine_family(topk_idx, y), "internode_combine_send",
               (topk_idx.shape[1], weighted, with_weights, row_dtype_code(y)), num_sms,
               INTERNODE_THREADS, fields)


def internode_combine_forward(topk_idx: torch.Tensor, y: torch.Tensor, with_weights: bool,
                              num_sms: int, fields: dict) -> None:
    """Sums this node's partials per forwarded token and puts them back to the sources."""
    _internode(_combine_family(topk_idx, y), "internode_combine_forward",
               (topk_idx.shape[1], with_weights, row_dtype_code(y)), num_sms, INTERNODE_THREADS,
               fields)


def internode_combine_reduce(topk_idx: torch.Tensor, y: torch.Tensor, with_weights: bool,
                             num_sms: int, fields: dict, ring: bool = False) -> None:
    """Sums each token's partials over its destination nodes, in node order."""
    _internode(_combine_family(topk_idx, y, ring), "internode_combine_reduce",
               (topk_idx.shape[1], with_weights, row_dtype_code(y)), num_sms, INTERNODE_THREADS,
               fields)


def internode_ring_count(topk_idx: torch.Tensor, fp8, num_nodes: int, fields: dict) -> None:
    """Ring staging, on the forwarder: waits for its rail peers' rows, then counts them per
    (node rank, source node) into the handle's `ring_base`: one block per source node."""
    _internode(_dispatch_family(topk_idx, fp8, True), "internode_ring_count",
               (topk_idx.shape[1],), num_nodes, INTERNODE_THREADS, fields)


def internode_ring_dispatch(topk_idx: torch.Tensor, cached: bool, fp8, num_blocks: int,
                            fields: dict) -> None:
    """Ring staging: forwards the received rows through the node's rings and expands the rows
    the rings bring into recv_x, in one kernel of `num_blocks` co-resident blocks."""
    fmt, dequant, _ = _wire(fp8)
    _internode(_dispatch_family(topk_idx, fp8, True), "internode_ring_dispatch",
               (topk_idx.shape[1], cached, fmt, dequant), num_blocks, INTERNODE_THREADS, fields)


def internode_ring_combine(topk_idx: torch.Tensor, y: torch.Tensor, weighted: bool,
                           with_weights: bool, num_blocks: int, fields: dict) -> None:
    """Ring staging: sends the partials through the node's rings and sums the forwarded tokens'
    partials, putting them back by chunks, in one kernel of `num_blocks` co-resident blocks."""
    _internode(_combine_family(topk_idx, y, True), "internode_ring_combine",
               (topk_idx.shape[1], weighted, with_weights, row_dtype_code(y)), num_blocks,
               INTERNODE_THREADS, fields)


# Warp groups per rank of the network ring's kernels (kNetGroupsPerRank in internode.cu): their
# grid needs at least this many x L warps, so that every role has a warp.
NET_ROLE_GROUPS_PER_RANK = 3


def net_ring_min_blocks(ranks_per_node: int) -> int:
    """The fewest blocks of INTERNODE_THREADS that give every role of the network ring's
    kernels a warp (3 L warps)."""
    warps = INTERNODE_THREADS // 32
    return -(-NET_ROLE_GROUPS_PER_RANK * ranks_per_node // warps)


def internode_net_dispatch(topk_idx: torch.Tensor, cached: bool, fp8, num_blocks: int,
                           fields: dict) -> None:
    """Network ring: sends this rank's chunks, forwards the chunks its rail peers sent through
    the node's rings and expands the rows the rings bring into recv_x, in one kernel of
    `num_blocks` co-resident blocks (at least `net_ring_min_blocks`)."""
    assert num_blocks >= net_ring_min_blocks(fields["ranks_per_node"]), num_blocks
    fmt, dequant, _ = _wire(fp8)
    _internode(_dispatch_family(topk_idx, fp8, net=True), "internode_net_dispatch",
               (topk_idx.shape[1], cached, _index_type(topk_idx), fmt, dequant), num_blocks,
               INTERNODE_THREADS, fields)


def internode_net_combine(topk_idx: torch.Tensor, y: torch.Tensor, weighted: bool,
                          with_weights: bool, num_blocks: int, fields: dict) -> None:
    """Network ring: sends the partials through the node's rings, sums the forwarded tokens'
    partials and puts them back by chunks, and sums this rank's tokens' rows from every node
    into `out`, in one kernel of `num_blocks` co-resident blocks."""
    assert num_blocks >= net_ring_min_blocks(fields["ranks_per_node"]), num_blocks
    _internode(_combine_family(topk_idx, y, net=True), "internode_net_combine",
               (topk_idx.shape[1], weighted, with_weights, row_dtype_code(y)), num_blocks,
               INTERNODE_THREADS, fields)
