"""CPU tier: autograd through dispatch/combine (reference transport) against plain torch."""

from __future__ import annotations

import pytest
import torch

from megatron_deepep.autograd import combine, dispatch
from megatron_deepep.buffer import Buffer
from tests.helpers.cases import make_inputs
from tests.helpers.distributed import run_distributed


def _loss_ours(buf, x, idx, w, num_experts, g):
    recv_x, recv_w, handle = dispatch(buf, x, idx, w, num_experts=num_experts)
    y = recv_x * recv_w.unsqueeze(1) * 1.5  # a differentiable stand-in expert
    out = combine(buf, y, handle)
    return (out * g).sum(), out


def _loss_oracle(x, idx, w, g):
    """The same model without communication: out[n] = sum_k 1.5 * w[n, k] * x[n] (valid k)."""
    scale = torch.where(idx >= 0, w, torch.zeros_like(w)).sum(1, keepdim=True)
    out = x * scale * 1.5
    return (out * g).sum(), out


def _check(rank, world, seed):
    xs, idxs, ws = make_inputs(seed, world, [6, 0, 9, 4][:world], 16, 4 * world, 3, "dropped",
                               dtype=torch.float32)
    buf = Buffer(None, 16, 2 * 16, 3, transport="reference")  # fp32 rows: 2-byte hidden x 2
    g = torch.randn(xs[rank].shape[0], 16, generator=torch.Generator().manual_seed(rank))
    x1, w1 = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    loss1, out1 = _loss_ours(buf, x1, idxs[rank], w1, 4 * world, g)
    loss1.backward()
    x2, w2 = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    loss2, out2 = _loss_oracle(x2, idxs[rank], w2, g)
    loss2.backward()
    torch.testing.assert_close(out1, out2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-5)
    # Forward twice (Megatron recompute) then backward through the second: same gradients.
    x3, w3 = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    _loss_ours(buf, x3, idxs[rank], w3, 4 * world, g)
    loss3, _ = _loss_ours(buf, x3, idxs[rank], w3, 4 * world, g)
    loss3.backward()
    torch.testing.assert_close(x3.grad, x2.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_autograd_matches_torch(world_size):
    run_distributed(world_size, _check, 5 + world_size)
