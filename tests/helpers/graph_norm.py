"""A LayerNorm that saves its input the way Megatron's local CUDA graphs can see.

Megatron's local graphs (megatron-core 0.19, `cuda_graphs._CudaGraphRunner`) keep a graph's
input buffer allocated until the backward graph is captured only when a Python
`save_for_backward` saw it (the observer `_CudagraphGlobalRecord._enable_saved_tensors_observer`
installs). With Transformer Engine installed they release the other input buffers right after
the forward capture (`_weakref_forward_buffers` -> `make_weakref`), so the backward capture may
hand that memory to its own buffers (such as the static output gradient, the same size as the
layer input). `torch.nn.LayerNorm`, which Megatron's local spec builds without apex
(`WrappedTorchNorm`), saves the layer input in C++, where the observer does not see it: each
replayed backward then reads a clobbered input, and the norm's weight gradient is wrong while
the output and the input gradient still look right. Apex's and TE's norms save through Python,
as this one does, so the GPU graph tests (tests/gpu/test_megatron_graphs_gpu.py) build their
layers with it.
"""

from __future__ import annotations

import torch


class _LayerNormFunction(torch.autograd.Function):
    """`layer_norm` over the last dimension; the backward recomputes the statistics in fp32."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        ctx.has_bias = bias is not None
        return torch.nn.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        x32, grad32 = x.float(), grad.float()
        mean = x32.mean(-1, keepdim=True)
        rstd = torch.rsqrt(x32.var(-1, unbiased=False, keepdim=True) + ctx.eps)
        x_hat = (x32 - mean) * rstd
        grad_x_hat = grad32 * weight.float()
        grad_x = rstd * (grad_x_hat - grad_x_hat.mean(-1, keepdim=True)
                         - x_hat * (grad_x_hat * x_hat).mean(-1, keepdim=True))
        rows = tuple(range(x.dim() - 1))
        grad_weight = (grad32 * x_hat).sum(rows).to(weight.dtype)
        grad_bias = grad32.sum(rows).to(weight.dtype) if ctx.has_bias else None
        return grad_x.to(x.dtype), grad_weight, grad_bias, None


class SavedInputLayerNorm(torch.nn.LayerNorm):
    """`torch.nn.LayerNorm` built from Megatron's norm arguments, its input saved in Python.

    Args:
        config: the TransformerConfig (unused; Megatron's specs pass it).
        hidden_size: the normalized size.
        eps: added to the variance.
    """

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-5, **kwargs):
        del config, kwargs  # persist_layer_norm, zero_centered_gamma, ...: not supported
        super().__init__(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LayerNormFunction.apply(x, self.weight, self.bias, self.eps)
