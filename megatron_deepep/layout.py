"""Dispatch layout: where every token goes, computed from `topk_idx` alone.

Notation: N tokens on this rank, K = top-k, E experts in all, R ranks, E_local = E / R. Rank r owns
the experts `[r * E_local, (r + 1) * E_local)`. An entry `(n, k)` of `topk_idx` is one (token,
expert) pair; -1 means "no expert".

The layout is the same on every transport: the CUDA layout kernel produces exactly these tensors,
and this module is its pure-torch definition (used by the reference transport and by the tests).
"""

from __future__ import annotations

import dataclasses
from typing import List, Tuple

import torch

from megatron_deepep.arena import ArenaFields


@dataclasses.dataclass
class DispatchLayout(ArenaFields):
    """Per-token routing facts of one rank, all on the device of `topk_idx`.

    Attributes:
        num_tokens_per_rank: `[R]`, int32: tokens sent to each rank (a token counts once per rank,
            however many of its experts live there).
        num_tokens_per_expert: `[E]`, int32: (token, k) entries per expert.
        is_token_in_rank: `[N, R]`, bool: token n has at least one expert on rank r.
        token_slot_in_rank: `[N, R]`, int32: the token's index among the tokens sent to rank r, in
            token order (its slot in r's receive region), or -1.
        slot_token: `[R, N]`, int32: the inverse: `slot_token[r, j]` is the token in slot j of rank
            r (entries `j >= num_tokens_per_rank[r]` are unspecified).
        pos_in_expert: `[N, K]`, int32: the index of entry (n, k) among this rank's entries for the
            same expert, in (n, k) order, or -1 for -1 entries.
    """

    num_tokens_per_rank: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    is_token_in_rank: torch.Tensor
    token_slot_in_rank: torch.Tensor
    slot_token: torch.Tensor
    pos_in_expert: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.shape_of("token_slot_in_rank")[0]

    @property
    def num_ranks(self) -> int:
        return self.shape_of("token_slot_in_rank")[1]


def layout_fields(num_tokens: int, num_topk: int, num_experts: int,
                  num_ranks: int) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
    """The `DispatchLayout` arrays as `ArenaPlan` fields (what the CUDA layout kernel writes)."""
    return [("num_tokens_per_rank", (num_ranks,), torch.int32),
            ("num_tokens_per_expert", (num_experts,), torch.int32),
            ("token_slot_in_rank", (num_tokens, num_ranks), torch.int32),
            ("slot_token", (num_ranks, num_tokens), torch.int32),
            ("pos_in_expert", (num_tokens, num_topk), torch.int32),
            ("is_token_in_rank", (num_tokens, num_ranks), torch.bool)]


def compute_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> DispatchLayout:
    """Computes the dispatch layout in pure torch (no host synchronization).

    Args:
        topk_idx: `[N, K]`, int32 or int64, expert ids in `[-1, num_experts)`.
        num_experts: E, a multiple of `num_ranks`.
        num_ranks: R.

    Returns:
        The `DispatchLayout`; see its attributes.
    """
    num_tokens, num_topk = topk_idx.shape
    device = topk_idx.device
    num_local_experts = num_experts // num_ranks
    idx = topk_idx.long()
    valid = idx >= 0
    dest_rank = torch.where(valid, idx // num_local_experts, torch.full_like(idx, -1))

    ranks = torch.arange(num_ranks, device=device)
    is_token_in_rank = (dest_rank.unsqueeze(-1) == ranks).any(dim=1)  # [N, R]
    in_rank_i32 = is_token_in_rank.to(torch.int32)
    slots = torch.cumsum(in_rank_i32, dim=0, dtype=torch.int32) - 1
    token_slot_in_rank = torch.where(is_token_in_rank, slots, torch.full_like(slots, -1))
    num_tokens_per_rank = in_rank_i32.sum(dim=0, dtype=torch.int32)

    slot_token = torch.zeros(num_ranks, num_tokens, dtype=torch.int32, device=device)
    token_ids = torch.arange(num_tokens, dtype=torch.int32, device=device)
    for r in range(num_ranks):
        col = token_slot_in_rank[:, r]
        sel = col >= 0
        slot_token[r].index_put_((col[sel].long(),), token_ids[sel])

    # Position of (n, k) among its expert's entries, in flattened (n, k) order: a stable sort by
    # expert id groups the entries of one expert while keeping their order.
    flat = torch.where(valid, idx, torch.full_like(idx, num_experts)).flatten()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts
    pos_sorted = torch.arange(flat.numel(), device=device) - starts[flat[order]]
    pos_flat = torch.empty_like(flat)
    pos_flat[order] = pos_sorted
    pos_in_expert = torch.where(valid, pos_flat.view(num_tokens, num_topk), -1).to(torch.int32)

    return DispatchLayout(
        num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_expert=counts[:num_experts].to(torch.int32),
        is_token_in_rank=is_token_in_rank,
        token_slot_in_rank=token_slot_in_rank.to(torch.int32),
        slot_token=slot_token,
        pos_in_expert=pos_in_expert,
    )
