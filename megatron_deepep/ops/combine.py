"""The NVLink and EP = 1 combine kernels (cuda_src/combine.cu): one fp32-accumulated partial
row per (token, rank) back to its source, then the sum."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_deepep.kernels import jit
from megatron_deepep.kernels.jit import I32, U64, KernelArgs, Ptr
from megatron_deepep.ops.launch import (
    COMM_THREADS, ErrorSink, addr, launch_stream, num_int4, row_dtype_code)


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


# combine_fused's block (kFusedCombineThreads in combine.cu): 384 threads keep its loads in
# registers (up to 168 a thread) where 512 spilled them.
FUSED_COMBINE_THREADS = 384


class CombineFusedArgs(KernelArgs):
    c_name = "mdeep::CombineFusedArgs"
    _fields_ = [
        ("out", Ptr), ("out_weights", Ptr), ("num_tokens", I32), ("num_int4", I32), ("y", Ptr),
        ("recv_weights", Ptr), ("grad_row_weights", Ptr), ("slot_rows", Ptr),
        ("num_recv_tokens_per_rank", Ptr), ("is_token_in_rank", Ptr),
        ("token_slot_in_rank", Ptr), ("peer_bases", Ptr), ("regions", Ptr), ("rank", I32),
        ("num_ranks", I32), ("epoch_word", Ptr), ("timeout_ns", U64), ("error_claim", Ptr),
        ("error_record", Ptr)]


class CombineLocalArgs(KernelArgs):
    c_name = "mdeep::CombineLocalArgs"
    _fields_ = [
        ("out", Ptr), ("out_weights", Ptr), ("num_tokens", I32), ("num_int4", I32), ("y", Ptr),
        ("recv_weights", Ptr), ("grad_row_weights", Ptr), ("slot_rows", Ptr),
        ("token_slot_in_rank", Ptr)]


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
        y=y.data_ptr(), num_int4=num_int4(y),
        recv_weights=handle.recv_weights.data_ptr(), grad_row_weights=addr(grad_row_weights),
        slot_rows=handle.address("slot_rows"),
        num_recv_tokens_per_rank=handle.address("num_recv_tokens_per_rank"),
        peer_bases=peer_bases.data_ptr(), regions=regions.data_ptr(), rank=rank,
        num_ranks=num_ranks, epoch_word=epoch_word, timeout_ns=timeout_ns,
        error_claim=errors.claim, error_record=errors.record)
    kernel.launch(num_sms, COMM_THREADS, args, launch_stream())


def _sum_tokens(kind: str, out: torch.Tensor, out_weights: Optional[torch.Tensor],
                y: torch.Tensor, handle, weighted: bool,
                grad_row_weights: Optional[torch.Tensor], peer_bases: torch.Tensor,
                regions: torch.Tensor, rank: int, num_ranks: int, epoch_word: int, num_sms: int,
                timeout_ns: int, errors: ErrorSink) -> None:
    """Launches `combine_reduce` or `combine_fused` (`kind`): the same token-side fields; the
    fused kernel also sends the partials, so it reads the received slots per source too."""
    assert out.dtype == y.dtype, (out.dtype, y.dtype)
    kernel = jit.get_kernel("combine.cu", kind,
                            [handle.num_topk, weighted, grad_row_weights is not None,
                             row_dtype_code(y)])
    if kind == "combine_reduce":
        args_class, threads, sends = CombineReduceArgs, COMM_THREADS, {}
    else:
        args_class, threads = CombineFusedArgs, FUSED_COMBINE_THREADS
        sends = dict(num_recv_tokens_per_rank=handle.address("num_recv_tokens_per_rank"))
    lay = handle.layout
    args = args_class.fill(
        out=out.data_ptr(), out_weights=addr(out_weights), num_tokens=out.shape[0],
        num_int4=num_int4(out), y=y.data_ptr(),
        recv_weights=handle.recv_weights.data_ptr(), grad_row_weights=addr(grad_row_weights),
        slot_rows=handle.address("slot_rows"), is_token_in_rank=lay.address("is_token_in_rank"),
        token_slot_in_rank=lay.address("token_slot_in_rank"), peer_bases=peer_bases.data_ptr(),
        regions=regions.data_ptr(), rank=rank, num_ranks=num_ranks, epoch_word=epoch_word,
        timeout_ns=timeout_ns, error_claim=errors.claim, error_record=errors.record, **sends)
    kernel.launch(num_sms, threads, args, launch_stream())


def combine_reduce(*args, **kwargs) -> None:
    """Sums every token's partials over ranks in fp32 into `out [N, H]` (y's dtype), after
    `combine_send`. Arguments as `combine_fused`'s."""
    _sum_tokens("combine_reduce", *args, **kwargs)


def combine_fused(out: torch.Tensor, out_weights: Optional[torch.Tensor], y: torch.Tensor,
                  handle, weighted: bool, grad_row_weights: Optional[torch.Tensor],
                  peer_bases: torch.Tensor, regions: torch.Tensor, rank: int, num_ranks: int,
                  epoch_word: int, num_sms: int, timeout_ns: int, errors: ErrorSink) -> None:
    """Sends each received slot's partial row back to its source and sums every token's
    partials over ranks into `out [N, H]` (y's dtype), in one launch: the values of
    `combine_send` + `combine_reduce`."""
    _sum_tokens("combine_fused", out, out_weights, y, handle, weighted, grad_row_weights,
                peer_bases, regions, rank, num_ranks, epoch_word, num_sms, timeout_ns, errors)


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
        num_int4=num_int4(out), y=y.data_ptr(),
        recv_weights=handle.recv_weights.data_ptr(), grad_row_weights=addr(grad_row_weights),
        slot_rows=handle.address("slot_rows"),
        token_slot_in_rank=handle.layout.address("token_slot_in_rank"))
    kernel.launch(num_sms, threads, args, launch_stream())
