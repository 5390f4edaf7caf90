"""Shared test inputs: every rank rebuilds all ranks' inputs from one seed, so any rank can run
the single-process oracle locally."""

from __future__ import annotations

import torch

from tests.helpers.oracle import random_routing


def make_inputs(seed: int, num_ranks: int, num_tokens, hidden: int, num_experts: int,
                num_topk: int, kind: str = "random", dtype=torch.bfloat16):
    """Returns lists (one entry per rank) of x `[N_r, H]`, topk_idx `[N_r, K]`, weights."""
    g = torch.Generator().manual_seed(seed)
    if isinstance(num_tokens, int):
        num_tokens = [num_tokens] * num_ranks
    xs, idxs, ws = [], [], []
    for r in range(num_ranks):
        n = num_tokens[r]
        xs.append(torch.randn(n, hidden, generator=g).to(dtype))
        idxs.append(random_routing(n, num_experts, num_topk, kind=kind, generator=g))
        ws.append(torch.rand(n, num_topk, generator=g))
    return xs, idxs, ws


def expert_scale(recv_x: torch.Tensor, tokens_per_expert) -> torch.Tensor:
    """A stand-in expert: row i of local expert e becomes `x * (e + 1)` (distinct per expert)."""
    scales = torch.repeat_interleave(
        torch.arange(1, len(tokens_per_expert) + 1, dtype=torch.float32),
        torch.tensor(tokens_per_expert))
    scales = torch.nn.functional.pad(scales, (0, recv_x.shape[0] - scales.numel()))
    return (recv_x.float() * scales.to(recv_x.device).unsqueeze(1)).to(recv_x.dtype)
