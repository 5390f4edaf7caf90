"""FP8 experts: the dispatched FP8 rows go into TE's grouped GEMM without a second quantization.

Megatron's `TEGroupedMLP` runs its experts through TE's `GroupedLinear`, which refuses quantized
input, so FP8 rows from the dispatch would be dequantized and quantized again by TE. The classes
here keep `TEGroupedMLP`'s parameters, checkpoints and code path and change one step, the fc1
GEMM of the received rows:

- `FP8GroupedMLP(TEGroupedMLP)` tells the `deepep` dispatcher it takes FP8 rows in training too
  (`takes_fp8_rows`); for rows it cannot take it dequantizes and runs `TEGroupedMLP` (logged once,
  with the reason).
- `FP8ColumnParallelGroupedLinear(TEColumnParallelGroupedLinear)`, its fc1: given the wire
  tensor (a rowwise 1x128 `Float8BlockwiseQTensor`, `fp8.te_bridge.is_wire_tensor`) it splits
  it into one TE quantized tensor per expert (data views, scales re-laid out GEMM-ready in one
  scatter: `te_bridge.split_rowwise`) and calls TE's `general_grouped_gemm` under the active
  `Float8BlockScaling` recipe; any other input goes to `TEGroupedLinear.forward` unchanged.

Forward and backward (`GroupedFP8Linear`), with TE's own quantizer settings of the recipe
(`Float8BlockScalingRecipeState.make_quantizers`: weights `w_block_scaling_dim` (128x128),
gradients `grad_block_scaling_dim` (1x128), e4m3 forward, e5m2 gradients under HYBRID):
    fprop  out_e   = x_e (wire, rowwise)       @ W_e^T (rowwise)            layout TN
    dgrad  dx_e    = dy_e (rowwise)            @ W_e   (columnwise)         layout NN
    wgrad  dW_e    = dy_e^T (columnwise)       @ x_e   (columnwise)         layout NT
The wgrad needs x's columnwise copy (128x1 blocks along tokens), which the wire cannot carry:
blocks span tokens from many senders. It is made where it costs least, in this backward, just
before the wgrad GEMM, by one kernel that reads the saved 1-byte rows and their scales and writes
every expert's transposed FP8 data and GEMM-ready scales (`cuda_src/fp8_columnwise.cu` through
`te_bridge.columnwise_tensors`; FP8 in, FP8 out, no bf16 copy). Nothing beyond the 1-byte rows and
their scales is kept from forward to backward. Its values are those of quantizing the
dequantized rows (TE's own `HybridQuantizer` calls this source "rowwise_dequantized"), bit for
bit (`fp8.columnwise`), so the wgrad operand carries the rowwise rounding too: a small
difference from `TEGroupedMLP`, which quantizes both copies from the bf16 input. The forward
output and dgrad use the same operands TE would. `MDEEP_FP8_COLUMNWISE=dequantize` (or a layer's
`fp8_columnwise` attribute) selects the two-step path instead: `ops.dequantize_rows` to bf16,
then TE's `split_quantize`; it is also the fallback where the kernel does not apply (rows off
CUDA, a TE whose columnwise layout differs, no NVRTC), logged once with the reason.

Shape rules (TE's, `common/gemm/cublaslt_gemm.cu`): every expert's row count must be a multiple
of 16 (the wgrad's leading dimension is the token count; Megatron's FP8 padding aligns to 16 for
blockwise: `--moe-router-padding-for-quantization` makes the dispatch pad each expert to it);
otherwise the experts dequantize. Not supported here (they dequantize): expert biases, fp8
primary weights, single grouped weights, TE's op fuser, `moe_apply_probs_on_input`, fc1
offloading, MXFP8 (Blackwell: the wire format matches TE's, tested for layout only).

Selection: `with_fp8_experts(layer_spec)` swaps the classes in a Megatron layer spec
(`ModuleSpec` trees of megatron-core <= 0.16 and the builder `functools.partial` trees of 0.17+).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_deepep import knobs
from megatron_deepep.fp8 import columnwise, te_bridge
from megatron_deepep.fp8.formats import BLOCKWISE_1x128, Fp8Format, ScaleKind
from megatron_deepep.logs import log_once

logger = logging.getLogger(__name__)

#: The attribute the dispatcher reads on `MoELayer.experts`.
TAKES_FP8_ROWS = "takes_fp8_rows"
#: Rows per expert: a multiple of this (TE wgrad: leading dimension % 16; Megatron's blockwise
#: FP8 padding size, `get_fp8_align_size`).
ROW_ALIGNMENT = 16
#: How the wgrad's columnwise copy is made: one kernel from the FP8 rows, or dequantize + TE.
COLUMNWISE_KERNEL = "kernel"
COLUMNWISE_DEQUANTIZE = "dequantize"
COLUMNWISE_METHODS = (COLUMNWISE_KERNEL, COLUMNWISE_DEQUANTIZE)


def columnwise_method(override: Optional[str] = None) -> str:
    """`override` (a layer's `fp8_columnwise` attribute), else `MDEEP_FP8_COLUMNWISE`.

    Raises:
        ValueError: naming the value and the choices.
    """
    method = override or knobs.get("FP8_COLUMNWISE")
    if method not in COLUMNWISE_METHODS:
        raise ValueError(f"fp8_columnwise / {knobs.PREFIX}FP8_COLUMNWISE={method!r}: choose "
                         f"from {COLUMNWISE_METHODS}")
    return method


def splits_reason(splits: Sequence[int]) -> str:
    """Why these rows per expert cannot go to the FP8 grouped GEMM ("" if they can)."""
    bad = [(i, int(m)) for i, m in enumerate(splits) if int(m) % ROW_ALIGNMENT]
    if not bad:
        return ""
    i, m = bad[0]
    return (f"{len(bad)} experts have a row count that is not a multiple of {ROW_ALIGNMENT} "
            f"(expert {i}: {m}); TE's FP8 wgrad needs it: set "
            f"--moe-router-padding-for-quantization")


def recipe_reason(recipe: Any) -> str:
    """Why `recipe` is not one these experts run ("" if it is)."""
    fmt, reason = te_bridge.format_for_recipe(recipe)
    if fmt is None:
        return reason
    if fmt.scale_kind is not ScaleKind.FP32_SCALE_INV:
        return f"{type(recipe).__name__}: the FP8 experts run Float8BlockScaling (1x128) only"
    if getattr(recipe, "backward_override", None):
        return f"backward_override={recipe.backward_override}: TE's own path handles it"
    return ""


def quantizer_settings(recipe: Any) -> Dict[str, Dict[str, Any]]:
    """The `Float8BlockQuantizer` keyword arguments TE's recipe state uses, per role.

    Returns:
        `{"input": ..., "weight": ..., "grad": ...}`, each with `fp8_dtype` ("e4m3"/"e5m2", a
        name), `amax_epsilon`, `force_pow_2_scales` and `block_scaling_dim`.
    """
    fwd = "e4m3"
    bwd = "e5m2" if getattr(recipe.fp8_format, "name", "") == "HYBRID" else "e4m3"
    roles = {"input": (recipe.fp8_quant_fwd_inp, fwd, recipe.x_block_scaling_dim),
             "weight": (recipe.fp8_quant_fwd_weight, fwd, recipe.w_block_scaling_dim),
             "grad": (recipe.fp8_quant_bwd_grad, bwd, recipe.grad_block_scaling_dim)}
    return {role: dict(fp8_dtype=dtype, amax_epsilon=float(q.amax_epsilon),
                       force_pow_2_scales=bool(q.power_2_scale), block_scaling_dim=int(dim))
            for role, (q, dtype, dim) in roles.items()}


def _quantizer(settings: Dict[str, Any], *, rowwise: bool, columnwise: bool):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    dtype = tex.DType.kFloat8E4M3 if settings["fp8_dtype"] == "e4m3" else tex.DType.kFloat8E5M2
    quantizer = Float8BlockQuantizer(
        dtype, rowwise=rowwise, columnwise=columnwise, amax_epsilon=settings["amax_epsilon"],
        force_pow_2_scales=settings["force_pow_2_scales"],
        block_scaling_dim=settings["block_scaling_dim"])
    quantizer.internal = True
    return quantizer


def _dequantize(x_fp8: torch.Tensor, scales: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    if x_fp8.is_cuda:
        from megatron_deepep import ops

        return ops.dequantize_rows(x_fp8.contiguous(), scales.contiguous(), fmt)
    from megatron_deepep.fp8 import formats

    return formats.dequantize(x_fp8, scales, fmt)


@dataclasses.dataclass
class _Call:
    """What one `GroupedFP8Linear` call needs besides tensors."""

    splits: List[int]
    settings: Dict[str, Dict[str, Any]]
    fmt: Fp8Format
    out_dtype: torch.dtype
    fuse_wgrad_accumulation: bool = False
    grad_enabled: bool = True  # grad mode at the call (forward runs with it off)
    columnwise: str = COLUMNWISE_KERNEL  # `columnwise_method`
    weights_fp8: Optional[List[Any]] = None  # quantized weights to reuse (`cached_weights_fp8`)


class GroupedFP8Linear(torch.autograd.Function):
    """`y_e = x_e @ W_e^T` per expert on wire rows; see the module docstring."""

    @staticmethod
    def forward(ctx, x, call: _Call, *weights):
        from transformer_engine.pytorch.cpp_extensions import general_grouped_gemm

        x_fp8, scales = te_bridge.from_te_tensor(x)
        scales = scales.contiguous()  # the wire form [M, nb]; TE's buffer is transposed
        inputs = te_bridge.split_rowwise(x_fp8, scales, call.splits, fmt=call.fmt,
                                         dtype=call.out_dtype)
        need_dgrad = call.grad_enabled and x.requires_grad
        need_wgrad = call.grad_enabled and any(w.requires_grad for w in weights)
        weights_fp8 = call.weights_fp8
        if weights_fp8 is None:
            wq = _quantizer(call.settings["weight"], rowwise=True, columnwise=need_dgrad)
            weights_fp8 = _quantize_all([w.detach() for w in weights], wq)
        out = torch.empty(x_fp8.shape[0], weights[0].shape[0], dtype=call.out_dtype,
                          device=x_fp8.device)
        general_grouped_gemm(weights_fp8, inputs, [out], [None] * len(weights), call.out_dtype,
                             layout="TN", m_splits=call.splits, single_output=True,
                             use_split_accumulator=True)
        if need_wgrad:
            ctx.save_for_backward(x_fp8, scales)
        call.weights_fp8 = None  # the module's cache holds them, not the saved call
        ctx.call, ctx.weights_fp8 = call, (weights_fp8 if need_dgrad else None)
        ctx.weights = weights if call.fuse_wgrad_accumulation else None
        ctx.weight_shape, ctx.weight_dtype = tuple(weights[0].shape), weights[0].dtype
        ctx.need_dgrad, ctx.need_wgrad = need_dgrad, need_wgrad
        ctx.hidden = x_fp8.shape[1]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.cpp_extensions import general_grouped_gemm

        call: _Call = ctx.call
        num = len(call.splits)
        if grad_out is not None and type(grad_out) is not torch.Tensor \
                and hasattr(grad_out, "dequantize"):
            grad_out = grad_out.dequantize()
        grad_out = grad_out.to(call.out_dtype).contiguous()
        gq = _quantizer(call.settings["grad"], rowwise=ctx.need_dgrad, columnwise=ctx.need_wgrad)
        # One quantizer object for every split: TE reads its settings (and copies it into each
        # tensor itself), so per-split copies here would only cost host time.
        grads = tex.split_quantize(grad_out, call.splits, [gq] * num)
        dgrad = None
        if ctx.need_dgrad:
            for w in ctx.weights_fp8:
                w.update_usage(columnwise_usage=True)
            dgrad = torch.empty(grad_out.shape[0], ctx.hidden, dtype=call.out_dtype,
                                device=grad_out.device)
            general_grouped_gemm(ctx.weights_fp8, grads, [dgrad], [None] * num, call.out_dtype,
                                 layout="NN", m_splits=call.splits, grad=True,
                                 single_output=True, use_split_accumulator=True)
            ctx.weights_fp8 = None
        wgrads = [None] * num
        if ctx.need_wgrad:
            x_fp8, scales = ctx.saved_tensors
            x_col = columnwise_operands(x_fp8, scales, call)
            wgrads, accumulate = _wgrad_outputs(ctx, num, grad_out.device)
            general_grouped_gemm(x_col, grads, wgrads, [None] * num, call.out_dtype,
                                 layout="NT", m_splits=call.splits, grad=True,
                                 use_split_accumulator=True, accumulate=accumulate)
            if ctx.weights is not None:
                wgrads = [_dummy_wgrad(w) for w in ctx.weights]
            ctx.weights = None
        return (dgrad, None, *wgrads)


def cached_weights_fp8(module: Any, weights: List[torch.Tensor], settings: Dict[str, Any],
                       columnwise: bool) -> Optional[List[Any]]:
    """The weights quantized once per training step, as TE's modules do under Megatron.

    Megatron's TE wrappers pass `is_first_microbatch` to TE (True at a step's first
    micro-batch, set by the schedule; False after each forward; None where
    `disable_parameter_transpose_cache` is set), and TE re-quantizes the weights only when it is
    None or True: later micro-batches of the step reuse them (the optimizer has not run). The
    same rule here: None when there is nothing to reuse (the caller quantizes), else the
    quantized weights of this step, made now when `is_first_microbatch` is True.

    Args:
        module: the experts' fc1 (`is_first_microbatch`, `disable_parameter_transpose_cache`).
        weights: `[out, H]` each, `module`'s weights.
        settings: the recipe's weight quantizer settings (`quantizer_settings(...)["weight"]`).
        columnwise: the weights are needed transposed too (dgrad).
    """
    first = getattr(module, "is_first_microbatch", None)
    if getattr(module, "disable_parameter_transpose_cache", False) or first is None:
        module.__dict__.pop("_mdeep_weights_fp8", None)
        return None
    key = (tuple((w.data_ptr(), tuple(w.shape), w.dtype) for w in weights),
           tuple(sorted(settings.items())), columnwise)
    cached = module.__dict__.get("_mdeep_weights_fp8")
    if not first and cached is not None and cached[0] == key:
        return cached[1]
    wq = _quantizer(settings, rowwise=True, columnwise=columnwise)
    weights_fp8 = _quantize_all([w.detach() for w in weights], wq)
    module.__dict__["_mdeep_weights_fp8"] = (key, weights_fp8)
    return weights_fp8


def _quantize_all(tensors: List[torch.Tensor], quantizer) -> List[Any]:
    """`[quantizer(t) for t in tensors]` in one call into TE where it has one."""
    import transformer_engine_torch as tex

    multi = getattr(tex, "multi_tensor_quantize", None)
    if multi is None or not all(t.is_contiguous() for t in tensors):
        return [quantizer(t) for t in tensors]
    return list(multi(tensors, [quantizer] * len(tensors)))


def columnwise_operands(x_fp8: torch.Tensor, scales: torch.Tensor, call: _Call) -> List[Any]:
    """The wgrad's columnwise copy of the rows: one TE tensor per expert (module docstring).

    Args:
        x_fp8: `[M, H]` torch.float8_e4m3fn, the saved wire rows.
        scales: `[M, ceil(H / 128)]` torch.float32 rowwise scale_inv.
        call: the call (splits, the input quantizer's settings, `columnwise` method).

    Returns:
        One columnwise-only `Float8BlockwiseQTensorStorage` per expert (data `[H, m_e]`,
        scale_inv `[ceil(m_e / 128), round_up(H, 4)]`): the same bits by either method.
    """
    settings = call.settings["input"]
    if call.columnwise == COLUMNWISE_KERNEL:
        reason = te_bridge.columnwise_reason(x_fp8)
        if not reason:
            from megatron_deepep import ops

            try:
                return _columnwise_by_kernel(x_fp8, scales, call)
            except (ImportError, ops.NvrtcUnavailable) as exc:  # NVRTC cannot build it
                reason = f"{type(exc).__name__}: {exc}"
        log_once(logger, "megatron_deepep: FP8 experts make the columnwise copy by "
                 "dequantize + TE split_quantize: %s", reason)
    import transformer_engine_torch as tex

    x_bf16 = _dequantize(x_fp8, scales, call.fmt)
    xq = _quantizer(settings, rowwise=False, columnwise=True)
    return tex.split_quantize(x_bf16, call.splits, [xq] * len(call.splits))


def _columnwise_by_kernel(x_fp8: torch.Tensor, scales: torch.Tensor, call: _Call) -> List[Any]:
    """`columnwise_operands` by `cuda_src/fp8_columnwise.cu`: one launch, then views."""
    from megatron_deepep import ops

    rows, blocks = columnwise.layout(call.splits)
    settings = call.settings["input"]
    data, scale_inv = ops.columnwise_from_rowwise(
        x_fp8, scales, columnwise.device_offsets(rows, x_fp8.device), blocks[-1],
        power_2_scale=settings["force_pow_2_scales"], amax_epsilon=settings["amax_epsilon"])
    return te_bridge.columnwise_tensors(data, scale_inv, call.splits, x_fp8.shape[1],
                                        dtype=call.out_dtype)


def _wgrad_outputs(ctx, num: int, device) -> Tuple[List[torch.Tensor], bool]:
    """The wgrad GEMM outputs: Megatron's `main_grad` buffers (fused accumulation) or new ones."""
    weights = ctx.weights
    if weights is not None and all(getattr(w, "main_grad", None) is not None for w in weights):
        overwrite = getattr(weights[0], "overwrite_main_grad", False)
        return [w.main_grad for w in weights], not overwrite
    ctx.weights = None
    packed = torch.empty(num, *ctx.weight_shape, dtype=ctx.call.out_dtype, device=device)
    return list(packed.unbind(0)), False


def _dummy_wgrad(weight) -> torch.Tensor:
    """What TE returns for a weight whose gradient went to `main_grad` (Megatron's DDP)."""
    weight.grad_added_to_main_grad = True
    grad = torch.empty_like(weight, requires_grad=False)
    if getattr(weight, "zero_out_wgrad", False):
        grad.zero_()
    return grad


def fc1_reason(module: Any, splits: Sequence[int], recipe: Any) -> str:
    """Why `module` (a TE GroupedLinear) cannot run wire rows itself ("" if it can)."""
    if getattr(module, "use_bias", False):
        return "expert biases (add_bias_linear) are not supported by the FP8 experts"
    if getattr(module, "single_grouped_weight", False):
        return "single grouped weights are not supported by the FP8 experts"
    weight = getattr(module, "weight0", None)
    if weight is None or type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return "the experts' weights are not plain tensors (fp8 primary weights?)"
    if getattr(module, "tp_size", 1) != 1:
        return "expert tensor parallelism is not supported by the FP8 experts"
    return splits_reason(splits) or recipe_reason(recipe)


def grouped_fp8_linear(module: Any, x: Any, splits: Sequence[int]) -> torch.Tensor:
    """fc1 of wire rows with `module`'s weights; see `GroupedFP8Linear`.

    Args:
        module: a TE `GroupedLinear` (weights `weight0..`, `[out, H]` each).
        x: the wire tensor `[M, H]` (rowwise 1x128 `Float8BlockwiseQTensor`).
        splits: rows per expert (sum M), multiples of `ROW_ALIGNMENT`.

    Returns:
        `[M, out]` in the weights' dtype (bf16).
    """
    recipe = te_bridge.active_recipe()
    fmt, _ = te_bridge.format_for_recipe(recipe)
    weights = [getattr(module, f"weight{i}") for i in range(module.num_gemms)]
    out_dtype = weights[0].dtype if weights[0].dtype in (torch.bfloat16, torch.float16) \
        else torch.bfloat16
    settings = quantizer_settings(recipe)
    need_dgrad = torch.is_grad_enabled() and getattr(x, "requires_grad", False)
    call = _Call(splits=[int(m) for m in splits], settings=settings,
                 fmt=fmt or BLOCKWISE_1x128, out_dtype=out_dtype,
                 fuse_wgrad_accumulation=bool(getattr(module, "fuse_wgrad_accumulation", False)),
                 grad_enabled=torch.is_grad_enabled(),
                 columnwise=columnwise_method(getattr(module, "fp8_columnwise", None)),
                 weights_fp8=cached_weights_fp8(module, weights, settings["weight"], need_dgrad))
    return GroupedFP8Linear.apply(x, call, *weights)


def _is_quantized(x: Any) -> bool:
    """A TE quantized tensor (what `GroupedLinear` refuses), not plain rows."""
    return type(x) is not torch.Tensor and hasattr(x, "dequantize")


def _not_wire_reason(x: Any) -> str:
    if te_bridge.is_wire_tensor(x):
        return ""
    return f"{type(x).__name__} rows: the FP8 experts take blockwise 1x128 rows only"


def _as_list(splits) -> List[int]:
    return [int(m) for m in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]


@functools.lru_cache(maxsize=None)
def fp8_expert_classes() -> Tuple[type, type]:
    """`(FP8GroupedMLP, FP8ColumnParallelGroupedLinear)`; needs megatron-core and TE."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelGroupedLinear
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    class FP8ColumnParallelGroupedLinear(TEColumnParallelGroupedLinear):
        """`TEColumnParallelGroupedLinear` that runs wire rows in TE's grouped FP8 GEMM."""

        def forward(self, x, m_splits):
            if _is_quantized(x):
                reason = _not_wire_reason(x)
                if not reason:
                    splits = _as_list(m_splits)
                    reason = fc1_reason(self, splits, te_bridge.active_recipe())
                    if not reason:
                        out = grouped_fp8_linear(self, x, splits)
                        self.is_first_microbatch = False  # as the TE wrapper after TE's call
                        return out, None
                log_once(logger, "megatron_deepep: FP8 experts dequantize the received rows: %s",
                         reason)
                x = x.dequantize()
            return super().forward(x, m_splits)

    class FP8GroupedMLP(TEGroupedMLP):
        """`TEGroupedMLP` whose fc1 takes the dispatched FP8 rows (module docstring)."""

        takes_fp8_rows = True

        def fp8_reason(self, tokens_per_expert) -> str:
            """Why this call cannot keep the FP8 rows ("" if it can)."""
            config = self.config
            if getattr(self, "_with_fused_impl", False):
                return "TE's op fuser (use_transformer_engine_op_fuser) takes bf16 rows"
            if config.moe_apply_probs_on_input:
                return "moe_apply_probs_on_input scales the rows in bf16"
            if getattr(self, "offload_expert_fc1", False):
                return "fc1 offloading keeps bf16 rows"
            if not isinstance(self.linear_fc1, FP8ColumnParallelGroupedLinear):
                return "linear_fc1 is not FP8ColumnParallelGroupedLinear (use with_fp8_experts)"
            return fc1_reason(self.linear_fc1, _as_list(tokens_per_expert),
                              te_bridge.active_recipe())

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs,
                    *args, **kwargs):
            x = permuted_local_hidden_states
            if _is_quantized(x):
                reason = _not_wire_reason(x) or self.fp8_reason(tokens_per_expert)
                if reason:
                    log_once(logger, "megatron_deepep: FP8 experts dequantize the received "
                             "rows: %s", reason)
                    x = x.dequantize()
            return super().forward(x, tokens_per_expert, permuted_probs, *args, **kwargs)

    return FP8GroupedMLP, FP8ColumnParallelGroupedLinear


