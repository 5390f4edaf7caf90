"""Hands received FP8 tokens to Transformer Engine as its own quantized tensor types.

When the active TE recipe produces the same bits as our wire format (see `formats`), the
receiver wraps `(x_fp8, scales)` as a `Float8BlockwiseQTensor` (Float8BlockScaling, 1x128) or an
`MXFP8Tensor` (MXFP8BlockScaling, 1x32), and TE's GEMM consumes it without quantizing again.

What this bridge does not do:
- Only the rowwise (1xN along hidden) copy exists. TE's wgrad GEMM needs the input's columnwise
  copy (Nx1 blocks along tokens), which TE quantizes from the high-precision input and which
  cannot be derived from rowwise data. Use the wrapped tensor where TE needs rowwise data only
  (forward / inference, or a recipe with `backward_override="dequantized"`), or dequantize.
- TE is never required: without it every function raises `TEUnavailableError` (or returns a
  reason), and callers fall back to `formats.dequantize` / the bf16 path.

TE sources this follows (NVIDIA/TransformerEngine): the rowwise scale shapes of
`Float8BlockQuantizer.get_scale_shape` (`transformer_engine/pytorch/tensor/
float8_blockwise_tensor.py`: 1D rowwise is `[ceil(K / 128), round_up(M, 4)]`, i.e. transposed
and padded, "GEMM ready") and of `MXFP8Quantizer.get_scale_shape` (`mxfp8_tensor.py`:
`[round_up(M, 128), round_up(K / 32, 4)]` uint8, unswizzled when `optimize_for_gemm` is off);
recipe fields from `transformer_engine/common/recipe/__init__.py` (`Float8BlockScaling`:
`x_block_scaling_dim`, `fp8_quant_fwd_inp.power_2_scale` / `.amax_epsilon`; `MXFP8BlockScaling`).
The buffers are allocated by the quantizer's own `make_empty`, so their shapes follow the
installed TE version; a layout this module does not recognise raises instead of guessing.
"""

from __future__ import annotations

import functools

import copy
import dataclasses
import logging
import math
from typing import Any, Optional, Tuple

import torch

from megatron_deepep.fp8.formats import (
    BLOCKWISE_1x128,
    BLOCKWISE_1x128_FP32_SCALES,
    MXFP8_1x32,
    Fp8Format,
    ScaleKind,
)

logger = logging.getLogger(__name__)


class TEUnavailableError(RuntimeError):
    """Transformer Engine is missing, or its active recipe does not match the wire format."""


@functools.lru_cache(maxsize=None)
def te_available() -> Tuple[bool, str]:
    """Whether `transformer_engine.pytorch` imports; returns (ok, reason when not)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
        import transformer_engine_torch  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising at import
        return False, f"transformer_engine is not importable ({type(exc).__name__}: {exc})"
    return True, ""


def _require_te() -> None:
    ok, reason = te_available()
    if not ok:
        raise TEUnavailableError(reason)


def active_recipe() -> Optional[Any]:
    """TE's recipe inside `fp8_autocast` (None outside it or without TE)."""
    if not te_available()[0]:
        return None
    manager = None
    # The manager moved from `fp8` to `quantization` in newer TE.
    for module_name in ("transformer_engine.pytorch.quantization",
                        "transformer_engine.pytorch.fp8"):
        try:
            module = __import__(module_name, fromlist=["FP8GlobalStateManager"])
            manager = module.FP8GlobalStateManager
            break
        except (ImportError, AttributeError):
            continue
    if manager is None or not manager.is_fp8_enabled():
        return None
    return manager.get_fp8_recipe()


