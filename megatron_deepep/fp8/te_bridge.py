"""Hands received FP8 tokens to Transformer Engine as its own quantized tensor types.

When the active TE recipe produces the same bits as our wire format (see `formats`), the
receiver wraps `(x_fp8, scales)` as a `Float8BlockwiseQTensor` (Float8BlockScaling, 1x128) or an
`MXFP8Tensor` (MXFP8BlockScaling, 1x32), and TE's GEMM consumes it without quantizing again.

What this bridge does not do:
- Only the rowwise (1xN along hidden) copy exists. TE's wgrad GEMM needs the input's columnwise
  copy (Nx1 blocks along tokens), which TE quantizes from the high-precision input and which
  cannot be derived from rowwise data. Use the wrapped tensor where TE needs rowwise data only
  (forward / inference, or a recipe with `backward_override="dequantized"`), with experts that
  make the columnwise copy themselves (`megatron.te_experts`), or dequantize.
- TE is never required: without it every function raises `TEUnavailableError` (or returns a
  reason), and callers fall back to `formats.dequantize` / the bf16 path.

Scale layouts (TE sources, NVIDIA/TransformerEngine, `transformer_engine/pytorch/tensor/`):
- Blockwise 1x128 rowwise scales are "GEMM ready", `[ceil(H / 128), round_up(N, 4)]` fp32
  (transposed and padded; `Float8BlockQuantizer.get_scale_shape`), in every TE version except one
  case: TE 2.5 up to 2.11 had a quantizer flag `all_gather_usage` that makes them "compact",
  `[N, ceil(H / 128)]`. The layout is chosen from the TE version and that flag
  (`blockwise_scale_layout`), never from the shapes, which coincide when N == ceil(H / 128) and
  N % 4 == 0 (N=4 H=512, N=56 H=7168).
- MXFP8 1x32 rowwise scales are `[round_up(N, 128), round_up(H / 32, 4)]` uint8, unswizzled when
  `optimize_for_gemm` is off (`mxfp8_tensor.py`).
The buffers are allocated by the quantizer's own `make_empty`; a buffer whose shape differs from
the layout's raises `TEUnavailableError` instead of being guessed at.

Shape rules checked before a handoff (`gemm_shape_reason`), each TE's own:
- every FP8 GEMM input: rows % 8 == 0 and hidden % 16 == 0
  (`transformer_engine/pytorch/utils.py`, `assert_dim_for_fp8_exec`; the cuBLAS leading-dimension
  and outer-dimension checks of `common/gemm/cublaslt_gemm.cu`, `CanonicalizeGemmInput`);
- MXFP8: rows % 32 == 0 and hidden % 32 == 0 (`pytorch/csrc/quantizer.cpp`,
  `MXFP8Quantizer::create_tensor`, which raises a RuntimeError otherwise).
Recipe fields come from `transformer_engine/common/recipe/__init__.py` (`Float8BlockScaling`:
`x_block_scaling_dim`, `fp8_quant_fwd_inp.power_2_scale` / `.amax_epsilon`; `MXFP8BlockScaling`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import re
from typing import Any, List, Optional, Sequence, Tuple

import torch

from megatron_deepep.fp8 import columnwise
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


#: TE versions [first, end) whose `Float8BlockQuantizer.all_gather_usage` selects compact scales.
COMPACT_LAYOUT_VERSIONS = ((2, 5), (2, 12))
GEMM_READY = "gemm_ready"
COMPACT = "compact"
#: TE's FP8 GEMM input rule (`assert_dim_for_fp8_exec`): rows % 8, hidden % 16.
GEMM_ROW_MULTIPLE = 8
GEMM_HIDDEN_MULTIPLE = 16
#: TE's MXFP8 quantizer rule (`MXFP8Quantizer::create_tensor`): both dims % 32.
MXFP8_MULTIPLE = 32


def parse_version(text: str) -> Tuple[int, int, int]:
    """`"2.20.2"`, `"2.5.0.dev0+abc"` -> `(major, minor, patch)`; (0, 0, 0) if unreadable."""
    match = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if match is None:
        return (0, 0, 0)
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


@functools.lru_cache(maxsize=None)
def te_version() -> Tuple[int, int, int]:
    """The installed Transformer Engine version, `(0, 0, 0)` without TE."""
    if not te_available()[0]:
        return (0, 0, 0)
    import transformer_engine

    return parse_version(getattr(transformer_engine, "__version__", ""))


def blockwise_scale_layout(version: Tuple[int, ...], quantizer: Any = None) -> str:
    """The rowwise 1x128 scale layout TE `version` gives a tensor made by `quantizer`.

    Args:
        version: TE's `(major, minor, patch)`.
        quantizer: the `Float8BlockQuantizer` that allocates the tensor (or None).

    Returns:
        `COMPACT` (`[N, ceil(H / 128)]`) only for TE 2.5 up to 2.11 with the quantizer's
        `all_gather_usage` set; else `GEMM_READY` (`[ceil(H / 128), round_up(N, 4)]`).
    """
    first, end = COMPACT_LAYOUT_VERSIONS
    if first <= tuple(version[:2]) < end and getattr(quantizer, "all_gather_usage", False):
        return COMPACT
    return GEMM_READY


def blockwise_scale_shape(layout: str, num_tokens: int, hidden: int) -> Tuple[int, int]:
    """TE's rowwise 1x128 scale buffer shape for `[num_tokens, hidden]` in `layout`."""
    num_blocks = math.ceil(hidden / 128)
    if layout == COMPACT:
        return (num_tokens, num_blocks)
    if layout != GEMM_READY:
        raise ValueError(f"unknown blockwise scale layout {layout!r}")
    return (num_blocks, 4 * math.ceil(num_tokens / 4))


