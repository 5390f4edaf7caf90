"""FP8 dispatch: which format travels and what the experts receive.

`Fp8Dispatch` is the one type of the `fp8=` argument of `Buffer.dispatch`,
`Buffer.cached_dispatch` and `autograd.dispatch` (None: bf16 rows on the wire). Build it from a
format, `Fp8Dispatch(MXFP8_1x32, output="bf16")`, or from a name of Megatron's
`--moe-mdeep-fp8-dispatch` flag or of `formats.FORMATS`, `Fp8Dispatch.named("blockwise")`.

A dispatch with an `Fp8Dispatch` moves each token as e4m3 data plus its block scales (about half
the bytes of bf16), quantized inside the send (bf16 input) or taken as given (pre-quantized
`(x_fp8, x_scales)` input). The receiver either keeps the FP8 form (`output="fp8"`: `recv_x` is a
pair `(recv_x_fp8 [M, H] float8_e4m3fn, recv_scales [M, num_blocks])`, padding rows all zero) or
dequantizes while it expands (`output="bf16"`: `recv_x [M, H]` bfloat16).

Every token is quantized on its own, so an FP8 dispatch equals the bf16 dispatch applied to
`formats.quantize(x)`: the same rows in the same order, padding rows with zero data bytes and zero
scales (they dequantize to zero rows).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from megatron_deepep.fp8.formats import FORMATS, Fp8Format, ScaleKind

OUTPUTS = ("fp8", "bf16")
#: The values of Megatron's `--moe-mdeep-fp8-dispatch` flag, which `Fp8Dispatch.named` takes too.
FLAG_NAMES = ("off", "blockwise", "mxfp8", "auto")
#: Flag values that name one format.
ALIASES = {"blockwise": "blockwise_1x128", "mxfp8": "mxfp8_1x32"}
# Kernel template codes of the wire format (cuda_src/common/fp8_row.cuh, kFmt).
WIRE_BF16 = 0
WIRE_BLOCKWISE = 1
WIRE_BLOCKWISE_POW2 = 2
WIRE_MXFP8 = 3


@dataclasses.dataclass(frozen=True)
class Fp8Dispatch:
    """An FP8 dispatch request: the `fp8=` argument of a dispatch.

    Attributes:
        fmt: the wire format (`formats.BLOCKWISE_1x128`, `MXFP8_1x32`, ...).
        output: "fp8" (data and scales to the experts) or "bf16" (dequantized in the expand).
    """

    fmt: Fp8Format
    output: str = "fp8"

    @classmethod
    def named(cls, name: str, output: str = "fp8") -> "Optional[Fp8Dispatch]":
        """The request a name means now.

        Args:
            name: one of `names()`: Megatron's flag values ("off", "blockwise", "mxfp8",
                "auto": TE's active recipe, read at this call) or a format of `formats.FORMATS`.
            output: "fp8" or "bf16" (see the module docstring).

        Returns:
            The request, or None for a bf16 dispatch ("off", or "auto" with no TE recipe that
            has a matching format).
        """
        fmt = format_for_name(name)
        return None if fmt is None else cls(fmt, check_output(output))

    def __post_init__(self):
        if self.output not in OUTPUTS:
            raise ValueError(f"fp8 output must be one of {OUTPUTS}, got {self.output!r}")
        if not isinstance(self.fmt, Fp8Format):
            raise ValueError(f"fp8 format must be an Fp8Format, got {self.fmt!r}")

    @property
    def wire_code(self) -> int:
        """The kernels' kFmt template argument."""
        if self.fmt.scale_kind is ScaleKind.E8M0:
            return WIRE_MXFP8
        return WIRE_BLOCKWISE_POW2 if self.fmt.power_2_scale else WIRE_BLOCKWISE

    @property
    def dequantize(self) -> bool:
        return self.output == "bf16"


