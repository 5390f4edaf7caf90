"""The columnwise (128x1) blockwise copy of FP8 rows, per expert: its layout and its reference.

The FP8 experts' weight gradient (`megatron.te_experts`) needs each expert's input rows quantized
with one scale per 128 tokens of a column, stored transposed: TE's `Float8BlockQuantizer`
(`block_scaling_dim=1`) with columnwise usage. The dispatch delivers the rows rowwise (1x128
blocks along hidden, `formats.BLOCKWISE_1x128`); `cuda_src/fp8_columnwise.cu`
(`ops.columnwise_from_rowwise`) turns them into the columnwise copy in one pass. What it must
produce is what the bf16 path produces, bit for bit: the rows dequantized to bf16
(`formats.dequantize`, as `ops.dequantize_rows`), then TE's columnwise quantization of those
bf16 values (TE 2.20 `split_quantize` -> `quantize_transpose_vector_blockwise.cu`,
`block_scaled_1d_cast_transpose_kernel`, step 3, GEMM-ready):

    for each expert e (rows [r_e, r_e + m_e)) and column h, per block of 128 tokens
    (the last one partial: the missing rows count as zeros, as TE clears them):
    amax      = max |x| over the block's tokens, NaN ignored (`formats.block_amax`)
    scale     = `formats.blockwise_scale(amax, power_2_scale, amax_epsilon)` (TE's
                `compute_scale_from_amax` with the bf16 input's `value_for_inf`)
    data[h, t] = e4m3(fp32(x[t, h]) * scale)   (`formats.to_e4m3`: RN, satfinite, NaN -> 0x7F)
    scale_inv[block, h] = fp32(1 / double(scale))

Shapes per expert (TE's `Float8BlockQuantizer.get_columnwise_shape` / `get_scale_shape(...,
columnwise=True)`): data `[H, m_e]`, scale_inv `[ceil(m_e / 128), round_up(H, 4)]` (columns past
H are padding, zero here). An empty expert has `[H, 0]` and `[0, round_up(H, 4)]`.

Packed layout (the kernel's output, `layout`): one data buffer `[H * M]` with expert e's `[H, m_e]`
at `H * row_offsets[e]`, and one scale buffer `[num_blocks, round_up(H, 4)]` with expert e's rows
from `block_offsets[e]` (`block_offsets`: prefix sums of `ceil(m_e / 128)`).
"""

from __future__ import annotations

import logging
import math
from typing import List, Sequence, Tuple

import torch

from megatron_deepep.fp8 import formats

logger = logging.getLogger(__name__)

#: Tokens per columnwise scale (TE's 128x1 blocks).
TOKEN_BLOCK = 128


def scale_columns(hidden: int) -> int:
    """Columns of a columnwise scale buffer: `round_up(hidden, 4)` (TE pads to 4)."""
    return 4 * math.ceil(hidden / 4)


def layout(splits: Sequence[int]) -> Tuple[List[int], List[int]]:
    """Row and token-block offsets of each expert in the packed columnwise buffers.

    Args:
        splits: rows per expert (m_e).

    Returns:
        `(row_offsets, block_offsets)`, each of length `len(splits) + 1` (the last entries are
        the totals): expert e's data starts at `H * row_offsets[e]`, its scale rows at
        `block_offsets[e]` (`ceil(m_e / 128)` of them).
    """
    rows, blocks = [0], [0]
    for m in splits:
        rows.append(rows[-1] + int(m))
        blocks.append(blocks[-1] + math.ceil(int(m) / TOKEN_BLOCK))
    return rows, blocks


def device_offsets(offsets: Sequence[int], device) -> torch.Tensor:
    """`offsets` as an int32 tensor on `device` (one asynchronous copy from pinned memory)."""
    host = torch.tensor(list(offsets), dtype=torch.int32)
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def quantize_columnwise(x: torch.Tensor, power_2_scale: bool = True,
                        amax_epsilon: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """TE's columnwise 128x1 quantization of one expert's rows.

    Args:
        x: `[m, H]` torch.bfloat16 (other float dtypes are read as fp32 values).
        power_2_scale: the quantizer's `force_pow_2_scales`.
        amax_epsilon: the quantizer's `amax_epsilon`.

    Returns:
        data: `[H, m]` torch.float8_e4m3fn (the transpose).
        scale_inv: `[ceil(m / 128), round_up(H, 4)]` torch.float32 (padding columns zero).
    """
    assert x.dim() == 2, f"x must be [rows, hidden], got {tuple(x.shape)}"
    num_rows, hidden = x.shape
    num_blocks = math.ceil(num_rows / TOKEN_BLOCK)
    values = x.float()
    pad = num_blocks * TOKEN_BLOCK - num_rows
    padded = torch.nn.functional.pad(values, (0, 0, 0, pad)) if pad else values
    blocks = padded.reshape(num_blocks, TOKEN_BLOCK, hidden)
    amax = formats.block_amax(blocks.transpose(1, 2))  # [num_blocks, H]
    scale = formats.blockwise_scale(amax, power_2_scale, amax_epsilon)
    quantized = formats.to_e4m3(blocks * scale.unsqueeze(1)).reshape(-1, hidden)[:num_rows]
    data = quantized.t().contiguous()
    scale_inv = torch.zeros(num_blocks, scale_columns(hidden), dtype=torch.float32)
    scale_inv[:, :hidden] = (1.0 / scale.double()).float()
    return data, scale_inv


def reference(x_fp8: torch.Tensor, scales: torch.Tensor, splits: Sequence[int], *,
              power_2_scale: bool = True, amax_epsilon: float = 0.0,
              fmt: formats.Fp8Format = formats.BLOCKWISE_1x128
              ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """The columnwise copy of rowwise FP8 rows, per expert, as the bf16 path makes it.

    Args:
        x_fp8: `[M, H]` torch.float8_e4m3fn (or uint8), rows grouped by expert.
        scales: `[M, ceil(H / 128)]` torch.float32 rowwise scale_inv (any strides).
        splits: rows per expert (sum M).
        power_2_scale, amax_epsilon: the columnwise quantizer's settings (the recipe's input
            quantizer).
        fmt: the rows' blockwise 1x128 format (for dequantization).

    Returns:
        One `(data [H, m_e] float8_e4m3fn, scale_inv [ceil(m_e / 128), round_up(H, 4)] fp32)`
        per expert, on the CPU.
    """
    rows, _ = layout(splits)
    if rows[-1] != x_fp8.shape[0]:
        raise ValueError(f"splits sum to {rows[-1]}, x_fp8 has {x_fp8.shape[0]} rows")
    x_bf16 = formats.dequantize(x_fp8.cpu(), scales.cpu().contiguous(), fmt)
    return [quantize_columnwise(x_bf16[r0:r1], power_2_scale, amax_epsilon)
            for r0, r1 in zip(rows[:-1], rows[1:])]


def pack(parts: Sequence[Tuple[torch.Tensor, torch.Tensor]], hidden: int
         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-expert `(data, scale_inv)` -> the kernel's packed buffers (see the module docstring).

    Returns:
        `(data [H * M] torch.uint8, scale_inv [num_blocks, round_up(H, 4)] torch.float32)`.
    """
    data = [d.reshape(-1).view(torch.uint8) for d, _ in parts]
    flat = torch.cat(data) if data else torch.empty(0, dtype=torch.uint8)
    scale_rows = [s for _, s in parts]
    scale_inv = torch.cat(scale_rows) if scale_rows else \
        torch.empty(0, scale_columns(hidden), dtype=torch.float32)
    return flat, scale_inv
