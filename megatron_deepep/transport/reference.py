"""Pure-torch dispatch and combine over `all_to_all_single`: the oracle and a fallback transport.

This module defines the semantics every transport implements (see `layout.py` and `handle.py`):

* dispatch sends each token once per destination rank and expands it on the receiver into the
  expert-major layout: local expert e's rows are ordered by (source rank, source token, k) and
  padded with zero rows to a multiple of `expert_alignment`;
* combine reduces, on each expert rank, the rows of one token into one fp32 partial that is rounded
  to the row dtype and sent back once; the source sums its partials in fp32 over ranks in ascending
  order and rounds once. Rows are summed in k order.

It runs on any process group that supports `all_to_all_single` (gloo on CPU, NCCL on GPU) and
synchronizes with the host to learn split sizes, so it is correct everywhere but not fast. Each
collective waits at most the Buffer's `timeout_s`; one that expires raises `PeerTimeoutError`
naming the peers that never reached the call (a rank that raised mid-step, say).
"""

from __future__ import annotations

import datetime
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

    def all_to_all(self, tensor: torch.Tensor, send_splits: List[int],
                   recv_splits: List[int]) -> torch.Tensor:
        """`all_to_all_single` along dim 0; 2-byte rows travel as int32 bits (gloo has neither
        bf16 nor int16, and every row holds an even number of elements)."""
        packed = tensor.element_size() == 2
        wire = tensor.contiguous().view(torch.int32) if packed else tensor.contiguous()
        out = wire.new_empty((sum(recv_splits),) + tuple(wire.shape[1:]))
        if self.num_ranks == 1:
            out.copy_(wire)
        else:
            self.wait(dist.all_to_all_single(out, wire, recv_splits, send_splits,
                                             group=self.group, async_op=True),
                      "all_to_all_single")
        return out.view(tensor.dtype) if packed else out

    def check_ranks_agree(self, header: List[int], names: List[str]) -> None:
        """Raises ValueError when ranks disagree on call parameters (that would corrupt the
        layout)."""
        if self.num_ranks == 1:
            return
        mine = torch.tensor(header, dtype=torch.int64)
        if dist.get_backend(self.group) == "nccl":
            mine = mine.cuda()
        gathered = [torch.empty_like(mine) for _ in range(self.num_ranks)]
        self.wait(dist.all_gather(gathered, mine, group=self.group, async_op=True),
                  "all_gather of the call's parameters")
        table = torch.stack(gathered).cpu()
        for col, name in enumerate(names):
            values = table[:, col].tolist()
            if len(set(values)) > 1:
                raise ValueError(f"ranks disagree on {name}: per-rank values {values}")


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
        W for bf16, the element count of the FP8 data otherwise)."""
        num_ranks = self.num_ranks
        num_local = num_experts // num_ranks
        num_tokens, num_topk = topk_idx.shape
        width = x.shape[1]
        validate.check_expert_ids_on_host(topk_idx, num_experts)
        comm = self.collectives
        comm.enter("dispatch")
        comm.check_ranks_agree([hidden, num_topk, num_experts, expert_alignment, wire],
                               ["hidden", "top-k", "num_experts", "expert_alignment",
                                "fp8 wire format (0 = bf16)"])
        layout = layout if layout is not None else compute_layout(topk_idx, num_experts,
                                                                  num_ranks)
        ones = [1] * num_ranks
        counts_from_src = comm.all_to_all(
            layout.num_tokens_per_expert.view(num_ranks, num_local), ones, ones)
        send_splits = layout.num_tokens_per_rank.tolist()
        recv_splits = comm.all_to_all(layout.num_tokens_per_rank, ones, ones).tolist()

        # Tokens in slot order for every destination, with their per-k local expert ids.
        order = torch.cat([layout.slot_token[r, :send_splits[r]] for r in range(num_ranks)]).long()
        dest_of_row = torch.repeat_interleave(
            torch.arange(num_ranks, device=x.device), torch.tensor(send_splits, device=x.device))
        idx = topk_idx[order].long()
        on_dest = (idx >= 0) & (idx // num_local == dest_of_row.unsqueeze(1))
        local_e = torch.where(on_dest, idx - dest_of_row.unsqueeze(1) * num_local, -1)
        pos = torch.where(on_dest, layout.pos_in_expert[order].long(), -1)
        meta = torch.cat([local_e, pos], dim=1).to(torch.int32)

        recv_rows = comm.all_to_all(x[order], send_splits, recv_splits)
        recv_meta = comm.all_to_all(meta, send_splits, recv_splits).long()
        recv_w = comm.all_to_all(topk_weights[order], send_splits, recv_splits)

        recv = compute_recv_layout(counts_from_src, expert_alignment)
        num_rows = int(recv.expert_row_start[-1])
        if num_max_recv_rows is not None:
            if num_rows > num_max_recv_rows:
                raise ValueError(
                    f"num_max_recv_rows={num_max_recv_rows} is too small: this rank receives "
                    f"{num_rows} rows (padding included)")
            num_rows = num_max_recv_rows

        src = torch.repeat_interleave(torch.arange(num_ranks, device=x.device),
                                      torch.tensor(recv_splits, device=x.device))
        slot = torch.cat([torch.arange(n, device=x.device) for n in recv_splits]) \
            if recv_rows.shape[0] else torch.zeros(0, dtype=torch.long, device=x.device)
        e, p = recv_meta[:, :num_topk], recv_meta[:, num_topk:]
        valid = e >= 0
        e_safe = e.clamp(min=0)
        rows = (recv.expert_row_start.long()[e_safe]
                + recv.src_expert_offset.long()[src.unsqueeze(1), e_safe] + p)
        rows = torch.where(valid, rows, -1)

        recv_x = torch.zeros(num_rows, width, dtype=x.dtype, device=x.device)
        recv_weights = torch.zeros(num_rows, dtype=torch.float32, device=x.device)
        token_of = torch.arange(rows.shape[0], device=x.device).unsqueeze(1).expand_as(rows)
        recv_x[rows[valid]] = recv_rows[token_of[valid]]
        recv_weights[rows[valid]] = recv_w[valid]

        slot_rows = torch.full((num_ranks, self.num_max_tokens_per_rank, num_topk), -1,
                               dtype=torch.int32, device=x.device)
        slot_rows[src, slot] = rows.to(torch.int32)
        handle = DispatchHandle(
            layout=layout, recv=recv,
            num_recv_tokens_per_rank=torch.tensor(recv_splits, dtype=torch.int32,
                                                  device=x.device),
            slot_rows=slot_rows, recv_weights=recv_weights, num_experts=num_experts,
            num_topk=num_topk, hidden=hidden, expert_alignment=expert_alignment,
            num_recv_rows=num_rows, tokens_per_expert_list=recv.tokens_per_expert.tolist(),
            transport_state=(send_splits, recv_splits))
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
        send_splits, recv_splits = handle.transport_state
        layout = handle.layout
        order = torch.cat([layout.slot_token[r, :send_splits[r]]
                           for r in range(self.num_ranks)]).long()
        self.collectives.enter("cached dispatch")
        recv_rows = self.collectives.all_to_all(x[order], send_splits, recv_splits)
        rows = self._received_slot_rows(handle, recv_splits)
        out = torch.zeros(handle.num_recv_rows, x.shape[1], dtype=x.dtype, device=x.device)
        valid = rows >= 0
        token_of = torch.arange(rows.shape[0], device=x.device).unsqueeze(1).expand_as(rows)
        out[rows[valid]] = recv_rows[token_of[valid]]
        return out

    def combine(self, y: torch.Tensor, handle: DispatchHandle, weighted: bool = False,
                grad_row_weights: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Combines expert rows `y [M, H]` back to `[N, H]` (see the module docstring).

        Args:
            y: `[M, H]` in the dispatch's row order.
            handle: the dispatch's handle.
            weighted: multiply each row by its routing weight before summing.
            grad_row_weights: optional `[M]` float32 per-row values returned per (token, k) as
                `[N, K]` (the gradient of the routing weights in dispatch's backward).
        """
        send_splits, recv_splits = handle.transport_state
        rows = self._received_slot_rows(handle, recv_splits)
        valid = rows >= 0
        safe = rows.clamp(min=0).long()
        acc = torch.zeros(rows.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
        for k in range(rows.shape[1]):
            term = y[safe[:, k]].float()
            if weighted:
                term = term * handle.recv_weights[safe[:, k]].unsqueeze(1)
            acc = torch.where(valid[:, k:k + 1], acc + term, acc)
        self.collectives.enter("combine")
        partial = self.collectives.all_to_all(acc.to(y.dtype), recv_splits, send_splits)
        wvals = None
        if grad_row_weights is not None:
            w = torch.where(valid, grad_row_weights.float()[safe], 0.0)
            wvals = self.collectives.all_to_all(w, recv_splits, send_splits)

        layout = handle.layout
        offsets = [0]
        for n in send_splits:
            offsets.append(offsets[-1] + n)
        out = torch.zeros(layout.num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
        wsum = (torch.zeros(layout.num_tokens, handle.num_topk, dtype=torch.float32,
                            device=y.device) if wvals is not None else None)
        for r in range(self.num_ranks):
            in_rank = layout.is_token_in_rank[:, r]
            src = (offsets[r] + layout.token_slot_in_rank[:, r].clamp(min=0)).long()
            if partial.shape[0] == 0:
                continue
            src = src.clamp(max=partial.shape[0] - 1)
            out = torch.where(in_rank.unsqueeze(1), out + partial[src].float(), out)
            if wsum is not None:
                wsum = torch.where(in_rank.unsqueeze(1), wsum + wvals[src], wsum)
        return out.to(y.dtype), wsum

    def _received_slot_rows(self, handle: DispatchHandle, recv_splits: List[int]) -> torch.Tensor:
        """`[T_recv, K]` rows of every received slot, in (source, slot) order."""
        parts = [handle.slot_rows[s, :n] for s, n in enumerate(recv_splits)]
        return torch.cat(parts) if parts else handle.slot_rows[0, :0]

    def destroy(self) -> None:
        pass
