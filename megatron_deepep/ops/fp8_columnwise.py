"""The columnwise (128x1) copy of rowwise FP8 rows per expert (cuda_src/fp8_columnwise.cu):
the GPU version of `fp8.columnwise.reference`, bit for bit, in its packed layout."""

from __future__ import annotations

import math
from typing import Tuple

import torch

from megatron_deepep.kernels import jit
from megatron_deepep.kernels.jit import F32, I32, I64, KernelArgs, Ptr
from megatron_deepep.ops.launch import launch_stream


class ColumnwiseArgs(KernelArgs):
    c_name = "mdeep::ColumnwiseArgs"
    _fields_ = [("q", Ptr), ("scales", Ptr), ("token_stride", I64), ("block_stride", I64),
                ("row_offsets", Ptr), ("col_data", Ptr), ("col_scales", Ptr),
                ("num_experts", I32), ("num_rows", I32), ("hidden", I32), ("scale_cols", I32),
                ("num_blocks", I32), ("amax_epsilon", F32)]


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
    kernel.launch(num_blocks * num_tiles, COLUMNWISE_THREADS, args, launch_stream())
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