def mxfp8_scale_shape(num_tokens: int, hidden: int) -> Tuple[int, int]:
    """TE's rowwise MXFP8 scale shape (unswizzled): `[round_up(N, 128), round_up(H / 32, 4)]`."""
    return (128 * math.ceil(num_tokens / 128), 4 * math.ceil(math.ceil(hidden / 32) / 4))


def to_te_scales(scales: torch.Tensor, layout: str) -> torch.Tensor:
    """Wire scales `[N, nb]` -> TE's blockwise buffer in `layout` (zeros in the padding)."""
    num_tokens, num_blocks = scales.shape
    if layout == COMPACT:
        return scales.contiguous().clone()
    out = scales.new_zeros(blockwise_scale_shape(layout, num_tokens, num_blocks * 128))
    out[:, :num_tokens].copy_(scales.t())
    return out


def from_te_scales(buffer: torch.Tensor, layout: str, num_tokens: int) -> torch.Tensor:
    """Inverse of `to_te_scales`: TE's blockwise buffer -> wire scales `[N, nb]` (a view)."""
    if layout == COMPACT:
        return buffer[:num_tokens]
    return buffer[:, :num_tokens].t()


def gemm_shape_reason(fmt: Fp8Format, num_rows: int, hidden: int) -> str:
    """Why TE cannot take `[num_rows, hidden]` rows of `fmt` into its FP8 GEMMs ("" if it can)."""
    if num_rows % GEMM_ROW_MULTIPLE or hidden % GEMM_HIDDEN_MULTIPLE:
        return (f"TE's FP8 GEMMs need rows % {GEMM_ROW_MULTIPLE} == 0 and hidden % "
                f"{GEMM_HIDDEN_MULTIPLE} == 0 (transformer_engine.pytorch.utils."
                f"assert_dim_for_fp8_exec), got rows={num_rows}, hidden={hidden}")
    return _mxfp8_shape_reason(fmt, num_rows, hidden)


