"""EP = 1: dispatch and combine on one GPU with no peers, no symmetric buffer and no protocol.

Dispatch: the layout kernel also writes the receive layout (one rank receives exactly what it
sends), then `dispatch_local` expands the rows straight into the expert-major `recv_x`; a
synchronous call launches the expand into a row bound before its host wait (programmatically, so
it overlaps the layout's end) and returns a view of the exact rows. Combine: `combine_local` sums
every token's rows. A caller-given layout gets its receive layout from the notify kernel run over
a small private metadata block (one rank: it only talks to itself).
"""

from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch

from megatron_deepep import ops
from megatron_deepep.handle import DispatchHandle, RecvLayout
from megatron_deepep.layout import DispatchLayout
from megatron_deepep.transport.base import Transport
from megatron_deepep.transport.epochs import DeviceEpochs
from megatron_deepep.transport.recv import as_recv_x, dispatch_plan, empty_recv
from megatron_deepep.transport.regions import META_BYTES
from megatron_deepep.transport.status import KernelStatus

logger = logging.getLogger(__name__)

# A synchronous dispatch launches its expand before the host wait when the row bound exceeds
# the entries by at most 1/this (the alignment padding it must allow for).
EARLY_LAUNCH_MAX_SLACK = 8


class LocalTransport(Transport):
    """The EP = 1 kernels.

    Args:
        group: the EP process group (one rank; nothing travels through it).
        num_max_tokens_per_rank: N_max (the slot count of the handle's `slot_rows`).
        hidden: unused (nothing is staged).
        num_topk: unused.
        num_sms: blocks of the expand and combine kernels.
        timeout_s: limit of the layout kernel's waits between its blocks.
    """

    name = "local"
    # Its kernels' epochs live on the device; `self.epoch` only tags host waits.
    graph_capture_refusal = None
    row_dtypes = tuple(ops.ROW_DTYPE_CODES)  # dispatch copies bytes; combine sums in fp32

    def __init__(self, group, num_max_tokens_per_rank: int, hidden: int, num_topk: int, *,
                 num_sms: int, timeout_s: float):
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_tokens = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.timeout_ns = int(timeout_s * 1e9)
        # The notify kernel's Meta block (zeroed once: flags carry epochs) and, after it, the
        # error claim word.
        self._private = torch.zeros(META_BYTES + 16, dtype=torch.uint8, device=self.device)
        self._meta_bases = torch.tensor([self._private.data_ptr()], dtype=torch.int64,
                                        device=self.device)
        self.status = KernelStatus(self._private.data_ptr() + META_BYTES, 0, timeout_s)
        self.epoch = 0  # what the receive layout publishes to the host
        self.epochs = DeviceEpochs(self.device)  # the notify kernel's (a given layout only)

    @staticmethod
    def size_hint(num_ranks: int, num_max_tokens_per_rank: int, hidden: int,
                  num_topk: int) -> int:
        return 0

    def check_errors(self) -> None:
        self.status.check_errors()

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout:
        self.check_errors()
        return ops.dispatch_layout(topk_idx.contiguous(), num_experts, 1, 0, self.status.errors,
                                   timeout_ns=self.timeout_ns)

    @staticmethod
    def _rows_before_wait(num_tokens: int, num_topk: int, num_local: int,
                          alignment: int) -> Optional[int]:
        """A row bound that lets the expand start before the host learns the exact count: every
        (token, k) entry is at most one row, plus each expert's alignment padding. None (wait
        first) when the padding would make the bound more than 1/8 larger than the entries."""
        num_entries = num_tokens * num_topk
        slack = min(num_local, num_entries) * (alignment - 1)
        return num_entries + slack if slack <= num_entries // EARLY_LAUNCH_MAX_SLACK else None

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 num_experts: int, expert_alignment: int = 1,
                 num_max_recv_rows: Optional[int] = None,
                 layout: Optional[DispatchLayout] = None, fp8=None,
                 x_scales: Optional[torch.Tensor] = None):
        self.check_errors()
        row_dtype, hidden = x.dtype, x.shape[1]  # the handle keeps the caller's width
        if fp8 is None:
            x = ops.as_wire_rows(x)  # fp16 / fp32 rows travel as the bf16 words of their bytes
        dev = x.device
        num_tokens, num_topk = topk_idx.shape
        arena = dispatch_plan(num_tokens, num_topk, num_experts, 1, self.max_tokens,
                              layout is None).allocate(dev)
        self.epoch += 1
        is_sync = num_max_recv_rows is None
        bound = -1 if is_sync else num_max_recv_rows
        rows_before_wait = (self._rows_before_wait(num_tokens, num_topk, num_experts,
                                                   expert_alignment) if is_sync else None)
        # Who publishes the receive layout to the host: nobody without a host wait; the expand
        # when it starts before the wait, unless it quantizes into FP8 rows (with row stages each
        # warp quantizes a row before its wait for the layout, which would hold the host's wait
        # back; the register path, below ops.dispatch.row_stage_min_sms(), keeps this choice
        # too, unmeasured against the other); else the kernel that derives the receive layout.
        host_info = self.status.host_info_ptr if is_sync else 0
        expand_publishes = (layout is None and rows_before_wait is not None
                            and not ops.local_quantizes_rows(fp8, x_scales))
        after_layout = layout is None
        if layout is None:
            local_recv = ops.LocalRecv(recv=arena, host_info_ptr=0 if expand_publishes else
                                       host_info, alignment=expert_alignment,
                                       max_recv_rows=bound, epoch=self.epoch)
            layout = ops.dispatch_layout(topk_idx, num_experts, 1, 0, self.status.errors,
                                         timeout_ns=self.timeout_ns, arena=arena,
                                         local_recv=local_recv)
        else:
            self.epochs.advance_dispatch()
            ops.notify_counts(peer_bases=self._meta_bases, rank=0, num_ranks=1,
                              epoch_word=self.epochs.notify, lay=layout, num_local=num_experts,
                              hidden=x.shape[1], num_topk=num_topk, alignment=expert_alignment,
                              max_recv_rows=bound, recv=arena, host_info_ptr=host_info,
                              host_epoch=self.epoch, timeout_ns=self.timeout_ns,
                              errors=self.status.errors)
        if not is_sync:
            num_rows = num_max_recv_rows
        elif rows_before_wait is None:
            num_rows = self.status.wait_num_rows(self.epoch)
        alloc_rows = num_rows if rows_before_wait is None else rows_before_wait
        recv_x, recv_scales = empty_recv(alloc_rows, x.shape[1], fp8, dev)
        recv_weights = torch.empty(alloc_rows, dtype=torch.float32, device=dev)
        ops.dispatch_local(recv_x, recv_scales, recv_weights, arena, x, x_scales, topk_idx,
                           topk_weights, layout, cached=False, fp8=fp8, num_local=num_experts,
                           num_sms=self.num_sms, after_layout=after_layout,
                           host_info_ptr=host_info if expand_publishes else 0,
                           host_epoch=self.epoch)
        tokens_per_expert_list = None
        if is_sync:  # read after the launch: off the wait's critical path
            if rows_before_wait is not None:
                num_rows = self.status.wait_num_rows(self.epoch)
                if num_rows < alloc_rows:  # the exact size: a view of the first rows
                    recv_x, recv_weights = recv_x[:num_rows], recv_weights[:num_rows]
                    recv_scales = None if recv_scales is None else recv_scales[:num_rows]
            tokens_per_expert_list = self.status.tokens_per_expert(num_experts)
        handle = DispatchHandle.from_arena(
            arena, layout=layout, recv=RecvLayout.from_arena(arena), recv_weights=recv_weights,
            num_experts=num_experts, num_topk=num_topk, hidden=hidden,
            expert_alignment=expert_alignment, num_recv_rows=num_rows,
            tokens_per_expert_list=tokens_per_expert_list, transport_state=(topk_idx, arena))
        if fp8 is None and row_dtype != torch.bfloat16:  # bf16 rows need no view (~1 µs)
            recv_x = recv_x.view(row_dtype)
        return as_recv_x(recv_x, recv_scales), recv_weights, handle

    def cached_dispatch(self, x: torch.Tensor, handle: DispatchHandle, fp8=None,
                        x_scales: Optional[torch.Tensor] = None):
        self.check_errors()
        row_dtype = x.dtype
        if fp8 is None:
            x = ops.as_wire_rows(x)
        topk_idx, arena = handle.transport_state
        recv_x, recv_scales = empty_recv(handle.num_recv_rows, x.shape[1], fp8, x.device)
        ops.dispatch_local(recv_x, recv_scales, None, arena, x, x_scales, topk_idx, None,
                           handle.layout, cached=True, fp8=fp8,
                           num_local=handle.num_local_experts, num_sms=self.num_sms)
        if fp8 is None and row_dtype != torch.bfloat16:
            recv_x = recv_x.view(row_dtype)
        return as_recv_x(recv_x, recv_scales)

    def combine(self, y: torch.Tensor, handle: DispatchHandle, weighted: bool = False,
                grad_row_weights: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        self.check_errors()
        out = torch.empty(handle.num_tokens, y.shape[1], dtype=y.dtype, device=y.device)
        out_weights = (torch.empty(handle.num_tokens, handle.num_topk, dtype=torch.float32,
                                   device=y.device) if grad_row_weights is not None else None)
        ops.combine_local(out, out_weights, y, handle, weighted, grad_row_weights,
                          num_sms=self.num_sms)
        return out, out_weights

    def destroy(self) -> None:
        if self.status is not None:
            torch.cuda.synchronize(self.device)  # no kernel may still write the mailboxes
            self.status.destroy()
            self.status = None