def format_for_recipe(recipe: Any) -> Tuple[Optional[Fp8Format], str]:
    """The wire format that reproduces `recipe`'s activation quantization bit for bit.

    Args:
        recipe: a `transformer_engine.common.recipe` instance (or None).

    Returns:
        (format, "") on a match, else (None, the reason).
    """
    if recipe is None:
        return None, "no active TE fp8 recipe"
    name = type(recipe).__name__
    fp8_format = getattr(getattr(recipe, "fp8_format", None), "name", None)
    # Forward activations are e4m3 under both E4M3 and HYBRID.
    if fp8_format not in ("E4M3", "HYBRID"):
        return None, f"{name}: fp8_format {fp8_format} does not quantize activations to e4m3"
    if name == "MXFP8BlockScaling":
        return MXFP8_1x32, ""
    if name == "Float8BlockScaling":
        if getattr(recipe, "x_block_scaling_dim", None) != 1:
            return None, f"{name}: x_block_scaling_dim={recipe.x_block_scaling_dim}, wire is 1x128"
        qparams = recipe.fp8_quant_fwd_inp
        base = BLOCKWISE_1x128 if qparams.power_2_scale else BLOCKWISE_1x128_FP32_SCALES
        fmt = dataclasses.replace(base, amax_epsilon=float(qparams.amax_epsilon))
        return fmt, ""
    return None, f"recipe {name} has no matching wire format (blockwise 1x128 or MXFP8 1x32)"


def recipe_matches(fmt: Fp8Format, recipe: Any = None) -> Tuple[bool, str]:
    """Whether `fmt` equals the format of `recipe` (default: TE's active recipe)."""
    ok, reason = te_available()
    if not ok:
        return False, reason
    expected, reason = format_for_recipe(recipe if recipe is not None else active_recipe())
    if expected is None:
        return False, reason
    same = (fmt.scale_kind is expected.scale_kind and fmt.block_size == expected.block_size
            and (fmt.scale_kind is ScaleKind.E8M0
                 or (fmt.power_2_scale == expected.power_2_scale
                     and fmt.amax_epsilon == expected.amax_epsilon)))
    if not same:
        return False, f"wire format {fmt} differs from the recipe's {expected}"
    return True, ""


def _rowwise_quantizer(fmt: Fp8Format, quantizer: Any) -> Any:
    """A rowwise-only copy of `quantizer` (or a new one), checked against `fmt`."""
    import transformer_engine_torch as tex

    e4m3 = tex.DType.kFloat8E4M3
    if fmt.scale_kind is ScaleKind.FP32_SCALE_INV:
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
        if quantizer is None:
            quantizer = Float8BlockQuantizer(
                e4m3, rowwise=True, columnwise=False, amax_epsilon=fmt.amax_epsilon,
                force_pow_2_scales=fmt.power_2_scale, block_scaling_dim=1)
        mismatch = (not isinstance(quantizer, Float8BlockQuantizer)
                    or quantizer.dtype != e4m3 or quantizer.block_scaling_dim != 1
                    or bool(quantizer.force_pow_2_scales) != fmt.power_2_scale
                    or float(quantizer.amax_epsilon) != fmt.amax_epsilon)
    else:
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
        if quantizer is None:
            quantizer = MXFP8Quantizer(e4m3, rowwise=True, columnwise=False)
        mismatch = not isinstance(quantizer, MXFP8Quantizer) or quantizer.dtype != e4m3
    if mismatch:
        raise TEUnavailableError(f"quantizer {quantizer!r} does not produce wire format {fmt}")
    quantizer = copy.copy(quantizer)
    if getattr(quantizer, "columnwise_usage", False):
        logger.debug("te_bridge: dropping columnwise usage (only rowwise data is on the wire)")
    quantizer.set_usage(rowwise=True, columnwise=False)
    if hasattr(quantizer, "optimize_for_gemm"):
        quantizer.optimize_for_gemm = False  # our scales are in TE's unswizzled layout
    return quantizer


def _fill_scales(dst: torch.Tensor, scales: torch.Tensor, transposed: bool) -> None:
    """Writes compact `[N, nb]` scales into TE's padded buffer (zeros in the padding)."""
    src = scales.t() if transposed else scales
    if dst.dim() != 2 or dst.shape[0] < src.shape[0] or dst.shape[1] < src.shape[1]:
        raise TEUnavailableError(
            f"unrecognised TE scale buffer {tuple(dst.shape)} for scales {tuple(scales.shape)}")
    dst.zero_()
    dst[: src.shape[0], : src.shape[1]].copy_(src)


