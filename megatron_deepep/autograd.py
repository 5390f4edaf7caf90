"""Dispatch and combine as autograd functions.

Dispatch's backward is a combine of the row gradients (plus the per-(token, k) gradient of the
routing weights); combine's backward is a cached dispatch that reuses the handle. Neither keeps
one-shot state, so running the forward twice (Megatron's `moe` recompute) is safe: every forward
makes its own handle.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron_deepep.handle import DispatchHandle


class _Dispatch(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, topk_weights, buffer, topk_idx, num_experts, expert_alignment,
                num_max_recv_rows, handle_box):
        recv_x, recv_weights, handle, _ = buffer.dispatch(
            x, topk_idx, topk_weights, num_experts=num_experts,
            expert_alignment=expert_alignment, num_max_recv_rows=num_max_recv_rows)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.weights_need_grad = topk_weights.requires_grad
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        handle_box.append(handle)
        return recv_x, recv_weights

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_weights):
        handle: DispatchHandle = ctx.handle
        if grad_recv_x is None:
            grad_recv_x = torch.zeros(handle.num_recv_rows, handle.hidden, dtype=ctx.x_dtype,
                                      device=handle.recv_weights.device)
        grad_rows_w = None
        if ctx.weights_need_grad:
            grad_rows_w = (grad_recv_weights if grad_recv_weights is not None
                           else torch.zeros_like(handle.recv_weights))
        grad_x, grad_w, _ = ctx.buffer.combine(grad_recv_x.contiguous(), handle,
                                               grad_row_weights=grad_rows_w)
        return grad_x, grad_w, None, None, None, None, None, None


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


def dispatch(buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
             num_experts: int, expert_alignment: int = 1,
             num_max_recv_rows: Optional[int] = None
             ) -> Tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """Differentiable dispatch.

    Args:
        buffer: a `Buffer`.
        x: `[N, H]` rows to send.
        topk_idx: `[N, K]`, int64 or int32, expert ids, -1 for none.
        topk_weights: `[N, K]`, float32, routing weights (may require grad).
        num_experts: E.
        expert_alignment: pad every local expert's segment to this many rows.
        num_max_recv_rows: an upper bound on the received rows: no host synchronization.

    Returns:
        `recv_x [M, H]`, `recv_weights [M]` float32 and the handle.
    """
    box = []
    recv_x, recv_weights = _Dispatch.apply(x, topk_weights, buffer, topk_idx, num_experts,
                                           expert_alignment, num_max_recv_rows, box)
    return recv_x, recv_weights, box[0]


def combine(buffer, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Differentiable (unweighted) combine of `y [M, H]` back to `[N, H]`."""
    return _Combine.apply(y, buffer, handle, False)