def _mxfp8_shape_reason(fmt: Fp8Format, num_rows: int, hidden: int) -> str:
    if fmt.scale_kind is ScaleKind.E8M0 and (num_rows % MXFP8_MULTIPLE
                                             or hidden % MXFP8_MULTIPLE):
        return (f"TE's MXFP8 tensors need rows % {MXFP8_MULTIPLE} == 0 and hidden % "
                f"{MXFP8_MULTIPLE} == 0 (MXFP8Quantizer::create_tensor), got rows={num_rows}, "
                f"hidden={hidden}")
    return ""


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


def _fill(dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise TEUnavailableError(
            f"TE allocated a scale buffer {tuple(dst.shape)}, the layout needs {tuple(src.shape)}")
    dst.copy_(src)


def to_te_tensor(x_fp8: torch.Tensor, scales: torch.Tensor, fmt: Fp8Format, *,
                 quantizer: Any = None, dtype: torch.dtype = torch.bfloat16,
                 check_gemm_shape: bool = True) -> Any:
    """Wraps wire data as TE's quantized tensor, so TE's GEMM skips its own quantization.

    The e4m3 data is used without a copy; the scales are copied into TE's layout.

    Args:
        x_fp8: `[num_tokens, hidden]`, torch.float8_e4m3fn (or torch.uint8), CUDA.
        scales: `[num_tokens, ceil(hidden / block)]`, torch.float32 (blockwise) or torch.uint8
            (MXFP8), as `formats.quantize` returns them.
        fmt: the wire format of the data.
        quantizer: the TE quantizer the consumer would have used (its settings are checked
            against `fmt`); None builds one from `fmt`.
        dtype: the nominal high-precision dtype of the TE tensor.
        check_gemm_shape: refuse shapes TE's FP8 GEMMs reject (`gemm_shape_reason`); off, only
            the quantizer's own rule applies (e.g. to dequantize any shape).

    Returns:
        A `Float8BlockwiseQTensor` (1D, rowwise only) or an `MXFP8Tensor` (rowwise only).

    Raises:
        TEUnavailableError: TE is missing, the quantizer disagrees with `fmt`, the shape breaks a
            TE rule (the message names it), TE raised while allocating, or the installed TE
            allocates a scale layout this bridge does not know.
    """
    _require_te()
    assert x_fp8.dim() == 2, f"x_fp8 must be [num_tokens, hidden], got {tuple(x_fp8.shape)}"
    num_tokens, hidden = x_fp8.shape
    assert tuple(scales.shape) == (num_tokens, fmt.num_blocks(hidden)), "scales shape"
    assert scales.dtype == fmt.scale_dtype, f"{fmt.name} scales must be {fmt.scale_dtype}"
    if check_gemm_shape:
        reason = gemm_shape_reason(fmt, num_tokens, hidden)
    else:
        reason = _mxfp8_shape_reason(fmt, num_tokens, hidden)
    if reason:
        raise TEUnavailableError(reason)
    quantizer = _rowwise_quantizer(fmt, quantizer)
    try:
        tensor = quantizer.make_empty((num_tokens, hidden), dtype=dtype, device=x_fp8.device)
    except RuntimeError as exc:  # TE's NVTE_CHECK on a shape rule this module does not know
        raise TEUnavailableError(f"TE refused a {fmt.name} tensor of "
                                 f"{(num_tokens, hidden)}: {str(exc).splitlines()[0]}") from exc
    data = x_fp8.contiguous().view(torch.uint8)
    if tuple(tensor._rowwise_data.shape) != tuple(data.shape):
        raise TEUnavailableError(f"TE rowwise data is {tuple(tensor._rowwise_data.shape)}")
    tensor._rowwise_data = data
    dst = tensor._rowwise_scale_inv
    if fmt.scale_kind is ScaleKind.FP32_SCALE_INV:
        _fill(dst, to_te_scales(scales, blockwise_scale_layout(te_version(), quantizer)))
    else:
        expected = mxfp8_scale_shape(num_tokens, hidden)
        if tuple(dst.shape) != expected:
            raise TEUnavailableError(f"TE MXFP8 scale_inv {tuple(dst.shape)}, want {expected}")
        dst.zero_()
        dst[:num_tokens, :scales.shape[1]].copy_(scales)
    return tensor


def from_te_tensor(tensor: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """The wire pair of a rowwise 1x128 `Float8BlockwiseQTensor` (inverse of `to_te_tensor`).

    Returns:
        `(x_fp8 [N, H] torch.float8_e4m3fn, scales [N, ceil(H / 128)] torch.float32)`; the data
        is TE's buffer (no copy), the scales a view of TE's.
    """
    data = tensor._rowwise_data
    num_tokens = data.shape[0]
    layout = blockwise_scale_layout(te_version(), getattr(tensor, "_quantizer", None))
    scales = from_te_scales(tensor._rowwise_scale_inv, layout, num_tokens)
    return data.view(torch.float8_e4m3fn), scales


def is_wire_tensor(x: Any) -> bool:
    """Whether `x` is a TE 1x128 blockwise tensor with rowwise e4m3 data (what we hand over)."""
    if not te_available()[0] or type(x) is torch.Tensor:
        return False
    from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
        Float8BlockwiseQTensorStorage,
    )
    import transformer_engine_torch as tex

    return (isinstance(x, Float8BlockwiseQTensorStorage) and not x._is_2D_scaled
            and x._rowwise_data is not None and x._rowwise_data.dim() == 2
            and int(x._fp8_dtype) == int(tex.DType.kFloat8E4M3))


def split_offsets(splits: Sequence[int], align: int = 4) -> Tuple[List[int], List[int]]:
    """Row offsets of each split, and each split's scale-column offset in a packed buffer.

    Split `i`'s GEMM-ready scales `[nb, round_up(m_i, align)]` are packed one after another
    into one flat buffer: split `i` occupies `nb * round_up(m_i, align)` elements from
    `nb * scale_offsets[i]` on.

    Returns:
        `(row_offsets, scale_offsets)`, both of length `len(splits) + 1` (the last entries are
        the totals).
    """
    rows, cols = [0], [0]
    for m in splits:
        rows.append(rows[-1] + int(m))
        cols.append(cols[-1] + align * math.ceil(int(m) / align))
    return rows, cols


def split_scale_index(splits: Sequence[int], num_blocks: int,
                      device: Any = None) -> torch.Tensor:
    """Where each wire scale lands in the packed per-split GEMM-ready scale buffer.

    Args:
        splits: rows per split (sum N).
        num_blocks: scales per row (nb).
        device: where to build the index.

    Returns:
        `[N, nb]` int64: for row `r` of split `i` (local row `j`) and block `b`, the flat
        position `nb * scale_offsets[i] + b * round_up(m_i, 4) + j` (see `split_offsets`).
    """
    rows, cols = split_offsets(splits)
    # One small host-to-device copy (pinned, asynchronous: no stream synchronization).
    host = torch.tensor([[int(m) for m in splits], rows[:-1], cols[:-1],
                         [c1 - c0 for c0, c1 in zip(cols[:-1], cols[1:])]], dtype=torch.int64)
    if device is not None and torch.device(device).type == "cuda":
        host = host.pin_memory()
    counts, row_start, col_start, padded = host.to(device, non_blocking=True).unbind(0)
    split_of_row = torch.repeat_interleave(torch.arange(len(splits), device=device), counts,
                                           output_size=rows[-1])
    local = torch.arange(rows[-1], device=device) - row_start[split_of_row]
    base = num_blocks * col_start[split_of_row] + local
    block = torch.arange(num_blocks, device=device)
    return base.unsqueeze(1) + block.unsqueeze(0) * padded[split_of_row].unsqueeze(1)


def pack_split_scales(scales: torch.Tensor, splits: Sequence[int]) -> List[torch.Tensor]:
    """Wire scales `[N, nb]` -> one GEMM-ready `[nb, round_up(m_i, 4)]` buffer per split.

    One allocation (zero-filled only where a split needs padding) and one scatter; the returned
    buffers are contiguous views.
    """
    num_blocks = scales.shape[1]
    rows, cols = split_offsets(splits)
    padding = cols[-1] != rows[-1]
    flat = (scales.new_zeros if padding else scales.new_empty)(num_blocks * cols[-1])
    if rows[-1]:
        index = split_scale_index(splits, num_blocks, device=scales.device)
        flat.index_copy_(0, index.reshape(-1), scales.reshape(-1))
    return [flat.as_strided((num_blocks, c1 - c0), (c1 - c0, 1), num_blocks * c0)
            for c0, c1 in zip(cols[:-1], cols[1:])]


def split_rowwise(x_fp8: torch.Tensor, scales: torch.Tensor, splits: Sequence[int], *,
                  fmt: Fp8Format = BLOCKWISE_1x128, dtype: torch.dtype = torch.bfloat16
                  ) -> List[Any]:
    """Per-split TE tensors of wire rows: one quantized GEMM operand per expert.

    Args:
        x_fp8: `[N, H]` torch.float8_e4m3fn (or uint8), CUDA, rows grouped by split.
        scales: `[N, ceil(H / 128)]` torch.float32 wire scales.
        splits: rows per split (sum N).
        fmt: a blockwise 1x128 format.
        dtype: the nominal high-precision dtype.

    Returns:
        One rowwise-only `Float8BlockwiseQTensorStorage` per split (data: a view of `x_fp8`;
        scales: GEMM-ready, `pack_split_scales`). They carry no quantizer: TE's GEMM reads their
        data, scales and dtype only (and a quantizer per split would be copied per split).
    """
    _require_te()
    if fmt.scale_kind is not ScaleKind.FP32_SCALE_INV:
        raise TEUnavailableError(f"split_rowwise takes blockwise 1x128 rows, not {fmt.name}")
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
        Float8BlockwiseQTensorStorage,
    )

    data = x_fp8.contiguous().view(torch.uint8)
    splits = [int(m) for m in splits]
    if sum(splits) != data.shape[0]:
        raise ValueError(f"splits sum to {sum(splits)}, rows are {data.shape[0]}")
    packed = pack_split_scales(scales, splits)
    e4m3 = tex.DType.kFloat8E4M3
    return [Float8BlockwiseQTensorStorage(rows, scale, None, None, e4m3, None, False,
                                          fake_dtype=dtype)
            for rows, scale in zip(data.split(splits), packed)]


