"""Pure-torch dispatch and combine over `all_to_all_single`: the oracle and a fallback transport.

This module defines the semantics every transport implements (see `layout.py` and `handle.py`):

* dispatch sends each token once per destination rank and expands it on the receiver into the
  expert-major layout: local expert e's rows are ordered by (source rank, source token, k) and
  padded with zero rows to a multiple of `expert_alignment`;
* combine reduces, on each expert rank, the rows of one token into one fp32 partial that is rounded
  to the row dtype and sent back once; the source sums its partials in fp32 over ranks in ascending
  order and rounds once. Rows are summed in k order.

It runs on any process group that supports `all_to_all_single` (gloo on CPU, NCCL on GPU) and
synchronizes with the host to learn split sizes. Per call it runs as few collectives as the
work allows (each one is a rendezvous of every rank): dispatch two (an all-gather of the call
parameters, which every rank checks, with the split sizes; one all-to-all of records that hold
a token's row, its per-k expert ids and positions and its weights), cached dispatch one, combine
one (partial rows and, in dispatch's backward, the routing-weight gradients in one record).
Megatron's `alltoall` dispatcher runs three for its dispatch (an all-gather of the counts, the
tokens, the probs). `python -m megatron_deepep.bench.reference` shows each collective and host
read of a layer step. Each collective waits at most the Buffer's `timeout_s`; one that expires
raises `PeerTimeoutError` naming the peers that never reached the call (a rank that raised
mid-step, say).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from megatron_deepep import validate
from megatron_deepep.fp8 import formats
from megatron_deepep.fp8.dispatch import Fp8Dispatch, pack_rows, unpack_rows
from megatron_deepep.handle import DispatchHandle, compute_recv_layout
from megatron_deepep.layout import DispatchLayout, compute_layout
from megatron_deepep.transport.base import Transport
from megatron_deepep.transport.errors import PeerTimeoutError

# A received `recv_x`: rows `[M, H]`, or the FP8 pair `(recv_x_fp8, recv_scales)`.
RecvX = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def _pack_fp8(x: torch.Tensor, x_scales: Optional[torch.Tensor],
              fp8: Fp8Dispatch) -> torch.Tensor:
    """Sender side: quantizes bf16 `x` (unless `x_scales` is given) and packs data + scales."""
    if x_scales is None:
        x_fp8, x_scales = formats.quantize(x, fp8.fmt)
    else:
        x_fp8 = x
    return pack_rows(x_fp8, x_scales)


def _unpack_fp8(recv: torch.Tensor, hidden: int, fp8: Fp8Dispatch) -> RecvX:
    """Receiver side: the FP8 pair, or its dequantization for output "bf16"."""
    recv_fp8, recv_scales = unpack_rows(recv, hidden, fp8.fmt)
    if fp8.dequantize:
        return formats.dequantize(recv_fp8, recv_scales, fp8.fmt)
    return recv_fp8, recv_scales


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """`[T, ...]` -> `[T, bytes per row]` torch.uint8, a view of the same bytes when `t` is
    contiguous."""
    t = t.contiguous()
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    return t.reshape(-1).view(torch.uint8).reshape(t.shape[0], row_bytes)


def _pack(parts: List[torch.Tensor]) -> Tuple[torch.Tensor, List[int]]:
    """Packs the parts `[T, ...]` side by side into one `[T, B]` torch.uint8 record per row (B a
    multiple of 4, so that each part's bytes can be viewed as its dtype again: parts of 4-byte
    elements go first); returns it and each part's byte offset."""
    rows = [_as_bytes(p) for p in parts]
    offsets, width = [], 0
    for r in rows:
        offsets.append(width)
        width += r.shape[1]
    pad = -width % 4
    if pad:
        rows.append(rows[0].new_zeros(rows[0].shape[0], pad))
    return torch.cat(rows, dim=1), offsets


