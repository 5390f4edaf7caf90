"""Dispatch and combine as autograd functions.

Dispatch's backward is a combine of the row gradients (plus the per-(token, k) gradient of the
routing weights); combine's backward is a cached dispatch that reuses the handle. Neither keeps
one-shot state, so running the forward twice (Megatron's `moe` recompute) is safe: every forward
makes its own handle.

FP8 dispatch (`fp8=`): the forward sends e4m3 rows and block scales; the backward is the same
bf16 combine of the row gradients as without FP8 (straight-through: the quantization counts as
the identity), so `x.grad` is exactly the gradient of a bf16 dispatch. The returned `recv_x` is
always something gradients can flow to:

* output "bf16": bf16 rows `[M, H]`, dequantized on the receiver (works with any experts);
* output "fp8": the rows as Transformer Engine's own quantized tensor (`Float8BlockwiseQTensor`
  or `MXFP8Tensor`, made by `fp8.te_bridge.to_te_tensor`) when TE is importable and its active
  recipe produces this wire format, so TE's GEMM uses the received bytes without quantizing
  again. Otherwise (no TE, no or another recipe) the forward falls back to output "bf16" and
  logs why once. The raw `(recv_x_fp8, recv_scales)` pair carries no gradient, so it is only
  returned by `Buffer.dispatch`, never here.

A pre-quantized pair `(x_fp8, x_scales)` may be passed as `x`; it gets no gradient (the routing
weights still do).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Tuple

import torch

from megatron_deepep import validate
from megatron_deepep.buffer import Buffer
from megatron_deepep.fp8.dispatch import Fp8Dispatch, check_fp8_argument
from megatron_deepep.handle import DispatchHandle
from megatron_deepep.logs import log_once

logger = logging.getLogger(__name__)
def resolve_fp8_output(spec):
    """Picks what an autograd dispatch returns for `spec` (see the module docstring).

    Args:
        spec: an `fp8.dispatch.Fp8Dispatch` or None.

    Returns:
        `(spec to send with, wrap_for_te)`: output "fp8" stays only when TE's active recipe
        matches the wire format (then `wrap_for_te` is True), else it becomes "bf16".
    """
    if spec is None or spec.output != "fp8":
        return spec, False
    from megatron_deepep.fp8 import te_bridge

    ok, reason = te_bridge.recipe_matches(spec.fmt)
    if ok:
        return spec, True
    log_once(logger, "megatron_deepep: FP8 dispatch %s returns bf16 rows (dequantized on the "
             "receiver) instead of TE tensors: %s", spec.fmt.name, reason)
    return dataclasses.replace(spec, output="bf16"), False


def _wrap_for_te(pair, fmt):
    """The received pair as TE's quantized tensor, or dequantized bf16 rows if TE refuses."""
    from megatron_deepep.fp8 import formats, te_bridge

    x_fp8, scales = pair
    try:
        return te_bridge.to_te_tensor(x_fp8, scales, fmt)
    except te_bridge.TEUnavailableError as exc:
        log_once(logger, "megatron_deepep: TE could not wrap %s rows (%s); dequantizing",
                 fmt.name, exc)
        return formats.dequantize(x_fp8, scales, fmt)