def to_te_tensor(x_fp8: torch.Tensor, scales: torch.Tensor, fmt: Fp8Format, *,
                 quantizer: Any = None, dtype: torch.dtype = torch.bfloat16) -> Any:
    """Wraps wire data as TE's quantized tensor, so TE's GEMM skips its own quantization.

    The e4m3 data is used without a copy; the scales are copied into TE's padded layout.

    Args:
        x_fp8: `[num_tokens, hidden]`, torch.float8_e4m3fn (or torch.uint8), CUDA.
        scales: `[num_tokens, ceil(hidden / block)]`, torch.float32 (blockwise) or torch.uint8
            (MXFP8), as `formats.quantize` returns them.
        fmt: the wire format of the data.
        quantizer: the TE quantizer the consumer would have used (its settings are checked
            against `fmt`); None builds one from `fmt`.
        dtype: the nominal high-precision dtype of the TE tensor.

    Returns:
        A `Float8BlockwiseQTensor` (1D, rowwise only) or an `MXFP8Tensor` (rowwise only).

    Raises:
        TEUnavailableError: TE is missing, the quantizer disagrees with `fmt`, or the installed
            TE allocates a scale layout this bridge does not know.
    """
    _require_te()
    assert x_fp8.dim() == 2, f"x_fp8 must be [num_tokens, hidden], got {tuple(x_fp8.shape)}"
    num_tokens, hidden = x_fp8.shape
    assert tuple(scales.shape) == (num_tokens, fmt.num_blocks(hidden)), "scales shape"
    assert scales.dtype == fmt.scale_dtype, f"{fmt.name} scales must be {fmt.scale_dtype}"
    if fmt.scale_kind is ScaleKind.E8M0 and hidden % 32 != 0:
        raise TEUnavailableError(f"TE MXFP8 needs hidden % 32 == 0, got {hidden}")
    quantizer = _rowwise_quantizer(fmt, quantizer)
    tensor = quantizer.make_empty((num_tokens, hidden), dtype=dtype, device=x_fp8.device)
    data = x_fp8.contiguous().view(torch.uint8)
    if tuple(tensor._rowwise_data.shape) != tuple(data.shape):
        raise TEUnavailableError(f"TE rowwise data is {tuple(tensor._rowwise_data.shape)}")
    tensor._rowwise_data = data
    dst = tensor._rowwise_scale_inv
    if fmt.scale_kind is ScaleKind.FP32_SCALE_INV:
        # GEMM-ready layout is transposed: [ceil(H/128), round_up(N, 4)]; a compact [N, nb]
        # buffer (older TE "COMPACT" format) is filled as is.
        compact = tuple(dst.shape) == (num_tokens, fmt.num_blocks(hidden))
        expected = (fmt.num_blocks(hidden), 4 * math.ceil(num_tokens / 4))
        if not compact and tuple(dst.shape) != expected:
            raise TEUnavailableError(f"TE blockwise scale_inv {tuple(dst.shape)}, want {expected}")
        _fill_scales(dst, scales, transposed=not compact)
    else:
        _fill_scales(dst, scales, transposed=False)
    return tensor


def maybe_to_te_tensor(x_fp8: torch.Tensor, scales: torch.Tensor, fmt: Fp8Format,
                       **kwargs) -> Tuple[Optional[Any], str]:
    """`to_te_tensor` when TE is present and its active recipe matches `fmt`.

    Returns:
        (tensor, "") or (None, the reason it was not wrapped).
    """
    ok, reason = recipe_matches(fmt)
    if not ok:
        return None, reason
    try:
        return to_te_tensor(x_fp8, scales, fmt, **kwargs), ""
    except TEUnavailableError as exc:
        return None, str(exc)


def handoff_reason(fmt: Fp8Format, training: bool, recipe: Any = None) -> Tuple[bool, str]:
    """Whether received rows of `fmt` may go to TE's GEMMs as TE quantized tensors.

    Args:
        fmt: the wire format.
        training: whether the experts' weights will get gradients (grad mode on). TE's wgrad
            GEMM then needs the input's columnwise copy, which the wire does not carry, so the
            handoff also needs a recipe whose backward works from dequantized data
            (`backward_override` set, e.g. "dequantized").
        recipe: the TE recipe (default: the active one).

    Returns:
        (True, "") or (False, the reason).
    """
    recipe = recipe if recipe is not None else active_recipe()
    ok, reason = recipe_matches(fmt, recipe)
    if not ok:
        return False, reason
    if training and not getattr(recipe, "backward_override", None):
        return False, (f"{type(recipe).__name__} without backward_override: TE's wgrad needs "
                       f"columnwise data the wire does not carry")
    return True, ""
