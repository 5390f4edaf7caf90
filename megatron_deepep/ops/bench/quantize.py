"""Standalone FP8 quantize (cuda_src/bench/quantize.cu): the GPU version of
`fp8.formats.quantize`, bit for bit. For the tests only (the transport quantizes inside its
dispatch kernels); not part of the product set: `tools.precompile` builds it only with
`--bench`."""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_deepep.kernels import jit
from megatron_deepep.kernels.jit import F32, I32, KernelArgs, Ptr
from megatron_deepep.ops.fp8 import launch_rows

SOURCE = "bench/quantize.cu"


class QuantizeArgs(KernelArgs):
    c_name = "mdeep::QuantizeArgs<float>"
    _fields_ = [("x", Ptr), ("q", Ptr), ("scales", Ptr), ("num_tokens", I32), ("hidden", I32),
                ("amax_epsilon", F32)]


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
        kernel = jit.get_kernel(SOURCE, "quantize_blockwise", [num_warps, fmt.power_2_scale])
    else:
        kernel = jit.get_kernel(SOURCE, "quantize_mxfp8", [num_warps])
    args = QuantizeArgs.fill(x=x.data_ptr(), q=x_fp8.data_ptr(), scales=scales.data_ptr(),
                             num_tokens=num_tokens, hidden=hidden,
                             amax_epsilon=float(fmt.amax_epsilon))
    launch_rows(kernel, num_tokens, hidden, num_warps, args)
    return x_fp8, scales


def _check_bf16_rows(x: torch.Tensor) -> None:
    if x.dim() != 2 or not x.is_cuda or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 2-D bf16 CUDA tensor, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
