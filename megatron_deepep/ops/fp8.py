"""Standalone FP8 quantize / dequantize (cuda_src/fp8.cu): the GPU versions of
`fp8.formats.quantize` / `dequantize`, bit for bit."""

from __future__ import annotations

import math
from typing import Tuple

import torch

from megatron_deepep.kernels import jit
from megatron_deepep.kernels.jit import F32, I32, KernelArgs, Ptr
from megatron_deepep.ops.launch import launch_stream


class QuantizeArgs(KernelArgs):
    c_name = "mdeep::QuantizeArgs<float>"
    _fields_ = [("x", Ptr), ("q", Ptr), ("scales", Ptr), ("num_tokens", I32), ("hidden", I32),
                ("amax_epsilon", F32)]


class DequantizeArgs(KernelArgs):
    c_name = "mdeep::DequantizeArgs<float>"
    _fields_ = [("q", Ptr), ("scales", Ptr), ("out", Ptr), ("num_tokens", I32),
                ("hidden", I32)]


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
    kernel.launch(math.ceil(total_warps / num_warps), 32 * num_warps, args, launch_stream())
