"""Standalone FP8 dequantize (cuda_src/fp8.cu): the GPU version of `fp8.formats.dequantize`,
bit for bit (the FP8 experts' two-step path; the test-only quantize is `ops.bench.quantize`)."""

from __future__ import annotations

import math

import torch

from megatron_deepep.kernels import jit
from megatron_deepep.kernels.jit import I32, KernelArgs, Ptr
from megatron_deepep.ops.launch import launch_stream


class DequantizeArgs(KernelArgs):
    c_name = "mdeep::DequantizeArgs<float>"
    _fields_ = [("q", Ptr), ("scales", Ptr), ("out", Ptr), ("num_tokens", I32),
                ("hidden", I32)]


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
    launch_rows(kernel, num_tokens, hidden, num_warps, args)
    return out


def launch_rows(kernel, num_tokens: int, hidden: int, num_warps: int, args) -> None:
    """Launches a standalone FP8 kernel (`common/fp8_standalone.cuh`'s layout) over
    `[num_tokens, hidden]` rows: one warp per (token, 128-column chunk), `num_warps` a CTA."""
    total_warps = num_tokens * math.ceil(hidden / 128)  # one per (token, 128-column chunk)
    if total_warps == 0:
        return
    kernel.launch(math.ceil(total_warps / num_warps), 32 * num_warps, args, launch_stream())