def replace_classes(spec: Any, mapping: Dict[type, type], _depth: int = 0) -> Any:
    """A copy of a layer spec tree with the classes of `mapping` replaced.

    Walks `ModuleSpec`s and other dataclass instances, `functools.partial` builders, lists,
    tuples and dicts; anything else is kept as is. Unchanged parts are shared, not copied.
    """
    if _depth > 64:
        return spec
    if isinstance(spec, type):
        return mapping.get(spec, spec)
    walk = functools.partial(replace_classes, mapping=mapping, _depth=_depth + 1)
    if isinstance(spec, functools.partial):
        func = walk(spec.func)
        args = tuple(walk(a) for a in spec.args)
        keywords = {k: walk(v) for k, v in spec.keywords.items()}
        if func is spec.func and all(a is b for a, b in zip(args, spec.args)) \
                and all(keywords[k] is spec.keywords[k] for k in keywords):
            return spec
        return functools.partial(func, *args, **keywords)
    if dataclasses.is_dataclass(spec):
        changes = {}
        for field in dataclasses.fields(spec):
            if not field.init:
                continue
            value = getattr(spec, field.name, None)
            new = walk(value)
            if new is not value:
                changes[field.name] = new
        return dataclasses.replace(spec, **changes) if changes else spec
    if isinstance(spec, (list, tuple)):
        items = [walk(v) for v in spec]
        if all(a is b for a, b in zip(items, spec)):
            return spec
        return type(spec)(items) if isinstance(spec, list) else tuple(items)
    if isinstance(spec, dict):
        items = {k: walk(v) for k, v in spec.items()}
        return items if any(items[k] is not spec[k] for k in spec) else spec
    return spec