def _unpack(records: torch.Tensor, offset: int, dtype: torch.dtype, width: int) -> torch.Tensor:
    """The `[T, width]` part of dtype `dtype` at byte `offset` of `records [T, B]` (a view)."""
    if records.shape[0] == 0:
        return torch.empty(0, width, dtype=dtype, device=records.device)
    return records[:, offset:offset + width * dtype.itemsize].view(dtype)


class _Collectives:
    """The transport's collectives on `group`, each waited on for at most `timeout_s`; a wait
    that expires (or fails: a peer's process gone) names the peers that never arrived.

    Where each rank is goes through the group's store (the default group's `PrefixStore`): every
    rank records its call number and the call's name when it enters a call (`enter`), one key per
    rank; the rank whose wait expired reads the others' and names those behind it. Ranks build
    their transports in the same order, so the i-th on a group has the same keys everywhere.
    """

    _instances: Dict[str, int] = {}  # group name -> transports built on it by this process

    def __init__(self, group, timeout_s: float):
        self.group, self.timeout_s = group, timeout_s
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        self.global_ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        name = (group or dist.group.WORLD).group_name
        instance = self._instances.get(name, 0)
        self._instances[name] = instance + 1
        self.prefix = f"megatron_deepep/reference/{name}/{instance}"
        self.call, self.what = 0, "set-up"
        try:
            self.store = dist.distributed_c10d._get_default_store()
        except Exception:  # no store (an unusual init): timeouts then name no peer
            self.store = None

    def enter(self, what: str) -> None:
        """This rank enters its next call, named `what` (e.g. "dispatch")."""
        self.call += 1
        self.what = what
        if self.store is not None and self.num_ranks > 1:
            self.store.set(f"{self.prefix}/{self.rank}", f"{self.call} {what}")

    def _where(self, rank: int) -> Optional[Tuple[int, str]]:
        """(call number, call name) rank `rank` last entered, or None (unknown / no call)."""
        key = f"{self.prefix}/{rank}"
        try:
            if not self.store.check([key]):
                return None
            call, what = self.store.get(key).decode().split(" ", 1)
            return int(call), what
        except Exception:
            return None

    def stalled_peers(self) -> str:
        """Which peers have not entered this rank's current call, in words."""
        if self.store is None:
            return "which peer is behind is unknown (no store)"
        behind = []
        for r in range(self.num_ranks):
            if r == self.rank:
                continue
            where = self._where(r)
            if where is None:
                behind.append(f"rank {r} (global {self.global_ranks[r]}) has entered no call")
            elif where[0] < self.call:
                behind.append(f"rank {r} (global {self.global_ranks[r]}) is still at its call "
                              f"{where[0]} ({where[1]})")
        if not behind:
            return "every peer entered this call (the collective itself stalled)"
        return "; ".join(behind)

    def wait(self, work, op: str) -> None:
        """Waits for `work` (an async collective) at most `timeout_s`.

        Raises:
            PeerTimeoutError: it did not complete in time; names the stalled peers.
            RuntimeError: it failed (e.g. a peer's process exited); names them too.
        """
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            where = (f"the reference transport's {self.what} (call {self.call} of rank "
                     f"{self.rank} of {self.num_ranks}) in {op}")
            if "timed out" in str(exc).lower():
                raise PeerTimeoutError(
                    f"megatron_deepep: {where} waited {self.timeout_s:g} s (the Buffer's "
                    f"timeout_s) for its peers: {self.stalled_peers()}. A rank that raised "
                    "between dispatch and combine, or skipped a call, leaves its peers here"
                ) from None
            raise RuntimeError(f"megatron_deepep: {where} failed ({exc}): "
                               f"{self.stalled_peers()}") from exc

    def all_to_all(self, records: torch.Tensor, send_splits: List[int], recv_splits: List[int],
                   zero_tail: bool = False) -> torch.Tensor:
        """`all_to_all_single` along dim 0 of a contiguous byte tensor `[T, B]` torch.uint8
        (every backend moves bytes; gloo has no bf16 or int16). With `zero_tail`, the result has
        one more row, all zero bytes, after the received ones (what padding rows gather)."""
        num_recv = sum(recv_splits)
        out = records.new_empty((num_recv + int(zero_tail),) + tuple(records.shape[1:]))
        if zero_tail:
            out[num_recv:].zero_()
        received = out[:num_recv]
        if self.num_ranks == 1:
            received.copy_(records)
        else:
            self.wait(dist.all_to_all_single(received, records, recv_splits, send_splits,
                                             group=self.group, async_op=True),
                      "all_to_all_single")
        return out

    def exchange_header(self, header: List[int], names: List[str],
                        num_tokens_per_rank: torch.Tensor) -> Tuple[List[int], List[int]]:
        """The one metadata collective of a dispatch: every rank's call parameters and tokens
        per destination rank, all-gathered.

        Raises ValueError when ranks disagree on a call parameter (that would corrupt the
        layout); every rank sees the same table, so every rank raises.

        Returns:
            `(send_splits, recv_splits)`: tokens this rank sends to each rank, and receives from
            each.
        """
        mine = torch.cat([torch.tensor(header, dtype=torch.int64),
                          num_tokens_per_rank.to(device="cpu", dtype=torch.int64)])
        if self.num_ranks == 1:
            table = [mine.tolist()]
        else:
            if dist.get_backend(self.group) == "nccl":
                mine = mine.cuda()
            gathered = [torch.empty_like(mine) for _ in range(self.num_ranks)]
            self.wait(dist.all_gather(gathered, mine, group=self.group, async_op=True),
                      "all_gather of the call's parameters and split sizes")
            table = torch.stack(gathered).tolist()
        for col, name in enumerate(names):
            values = [row[col] for row in table]
            if len(set(values)) > 1:
                raise ValueError(f"ranks disagree on {name}: per-rank values {values}")
        num_fields = len(header)
        return table[self.rank][num_fields:], [row[num_fields + self.rank] for row in table]