def columnwise_reason(x_fp8: torch.Tensor) -> str:
    """Why `ops.columnwise_from_rowwise` cannot make these rows' columnwise copy ("" if it can)."""
    if not te_available()[0]:
        return te_available()[1]
    if not x_fp8.is_cuda:
        return f"the rows are on {x_fp8.device} (the kernel runs on CUDA devices)"
    hidden = x_fp8.shape[1]
    if hidden % GEMM_HIDDEN_MULTIPLE:
        return f"hidden {hidden} is not a multiple of {GEMM_HIDDEN_MULTIPLE}"
    if not x_fp8.is_contiguous() or x_fp8.data_ptr() % 16:
        return "the rows are not contiguous and 16-byte aligned"
    return _columnwise_layout_reason()


@functools.lru_cache(maxsize=None)
def _columnwise_layout_reason() -> str:
    """Whether TE's columnwise 1D blockwise layout is the one the kernel writes (asked once)."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    quantizer = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=False, columnwise=True,
                                     block_scaling_dim=1)
    rows, hidden = 2 * columnwise.TOKEN_BLOCK + 16, 2 * 128 + 16
    want = ((hidden, rows), (3, columnwise.scale_columns(hidden)))
    got = (tuple(quantizer.get_columnwise_shape((rows, hidden))),
           tuple(quantizer.get_scale_shape((rows, hidden), columnwise=True)))
    if got != want:
        return (f"TE {'.'.join(map(str, te_version()))} lays columnwise 1D blocks out as data "
                f"{got[0]}, scales {got[1]} for {(rows, hidden)}; the kernel writes {want}")
    return ""


def columnwise_tensors(data: torch.Tensor, scale_inv: torch.Tensor, splits: Sequence[int],
                       hidden: int, *, dtype: torch.dtype = torch.bfloat16) -> List[Any]:
    """Per-split TE tensors over the packed columnwise copy of wire rows (the wgrad operand).

    Args:
        data: `[H * N]` torch.uint8, the packed columnwise data (`fp8.columnwise` layout, as
            `ops.columnwise_from_rowwise` writes it): split i's `[H, m_i]` at `H * row_i`.
        scale_inv: `[num_blocks, round_up(H, 4)]` torch.float32: split i's
            `[ceil(m_i / 128), round_up(H, 4)]` GEMM-ready scales from its first block's row.
        splits: rows per split (sum N).
        hidden: H.
        dtype: the nominal high-precision dtype.

    Returns:
        One columnwise-only `Float8BlockwiseQTensorStorage` per split (views of the two
        buffers): what `tex.split_quantize` returns for the dequantized rows with a
        columnwise-only `Float8BlockQuantizer`. They carry no quantizer: TE's GEMM reads data,
        scales and dtype only (and would copy a quantizer per split).
    """
    _require_te()
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
        Float8BlockwiseQTensorStorage,
    )

    rows, blocks = columnwise.layout(splits)
    cols = scale_inv.shape[1]
    if hidden * rows[-1] > data.numel() or scale_inv.shape[0] < blocks[-1] \
            or cols != columnwise.scale_columns(hidden):
        raise ValueError(f"columnwise buffers {tuple(data.shape)}, {tuple(scale_inv.shape)} do "
                         f"not hold splits {list(splits)}")
    e4m3 = tex.DType.kFloat8E4M3
    # One as_strided view per buffer and split (one call each).
    return [Float8BlockwiseQTensorStorage(
        None, None, data.as_strided((hidden, r1 - r0), (r1 - r0, 1), hidden * r0),
        scale_inv.as_strided((b1 - b0, cols), (cols, 1), cols * b0), e4m3, None, False,
        fake_dtype=dtype)
        for r0, r1, b0, b1 in zip(rows[:-1], rows[1:], blocks[:-1], blocks[1:])]


def handoff_reason(fmt: Fp8Format, training: bool, recipe: Any = None, *,
                   experts_make_columnwise: bool = False, num_rows: Optional[int] = None,
                   hidden: Optional[int] = None) -> Tuple[bool, str]:
    """Whether received rows of `fmt` may go to TE's GEMMs as TE quantized tensors.

    Args:
        fmt: the wire format.
        training: whether the experts' weights will get gradients (grad mode on). TE's wgrad
            GEMM then needs the input's columnwise copy, which the wire does not carry, so the
            handoff also needs experts that make that copy themselves
            (`experts_make_columnwise`, blockwise only) or a recipe whose backward works from
            dequantized data (`backward_override` set, e.g. "dequantized").
        recipe: the TE recipe (default: the active one).
        experts_make_columnwise: the experts build the columnwise copy (`te_experts`).
        num_rows, hidden: the received shape when known; checked against TE's shape rules
            (`gemm_shape_reason`).

    Returns:
        (True, "") or (False, the reason).
    """
    recipe = recipe if recipe is not None else active_recipe()
    ok, reason = recipe_matches(fmt, recipe)
    if not ok:
        return False, reason
    if num_rows is not None and hidden is not None:
        reason = gemm_shape_reason(fmt, num_rows, hidden)
        if reason:
            return False, reason
    if training and not getattr(recipe, "backward_override", None):
        if experts_make_columnwise and fmt.scale_kind is ScaleKind.FP32_SCALE_INV:
            return True, ""
        return False, (f"{type(recipe).__name__} without backward_override: TE's wgrad needs "
                       f"columnwise data the wire does not carry (experts that make it: "
                       f"megatron_deepep.megatron.te_experts, blockwise only)")
    return True, ""
