"""Ceiling kernels for the benchmarks (cuda_src/bench/ceiling.cu): fill, fan-out copy,
fan-in sum and peer copy, the floors the dispatch and combine kernels are measured against.
Not part of the product set: `tools.precompile` builds them only with `--bench`."""

from __future__ import annotations

import torch

from megatron_deepep.kernels import jit
from megatron_deepep.kernels.jit import I32, I64, KernelArgs, Ptr
from megatron_deepep.ops.launch import launch_stream


class FillArgs(KernelArgs):
    c_name = "mdeep::FillArgs"
    _fields_ = [("dst", Ptr), ("num_int4", I64)]


class FanOutArgs(KernelArgs):
    c_name = "mdeep::FanOutArgs"
    _fields_ = [("src", Ptr), ("dst_rows", Ptr), ("dst", Ptr), ("num_rows", I32),
                ("num_int4", I32), ("fan_out", I32)]


class FanOutBytesArgs(KernelArgs):
    c_name = "mdeep::FanOutBytesArgs"
    _fields_ = [("src", Ptr), ("dst_rows", Ptr), ("dst", Ptr), ("dst_scales", Ptr),
                ("num_rows", I32), ("num_int4", I32), ("fan_out", I32), ("scale_int4", I32),
                ("narrow_stores", I32)]


class FanInArgs(KernelArgs):
    c_name = "mdeep::FanInArgs"
    _fields_ = [("src", Ptr), ("src_rows", Ptr), ("dst", Ptr), ("num_rows", I32),
                ("num_int4", I32)]


class PeerCopyArgs(KernelArgs):
    c_name = "mdeep::PeerCopyArgs"
    _fields_ = [("src", Ptr), ("peer_bases", Ptr), ("num_int4_per_peer", I64), ("rank", I32),
                ("num_ranks", I32)]


# ---------------------------------------------------------------------------------------------
# Ceiling kernels for the benchmark (cuda_src/bench/ceiling.cu).

def fill(dst: torch.Tensor, num_blocks: int) -> None:
    """`fill_kernel`: zeroes `dst` (contiguous, a multiple of 16 bytes) with 16-byte stores,
    `num_blocks` blocks of 256 threads."""
    args = FillArgs.fill(dst=dst.data_ptr(), num_int4=dst.numel() * dst.element_size() // 16)
    jit.get_kernel("bench/ceiling.cu", "fill_kernel").launch(num_blocks, 256, args, launch_stream())


def fan_out_copy(src: torch.Tensor, dst_rows: torch.Tensor, dst: torch.Tensor, fan_out: int,
                 num_blocks: int, num_threads: int = 512) -> None:
    """`fan_out_copy`: row n of `src [N, H]` written to rows `dst_rows[n * fan_out + k]` of
    `dst` (int32, -1 skips), `num_blocks` blocks of `num_threads` (at most 1024) threads."""
    args = FanOutArgs.fill(src=src.data_ptr(), dst_rows=dst_rows.data_ptr(),
                           dst=dst.data_ptr(), num_rows=src.shape[0],
                           num_int4=src.shape[1] * src.element_size() // 16, fan_out=fan_out)
    jit.get_kernel("bench/ceiling.cu", "fan_out_copy").launch(num_blocks, num_threads, args,
                                                              launch_stream())


def fan_out_fp8_bytes(src: torch.Tensor, dst_rows: torch.Tensor, dst: torch.Tensor,
                      dst_scales: torch.Tensor, fan_out: int, num_blocks: int,
                      num_threads: int = 512, narrow_stores: bool = False) -> None:
    """`fan_out_fp8_bytes`: row n of `src [N, H]` bf16 written, as its elements' high bytes, to
    rows `dst_rows[n * fan_out + k]` of `dst [M, H]` uint8 (int32, -1 skips), and 16-byte words
    to the same rows of `dst_scales [M, S]` uint8 (S a multiple of 16): the FP8 expand's bytes
    without its arithmetic. `num_blocks` blocks of `num_threads` (at most 1024) threads; H a
    multiple of 16. `narrow_stores`: 8-byte stores from coalesced loads, else 16-byte stores
    from loads with a 32-byte lane stride."""
    if src.dtype != torch.bfloat16 or src.shape[1] % 16:
        raise ValueError(f"fan_out_fp8_bytes: src must be bf16 with a multiple of 16 columns, "
                         f"got {src.dtype} {tuple(src.shape)}")
    if dst_scales.shape[1] % 16:
        raise ValueError(f"fan_out_fp8_bytes: dst_scales' row ({dst_scales.shape[1]} bytes) "
                         "must be a multiple of 16 bytes")
    args = FanOutBytesArgs.fill(src=src.data_ptr(), dst_rows=dst_rows.data_ptr(),
                                dst=dst.data_ptr(), dst_scales=dst_scales.data_ptr(),
                                num_rows=src.shape[0], num_int4=src.shape[1] * 2 // 16,
                                fan_out=fan_out, scale_int4=dst_scales.shape[1] // 16,
                                narrow_stores=int(narrow_stores))
    jit.get_kernel("bench/ceiling.cu", "fan_out_fp8_bytes").launch(num_blocks, num_threads, args,
                                                                   launch_stream())


def fan_in_sum(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor,
               num_blocks: int) -> None:
    """`fan_in_sum`: row n of `dst` = the fp32 sum of the 8 rows `src_rows [N, 8]` (int32,
    -1 skips) of `src [M, H]` bf16, `num_blocks` blocks of 512 threads."""
    args = FanInArgs.fill(src=src.data_ptr(), src_rows=src_rows.data_ptr(),
                          dst=dst.data_ptr(), num_rows=src_rows.shape[0],
                          num_int4=src.shape[1] * src.element_size() // 16)
    jit.get_kernel("bench/ceiling.cu", "fan_in_sum").launch(num_blocks, 512, args, launch_stream())


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
    jit.get_kernel("bench/ceiling.cu", "peer_copy").launch(num_blocks, PEER_COPY_THREADS, args,
                                                     launch_stream())
