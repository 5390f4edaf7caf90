"""The NVLink and EP = 1 dispatch kernels (cuda_src/dispatch.cu): send rows to peers' staging
regions, expand them into the expert-major `recv_x`."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from megatron_deepep import knobs
from megatron_deepep.arena import Arena
from megatron_deepep.kernels import jit
from megatron_deepep.kernels.jit import F32, I32, U32, U64, KernelArgs, Ptr
from megatron_deepep.layout import DispatchLayout
from megatron_deepep.ops.launch import (
    COMM_THREADS, ErrorSink, addr, index_type_name, launch_stream, wire_format)


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


class DispatchFusedArgs(KernelArgs):
    c_name = "mdeep::DispatchFusedArgs<long long>"
    _fields_ = [
        ("recv_x", Ptr), ("recv_scales", Ptr), ("recv_weights", Ptr), ("max_rows", I32),
        ("hidden", I32), ("num_recv_tokens_per_rank", Ptr), ("num_recv_tokens_per_expert", Ptr),
        ("expert_row_start", Ptr), ("src_expert_offset", Ptr), ("slot_rows", Ptr), ("x", Ptr),
        ("x_scales", Ptr), ("amax_epsilon", F32), ("topk_idx", Ptr), ("topk_weights", Ptr),
        ("pos_in_expert", Ptr), ("is_token_in_rank", Ptr), ("token_slot_in_rank", Ptr),
        ("num_tokens", I32), ("peer_bases", Ptr), ("regions", Ptr), ("rank", I32),
        ("num_ranks", I32), ("num_local", I32), ("epoch_word", Ptr), ("timeout_ns", U64),
        ("error_claim", Ptr), ("error_record", Ptr)]


class DispatchLocalArgs(KernelArgs):
    c_name = "mdeep::DispatchLocalArgs<long long>"
    _fields_ = [
        ("recv_x", Ptr), ("recv_scales", Ptr), ("recv_weights", Ptr), ("max_rows", I32),
        ("hidden", I32), ("num_recv_tokens_per_expert", Ptr), ("expert_row_start", Ptr),
        ("slot_rows", Ptr), ("x", Ptr), ("x_scales", Ptr), ("amax_epsilon", F32),
        ("topk_idx", Ptr), ("topk_weights", Ptr), ("pos_in_expert", Ptr),
        ("token_slot_in_rank", Ptr), ("num_tokens", I32), ("num_local", I32), ("host_info", Ptr),
        ("tokens_per_expert", Ptr), ("host_epoch", U32)]


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
    fmt, _, amax_epsilon = wire_format(fp8)
    kernel = jit.get_kernel("dispatch.cu", "dispatch_send",
                            [topk_idx.shape[1], cached, index_type_name(topk_idx), fmt])
    args = DispatchSendArgs.fill(
        x=x.data_ptr(), x_scales=addr(x_scales), num_tokens=num_tokens, hidden=hidden,
        amax_epsilon=amax_epsilon, topk_idx=topk_idx.data_ptr(),
        topk_weights=addr(topk_weights), pos_in_expert=lay.address("pos_in_expert"),
        is_token_in_rank=lay.address("is_token_in_rank"),
        token_slot_in_rank=lay.address("token_slot_in_rank"),
        peer_bases=peer_bases.data_ptr(), regions=regions.data_ptr(), rank=rank,
        num_ranks=num_ranks, num_local=num_local, epoch_word=epoch_word,
        timeout_ns=timeout_ns, error_claim=errors.claim, error_record=errors.record)
    kernel.launch(num_sms, COMM_THREADS, args, launch_stream())


def _expand(kind: str, recv_x: torch.Tensor, recv_scales: Optional[torch.Tensor],
            recv_weights: Optional[torch.Tensor], recv: Arena, x: torch.Tensor,
            x_scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
            topk_weights: Optional[torch.Tensor], lay: DispatchLayout, cached: bool, fp8,
            peer_bases: torch.Tensor, regions: torch.Tensor, rank: int, num_ranks: int,
            num_local: int, epoch_word: int, num_sms: int, timeout_ns: int,
            errors: ErrorSink) -> None:
    """Launches `dispatch_recv` or `dispatch_fused` (`kind`): the same receive-side fields,
    and the layout arrays each reads (the slot's token; or each token's ranks and slots)."""
    fmt, dequant, amax_epsilon = wire_format(fp8)
    kernel = jit.get_kernel("dispatch.cu", kind,
                            [topk_idx.shape[1], cached, index_type_name(topk_idx), fmt, dequant])
    if kind == "dispatch_recv":
        args_class, layout = DispatchRecvArgs, dict(slot_token=lay.address("slot_token"))
    else:
        args_class, layout = DispatchFusedArgs, dict(
            is_token_in_rank=lay.address("is_token_in_rank"),
            token_slot_in_rank=lay.address("token_slot_in_rank"))
    a = recv.address
    args = args_class.fill(
        recv_x=recv_x.data_ptr(), recv_scales=addr(recv_scales),
        recv_weights=addr(recv_weights), max_rows=recv_x.shape[0], hidden=recv_x.shape[1],
        num_recv_tokens_per_rank=a("num_recv_tokens_per_rank"),
        num_recv_tokens_per_expert=a("num_recv_tokens_per_expert"),
        expert_row_start=a("expert_row_start"), src_expert_offset=a("src_expert_offset"),
        slot_rows=a("slot_rows"), x=x.data_ptr(), x_scales=addr(x_scales),
        amax_epsilon=amax_epsilon, topk_idx=topk_idx.data_ptr(),
        topk_weights=addr(topk_weights), pos_in_expert=lay.address("pos_in_expert"),
        num_tokens=x.shape[0], peer_bases=peer_bases.data_ptr(), regions=regions.data_ptr(),
        rank=rank, num_ranks=num_ranks, num_local=num_local, epoch_word=epoch_word,
        timeout_ns=timeout_ns, error_claim=errors.claim, error_record=errors.record, **layout)
    kernel.launch(num_sms, COMM_THREADS, args, launch_stream())


def dispatch_recv(*args, **kwargs) -> None:
    """Expands staged rows (and this rank's own tokens) into the expert-major `recv_x`, after
    `dispatch_send`. Arguments as `dispatch_fused`'s.

    `recv_x` is `[M, H]` bf16, or e4m3 rows with `recv_scales` when `fp8` keeps FP8; `recv`
    holds the dispatch's `recv_fields` arrays (`slot_rows` written unless `cached`).
    """
    _expand("dispatch_recv", *args, **kwargs)


def dispatch_fused(recv_x: torch.Tensor, recv_scales: Optional[torch.Tensor],
                   recv_weights: Optional[torch.Tensor], recv: Arena, x: torch.Tensor,
                   x_scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                   topk_weights: Optional[torch.Tensor], lay: DispatchLayout, cached: bool,
                   fp8, peer_bases: torch.Tensor, regions: torch.Tensor, rank: int,
                   num_ranks: int, num_local: int, epoch_word: int, num_sms: int,
                   timeout_ns: int, errors: ErrorSink) -> None:
    """Sends every token row to the peers that hold its experts and expands this rank's own
    and the peers' rows into the expert-major `recv_x`, in one launch after notify.

    `x` is `[N, H]` bf16, or e4m3 data with its `x_scales` (pre-quantized); `recv_x` is
    `[M, H]` bf16, or e4m3 rows with `recv_scales` when `fp8` keeps FP8; `recv` holds the
    dispatch's `recv_fields` arrays (`slot_rows` and `recv_weights` written unless `cached`).
    """
    _expand("dispatch_fused", recv_x, recv_scales, recv_weights, recv, x, x_scales, topk_idx,
            topk_weights, lay, cached, fp8, peer_bases, regions, rank, num_ranks, num_local,
            epoch_word, num_sms, timeout_ns, errors)


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
    fmt, dequant, amax_epsilon = wire_format(fp8)
    kernel = jit.get_kernel("dispatch.cu", "dispatch_local",
                            [topk_idx.shape[1], cached, index_type_name(topk_idx), fmt, dequant])
    threads = 1024 if fmt == 0 else COMM_THREADS  # DispatchLocalThreads in dispatch.cu
    if fmt == 0:
        stage_bytes = 0 if cached else _dispatch_stage_bytes(x.shape[1], threads)
    else:
        stage_bytes = _quantize_stage_bytes(x.shape[1], threads, fp8, x_scales, num_sms)
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
    kernel.launch(num_sms, threads, args, launch_stream(), shared_mem=stage_bytes,
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


def local_quantizes_rows(fp8, x_scales) -> bool:
    """Whether dispatch_local quantizes the rows it writes (bf16 `x` in, FP8 rows out): its
    warps then quantize each token's row into a shared-memory stage, the first one before their
    wait for the layout kernel."""
    return fp8 is not None and x_scales is None and not fp8.dequantize


@functools.lru_cache(maxsize=None)
def row_stage_min_sms() -> int:
    """The SM budget from which the quantizing EP = 1 expand stages whole rows in shared memory
    (its warps quantize their first token before the layout kernel ends); below it they
    quantize in registers, which takes the row's trip through shared memory off each SM's
    load/store path, the limit at small budgets. MDEEP_FP8_ROW_STAGE_MIN_SMS sets it, read once
    per process (its default and why: `knobs.py`)."""
    return knobs.get("FP8_ROW_STAGE_MIN_SMS")


def _quantize_stage_bytes(hidden: int, threads: int, fp8, x_scales, num_sms: int) -> int:
    """Bytes an FP8 dispatch_local stages per block when it quantizes (`local_quantizes_rows`):
    from `row_stage_min_sms()` up, each warp's row of `hidden` e4m3 bytes, then its scales from
    the next 16-byte boundary (fp8_row.cuh's stage_stride), where DISPATCH_STAGE_MAX_BYTES holds
    them; else each warp's scales alone (scale_stage_stride: the warps quantize in registers).
    0 (nothing staged) when the rows come pre-quantized or bf16."""
    if not local_quantizes_rows(fp8, x_scales):
        return 0
    scale_stride = -(-fp8.fmt.scale_bytes_per_token(hidden) // 16) * 16
    warps = threads // 32
    row_stages = warps * (hidden + scale_stride)
    if num_sms >= row_stage_min_sms() and row_stages <= DISPATCH_STAGE_MAX_BYTES:
        return row_stages
    return warps * scale_stride
