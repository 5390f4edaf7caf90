"""Receive-side allocations shared by the kernel transports (`local`, `nvlink`)."""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from megatron_deepep.arena import ArenaPlan
from megatron_deepep.handle import recv_fields
from megatron_deepep.layout import layout_fields


@functools.lru_cache(maxsize=256)
def dispatch_plan(num_tokens: int, num_topk: int, num_experts: int, num_ranks: int,
                  slots_per_rank: int, with_layout: bool) -> ArenaPlan:
    """The arena of one dispatch: its layout's arrays (unless the caller gave a layout), the
    receive layout, the per-source token counts and the slot rows."""
    fields = layout_fields(num_tokens, num_topk, num_experts, num_ranks) if with_layout else []
    return ArenaPlan(fields + recv_fields(num_ranks, num_experts // num_ranks, slots_per_rank,
                                          num_topk))


def empty_recv(num_rows: int, hidden: int, fp8, device
               ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`(recv_x, recv_scales)` for `num_rows` rows: bf16 `[num_rows, hidden]` and None, or for
    FP8 output the e4m3 rows and their `[num_rows, num_blocks]` scales."""
    if fp8 is None or fp8.dequantize:
        return torch.empty(num_rows, hidden, dtype=torch.bfloat16, device=device), None
    return (torch.empty(num_rows, hidden, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(num_rows, fp8.fmt.num_blocks(hidden), dtype=fp8.fmt.scale_dtype,
                        device=device))


def as_recv_x(recv_x: torch.Tensor, recv_scales: Optional[torch.Tensor]):
    """What `dispatch` returns as recv_x: the rows, or the FP8 pair."""
    return recv_x if recv_scales is None else (recv_x, recv_scales)
