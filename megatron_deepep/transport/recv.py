"""Receive-side allocations shared by the kernel transports (`local`, `nvlink`)."""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from megatron_deepep.arena import Arena, ArenaPlan
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


def regrow_slots(old: Arena, plan: ArenaPlan, slot_fields: Tuple[str, ...], device) -> Arena:
    """`old`'s arrays moved into a new arena of `plan`, whose `slot_fields` (slots on dim 1) are
    longer: the old slots keep their values, the new ones are -1 (unused); the other arrays are
    copied as they are. For a handle of a smaller buffer that `get_buffer` replaced."""
    new = plan.allocate(device)
    for name in plan.fields:
        if name in slot_fields:
            slots = old.view(name).shape[1]
            new.view(name).fill_(-1)[:, :slots].copy_(old.view(name))
        else:
            new.view(name).copy_(old.view(name))
    return new


def empty_combine_out(handle, y: torch.Tensor, with_weights: bool
                      ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`(out [N, H], out_weights [N, K] float32 or None)` of a combine of `y` for `handle`."""
    out = torch.empty(handle.num_tokens, y.shape[1], dtype=y.dtype, device=y.device)
    out_weights = (torch.empty(handle.num_tokens, handle.num_topk, dtype=torch.float32,
                               device=y.device) if with_weights else None)
    return out, out_weights
