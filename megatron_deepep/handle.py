"""The dispatch handle: everything combine and a cached dispatch need to replay one dispatch.

Receive-side notation: S = source rank, e = local expert. Rows of `recv_x` are grouped by local
expert; expert e's segment starts at `expert_row_start[e]`, holds its
`num_recv_tokens_per_expert[e]` rows ordered by (source rank, source token, k), and is padded with
zero rows up to `tokens_per_expert[e]` (a multiple of `expert_alignment`).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch

from megatron_deepep.arena import ArenaFields
from megatron_deepep.layout import DispatchLayout


@dataclasses.dataclass
class RecvLayout(ArenaFields):
    """Receive-side offsets derived from the per-source expert counts.

    Attributes:
        num_recv_tokens_per_expert: `[E_local]`, int32, entries received per local expert.
        tokens_per_expert: `[E_local]`, int32, segment sizes after alignment padding.
        expert_row_start: `[E_local + 1]`, int32, exclusive prefix sum of `tokens_per_expert`.
        src_expert_offset: `[R, E_local]`, int32, row offset of source S's rows inside expert e's
            segment.
    """

    num_recv_tokens_per_expert: torch.Tensor
    tokens_per_expert: torch.Tensor
    expert_row_start: torch.Tensor
    src_expert_offset: torch.Tensor


def recv_fields(num_ranks: int, num_local: int, slots_per_rank: int,
                num_topk: int) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
    """The receive-side arrays of one NVLink dispatch as `ArenaPlan` fields: the `RecvLayout`,
    then the handle's `num_recv_tokens_per_rank` and `slot_rows`."""
    return [("num_recv_tokens_per_expert", (num_local,), torch.int32),
            ("tokens_per_expert", (num_local,), torch.int32),
            ("expert_row_start", (num_local + 1,), torch.int32),
            ("src_expert_offset", (num_ranks, num_local), torch.int32),
            ("num_recv_tokens_per_rank", (num_ranks,), torch.int32),
            ("slot_rows", (num_ranks, slots_per_rank, num_topk), torch.int32)]


def align_up(value: torch.Tensor, alignment: int) -> torch.Tensor:
    """Rounds every entry of `value` up to a multiple of `alignment`."""
    return (value + alignment - 1) // alignment * alignment


def compute_recv_layout(num_tokens_from_src_per_expert: torch.Tensor,
                        expert_alignment: int) -> RecvLayout:
    """Derives the receive offsets (the CUDA notify kernel computes exactly this).

    Args:
        num_tokens_from_src_per_expert: `[R, E_local]`, int32: entries source S sends to local
            expert e.
        expert_alignment: segment alignment in rows, >= 1.
    """
    counts = num_tokens_from_src_per_expert.to(torch.int32)
    src_expert_offset = (torch.cumsum(counts, dim=0, dtype=torch.int32) - counts)
    num_recv = counts.sum(dim=0, dtype=torch.int32)
    padded = align_up(num_recv, expert_alignment).to(torch.int32)
    row_start = torch.zeros(padded.numel() + 1, dtype=torch.int32, device=counts.device)
    row_start[1:] = torch.cumsum(padded, dim=0, dtype=torch.int32)
    return RecvLayout(num_recv, padded, row_start, src_expert_offset)


@dataclasses.dataclass
class DispatchHandle(ArenaFields):
    """State of one dispatch, reused by combine and by cached dispatch (combine's backward).

    Attributes:
        layout: the sender-side `DispatchLayout`.
        recv: the receiver-side `RecvLayout`.
        num_recv_tokens_per_rank: `[R]`, int32: tokens (slots) received from each source rank.
        slot_rows: `[R, slots_per_rank, K]`, int32: for received slot j of source S, the rows of
            `recv_x` it was expanded into (one per k that names a local expert), else -1.
        recv_weights: `[M]`, float32: the routing weight of each row (0 for padding rows).
        num_experts: E.
        num_topk: K.
        hidden: H of the dispatched rows.
        expert_alignment: segment alignment in rows.
        num_recv_rows: M, the row count of `recv_x` (exact, or the caller's upper bound).
        tokens_per_expert_list: padded segment sizes on the host, when the dispatch synchronized.
        transport_state: anything the transport keeps for replay (opaque).
        buffer_lineage: the Buffer that made it (kept across `get_buffer` growth), so another
            Buffer's handle is refused.
    """

    layout: DispatchLayout
    recv: RecvLayout
    num_recv_tokens_per_rank: torch.Tensor
    slot_rows: torch.Tensor
    recv_weights: torch.Tensor
    num_experts: int
    num_topk: int
    hidden: int
    expert_alignment: int
    num_recv_rows: int
    tokens_per_expert_list: Optional[List[int]] = None
    transport_state: object = None
    buffer_lineage: Optional[int] = None

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """`[E_local]`, int32, padded segment sizes on the device."""
        return self.recv.tokens_per_expert

    @property
    def num_recv_tokens_per_expert(self) -> torch.Tensor:
        """`[E_local]`, int32, unpadded entry counts on the device."""
        return self.recv.num_recv_tokens_per_expert

    @property
    def num_tokens_per_rank(self) -> torch.Tensor:
        """`[R]`, int32, tokens this rank sent to each rank."""
        return self.layout.num_tokens_per_rank

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.layout.num_ranks