def check_fp8_argument(value) -> "Fp8Dispatch | None":
    """Returns a dispatch's `fp8=` argument if it is None or an `Fp8Dispatch`.

    Raises:
        TypeError: for anything else, saying how to build the `Fp8Dispatch` from a name or a
            format.
    """
    if value is None or isinstance(value, Fp8Dispatch):
        return value
    hint = ""
    if isinstance(value, str):
        hint = f" (from a name: fp8=Fp8Dispatch.named({value!r}))"
    elif isinstance(value, Fp8Format):
        hint = " (from a format: fp8=Fp8Dispatch(fmt))"
    raise TypeError(f"fp8 must be None or an Fp8Dispatch{hint}; got {type(value).__name__} "
                    f"{value!r}")


def names() -> Tuple[str, ...]:
    """Every name `Fp8Dispatch.named` takes: Megatron's flag values, then the format names."""
    return FLAG_NAMES + tuple(sorted(FORMATS))


def format_for_name(name: str) -> "Fp8Format | None":
    """The wire format a name of `names()` means now (None: bf16 dispatch).

    "auto" asks Transformer Engine for its active recipe each time it is read.
    """
    if name == "off":
        return None
    if name == "auto":
        from megatron_deepep.fp8 import te_bridge

        return te_bridge.format_for_recipe(te_bridge.active_recipe())[0]
    fmt = FORMATS.get(ALIASES.get(name, name))
    if fmt is None:
        raise ValueError(f"FP8 format {name!r} is unknown; use one of "
                         f"{', '.join(repr(n) for n in names())}")
    return fmt


def check_output(output: str) -> str:
    """Raises ValueError unless `output` is one of `OUTPUTS`; returns it."""
    if output not in OUTPUTS:
        raise ValueError(f"fp8 output must be one of {OUTPUTS}, got {output!r}")
    return output


def row_bytes(spec: "Fp8Dispatch | None", hidden: int, element_size: int = 2) -> int:
    """Bytes one token occupies on the wire: `hidden * element_size` without FP8."""
    if spec is None:
        return hidden * element_size
    return spec.fmt.bytes_per_token(hidden)


def pack_rows(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Packs each token's e4m3 bytes and scale bytes into one int32 row (for `all_to_all`).

    Args:
        x_fp8: `[N, H]`, torch.float8_e4m3fn.
        scales: `[N, num_blocks]`, torch.float32 or torch.uint8.

    Returns:
        `[N, W]` torch.int32, `W = ceil((H + scale bytes) / 4)`; the tail bytes are zero.
    """
    num_tokens = x_fp8.shape[0]
    data = x_fp8.contiguous().view(torch.uint8)
    # Through 1-D: an empty [0, nb] tensor may carry strides that `view(dtype)` refuses.
    scale_bytes = scales.contiguous().reshape(-1).view(torch.uint8).reshape(
        num_tokens, scales.shape[1] * scales.element_size())
    parts = [data, scale_bytes]
    pad = (-(data.shape[1] + scale_bytes.shape[1])) % 4
    if pad:
        parts.append(data.new_zeros(data.shape[0], pad))
    return torch.cat(parts, dim=1).contiguous().view(torch.int32)


def unpack_rows(packed: torch.Tensor, hidden: int, fmt: Fp8Format
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_rows`: `[M, W]` int32 -> (`[M, H]` float8_e4m3fn, `[M, nb]` scales)."""
    num_rows = packed.shape[0]
    raw = packed.contiguous().reshape(-1).view(torch.uint8).reshape(
        num_rows, packed.shape[1] * packed.element_size())
    num_scale_bytes = fmt.scale_bytes_per_token(hidden)
    data = raw[:, :hidden].contiguous().view(torch.float8_e4m3fn)
    scales = raw[:, hidden:hidden + num_scale_bytes].contiguous().reshape(-1)
    return data, scales.view(fmt.scale_dtype).reshape(num_rows, fmt.num_blocks(hidden))