class _Dispatch(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, topk_weights, buffer, topk_idx, num_experts, expert_alignment,
                num_max_recv_rows, handle_box, fp8=None, x_scales=None, wrap_for_te=False):
        x_in = x if x_scales is None else (x, x_scales)
        recv_x, recv_weights, handle, _ = buffer.dispatch(
            x_in, topk_idx, topk_weights, num_experts=num_experts,
            expert_alignment=expert_alignment, num_max_recv_rows=num_max_recv_rows, fp8=fp8)
        if wrap_for_te:
            recv_x = _wrap_for_te(recv_x, fp8.fmt)
        # The handle outlives the step (the dispatcher keeps the last one; combine's context
        # holds it), so it must not hold this node's output: that would keep the step's autograd
        # graph alive, and with it the parameters' AccumulateGrad nodes and the stream they were
        # made on (a later CUDA-graph capture fails when that is the legacy default stream).
        handle.recv_weights = handle.recv_weights.detach()
        # The handle keeps `topk_idx` for the backward. Saved here too, so Megatron's
        # local CUDA graphs (which watch save_for_backward) keep a graph output that is our
        # topk_idx (the `moe_preprocess` attributes) allocated until the backward has run.
        ctx.save_for_backward(topk_idx)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.weights_need_grad = topk_weights.requires_grad
        ctx.x_shape = x.shape
        # Gradients are bf16 rows whatever travelled forward (FP8 is straight-through).
        ctx.x_dtype = x.dtype if fp8 is None else torch.bfloat16
        ctx.x_is_fp8 = x_scales is not None
        handle_box.append(handle)
        return recv_x, recv_weights

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_weights):
        handle: DispatchHandle = ctx.handle
        if grad_recv_x is not None and type(grad_recv_x) is not torch.Tensor \
                and hasattr(grad_recv_x, "dequantize"):
            grad_recv_x = grad_recv_x.dequantize()  # a TE quantized gradient: plain rows
        if grad_recv_x is None:
            grad_recv_x = torch.zeros(handle.num_recv_rows, handle.hidden, dtype=ctx.x_dtype,
                                      device=handle.recv_weights.device)
        grad_rows_w = None
        if ctx.weights_need_grad:
            grad_rows_w = (grad_recv_weights if grad_recv_weights is not None
                           else torch.zeros_like(handle.recv_weights))
        grad_x, grad_w, _ = ctx.buffer.combine(grad_recv_x.contiguous(), handle,
                                               grad_row_weights=grad_rows_w)
        if ctx.x_is_fp8:
            grad_x = None
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None


class _Combine(torch.autograd.Function):

    @staticmethod
    def forward(ctx, y, buffer, handle, weighted):
        if weighted:
            raise NotImplementedError("the weighted combine has no autograd rule; use "
                                      "Buffer.combine directly or weight the rows in torch")
        out, _, _ = buffer.combine(y, handle)
        ctx.buffer, ctx.handle = buffer, handle
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_y, _, _, _ = ctx.buffer.dispatch(grad_out.contiguous(), handle=ctx.handle)
        return grad_y, None, None, None


def dispatch(buffer, x, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
             num_experts: int, expert_alignment: int = 1,
             num_max_recv_rows: Optional[int] = None, fp8: Optional[Fp8Dispatch] = None
             ) -> Tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """Differentiable dispatch.

    Args:
        buffer: a `Buffer`.
        x: `[N, H]` rows to send; with `fp8`, bf16 rows or a pre-quantized pair
            `(x_fp8, x_scales)` (which gets no gradient).
        topk_idx: `[N, K]`, int64 or int32, expert ids, -1 for none.
        topk_weights: `[N, K]`, float32, routing weights (may require grad).
        num_experts: E.
        expert_alignment: pad every local expert's segment to this many rows.
        num_max_recv_rows: an upper bound on the received rows: no host synchronization.
        fp8: None or an `Fp8Dispatch` (as `Buffer.dispatch`); its output "fp8" gives TE's
            quantized tensor when TE's recipe matches, else bf16 rows (see the module
            docstring).

    Returns:
        `recv_x [M, H]` (bf16 rows or a TE quantized tensor under FP8), `recv_weights [M]`
        float32 and the handle.
    """
    _check_buffer(buffer)
    spec, wrap = resolve_fp8_output(check_fp8_argument(fp8))
    x_scales = None
    if isinstance(x, (tuple, list)):
        validate.check_x_sequence(x, spec is not None)
        x, x_scales = x
    box = []
    recv_x, recv_weights = _Dispatch.apply(x, topk_weights, buffer, topk_idx, num_experts,
                                           expert_alignment, num_max_recv_rows, box, spec,
                                           x_scales, wrap)
    return recv_x, recv_weights, box[0]


def combine(buffer, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Differentiable (unweighted) combine of `y [M, H]` back to `[N, H]`."""
    _check_buffer(buffer)
    validate.check_handle(handle, hidden=buffer.row_bytes // 2, num_topk=buffer.num_topk,
                          num_ranks=buffer.num_ranks, max_tokens=buffer.num_max_tokens_per_rank)
    return _Combine.apply(y, buffer, handle, False)


def _check_buffer(buffer) -> None:
    if not isinstance(buffer, Buffer):
        raise ValueError(f"buffer must be a megatron_deepep.Buffer, got {type(buffer).__name__}")
