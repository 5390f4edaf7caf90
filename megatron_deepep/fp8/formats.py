"""FP8 wire formats (Transformer Engine's recipe formats) and their pure-torch references.

Two formats quantize each token (one row of `[num_tokens, hidden]`) along the hidden dimension
into e4m3 (`torch.float8_e4m3fn`) with one scale per block of consecutive columns:

- `BLOCKWISE_1x128`: TE's `Float8BlockScaling` for activations (`x_block_scaling_dim=1`, as in
  DeepSeek-V3): 1x128 blocks, one fp32 `scale_inv` per block (the dequantization factor, about
  amax / 448), power-of-two scales by default as in TE's recipe.
  `BLOCKWISE_1x128_FP32_SCALES` is the same without power-of-two rounding (TE with
  `NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`).
- `MXFP8_1x32`: TE's `MXFP8BlockScaling`: 1x32 blocks, one E8M0 scale per block (uint8 biased
  exponent e, the block's factor is 2^(e - 127)).

Scales are laid out compactly, `[num_tokens, num_blocks]` row-major, which is what goes on the
wire; `te_bridge` converts to TE's padded GEMM layouts. If `hidden` is not a multiple of the block
size, the last block covers only the remaining columns (e.g. hidden 2880: 22 full 1x128 blocks
and one of 64 columns), as TE does: out-of-range columns count as zeros for the amax and are
never stored.

The rules below are TE's, rule by rule (paths are in NVIDIA/TransformerEngine):

Blockwise (`transformer_engine/common/transpose/quantize_transpose_vector_blockwise.cu`,
`block_scaled_1d_cast_transpose_kernel`, step 2, and
`transformer_engine/common/recipe/recipe_common.cuh`, `compute_scale_from_amax`):
    amax   = max |x| over the block, starting from 0 with fmaxf (so NaN is ignored)
    amax   = epsilon if amax < epsilon (NaN compares false)
    scale  = 1 if amax is 0, inf or NaN; else 448 / amax (fp32, round to nearest, `__fdiv_rn`)
    scale  = bf16 max (0x1.FEp127, TE's `value_for_inf` for bf16 input) if that overflowed
    scale &= 0xFF800000 (keep sign and exponent) if power-of-two scales
    q      = e4m3(fp32(x) * scale), round to nearest even, saturating (`__NV_SATFINITE`)
    scale_inv = fp32(1.0 / double(scale))  (TE: `CType scale_inv = 1.0 / scale`)
    dequant: bf16(fp32(q) * scale_inv)
      (`transformer_engine/pytorch/tensor/storage/float8_blockwise_tensor_storage.py`,
      `Float8BlockwiseQTensorStorage._dequantize_vectorwise`)

MXFP8 (`transformer_engine/common/cast/mxfp8/quantize_mxfp8.cuh`, `quantize_mxfp8_kernel`, rowwise
path, with `transformer_engine/common/util/ptx.cuh`, `float_to_e8m0`, `exp2f_rcp`, `exp2f`,
`mul_cvt_2x`):
    amax   = max |x| over the block, NaN ignored (`max.xorsign.abs.bf16x2` / `__hmax`)
    e      = float_to_e8m0(amax * fp32(1/448)): the biased exponent rounded up (toward +inf),
             0 for 0, 0xFE for inf and at the top, 0xFF for NaN; a value at most 2^-127 gives 0
    q      = e4m3(fp32(x) * m), RN + satfinite (`cvt.rn.satfinite.e4m3x2.f32`), where
             m = 1 if e == 0 else 2^(127 - e) as the bit pattern (254 - e) << 23 (so m = 0 for
             e == 254)
    dequant: bf16(fp32(q) * d), d = the fp32 with bit pattern e << 23 (0 for e == 0, inf for 255)
      (`transformer_engine/common/cast/mxfp8/dequantize_mxfp8.cuh`, `dequantize_mxfp8_kernel`)

NaN and inf (both formats quantize a NaN element to the e4m3 NaN, stored as 0x7F here):
- NaN never enters a block's amax, so the other elements of its block quantize normally, and the
  NaN dequantizes to NaN.
- Blockwise, a block holding +-inf: amax is inf, so scale = scale_inv = 1; inf saturates to +-448
  and the finite elements are cast unscaled (values above 448 saturate, tiny ones flush to 0).
- MXFP8, a block holding +-inf: e = 0xFE and m = 0, so every finite element becomes +-0 and the
  inf becomes NaN (inf * 0); after dequantization that block is all zeros except NaN where the
  inf was.
- Finite values above 448 (up to the fp32 maximum) never overflow: the scale maps the block's
  amax to at most 448, and the cast saturates.
- MXFP8 blocks whose amax is at most 448 * 2^-127 (only bf16 subnormal-range data) get e = 0:
  they quantize unscaled (so to zeros) and dequantize to zeros.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from typing import Tuple

import torch

logger = logging.getLogger(__name__)

E4M3_MAX = 448.0
# TE TypeExtrema<bf16>::max, the blockwise scale when 448 / amax overflows fp32.
BF16_MAX = float.fromhex("0x1.FEp127")
# TE Quantized_Limits<fp8e4m3>::max_norm_rcp: 1/448 rounded once to fp32.
E4M3_MAX_RCP = float(torch.tensor(1.0 / 448.0, dtype=torch.float32))
# The e4m3 NaN byte the device cast (cvt.rn.satfinite.e4m3x2.f32) writes.
E4M3_NAN_BYTE = 0x7F
# The bf16 NaN the device code writes (f32_to_bf16_bits_rn).
BF16_NAN_BITS = 0x7FC0


class ScaleKind(enum.Enum):
    """How a block's scale is stored."""

    FP32_SCALE_INV = "fp32_scale_inv"  # fp32 dequantization factor (TE Float8BlockScaling)
    E8M0 = "e8m0"  # uint8 biased exponent (TE MXFP8BlockScaling)


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """A per-token FP8 wire format.

    Attributes:
        name: short name, e.g. "blockwise_1x128".
        block_size: columns per scale block (128 or 32).
        scale_kind: fp32 `scale_inv` or uint8 E8M0.
        power_2_scale: blockwise only: truncate the scale to a power of two (TE's
            `QParams.power_2_scale`, on by default in `Float8BlockScaling`).
        amax_epsilon: blockwise only: floor for the amax (TE's `QParams.amax_epsilon`, 0.0).
        te_recipe: name of the TE recipe class this format reproduces.
    """

    name: str
    block_size: int
    scale_kind: ScaleKind
    power_2_scale: bool = True
    amax_epsilon: float = 0.0
    te_recipe: str = ""

    @property
    def scale_dtype(self) -> torch.dtype:
        """torch.float32 for blockwise, torch.uint8 for MXFP8."""
        return torch.float32 if self.scale_kind is ScaleKind.FP32_SCALE_INV else torch.uint8

    def num_blocks(self, hidden: int) -> int:
        """Scale blocks per token: ceil(hidden / block_size)."""
        return math.ceil(hidden / self.block_size)

    def scale_bytes_per_token(self, hidden: int) -> int:
        """Bytes of scales per token."""
        return self.num_blocks(hidden) * self.scale_dtype.itemsize

    def bytes_per_token(self, hidden: int) -> int:
        """Bytes per token on the wire: `hidden` e4m3 bytes plus the scales."""
        return hidden + self.scale_bytes_per_token(hidden)

    def byte_ratio(self, hidden: int) -> float:
        """Wire bytes relative to bf16 (2 * hidden), e.g. blockwise at 7168: 0.5156."""
        return self.bytes_per_token(hidden) / (2 * hidden)

    def quantize(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Pure-torch reference quantization; see `quantize`."""
        return quantize(x, self)

    def dequantize(self, x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Pure-torch reference dequantization; see `dequantize`."""
        return dequantize(x_fp8, scales, self)


BLOCKWISE_1x128 = Fp8Format(
    name="blockwise_1x128", block_size=128, scale_kind=ScaleKind.FP32_SCALE_INV,
    power_2_scale=True, amax_epsilon=0.0, te_recipe="Float8BlockScaling")
BLOCKWISE_1x128_FP32_SCALES = dataclasses.replace(
    BLOCKWISE_1x128, name="blockwise_1x128_fp32_scales", power_2_scale=False)
MXFP8_1x32 = Fp8Format(
    name="mxfp8_1x32", block_size=32, scale_kind=ScaleKind.E8M0, power_2_scale=True,
    amax_epsilon=0.0, te_recipe="MXFP8BlockScaling")

FORMATS = {f.name: f for f in (BLOCKWISE_1x128, BLOCKWISE_1x128_FP32_SCALES, MXFP8_1x32)}


def _check_2d(x: torch.Tensor, what: str) -> None:
    assert x.dim() == 2, f"{what} must be [num_tokens, hidden], got shape {tuple(x.shape)}"


def _blocks(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[N, H]` fp32 -> `[N, num_blocks, block_size]`, the partial last block padded with 0."""
    num_tokens, hidden = values.shape
    pad = (-hidden) % block_size
    if pad:
        values = torch.nn.functional.pad(values, (0, pad))
    return values.reshape(num_tokens, (hidden + pad) // block_size, block_size)


def _unblock(blocks: torch.Tensor, hidden: int) -> torch.Tensor:
    return blocks.reshape(blocks.shape[0], blocks.shape[1] * blocks.shape[2])[:, :hidden]


def block_amax(values: torch.Tensor) -> torch.Tensor:
    """Max |x| over the last dim, ignoring NaN and starting at 0 (fmaxf semantics, as TE)."""
    magnitude = values.abs()
    magnitude = torch.where(torch.isnan(magnitude), torch.zeros_like(magnitude), magnitude)
    return magnitude.amax(dim=-1)


def to_e4m3(values: torch.Tensor) -> torch.Tensor:
    """fp32 -> `torch.float8_e4m3fn`: round to nearest even, saturate to +-448, NaN -> 0x7F.

    torch's own cast does not saturate (it maps overflow to NaN), hence the clamp; it keeps NaN.
    """
    is_nan = torch.isnan(values)
    q = values.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(is_nan, torch.full_like(q, E4M3_NAN_BYTE), q)
    return q.view(torch.float8_e4m3fn)


def blockwise_scale(amax: torch.Tensor, power_2_scale: bool, amax_epsilon: float) -> torch.Tensor:
    """TE `compute_scale_from_amax` for e4m3 with bf16 input: the fp32 quantization multiplier."""
    amax = amax.float()
    amax = torch.where(amax < amax_epsilon, torch.full_like(amax, amax_epsilon), amax)
    scale = torch.full_like(amax, E4M3_MAX) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, BF16_MAX), scale)
    unscaled = torch.isinf(amax) | (amax == 0) | torch.isnan(amax)
    scale = torch.where(unscaled, torch.ones_like(scale), scale)
    if power_2_scale:
        # Keep sign and exponent bits: 0xFF800000 as a signed int32.
        scale = (scale.view(torch.int32) & -0x800000).view(torch.float32)
    return scale


def float_to_e8m0(values: torch.Tensor) -> torch.Tensor:
    """TE `ptx::float_to_e8m0` on non-negative fp32: biased exponent rounded up, as uint8."""
    values = values.float()
    bits = values.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    bump = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    exponent = exponent + bump.to(torch.int32)
    exponent = torch.where(values == 0, torch.zeros_like(exponent), exponent)
    exponent = torch.where(torch.isinf(values), torch.full_like(exponent, 0xFE), exponent)
    exponent = torch.where(torch.isnan(values), torch.full_like(exponent, 0xFF), exponent)
    return exponent.to(torch.uint8)


def e8m0_quant_multiplier(e8m0: torch.Tensor) -> torch.Tensor:
    """TE `exp2f_rcp`: 1 for e == 0, else the fp32 with bits (254 - e) << 23."""
    e = e8m0.to(torch.int32)
    multiplier = ((254 - e) << 23).view(torch.float32)
    return torch.where(e == 0, torch.ones_like(multiplier), multiplier)


def e8m0_dequant_multiplier(e8m0: torch.Tensor) -> torch.Tensor:
    """TE `exp2f`: the fp32 with bits e << 23 (0 for e == 0, inf for e == 255)."""
    return (e8m0.to(torch.int32) << 23).view(torch.float32)


def quantize(x: torch.Tensor, fmt: Fp8Format) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantizes tokens to `fmt` exactly as TE does (see the module docstring for the rules).

    Args:
        x: `[num_tokens, hidden]`, torch.bfloat16 (other float dtypes are read as fp32 values;
            TE's rules here are the bf16-input ones).
        fmt: the wire format.

    Returns:
        x_fp8: `[num_tokens, hidden]`, torch.float8_e4m3fn (NaN stored as 0x7F).
        scales: `[num_tokens, ceil(hidden / block)]`, torch.float32 `scale_inv` (blockwise) or
            torch.uint8 E8M0 biased exponents (MXFP8).
    """
    _check_2d(x, "x")
    hidden = x.shape[1]
    blocks = _blocks(x.float(), fmt.block_size)
    amax = block_amax(blocks)
    if fmt.scale_kind is ScaleKind.FP32_SCALE_INV:
        scale = blockwise_scale(amax, fmt.power_2_scale, fmt.amax_epsilon)
        scales = (1.0 / scale.double()).float()
        multiplier = scale
    else:
        scales = float_to_e8m0(amax * E4M3_MAX_RCP)
        multiplier = e8m0_quant_multiplier(scales)
    x_fp8 = to_e4m3(_unblock(blocks * multiplier.unsqueeze(-1), hidden))
    return x_fp8.contiguous(), scales.contiguous()


def dequantize(x_fp8: torch.Tensor, scales: torch.Tensor, fmt: Fp8Format,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantizes `quantize`'s output exactly as TE does.

    Args:
        x_fp8: `[num_tokens, hidden]`, torch.float8_e4m3fn (or its torch.uint8 bytes).
        scales: `[num_tokens, ceil(hidden / block)]`, torch.float32 (blockwise) or torch.uint8
            (MXFP8).
        fmt: the wire format.
        out_dtype: output dtype, torch.bfloat16 by default.

    Returns:
        `[num_tokens, hidden]`, `out_dtype`: fp32(q) * block factor, rounded once (to nearest
        even); in bf16 every NaN is the canonical 0x7FC0, as the device code writes it.
    """
    _check_2d(x_fp8, "x_fp8")
    num_tokens, hidden = x_fp8.shape
    expected = (num_tokens, fmt.num_blocks(hidden))
    assert tuple(scales.shape) == expected, f"scales must be {expected}, got {tuple(scales.shape)}"
    assert scales.dtype == fmt.scale_dtype, f"{fmt.name} scales are {fmt.scale_dtype}"
    values = x_fp8.view(torch.float8_e4m3fn).float()
    if fmt.scale_kind is ScaleKind.FP32_SCALE_INV:
        factor = scales.float()
    else:
        factor = e8m0_dequant_multiplier(scales)
    blocks = _blocks(values, fmt.block_size) * factor.unsqueeze(-1)
    out = _unblock(blocks, hidden).to(out_dtype).contiguous()
    if out_dtype == torch.bfloat16:
        # torch keeps NaN sign and payload; the device writes the canonical 0x7FC0.
        bits = out.view(torch.int16)
        out = torch.where(torch.isnan(out), torch.full_like(bits, BF16_NAN_BITS), bits)
        out = out.view(torch.bfloat16)
    return out
