"""The intranode NVLink transport (EP 2-8): the protocol of docs/design.md on our kernels.

Per dispatch: layout (local) -> notify (counts to every peer, epoch flag) -> [one host wait for
the row count, unless the caller gave an upper bound] -> dispatch_fused: each warp sends tokens
(each row read from x once, written once into the staging slot of every peer rank holding one of
its experts, and into this rank's own expert-major rows) and expands the peers' slots as their
flags arrive, while the rows are still in L2.
Per combine: combine_fused: each warp sends received slots' partial rows back to their sources
and sums the tokens whose partials have all arrived, in ascending rank order.
`MDEEP_NVLINK_KERNELS=split` runs the earlier two kernels per operation instead: a send, then,
after a barrier over every peer, the receive (dispatch_send / dispatch_recv, combine_send /
combine_reduce; the send overlaps a synchronous dispatch's host wait). The default, `auto`, is
the fused dispatch of bf16 rows and the split kernels for FP8 rows and the combine: on an H100
under MPS the fused combine took 1.6x the split one's time, the fused FP8 dispatch 1.08x
(benchmarks/h100_2026-12-07_mps.md).
Flags carry per-operation epochs, so the buffer is never zeroed between calls, and every writer
first waits until its reader has consumed the previous call.
The epochs live in device words (`epochs.DeviceEpochs`): with a row bound, a dispatch and its
combine can be captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import logging
from typing import Optional, Tuple

import torch

from megatron_deepep import knobs, ops
from megatron_deepep.handle import DispatchHandle, RecvLayout
from megatron_deepep.layout import DispatchLayout
from megatron_deepep.transport.base import Transport
from megatron_deepep.transport.epochs import DeviceEpochs
from megatron_deepep.transport.ipc import SymmetricBuffer
from megatron_deepep.transport.recv import as_recv_x, dispatch_plan, empty_recv
from megatron_deepep.transport.regions import MAX_RANKS, BufferRegions
from megatron_deepep.transport.status import KernelStatus

logger = logging.getLogger(__name__)

CLAIM_OFFSET = 8 * 4  # Workspace.error_claim, after 8 block counters


class NVLinkTransport(Transport):
    """Dispatch/combine over a CUDA-IPC symmetric buffer (ranks of one node, or one GPU).

    Args:
        group: the EP process group of 2 to 8 ranks (any backend: only handles travel
            through it).
        num_max_tokens_per_rank: N_max.
        hidden: the widest row in bf16 elements.
        num_topk: the largest top-k.
        num_sms: blocks of the communication kernels.
        timeout_s: limit of every cross-GPU wait.
    """

    name = "nvlink"
    # The flag epochs live in device words (`epochs.DeviceEpochs`): replays advance them.
    graph_capture_refusal = None
    row_dtypes = tuple(ops.ROW_DTYPE_CODES)  # dispatch copies bytes; combine sums in fp32

    def __init__(self, group, num_max_tokens_per_rank: int, hidden: int, num_topk: int, *,
                 num_sms: int, timeout_s: float):
        num_ranks = torch.distributed.get_world_size(group)
        if not 2 <= num_ranks <= MAX_RANKS:
            raise ValueError(f"the NVLink transport spans 2 to {MAX_RANKS} ranks of one node, "
                             f"the EP group has {num_ranks} (EP = 1 uses the local transport)")
        self.regions = BufferRegions(num_ranks, num_max_tokens_per_rank, hidden, num_topk)
        self.sym = SymmetricBuffer(group, self.regions.num_bytes)
        self.num_bytes = self.regions.num_bytes
        self.rank, self.num_ranks = self.sym.rank, self.sym.num_ranks
        self.device = self.sym.device
        self.regions_dev = self.regions.as_device_struct(self.device)
        self.num_sms = num_sms
        self.timeout_ns = int(timeout_s * 1e9)
        self.status = KernelStatus(self.sym.ptr + self.regions.workspace + CLAIM_OFFSET,
                                   self.rank, timeout_s)
        self.epochs = DeviceEpochs(self.device)
        self.host_epoch = 0  # what a synchronous dispatch's notify publishes to the host
        self.kernels = knobs.get("NVLINK_KERNELS")
        self.fused_combine = self.kernels == "fused"

    @staticmethod
    def size_hint(num_ranks: int, num_max_tokens_per_rank: int, hidden: int,
                  num_topk: int) -> int:
        return BufferRegions(num_ranks, num_max_tokens_per_rank, hidden, num_topk).num_bytes

    def check_errors(self) -> None:
        self.status.check_errors()

    def _fused_dispatch(self, fp8) -> bool:
        """Whether a dispatch runs `dispatch_fused`: always with `fused`, never with `split`;
        with `auto` for bf16 rows only (FP8 rows were faster split in the H100 MPS run)."""
        return self.kernels == "fused" or (self.kernels == "auto" and fp8 is None)

    # ------------------------------------------------------------------ dispatch
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout:
        self.check_errors()
        return ops.dispatch_layout(topk_idx.contiguous(), num_experts, self.num_ranks, self.rank,
                                   self.status.errors, timeout_ns=self.timeout_ns)

    def _peers(self, epoch_word: int) -> dict:
        """The arguments every protocol kernel of one call takes."""
        return dict(peer_bases=self.sym.peer_bases, regions=self.regions_dev, rank=self.rank,
                    num_ranks=self.num_ranks, epoch_word=epoch_word, num_sms=self.num_sms,
                    timeout_ns=self.timeout_ns, errors=self.status.errors)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 num_experts: int, expert_alignment: int = 1,
                 num_max_recv_rows: Optional[int] = None,
                 layout: Optional[DispatchLayout] = None, fp8=None,
                 x_scales: Optional[torch.Tensor] = None):
        self.check_errors()
        row_dtype, hidden = x.dtype, x.shape[1]  # the handle keeps the caller's width
        if fp8 is None:
            x = ops.as_wire_rows(x)  # fp16 / fp32 rows travel as the bf16 words of their bytes
        dev, num_ranks = x.device, self.num_ranks
        num_local = num_experts // num_ranks
        num_tokens, num_topk = topk_idx.shape
        # One allocation for the layout (unless given) and every receive-side array.
        arena = dispatch_plan(num_tokens, num_topk, num_experts, num_ranks,
                              self.regions.max_tokens, layout is None).allocate(dev)
        self.epochs.advance_dispatch()
        self.host_epoch += 1
        is_sync = num_max_recv_rows is None
        if layout is None:
            layout = ops.dispatch_layout(topk_idx, num_experts, num_ranks, self.rank,
                                         self.status.errors, timeout_ns=self.timeout_ns,
                                         arena=arena)
        ops.notify_counts(peer_bases=self.sym.peer_bases, rank=self.rank, num_ranks=num_ranks,
                          epoch_word=self.epochs.notify, lay=layout, num_local=num_local,
                          hidden=x.shape[1], num_topk=num_topk, alignment=expert_alignment,
                          max_recv_rows=-1 if is_sync else num_max_recv_rows, recv=arena,
                          host_info_ptr=self.status.host_info_ptr if is_sync else 0,
                          host_epoch=self.host_epoch, timeout_ns=self.timeout_ns,
                          errors=self.status.errors)
        peers = self._peers(self.epochs.dispatch)
        fused = self._fused_dispatch(fp8)
        if not fused:
            ops.dispatch_send(x, x_scales, topk_idx, topk_weights, layout, cached=False,
                              fp8=fp8, num_local=num_local, **peers)
        num_rows = (self.status.wait_num_rows(self.host_epoch) if is_sync
                    else num_max_recv_rows)
        recv_x, recv_scales = empty_recv(num_rows, x.shape[1], fp8, dev)
        recv_weights = torch.empty(num_rows, dtype=torch.float32, device=dev)
        expand = ops.dispatch_fused if fused else ops.dispatch_recv
        expand(recv_x, recv_scales, recv_weights, arena, x, x_scales, topk_idx, topk_weights,
               layout, cached=False, fp8=fp8, num_local=num_local, **peers)
        handle = DispatchHandle.from_arena(
            arena, layout=layout, recv=RecvLayout.from_arena(arena), recv_weights=recv_weights,
            num_experts=num_experts, num_topk=num_topk, hidden=hidden,
            expert_alignment=expert_alignment, num_recv_rows=num_rows,
            tokens_per_expert_list=self.status.tokens_per_expert(num_local) if is_sync else None,
            transport_state=(topk_idx, arena))
        if fp8 is None:
            recv_x = recv_x.view(row_dtype)
        return as_recv_x(recv_x, recv_scales), recv_weights, handle

    def _adopt(self, handle: DispatchHandle) -> None:
        """Makes a handle of a smaller buffer (one `get_buffer` has since replaced) usable here:
        the kernels index `slot_rows [R, slots, K]` with this buffer's N_max, so its receive
        arrays move into an arena of this buffer's size, the new slots unused (-1)."""
        slots = handle.shape_of("slot_rows")[1]
        if slots == self.regions.max_tokens:
            return
        topk_idx, old = handle.transport_state
        num_tokens, num_topk = topk_idx.shape
        arena = dispatch_plan(num_tokens, num_topk, handle.num_experts, self.num_ranks,
                              self.regions.max_tokens, False).allocate(self.device)
        for name in arena.plan.fields:
            if name == "slot_rows":
                arena.view(name).fill_(-1)[:, :slots].copy_(old.view(name))
            else:
                arena.view(name).copy_(old.view(name))
        for name in arena.plan.fields:  # drop views of the old arena
            handle.__dict__.pop(name, None)
        handle.__dict__["_arena"] = arena
        handle.recv = RecvLayout.from_arena(arena)
        handle.transport_state = (topk_idx, arena)

    def cached_dispatch(self, x: torch.Tensor, handle: DispatchHandle, fp8=None,
                        x_scales: Optional[torch.Tensor] = None):
        self.check_errors()
        row_dtype = x.dtype
        if fp8 is None:
            x = ops.as_wire_rows(x)
        self._adopt(handle)
        num_local = handle.num_local_experts
        topk_idx, arena = handle.transport_state
        self.epochs.advance_cached_dispatch()
        peers = self._peers(self.epochs.dispatch)
        fused = self._fused_dispatch(fp8)
        if not fused:
            ops.dispatch_send(x, x_scales, topk_idx, None, handle.layout, cached=True, fp8=fp8,
                              num_local=num_local, **peers)
        recv_x, recv_scales = empty_recv(handle.num_recv_rows, x.shape[1], fp8, x.device)
        expand = ops.dispatch_fused if fused else ops.dispatch_recv
        expand(recv_x, recv_scales, None, arena, x, x_scales, topk_idx, None, handle.layout,
               cached=True, fp8=fp8, num_local=num_local, **peers)
        if fp8 is None:
            recv_x = recv_x.view(row_dtype)
        return as_recv_x(recv_x, recv_scales)

    # ------------------------------------------------------------------ combine
    def combine(self, y: torch.Tensor, handle: DispatchHandle, weighted: bool = False,
                grad_row_weights: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        self.check_errors()
        self._adopt(handle)
        self.epochs.advance_combine()
        peers = self._peers(self.epochs.combine)
        if not self.fused_combine:
            ops.combine_send(y, handle, weighted, grad_row_weights, **peers)
        out = torch.empty(handle.num_tokens, y.shape[1], dtype=y.dtype, device=y.device)
        out_weights = (torch.empty(handle.num_tokens, handle.num_topk, dtype=torch.float32,
                                   device=y.device) if grad_row_weights is not None else None)
        reduce = ops.combine_fused if self.fused_combine else ops.combine_reduce
        reduce(out, out_weights, y, handle, weighted, grad_row_weights, **peers)
        return out, out_weights

    def destroy(self) -> None:
        if self.status is None:
            return
        self.sym.destroy()  # synchronizes the device first: no kernel still writes the mailboxes
        self.status.destroy()
        self.status = None