def with_fp8_experts(spec: Any) -> Any:
    """A layer spec whose `TEGroupedMLP` experts take the dispatched FP8 rows.

    Args:
        spec: a layer spec (e.g. `get_gpt_layer_with_transformer_engine_spec(num_experts,
            moe_grouped_gemm=True)`), a decoder block spec or an MoE module spec.

    Returns:
        The spec with `TEGroupedMLP` -> `FP8GroupedMLP` and `TEColumnParallelGroupedLinear`
        -> `FP8ColumnParallelGroupedLinear` (same parameters and checkpoints).

    Raises:
        ValueError: the spec holds no `TEGroupedMLP` (e.g. no `--moe-grouped-gemm`).
    """
    from megatron.core.extensions.transformer_engine import TEColumnParallelGroupedLinear
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    mlp, fc1 = fp8_expert_classes()
    new = replace_classes(spec, {TEGroupedMLP: mlp, TEColumnParallelGroupedLinear: fc1})
    if new is spec:
        raise ValueError("with_fp8_experts: the spec has no TEGroupedMLP experts (Megatron "
                         "with Transformer Engine and --moe-grouped-gemm builds them)")
    return new


def experts_take_fp8_rows(experts: Optional[Any]) -> bool:
    """Whether an `MoELayer.experts` module makes its own columnwise copy of FP8 rows."""
    return bool(getattr(experts, TAKES_FP8_ROWS, False))


def experts_refuse_fp8_reason(experts: Optional[Any]) -> str:
    """Why an `MoELayer.experts` module cannot take TE quantized rows at all ("" if it can).

    Megatron's `TEGroupedMLP` feeds its input to TE's `GroupedLinear`, which raises a TypeError
    for quantized input ("GroupedLinear doesn't support input tensor in FP8"), also in eval and
    inference; `FP8GroupedMLP` takes them.
    """
    if experts is None or experts_take_fp8_rows(experts):
        return ""
    fc1 = getattr(experts, "linear_fc1", None)
    if any(cls.__name__ == "GroupedLinear" for cls in type(fc1).__mro__):
        return (f"{type(experts).__name__} runs TE's GroupedLinear, which refuses quantized "
                f"input (with_fp8_experts makes experts that take it)")
    return ""
