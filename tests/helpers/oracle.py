"""A single-process oracle: what every rank must receive, computed by plain loops.

It knows nothing of layouts or slots, only the documented order: local expert e's rows are the
(source rank, source token, k) entries naming it, in that order, then zero rows up to the
alignment. Tests compare every transport against it.
"""

from __future__ import annotations

from typing import List, Tuple

import torch


def oracle_dispatch(xs: List[torch.Tensor], idxs: List[torch.Tensor], ws: List[torch.Tensor],
                    num_experts: int, expert_alignment: int = 1
                    ) -> List[Tuple[torch.Tensor, torch.Tensor, List[int], List[Tuple]]]:
    """Returns per rank: (recv_x, recv_weights, tokens_per_expert_list, row_sources).

    `row_sources[i]` is `(source rank, token, k)` of row i, or None for a padding row.
    """
    num_ranks = len(xs)
    num_local = num_experts // num_ranks
    hidden = xs[0].shape[1]
    # Each expert's (source rank, token, k) entries, in that order: one pass over the ids.
    entries = {}
    for s in range(num_ranks):
        for n, ids in enumerate(idxs[s].tolist()):
            for k, g in enumerate(ids):
                entries.setdefault(g, []).append((s, n, k))
    weight_lists = [w.tolist() for w in ws]
    out = []
    for r in range(num_ranks):
        rows, weights, sources, sizes = [], [], [], []
        for e in range(num_local):
            seg = entries.get(r * num_local + e, [])
            pad = (-len(seg)) % expert_alignment
            for s, n, k in seg:
                rows.append(xs[s][n])
                weights.append(weight_lists[s][n][k])
                sources.append((s, n, k))
            for _ in range(pad):
                rows.append(torch.zeros(hidden, dtype=xs[0].dtype))
                weights.append(0.0)
                sources.append(None)
            sizes.append(len(seg) + pad)
        recv_x = torch.stack(rows) if rows else torch.zeros(0, hidden, dtype=xs[0].dtype)
        out.append((recv_x, torch.tensor(weights, dtype=torch.float32), sizes, sources))
    return out


def oracle_combine(ys: List[torch.Tensor], sources: List[List[Tuple]], num_tokens: List[int],
                   weights: List[torch.Tensor] = None) -> List[torch.Tensor]:
    """Combines per-rank rows `ys[r] [M_r, H]` back to the sources with the documented rounding.

    Each rank first sums a token's rows in k order in fp32 (times the row weight when `weights`
    is given) and rounds to the row dtype; the source sums those partials over ranks in
    ascending order in fp32 and rounds once.
    """
    num_ranks = len(ys)
    dtype, hidden = ys[0].dtype, ys[0].shape[1]
    acc = [torch.zeros(n, hidden, dtype=torch.float32) for n in num_tokens]
    for r in range(num_ranks):
        terms = {}  # (source, token) -> [(k, row)]: a token's rows lie in expert order
        for i, src in enumerate(sources[r]):
            if src is None:
                continue
            s, n, k = src
            term = ys[r][i].float()
            if weights is not None:
                term = term * weights[r][i]
            terms.setdefault((s, n), []).append((k, term))
        for (s, n), rows in terms.items():
            partial = torch.zeros(hidden)
            for _, term in sorted(rows, key=lambda kt: kt[0]):  # k order, not row order
                partial = partial + term
            acc[s][n] += partial.to(dtype).float()
    return [a.to(dtype) for a in acc]


def random_routing(num_tokens: int, num_experts: int, num_topk: int, *, kind: str = "random",
                   generator: torch.Generator = None) -> torch.Tensor:
    """`[N, K]` int64 expert ids: "random" (distinct per token), "skewed" (all to expert 0 plus
    distinct others), "dropped" (random with some -1 entries), "empty" (all -1)."""
    if kind == "empty":
        return torch.full((num_tokens, num_topk), -1, dtype=torch.int64)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    if kind == "skewed":
        scores[:, 0] = 2.0
    idx = scores.topk(min(num_topk, num_experts), dim=1).indices
    if idx.shape[1] < num_topk:
        pad = torch.full((num_tokens, num_topk - idx.shape[1]), -1, dtype=torch.int64)
        idx = torch.cat([idx, pad], dim=1)
    if kind == "dropped":
        drop = torch.rand(num_tokens, num_topk, generator=generator) < 0.3
        idx = torch.where(drop, torch.full_like(idx, -1), idx)
    return idx
