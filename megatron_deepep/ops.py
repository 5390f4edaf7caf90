"""One thin typed wrapper per CUDA operation: picks template arguments and launches.

The only module that calls `jit`. Callers (the NVLink transport) have validated the user's
arguments; wrappers here assert internal invariants (dtypes, contiguity) and pass raw pointers.
Every launch goes on the torch stream that is current when it is called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from typing import Optional, Tuple

import torch

from megatron_deepep import jit
from megatron_deepep.arena import Arena, ArenaPlan
from megatron_deepep.layout import DispatchLayout, layout_fields

LAYOUT_THREADS = 512
NOTIFY_THREADS = 256
COMM_THREADS = 512

Sig = jit.Signature


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


def _layout_chunk_entries() -> int:
    """Entries per layout block: MEGATRON_DEEPEP_LAYOUT_CHUNK_ENTRIES (a multiple of 32 up to
    LAYOUT_MAX_CHUNK_ENTRIES), else 512, which scripts/probe_layout.py measured fastest on H200
    at the bench shapes (7.8 / 7.6 / 6.9 µs against 8.1 / 7.9 / 7.7 µs at 1024)."""
    text = os.environ.get(jit.ENV_PREFIX + "LAYOUT_CHUNK_ENTRIES", "")
    if not text:
        return LAYOUT_THREADS
    entries = int(text)
    if entries % 32 or not 32 <= entries <= LAYOUT_MAX_CHUNK_ENTRIES:
        raise ValueError(f"{jit.ENV_PREFIX}LAYOUT_CHUNK_ENTRIES={text} must be a multiple of 32 "
                         f"in [32, {LAYOUT_MAX_CHUNK_ENTRIES}]")
    return entries


LAYOUT_CHUNK_ENTRIES = _layout_chunk_entries()


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

    def get(self, num_chunks: int, num_counts: int, device):
        """(state, chunk_status, chunk_counts) addresses for a launch of `num_chunks` blocks."""
        count_stride = -(-num_counts // 4) * 4  # the kernel's half row of counts
        if num_chunks > self.max_chunks or count_stride > self.max_counts:
            self.max_chunks = max(num_chunks, 2 * self.max_chunks, 64)
            self.max_counts = max(count_stride, self.max_counts)
            counts_offset = -(-(2 + self.max_chunks) // 4) * 4  # 16-byte aligned
            self.tensor = torch.zeros(counts_offset + self.max_chunks * 2 * self.max_counts,
                                      dtype=torch.int32, device=device)
            # The zeros come from the current stream; the kernel may run on another.
            torch.cuda.current_stream(device).synchronize()
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

    def args(self) -> tuple:
        recv = self.recv
        return (recv.address("num_recv_tokens_per_expert"), recv.address("tokens_per_expert"),
                recv.address("expert_row_start"), recv.address("src_expert_offset"),
                recv.address("num_recv_tokens_per_rank"), self.host_info_ptr, self.alignment,
                self.max_recv_rows, self.epoch & 0xFFFFFFFF)


_LAYOUT_SIG = Sig("p iiii pppppp ppp q pp i ppppp p iiu")
_NO_LOCAL_RECV = (0, 0, 0, 0, 0, 0, 1, -1, 0)


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
    state, status, counts = workspace.get(num_chunks, num_experts + num_ranks, dev)
    a = arena.address
    kernel = jit.get_kernel("layout.cu", "layout_kernel", [_index_type(topk_idx), num_topk])
    kernel.launch(num_chunks, LAYOUT_THREADS, (
        topk_idx.data_ptr(), num_tokens, num_experts, num_ranks, chunk_tokens,
        a("num_tokens_per_expert"), a("pos_in_expert"), a("num_tokens_per_rank"),
        a("is_token_in_rank"), a("token_slot_in_rank"), a("slot_token"),
        state, status, counts, timeout_ns, errors.claim, errors.record, rank,
        *(local_recv.args() if local_recv is not None else _NO_LOCAL_RECV)),
        stream, shared_mem=shared_bytes, signature=_LAYOUT_SIG,
        programmatic=jit.pdl_first_enabled())
    return DispatchLayout.from_arena(arena)


_NOTIFY_SIG = Sig("p iiu pp iiiii ppppp p q pp")


def notify(peer_bases: torch.Tensor, rank: int, num_ranks: int, epoch: int,
           lay: DispatchLayout, num_local: int, hidden: int, num_topk: int, alignment: int,
           max_recv_rows: int, recv: Arena, host_info_ptr: int, timeout_ns: int,
           errors: ErrorSink) -> None:
    """Exchanges counts with every peer and writes the receive layout (the `recv_fields`
    arrays of `recv`) on the device."""
    kernel = jit.get_kernel("notify.cu", "notify_kernel")
    a = recv.address
    kernel.launch(1, NOTIFY_THREADS, (
        peer_bases.data_ptr(), rank, num_ranks, epoch & 0xFFFFFFFF,
        lay.address("num_tokens_per_rank"), lay.address("num_tokens_per_expert"), num_local,
        hidden, num_topk, alignment, max_recv_rows, a("num_recv_tokens_per_rank"),
        a("num_recv_tokens_per_expert"), a("tokens_per_expert"), a("expert_row_start"),
        a("src_expert_offset"), host_info_ptr, timeout_ns, errors.claim, errors.record),
        _stream(), signature=_NOTIFY_SIG)


def _wire(fp8) -> tuple:
    """(kFmt, kDequant, amax_epsilon) of an optional `Fp8Dispatch`."""
    if fp8 is None:
        return 0, False, 0.0
    return fp8.wire_code, fp8.dequantize, float(fp8.fmt.amax_epsilon)


_SEND_SIG = Sig("pp iif ppppp pp iiiu q pp")


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
    fmt, _, amax_epsilon = _wire(fp8)
    kernel = jit.get_kernel("dispatch.cu", "dispatch_send",
                            [topk_idx.shape[1], cached, _index_type(topk_idx), fmt])
    kernel.launch(num_sms, COMM_THREADS, (
        x.data_ptr(), addr(x_scales), num_tokens, hidden, amax_epsilon, topk_idx.data_ptr(),
        addr(topk_weights), lay.address("pos_in_expert"), lay.address("is_token_in_rank"),
        lay.address("token_slot_in_rank"), peer_bases.data_ptr(), regions.data_ptr(), rank,
        num_ranks, num_local, epoch & 0xFFFFFFFF, timeout_ns, errors.claim, errors.record),
        _stream(), signature=_SEND_SIG)


_RECV_SIG = Sig("ppp ii ppppp ppf ppppi pp iiiu q pp")


def dispatch_recv(recv_x: torch.Tensor, recv_scales: Optional[torch.Tensor],
                  recv_weights: Optional[torch.Tensor], recv: Arena, x: torch.Tensor,
                  x_scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                  topk_weights: Optional[torch.Tensor], lay: DispatchLayout, cached: bool,
                  fp8, peer_bases: torch.Tensor, regions: torch.Tensor, rank: int,
                  num_ranks: int, num_local: int, epoch: int, num_sms: int, timeout_ns: int,
                  errors: ErrorSink) -> None:
    """Expands staged rows (and this rank's own tokens) into the expert-major `recv_x`.

    `recv_x` is `[M, H]` bf16, or e4m3 rows with `recv_scales` when `fp8` keeps FP8; `recv`
    holds the dispatch's `recv_fields` arrays (`slot_rows` written unless `cached`).
    """
    fmt, dequant, amax_epsilon = _wire(fp8)
    kernel = jit.get_kernel("dispatch.cu", "dispatch_recv",
                            [topk_idx.shape[1], cached, _index_type(topk_idx), fmt, dequant])
    a = recv.address
    kernel.launch(num_sms, COMM_THREADS, (
        recv_x.data_ptr(), addr(recv_scales), addr(recv_weights), recv_x.shape[0],
        recv_x.shape[1], a("num_recv_tokens_per_rank"), a("num_recv_tokens_per_expert"),
        a("expert_row_start"), a("src_expert_offset"), a("slot_rows"), x.data_ptr(),
        addr(x_scales), amax_epsilon, topk_idx.data_ptr(), addr(topk_weights),
        lay.address("pos_in_expert"), lay.address("slot_token"), x.shape[0],
        peer_bases.data_ptr(), regions.data_ptr(), rank, num_ranks, num_local,
        epoch & 0xFFFFFFFF, timeout_ns, errors.claim, errors.record),
        _stream(), signature=_RECV_SIG)


_LOCAL_SIG = Sig("ppp ii ppp ppf pppp ii ppu")


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
    kernel.launch(num_sms, threads, (
        recv_x.data_ptr(), addr(recv_scales), addr(recv_weights), recv_x.shape[0],
        recv_x.shape[1], a("num_recv_tokens_per_expert"), a("expert_row_start"),
        a("slot_rows"), x.data_ptr(), addr(x_scales), amax_epsilon, topk_idx.data_ptr(),
        addr(topk_weights), lay.address("pos_in_expert"), lay.address("token_slot_in_rank"),
        x.shape[0], num_local, host_info_ptr, a("tokens_per_expert"), host_epoch & 0xFFFFFFFF),
        _stream(), shared_mem=stage_bytes, signature=_LOCAL_SIG,
        programmatic=after_layout or (cached and jit.pdl_first_enabled()))


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


_COMBINE_SEND_SIG = Sig("p i pppp pp iiu q pp")


def combine_send(y: torch.Tensor, handle, weighted: bool,
                 grad_row_weights: Optional[torch.Tensor], peer_bases: torch.Tensor,
                 regions: torch.Tensor, rank: int, num_ranks: int, epoch: int, num_sms: int,
                 timeout_ns: int, errors: ErrorSink) -> None:
    """Sends one fp32-accumulated partial row per received slot back to its source rank."""
    kernel = jit.get_kernel("combine.cu", "combine_send",
                            [handle.num_topk, weighted, grad_row_weights is not None])
    kernel.launch(num_sms, COMM_THREADS, (
        y.data_ptr(), y.shape[1] * 2 // 16, handle.recv_weights.data_ptr(),
        addr(grad_row_weights), handle.address("slot_rows"),
        handle.address("num_recv_tokens_per_rank"), peer_bases.data_ptr(), regions.data_ptr(),
        rank, num_ranks, epoch & 0xFFFFFFFF, timeout_ns, errors.claim, errors.record),
        _stream(), signature=_COMBINE_SEND_SIG)


_COMBINE_REDUCE_SIG = Sig("pp ii p ppp pp pp iiu q pp")


def combine_reduce(out: torch.Tensor, out_weights: Optional[torch.Tensor], y: torch.Tensor,
                   handle, weighted: bool, grad_row_weights: Optional[torch.Tensor],
                   peer_bases: torch.Tensor, regions: torch.Tensor, rank: int, num_ranks: int,
                   epoch: int, num_sms: int, timeout_ns: int, errors: ErrorSink) -> None:
    """Sums every token's partials over ranks into `out [N, H]`."""
    kernel = jit.get_kernel("combine.cu", "combine_reduce",
                            [handle.num_topk, weighted, grad_row_weights is not None])
    lay = handle.layout
    kernel.launch(num_sms, COMM_THREADS, (
        out.data_ptr(), addr(out_weights), out.shape[0], out.shape[1] * 2 // 16, y.data_ptr(),
        handle.recv_weights.data_ptr(), addr(grad_row_weights), handle.address("slot_rows"),
        lay.address("is_token_in_rank"), lay.address("token_slot_in_rank"),
        peer_bases.data_ptr(), regions.data_ptr(), rank, num_ranks, epoch & 0xFFFFFFFF,
        timeout_ns, errors.claim, errors.record), _stream(), signature=_COMBINE_REDUCE_SIG)


_COMBINE_LOCAL_SIG = Sig("pp ii p ppp p")


def combine_local(out: torch.Tensor, out_weights: Optional[torch.Tensor], y: torch.Tensor,
                  handle, weighted: bool, grad_row_weights: Optional[torch.Tensor],
                  num_sms: int) -> None:
    """EP = 1: every token's rows of `y` summed into `out [N, H]`, no protocol; the same values
    as `combine_reduce` on one rank."""
    kernel = jit.get_kernel("combine.cu", "combine_local",
                            [handle.num_topk, weighted, grad_row_weights is not None])
    threads = 1024 if handle.num_topk <= 8 else 512  # CombineLocalThreads in combine.cu
    kernel.launch(num_sms, threads, (
        out.data_ptr(), addr(out_weights), out.shape[0], out.shape[1] * 2 // 16, y.data_ptr(),
        handle.recv_weights.data_ptr(), addr(grad_row_weights), handle.address("slot_rows"),
        handle.layout.address("token_slot_in_rank")), _stream(),
        signature=_COMBINE_LOCAL_SIG, programmatic=jit.pdl_first_enabled())


# Every kernel's argument signature, checked against its CUDA parameter list by the CPU tests.
KERNEL_SIGNATURES = {
    ("layout.cu", "layout_kernel"): _LAYOUT_SIG, ("notify.cu", "notify_kernel"): _NOTIFY_SIG,
    ("dispatch.cu", "dispatch_send"): _SEND_SIG, ("dispatch.cu", "dispatch_recv"): _RECV_SIG,
    ("dispatch.cu", "dispatch_local"): _LOCAL_SIG,
    ("combine.cu", "combine_send"): _COMBINE_SEND_SIG,
    ("combine.cu", "combine_reduce"): _COMBINE_REDUCE_SIG,
    ("combine.cu", "combine_local"): _COMBINE_LOCAL_SIG,
}

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