@dataclasses.dataclass
class _Replay:
    """What a dispatch keeps (in its handle's `transport_state`) for its combine and cached
    dispatch, as gather indices (a gather is much faster than a masked scatter on the CPU).

    Attributes:
        send_splits: tokens sent to each rank.
        recv_splits: tokens received from each rank.
        order: `[T_send]` int64, the sent tokens in (destination, slot) order.
        row_source: `[M]` int64, the received slot of every row (T_recv for padding rows: the
            zero record after the received ones).
        row_of_entry: `[T_recv, K]` int64, the row of every received (slot, k) entry (M for
            none: the zero row after the rows).
        partial_of_token: `[R, N]` int64, the combine record of token n from rank r (T_send
            when rank r holds none of its experts: the zero record after the received ones).
    """

    send_splits: List[int]
    recv_splits: List[int]
    order: torch.Tensor
    row_source: torch.Tensor
    row_of_entry: torch.Tensor
    partial_of_token: torch.Tensor


def _segment_ids(splits: List[int], device) -> Tuple[torch.Tensor, torch.Tensor]:
    """For rows grouped in segments of `splits` rows: each row's segment and index within it
    (`[T]` int64 each)."""
    sizes = torch.tensor(splits, dtype=torch.long, device=device)
    segment = torch.repeat_interleave(torch.arange(len(splits), device=device), sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    return segment, torch.arange(segment.numel(), device=device) - starts[segment]


class ReferenceTransport(Transport):
    """Dispatch/combine in pure torch over a process group.

    Args:
        group: the EP process group.
        num_max_tokens_per_rank: N_max; also the slot count per source in `slot_rows`.
        hidden: unused (rows of any width travel).
        num_topk: unused.
        num_sms: unused (no kernels of ours).
        timeout_s: how long each collective may wait for the peers before it raises
            `PeerTimeoutError` naming the ranks that did not arrive (`_Collectives`).
    """

    name = "reference"
    graph_capture_refusal = "it exchanges split sizes on the host (torch.distributed)"
    row_dtypes = (torch.bfloat16, torch.float16, torch.float32)

    def __init__(self, group, num_max_tokens_per_rank: int, hidden: int = 0, num_topk: int = 0,
                 *, num_sms: int = 0, timeout_s: float = 0.0):
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.collectives = _Collectives(group, timeout_s if timeout_s > 0 else 100.0)

    @staticmethod
    def size_hint(num_ranks: int, num_max_tokens_per_rank: int, hidden: int,
                  num_topk: int) -> int:
        return 0

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout:
        return compute_layout(topk_idx, num_experts, self.num_ranks)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 num_experts: int, expert_alignment: int = 1,
                 num_max_recv_rows: Optional[int] = None,
                 layout: Optional[DispatchLayout] = None, fp8: Optional[Fp8Dispatch] = None,
                 x_scales: Optional[torch.Tensor] = None
                 ) -> Tuple[RecvX, torch.Tensor, DispatchHandle]:
        """Dispatches `x`; see the module docstring for the layout of the result.

        Args:
            x: `[N, H]` rows (bf16, fp16 or fp32); with `fp8` and `x_scales`, the e4m3 data.
            fp8: None, or the FP8 dispatch: the sender quantizes `x` with `formats.quantize`
                (unless `x_scales` is given), each token's e4m3 bytes and scale bytes travel as
                one packed row, and the receiver returns them (`fp8.output == "fp8"`) or their
                `formats.dequantize` (`"bf16"`).
            x_scales: `[N, num_blocks]` scales of a pre-quantized `x` (fp32 or uint8, per the
                format), else None.

        Returns:
            `recv_x [M, H]` (x.dtype; bf16 for FP8 output "bf16"; for FP8 output "fp8" the pair
            `(recv_x_fp8 [M, H] float8_e4m3fn, recv_scales [M, num_blocks])`),
            `recv_weights [M]` float32 and the handle.
        """
        if fp8 is not None:
            hidden = x.shape[1]
            packed = _pack_fp8(x, x_scales, fp8)
            recv, recv_weights, handle = self._dispatch_rows(
                packed, topk_idx, topk_weights, num_experts, expert_alignment,
                num_max_recv_rows, layout, hidden=hidden, wire=fp8.wire_code)
            return _unpack_fp8(recv, hidden, fp8), recv_weights, handle
        return self._dispatch_rows(x, topk_idx, topk_weights, num_experts, expert_alignment,
                                   num_max_recv_rows, layout, hidden=x.shape[1], wire=0)

    def _dispatch_rows(self, x: torch.Tensor, topk_idx: torch.Tensor,
                       topk_weights: torch.Tensor, num_experts: int, expert_alignment: int,
                       num_max_recv_rows: Optional[int], layout: Optional[DispatchLayout], *,
                       hidden: int, wire: int
                       ) -> Tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Dispatches rows `x [N, W]` of any dtype; the handle records `hidden` (the token width,
        W for bf16, the element count of the FP8 data otherwise).

        Two collectives: the header (call parameters and split sizes) and one all-to-all of
        records that carry each sent token's row, its per-k local expert ids and positions, and
        its weights. The receiver counts its entries per (source, local expert) from the
        received ids. Two host reads: the header table and the segment sizes.
        """
        num_ranks = self.num_ranks
        num_local = num_experts // num_ranks
        num_tokens, num_topk = topk_idx.shape
        width, device = x.shape[1], x.device
        validate.check_expert_ids_on_host(topk_idx, num_experts)
        layout = layout if layout is not None else compute_layout(topk_idx, num_experts,
                                                                  num_ranks)
        comm = self.collectives
        comm.enter("dispatch")
        send_splits, recv_splits = comm.exchange_header(
            [hidden, num_topk, num_experts, expert_alignment, wire],
            ["hidden", "top-k", "num_experts", "expert_alignment", "fp8 wire format (0 = bf16)"],
            layout.num_tokens_per_rank)

        # Tokens in slot order for every destination, with their per-k local expert ids.
        dest_of_row, slot_of_row = _segment_ids(send_splits, device)
        order = layout.slot_token.view(-1).index_select(
            0, dest_of_row * layout.slot_token.shape[1] + slot_of_row).long()
        idx = topk_idx.index_select(0, order).long()
        dest = dest_of_row.unsqueeze(1)
        on_dest = (idx >= 0) & (idx // num_local == dest)
        local_e = torch.where(on_dest, idx - dest * num_local, -1)
        pos = torch.where(on_dest, layout.pos_in_expert.index_select(0, order).long(), -1)
        meta = torch.cat([local_e, pos], dim=1).to(torch.int32)
        records, (at_meta, at_w, at_row) = _pack(
            [meta, topk_weights.index_select(0, order).float(), x.index_select(0, order)])
        received = comm.all_to_all(records, send_splits, recv_splits, zero_tail=True)
        num_recv = received.shape[0] - 1
        recv_meta = _unpack(received[:num_recv], at_meta, torch.int32, 2 * num_topk).long()

        src, slot = _segment_ids(recv_splits, device)
        e, p = recv_meta[:, :num_topk], recv_meta[:, num_topk:]
        valid = e >= 0
        # (source, local expert) of every entry; entries per pair are what the source's layout
        # counted for them.
        pair = src.unsqueeze(1) * num_local + e.clamp(min=0)
        counts_from_src = torch.bincount(pair[valid], minlength=num_ranks * num_local).view(
            num_ranks, num_local)
        recv = compute_recv_layout(counts_from_src, expert_alignment)
        tokens_per_expert_list = recv.tokens_per_expert.tolist()
        num_rows = sum(tokens_per_expert_list)
        if num_max_recv_rows is not None:
            if num_rows > num_max_recv_rows:
                raise ValueError(
                    f"num_max_recv_rows={num_max_recv_rows} is too small: this rank receives "
                    f"{num_rows} rows (padding included)")
            num_rows = num_max_recv_rows

        row_start = recv.expert_row_start.long().index_select(0, e.clamp(min=0).view(-1))
        src_offset = recv.src_expert_offset.long().view(-1).index_select(0, pair.view(-1))
        rows = (row_start + src_offset).view_as(p) + p
        # Every row gathers its (slot, k) entry; padding rows the zero record after the last.
        row_of_entry = torch.where(valid, rows, num_rows)
        entry_of_row = torch.full((num_rows + 1,), num_recv * num_topk, dtype=torch.long,
                                  device=device)
        entry_of_row.index_copy_(0, row_of_entry.view(-1),
                                 torch.arange(num_recv * num_topk, device=device))
        entry_of_row = entry_of_row[:num_rows]  # slot num_rows took the entries of no row
        row_source = entry_of_row // num_topk
        recv_x = _unpack(received, at_row, x.dtype, width).index_select(0, row_source)
        recv_weights = _unpack(received, at_w, torch.float32, num_topk).reshape(-1).index_select(
            0, entry_of_row)

        n_max = self.num_max_tokens_per_rank
        slot_rows = torch.full((num_ranks, n_max, num_topk), -1, dtype=torch.int32,
                               device=device)
        slot_rows.view(-1, num_topk).index_copy_(0, src * n_max + slot,
                                                 torch.where(valid, rows, -1).to(torch.int32))
        # Combine: token n's record from rank r, or the zero record after the T_send received.
        sent_before = torch.tensor([0] + send_splits[:-1], device=device).cumsum(0)
        partial_of_token = torch.where(
            layout.is_token_in_rank, sent_before + layout.token_slot_in_rank.long(),
            sum(send_splits)).t().contiguous()
        handle = DispatchHandle(
            layout=layout, recv=recv,
            num_recv_tokens_per_rank=torch.tensor(recv_splits, dtype=torch.int32,
                                                  device=device),
            slot_rows=slot_rows, recv_weights=recv_weights, num_experts=num_experts,
            num_topk=num_topk, hidden=hidden, expert_alignment=expert_alignment,
            num_recv_rows=num_rows, tokens_per_expert_list=tokens_per_expert_list,
            transport_state=_Replay(send_splits, recv_splits, order, row_source, row_of_entry,
                                    partial_of_token))
        return recv_x, recv_weights, handle

    def cached_dispatch(self, x: torch.Tensor, handle: DispatchHandle,
                        fp8: Optional[Fp8Dispatch] = None,
                        x_scales: Optional[torch.Tensor] = None) -> RecvX:
        """Replays a dispatch's routing for new rows `x [N, H]`; returns `[M, H]`.

        `fp8` and `x_scales` work as in `dispatch` (the result is then the FP8 pair or the
        dequantized bf16 rows).
        """
        if fp8 is not None:
            hidden = x.shape[1]
            recv = self._cached_rows(_pack_fp8(x, x_scales, fp8), handle)
            return _unpack_fp8(recv, hidden, fp8)
        return self._cached_rows(x, handle)

    def _cached_rows(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """One collective: the rows, in the dispatch's order and split sizes."""
        state: _Replay = handle.transport_state
        records, _ = _pack([x.index_select(0, state.order)])
        self.collectives.enter("cached dispatch")
        received = self.collectives.all_to_all(records, state.send_splits, state.recv_splits,
                                               zero_tail=True)
        return _unpack(received, 0, x.dtype, x.shape[1]).index_select(0, state.row_source)

    def combine(self, y: torch.Tensor, handle: DispatchHandle, weighted: bool = False,
                grad_row_weights: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Combines expert rows `y [M, H]` back to `[N, H]` (see the module docstring).

        One collective: each received token's partial row, with its `grad_row_weights` values
        when given, travels back in one record.

        Args:
            y: `[M, H]` in the dispatch's row order.
            handle: the dispatch's handle.
            weighted: multiply each row by its routing weight before summing.
            grad_row_weights: optional `[M]` float32 per-row values returned per (token, k) as
                `[N, K]` (the gradient of the routing weights in dispatch's backward).
        """
        state: _Replay = handle.transport_state
        entries = state.row_of_entry
        # Entries of no row gather the zero row after y's: adding +0.0 to a sum that started at
        # +0.0 leaves it unchanged, so this is the masked sum, bit for bit.
        y_ext = torch.cat([y, y.new_zeros(1, y.shape[1])])
        if weighted:
            w_ext = torch.cat([handle.recv_weights, handle.recv_weights.new_zeros(1)])
        acc = torch.zeros(entries.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
        for k in range(entries.shape[1]):
            term = y_ext.index_select(0, entries[:, k]).float()
            if weighted:
                term = term * w_ext.index_select(0, entries[:, k]).unsqueeze(1)
            acc = acc + term
        parts = [acc.to(y.dtype)]
        if grad_row_weights is not None:
            g_ext = torch.cat([grad_row_weights.float(), y.new_zeros(1, dtype=torch.float32)])
            parts.insert(0, g_ext.index_select(0, entries.view(-1)).view_as(entries))
        records, offsets = _pack(parts)
        self.collectives.enter("combine")
        received = self.collectives.all_to_all(records, state.recv_splits, state.send_splits,
                                               zero_tail=True)
        partial = _unpack(received, offsets[-1], y.dtype, y.shape[1])

        # Partials summed over ranks in ascending order; a rank that holds none of a token's
        # experts adds the zero record (+0.0, as above).
        num_tokens = handle.layout.num_tokens
        out = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
        for r in range(self.num_ranks):
            out = out + partial.index_select(0, state.partial_of_token[r]).float()
        wsum = None
        if grad_row_weights is not None:
            wvals = _unpack(received, offsets[0], torch.float32, handle.num_topk)
            wsum = torch.zeros(num_tokens, handle.num_topk, dtype=torch.float32,
                               device=y.device)
            for r in range(self.num_ranks):
                wsum = wsum + wvals.index_select(0, state.partial_of_token[r])
        return out.to(y.dtype), wsum

    def destroy(self) -> None:
        pass
