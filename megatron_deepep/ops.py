"""One thin typed wrapper per CUDA operation: picks template arguments and launches.

The only module that calls `jit`. Callers (the NVLink transport) have validated the user's
arguments; wrappers here assert internal invariants (dtypes, contiguity) and pass raw pointers.
Every launch goes on the torch stream that is current when it is called.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import numpy as np
import torch

from megatron_deepep import jit
from megatron_deepep.layout import DispatchLayout

LAYOUT_THREADS = 512
NOTIFY_THREADS = 256
COMM_THREADS = 512

i32, u32, u64, f32 = np.int32, np.uint32, np.uint64, np.float32
ptr = jit.ptr


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


def _stream():
    """The stream kernels go to now: `launch_on`'s, else the current one as a raw handle
    (building a torch Stream object per launch costs tens of µs)."""
    stream = getattr(_launch, "stream", None)
    return stream if stream is not None else jit.current_raw_stream()


class ErrorSink:
    """Where kernels record the first error: a device claim word and a host-mapped record."""

    def __init__(self, claim_ptr: int, record_ptr: int):
        self.claim, self.record = u64(claim_ptr), u64(record_ptr)


# The layout kernel keeps per-chunk bitmaps in shared memory: this many 32-bit words of them.
LAYOUT_BITMAP_WORDS = 8192
LAYOUT_MAX_CHUNK_ENTRIES = 2 * LAYOUT_THREADS  # kEntriesPerThread in layout.cu
LAYOUT_MAX_COUNTS = 5 * LAYOUT_THREADS  # kCountsPerThread: experts plus ranks


# Entries per block by default: scripts/probe_layout.py measured 512 fastest on H200 at the
# bench shapes (9.9 / 11.0 / 7.9 µs against 15.8 / 15.3 / 14.1 µs at 1024).
LAYOUT_CHUNK_ENTRIES = LAYOUT_THREADS


def layout_chunk_tokens(num_experts: int, num_topk: int,
                        max_entries: int = LAYOUT_CHUNK_ENTRIES) -> int:
    """Tokens per block of the layout kernel: as many as fit `max_entries` entries (at most
    the kernel's LAYOUT_MAX_CHUNK_ENTRIES) and its bitmap limit."""
    words_per_expert = max(1, min(max_entries // 32, LAYOUT_BITMAP_WORDS // num_experts))
    return max(1, 32 * words_per_expert // num_topk)


class _LayoutWorkspace:
    """The layout kernel's state between launches, for one stream: an epoch word and a
    finished-blocks counter, a status word per chunk and its published counts
    (`[chunks, 2, experts + ranks]` int32). Zeroed once; grown (zeroed again) when a call needs
    more chunks or counts. One per stream, since two layouts running at once would share it."""

    def __init__(self):
        self.tensor = None
        self.max_chunks = self.max_counts = 0

    def views(self, num_chunks: int, num_counts: int, device):
        if num_chunks > self.max_chunks or num_counts > self.max_counts:
            self.max_chunks = max(num_chunks, 2 * self.max_chunks, 64)
            self.max_counts = max(num_counts, self.max_counts)
            self.tensor = torch.zeros(2 + self.max_chunks * (1 + 2 * self.max_counts),
                                      dtype=torch.int32, device=device)
            # The zeros come from the current stream; the kernel may run on another.
            torch.cuda.current_stream(device).synchronize()
        state, status, counts = self.tensor.split(
            [2, self.max_chunks, self.max_chunks * 2 * self.max_counts])
        return state, status, counts


_layout_workspaces: dict = {}


def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, rank: int,
           errors: ErrorSink, extra_ints: int = 0, timeout_ns: int = 10**10,
           chunk_tokens: Optional[int] = None):
    """`DispatchLayout` of `topk_idx [N, K]` (see layout.py), computed by layout.cu.

    `chunk_tokens` (tokens per block) defaults to `layout_chunk_tokens` (512 entries); tests and
    probes may pass any size up to the kernel's limit.

    Returns the layout and a `[extra_ints]` int32 scratch tensor carved from the same allocation
    (the caller's receive-side arrays): allocations dominate the host time of a dispatch.
    """
    num_tokens, num_topk = topk_idx.shape
    num_counts = num_experts + num_ranks
    if num_counts > LAYOUT_MAX_COUNTS:
        raise ValueError(f"num_experts={num_experts} with {num_ranks} ranks exceeds the layout "
                         f"kernel's {LAYOUT_MAX_COUNTS} experts plus ranks")
    dev = topk_idx.device
    bool_words = -(-num_tokens * num_ranks // 4)  # is_token_in_rank as bytes of int32 words
    sizes = [num_ranks, num_experts, num_tokens * num_ranks, num_ranks * num_tokens,
             num_tokens * num_topk, bool_words, extra_ints]
    per_rank, per_expert, slot_in_rank, slot_token, pos, in_rank, extra = torch.empty(
        sum(sizes), dtype=torch.int32, device=dev).split(sizes)
    out = DispatchLayout(
        num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert,
        is_token_in_rank=in_rank.view(torch.uint8)[:num_tokens * num_ranks].view(
            torch.bool).view(num_tokens, num_ranks),
        token_slot_in_rank=slot_in_rank.view(num_tokens, num_ranks),
        slot_token=slot_token.view(num_ranks, num_tokens),
        pos_in_expert=pos.view(num_tokens, num_topk))
    max_chunk_tokens = layout_chunk_tokens(num_experts, num_topk, LAYOUT_MAX_CHUNK_ENTRIES)
    if chunk_tokens is None:
        chunk_tokens = layout_chunk_tokens(num_experts, num_topk)
    elif not 1 <= chunk_tokens <= max_chunk_tokens:
        raise ValueError(f"chunk_tokens={chunk_tokens} is outside [1, {max_chunk_tokens}] for "
                         f"{num_experts} experts and top-{num_topk}")
    num_chunks = max(1, -(-num_tokens // chunk_tokens))
    stream = _stream()
    workspace = _layout_workspaces.setdefault((dev.index, stream.cuda_stream), _LayoutWorkspace())
    state, status, counts = workspace.views(num_chunks, num_counts, dev)
    shared_words = (num_experts * (-(-chunk_tokens * num_topk // 32))
                    + num_ranks * (-(-chunk_tokens // 32)) + num_counts)
    kernel = jit.get_kernel("layout.cu", "layout_kernel", [_index_type(topk_idx), num_topk])
    kernel.launch(num_chunks, LAYOUT_THREADS, [
        ptr(topk_idx), i32(num_tokens), i32(num_experts), i32(num_ranks), i32(chunk_tokens),
        ptr(out.num_tokens_per_expert), ptr(out.pos_in_expert), ptr(out.num_tokens_per_rank),
        ptr(out.is_token_in_rank), ptr(out.token_slot_in_rank), ptr(out.slot_token),
        ptr(state), ptr(status), ptr(counts), u64(timeout_ns), errors.claim, errors.record,
        i32(rank)], stream, shared_mem=4 * shared_words)
    return out, extra


def notify(peer_bases: torch.Tensor, rank: int, num_ranks: int, epoch: int,
           lay: DispatchLayout, num_local: int, hidden: int, num_topk: int, alignment: int,
           max_recv_rows: int, recv, num_recv_tokens_per_rank: torch.Tensor, host_info_ptr: int,
           timeout_ns: int, errors: ErrorSink) -> None:
    """Exchanges counts with every peer and fills `recv` (a RecvLayout) on the device."""
    kernel = jit.get_kernel("notify.cu", "notify_kernel")
    kernel.launch(1, NOTIFY_THREADS, [
        ptr(peer_bases), i32(rank), i32(num_ranks), u32(epoch & 0xFFFFFFFF),
        ptr(lay.num_tokens_per_rank), ptr(lay.num_tokens_per_expert), i32(num_local),
        i32(hidden), i32(num_topk), i32(alignment), i32(max_recv_rows),
        ptr(num_recv_tokens_per_rank), ptr(recv.num_recv_tokens_per_expert),
        ptr(recv.tokens_per_expert), ptr(recv.expert_row_start), ptr(recv.src_expert_offset),
        u64(host_info_ptr), u64(timeout_ns), errors.claim, errors.record], _stream())


def _wire(fp8) -> tuple:
    """(kFmt, kDequant, amax_epsilon) of an optional `Fp8Dispatch`."""
    if fp8 is None:
        return 0, False, 0.0
    return fp8.wire_code, fp8.dequantize, float(fp8.fmt.amax_epsilon)


def dispatch_send(x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                  topk_weights: Optional[torch.Tensor], lay: DispatchLayout, cached: bool,
                  fp8, peer_bases: torch.Tensor, regions: torch.Tensor, rank: int,
                  num_ranks: int, num_local: int, epoch: int, num_sms: int, timeout_ns: int,
                  errors: ErrorSink) -> None:
    """Writes every token row (quantized when `fp8` is given) into each peer's staging region.

    `x` is `[N, H]` bf16, or e4m3 data with its `x_scales` (pre-quantized); `fp8` an
    `Fp8Dispatch` or None.
    """
    num_tokens, hidden = x.shape
    num_topk = lay.pos_in_expert.shape[1]
    fmt, _, amax_epsilon = _wire(fp8)
    kernel = jit.get_kernel("dispatch.cu", "dispatch_send",
                            [num_topk, cached, _index_type(topk_idx), fmt])
    kernel.launch(num_sms, COMM_THREADS, [
        ptr(x), ptr(x_scales), i32(num_tokens), i32(hidden), f32(amax_epsilon), ptr(topk_idx),
        ptr(topk_weights), ptr(lay.pos_in_expert), ptr(lay.is_token_in_rank),
        ptr(lay.token_slot_in_rank), ptr(peer_bases), ptr(regions), i32(rank), i32(num_ranks),
        i32(num_local), u32(epoch & 0xFFFFFFFF), u64(timeout_ns), errors.claim, errors.record],
        _stream())


def dispatch_recv(recv_x: torch.Tensor, recv_scales: Optional[torch.Tensor],
                  recv_weights: Optional[torch.Tensor], recv,
                  num_recv_tokens_per_rank: torch.Tensor, slot_rows: torch.Tensor,
                  x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                  topk_weights: Optional[torch.Tensor], lay: DispatchLayout, cached: bool,
                  fp8, peer_bases: torch.Tensor, regions: torch.Tensor, rank: int,
                  num_ranks: int, num_local: int, epoch: int, num_sms: int, timeout_ns: int,
                  errors: ErrorSink) -> None:
    """Expands staged rows (and this rank's own tokens) into the expert-major `recv_x`.

    `recv_x` is `[M, H]` bf16, or e4m3 rows with `recv_scales` when `fp8` keeps FP8.
    """
    num_topk = slot_rows.shape[2]
    fmt, dequant, amax_epsilon = _wire(fp8)
    kernel = jit.get_kernel("dispatch.cu", "dispatch_recv",
                            [num_topk, cached, _index_type(topk_idx), fmt, dequant])
    kernel.launch(num_sms, COMM_THREADS, [
        ptr(recv_x), ptr(recv_scales), ptr(recv_weights), i32(recv_x.shape[0]),
        i32(recv_x.shape[1]), ptr(num_recv_tokens_per_rank),
        ptr(recv.num_recv_tokens_per_expert), ptr(recv.expert_row_start),
        ptr(recv.src_expert_offset), ptr(slot_rows), ptr(x), ptr(x_scales), f32(amax_epsilon),
        ptr(topk_idx), ptr(topk_weights), ptr(lay.pos_in_expert), ptr(lay.slot_token),
        i32(x.shape[0]), ptr(peer_bases), ptr(regions), i32(rank), i32(num_ranks),
        i32(num_local), u32(epoch & 0xFFFFFFFF), u64(timeout_ns), errors.claim,
        errors.record], _stream())


def dispatch_local(recv_x: torch.Tensor, recv_scales: Optional[torch.Tensor],
                   recv_weights: Optional[torch.Tensor], recv, slot_rows: torch.Tensor,
                   x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                   topk_weights: Optional[torch.Tensor], lay: DispatchLayout, cached: bool,
                   fp8, num_local: int, num_sms: int) -> None:
    """EP = 1: expands `x [N, H]` into the expert-major `recv_x` with no protocol; the same
    outputs as `dispatch_recv` on one rank (`recv_weights` and `slot_rows` written unless
    `cached`, which reads `slot_rows`)."""
    num_topk = slot_rows.shape[2]
    fmt, dequant, amax_epsilon = _wire(fp8)
    kernel = jit.get_kernel("dispatch.cu", "dispatch_local",
                            [num_topk, cached, _index_type(topk_idx), fmt, dequant])
    threads = 1024 if fmt == 0 else COMM_THREADS  # DispatchLocalThreads in dispatch.cu
    kernel.launch(num_sms, threads, [
        ptr(recv_x), ptr(recv_scales), ptr(recv_weights), i32(recv_x.shape[0]),
        i32(recv_x.shape[1]), ptr(recv.num_recv_tokens_per_expert),
        ptr(recv.expert_row_start), ptr(slot_rows), ptr(x), ptr(x_scales), f32(amax_epsilon),
        ptr(topk_idx), ptr(topk_weights), ptr(lay.pos_in_expert), ptr(lay.token_slot_in_rank),
        i32(x.shape[0]), i32(num_local)], _stream())


def combine_send(y: torch.Tensor, handle, weighted: bool,
                 grad_row_weights: Optional[torch.Tensor], peer_bases: torch.Tensor,
                 regions: torch.Tensor, rank: int, num_ranks: int, epoch: int, num_sms: int,
                 timeout_ns: int, errors: ErrorSink) -> None:
    """Sends one fp32-accumulated partial row per received slot back to its source rank."""
    kernel = jit.get_kernel("combine.cu", "combine_send",
                            [handle.num_topk, weighted, grad_row_weights is not None])
    kernel.launch(num_sms, COMM_THREADS, [
        ptr(y), i32(y.shape[1] * 2 // 16), ptr(handle.recv_weights), ptr(grad_row_weights),
        ptr(handle.slot_rows), ptr(handle.num_recv_tokens_per_rank), ptr(peer_bases),
        ptr(regions), i32(rank), i32(num_ranks), u32(epoch & 0xFFFFFFFF), u64(timeout_ns),
        errors.claim, errors.record], _stream())


def combine_reduce(out: torch.Tensor, out_weights: Optional[torch.Tensor], y: torch.Tensor,
                   handle, weighted: bool, grad_row_weights: Optional[torch.Tensor],
                   peer_bases: torch.Tensor, regions: torch.Tensor, rank: int, num_ranks: int,
                   epoch: int, num_sms: int, timeout_ns: int, errors: ErrorSink) -> None:
    """Sums every token's partials over ranks into `out [N, H]`."""
    kernel = jit.get_kernel("combine.cu", "combine_reduce",
                            [handle.num_topk, weighted, grad_row_weights is not None])
    lay = handle.layout
    kernel.launch(num_sms, COMM_THREADS, [
        ptr(out), ptr(out_weights), i32(out.shape[0]), i32(out.shape[1] * 2 // 16), ptr(y),
        ptr(handle.recv_weights), ptr(grad_row_weights), ptr(handle.slot_rows),
        ptr(lay.is_token_in_rank), ptr(lay.token_slot_in_rank), ptr(peer_bases), ptr(regions),
        i32(rank), i32(num_ranks), u32(epoch & 0xFFFFFFFF), u64(timeout_ns), errors.claim,
        errors.record], _stream())


def combine_local(out: torch.Tensor, out_weights: Optional[torch.Tensor], y: torch.Tensor,
                  handle, weighted: bool, grad_row_weights: Optional[torch.Tensor],
                  num_sms: int) -> None:
    """EP = 1: every token's rows of `y` summed into `out [N, H]`, no protocol; the same values
    as `combine_reduce` on one rank."""
    kernel = jit.get_kernel("combine.cu", "combine_local",
                            [handle.num_topk, weighted, grad_row_weights is not None])
    threads = 1024 if handle.num_topk <= 8 else 512  # CombineLocalThreads in combine.cu
    kernel.launch(num_sms, threads, [
        ptr(out), ptr(out_weights), i32(out.shape[0]), i32(out.shape[1] * 2 // 16), ptr(y),
        ptr(handle.recv_weights), ptr(grad_row_weights), ptr(handle.slot_rows),
        ptr(handle.layout.token_slot_in_rank)], _stream())


# (kFmt, kDequant) pairs of dispatch_recv beyond bf16: every FP8 wire format, kept or dequantized.
FP8_RECV_VARIANTS = [(fmt, dequant) for fmt in (1, 2, 3) for dequant in (False, True)]


def kernel_names(num_topk: int, fp8: bool = False) -> dict:
    """Every instantiation a top-k needs, per source file (for compile checks and warm-up).

    Args:
        num_topk: K.
        fp8: list the FP8 dispatch variants instead of the bf16 ones for dispatch.cu.
    """
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
                names["combine.cu"].append(f"{kind}<{num_topk}, {weighted}, {with_weights}>")
    return names


def warm_up(num_topks) -> None:
    """Compiles (or loads from the disk cache) every kernel the given top-k values need."""
    for num_topk in num_topks:
        for source, exprs in kernel_names(num_topk).items():
            for expr in exprs:
                name, _, args = expr.partition("<")
                jit.get_kernel(source, name, [a.strip() for a in args.rstrip(">").split(",")]
                               if args else [])
