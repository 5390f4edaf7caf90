"""The intranode NVLink transport: the protocol of DESIGN.md on our kernels.

Per dispatch: layout (local) -> notify (counts to every peer, epoch flag) -> dispatch_send (each
token once per destination rank into its staging region) -> [one host wait for the row count,
unless the caller gave an upper bound] -> dispatch_recv (expand into expert-major rows). At
EP = 1 the layout kernel also writes the receive layout (no notify), and dispatch_local expands
with no staging and no protocol; a synchronous call launches it into a row bound before its host
wait and returns a view of the exact rows.
Per combine: combine_send (one partial row per received slot back to its source) ->
combine_reduce (sum over ranks); at EP = 1, combine_local alone (no protocol). Flags carry
per-operation epochs, so the buffer is never zeroed between calls, and every writer first waits
until its reader has consumed the previous call.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Optional, Tuple

import torch

from megatron_deepep import ops
from megatron_deepep.arena import ArenaPlan
from megatron_deepep.handle import DispatchHandle, RecvLayout, recv_fields
from megatron_deepep.layout import DispatchLayout, layout_fields
from megatron_deepep.transport.errors import ERROR_RECORD_WORDS, error_from_record
from megatron_deepep.transport.ipc import MappedHostArray, SymmetricBuffer
from megatron_deepep.transport.regions import MAX_LOCAL_EXPERTS, BufferRegions

logger = logging.getLogger(__name__)

HOST_INFO_WORDS = 4 + MAX_LOCAL_EXPERTS  # struct HostInfo of common/host_info.cuh
CLAIM_OFFSET = 8 * 4                     # Workspace.error_claim, after 8 block counters
# A synchronous dispatch at EP = 1 launches its expand before the host wait when the row bound
# exceeds the entries by at most 1/this (the alignment padding it must allow for).
EARLY_LAUNCH_MAX_SLACK = 8


@functools.lru_cache(maxsize=256)
def _dispatch_plan(num_tokens: int, num_topk: int, num_experts: int, num_ranks: int,
                   slots_per_rank: int, with_layout: bool) -> ArenaPlan:
    """The arena of one dispatch: its layout's arrays (unless the caller gave a layout), the
    receive layout, the per-source token counts and the slot rows."""
    fields = layout_fields(num_tokens, num_topk, num_experts, num_ranks) if with_layout else []
    return ArenaPlan(fields + recv_fields(num_ranks, num_experts // num_ranks, slots_per_rank,
                                          num_topk))


class BrokenBufferError(RuntimeError):
    """The buffer saw a kernel error earlier; its flags are no longer consistent."""


class NVLinkTransport:
    """Dispatch/combine over a CUDA-IPC symmetric buffer (ranks of one node, or one GPU).

    Args:
        group: the EP process group (any backend: only handles travel through it).
        num_max_tokens_per_rank: N_max.
        hidden: the widest row in bf16 elements.
        num_topk: the largest top-k.
        num_sms: blocks of the communication kernels.
        timeout_s: limit of every cross-GPU wait.
    """

    name = "nvlink"

    def __init__(self, group, num_max_tokens_per_rank: int, hidden: int, num_topk: int, *,
                 num_sms: int, timeout_s: float):
        self.regions = BufferRegions(torch.distributed.get_world_size(group),
                                     num_max_tokens_per_rank, hidden, num_topk)
        self.sym = SymmetricBuffer(group, self.regions.num_bytes)
        self.rank, self.num_ranks = self.sym.rank, self.sym.num_ranks
        self.device = self.sym.device
        self.regions_dev = self.regions.as_device_struct(self.device)
        self.num_sms = num_sms
        self.timeout_s = timeout_s
        self.timeout_ns = int(timeout_s * 1e9)
        self.host_info = MappedHostArray(HOST_INFO_WORDS)
        self.error_record = MappedHostArray(ERROR_RECORD_WORDS)
        self.errors = ops.ErrorSink(self.sym.ptr + self.regions.workspace + CLAIM_OFFSET,
                                    self.error_record.device_ptr)
        self.notify_epoch = 0
        self.dispatch_epoch = 0
        self.combine_epoch = 0
        self._broken: Optional[BaseException] = None

    # ------------------------------------------------------------------ errors
    def check_errors(self) -> None:
        """Raises the first error any kernel recorded (reads host memory; no device sync)."""
        if self._broken is not None:
            raise BrokenBufferError(
                f"this Buffer failed earlier ({self._broken}); destroy it and build a new one")
        exc = error_from_record(self.error_record.words, self.timeout_s)
        if exc is not None:
            self._broken = exc
            raise exc

    def _wait_host_info(self, epoch: int) -> int:
        """Polls the mapped notify result of `epoch` and returns its row count; raises on a
        recorded error or timeout. Its per-expert sizes stay readable (`_host_tokens_per_expert`)
        until the next notify."""
        words = self.host_info.words
        deadline = time.monotonic() + self.timeout_s + 5.0
        target = epoch & 0xFFFFFFFF
        spins = 0
        while (int(words[0]) & 0xFFFFFFFF) != target:
            spins += 1
            if spins % 64 == 0:
                self.check_errors()
                if time.monotonic() > deadline:
                    self._broken = RuntimeError("host wait for notify timed out")
                    raise RuntimeError(
                        f"megatron_deepep: rank {self.rank} waited {self.timeout_s + 5:g}s for "
                        "the notify kernel, which never finished (the GPU did not run it)")
                if spins > 4096:
                    time.sleep(1e-5)
        num_rows = int(words[1])
        self.check_errors()
        return num_rows

    def _host_tokens_per_expert(self, num_local: int) -> list:
        """The last notify's padded rows per local expert, from mapped host memory."""
        return self.host_info.words[4:4 + num_local].tolist()

    # ------------------------------------------------------------------ dispatch
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout:
        self.check_errors()
        return ops.layout(topk_idx.contiguous(), num_experts, self.num_ranks, self.rank,
                          self.errors, timeout_ns=self.timeout_ns)

    def _common(self):
        return dict(peer_bases=self.sym.peer_bases, regions=self.regions_dev, rank=self.rank,
                    num_ranks=self.num_ranks)

    @staticmethod
    def _empty_recv(num_rows: int, hidden: int, fp8, device):
        """recv_x for `num_rows` rows: bf16, or the (e4m3 data, scales) pair of FP8 output."""
        if fp8 is None or fp8.dequantize:
            return torch.empty(num_rows, hidden, dtype=torch.bfloat16, device=device), None
        return (torch.empty(num_rows, hidden, dtype=torch.float8_e4m3fn, device=device),
                torch.empty(num_rows, fp8.fmt.num_blocks(hidden), dtype=fp8.fmt.scale_dtype,
                            device=device))

    def _rows_before_wait(self, num_tokens: int, num_topk: int, num_local: int,
                          alignment: int) -> Optional[int]:
        """At EP = 1, a row bound that lets the expand start before the host learns the exact
        count (the result is then a view of its first rows): every (token, k) entry is at most
        one row, plus each expert's alignment padding. None (wait first) at EP > 1, or when
        the padding would make the bound more than 1/8 larger than the entries."""
        if self.num_ranks != 1:
            return None
        num_entries = num_tokens * num_topk
        slack = min(num_local, num_entries) * (alignment - 1)
        return num_entries + slack if slack <= num_entries // EARLY_LAUNCH_MAX_SLACK else None

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 num_experts: int, expert_alignment: int = 1,
                 num_max_recv_rows: Optional[int] = None,
                 layout: Optional[DispatchLayout] = None, fp8=None,
                 x_scales: Optional[torch.Tensor] = None):
        """See `Buffer.dispatch`; `fp8` is an `Fp8Dispatch` or None, `x_scales` the scales of a
        pre-quantized `x`. Returns (recv_x or (recv_x_fp8, recv_scales), recv_weights, handle).
        """
        self.check_errors()
        dev, R = x.device, self.num_ranks
        num_local = num_experts // R
        num_tokens, num_topk = topk_idx.shape
        hidden = x.shape[1]
        # One allocation for the layout (unless given) and every receive-side array.
        arena = _dispatch_plan(num_tokens, num_topk, num_experts, R, self.regions.max_tokens,
                               layout is None).allocate(dev)
        self.notify_epoch += 1
        self.dispatch_epoch += 1
        bound = -1 if num_max_recv_rows is None else num_max_recv_rows
        rows_before_wait = None
        if num_max_recv_rows is None:
            rows_before_wait = self._rows_before_wait(num_tokens, num_topk, num_local,
                                                      expert_alignment)
        # Who publishes the receive layout to the host: nobody without a host wait; the EP = 1
        # expand when it starts before the wait; else the kernel that derives the layout.
        host_info = self.host_info.device_ptr if num_max_recv_rows is None else 0
        expand_publishes = R == 1 and layout is None and rows_before_wait is not None
        local_recv = None
        if layout is None:
            if R == 1:  # one rank: the layout kernel writes the receive layout, no notify
                local_recv = ops.LocalRecv(arena, 0 if expand_publishes else host_info,
                                           expert_alignment, bound, self.notify_epoch)
            layout = ops.layout(topk_idx, num_experts, R, self.rank, self.errors,
                                timeout_ns=self.timeout_ns, arena=arena, local_recv=local_recv)
        if local_recv is None:
            ops.notify(self.sym.peer_bases, self.rank, R, self.notify_epoch, layout, num_local,
                       hidden, num_topk, expert_alignment, bound, arena, host_info,
                       self.timeout_ns, self.errors)
        if R > 1:
            ops.dispatch_send(x, x_scales, topk_idx, topk_weights, layout, False, fp8,
                              num_local=num_local,
                              epoch=self.dispatch_epoch, num_sms=self.num_sms,
                              timeout_ns=self.timeout_ns, errors=self.errors, **self._common())
        if num_max_recv_rows is not None:
            num_rows = num_max_recv_rows
        elif rows_before_wait is None:
            num_rows = self._wait_host_info(self.notify_epoch)
        alloc_rows = num_rows if rows_before_wait is None else rows_before_wait
        recv_x, recv_scales = self._empty_recv(alloc_rows, hidden, fp8, dev)
        recv_weights = torch.empty(alloc_rows, dtype=torch.float32, device=dev)
        if R == 1:  # nothing to exchange: no protocol
            ops.dispatch_local(recv_x, recv_scales, recv_weights, arena, x, x_scales,
                               topk_idx, topk_weights, layout, False, fp8, num_local,
                               self.num_sms, after_layout=local_recv is not None,
                               host_info_ptr=host_info if expand_publishes else 0,
                               host_epoch=self.notify_epoch)
        else:
            ops.dispatch_recv(recv_x, recv_scales, recv_weights, arena, x, x_scales, topk_idx,
                              topk_weights, layout, False, fp8, num_local=num_local,
                              epoch=self.dispatch_epoch, num_sms=self.num_sms,
                              timeout_ns=self.timeout_ns, errors=self.errors, **self._common())
        tokens_per_expert_list = None
        if num_max_recv_rows is None:  # read after the launch: off the wait's critical path
            if rows_before_wait is not None:
                num_rows = self._wait_host_info(self.notify_epoch)
                if num_rows < alloc_rows:  # the exact size: a view of the first rows
                    recv_x, recv_weights = recv_x[:num_rows], recv_weights[:num_rows]
                    recv_scales = None if recv_scales is None else recv_scales[:num_rows]
            tokens_per_expert_list = self._host_tokens_per_expert(num_local)
        handle = DispatchHandle.from_arena(
            arena, layout=layout, recv=RecvLayout.from_arena(arena), recv_weights=recv_weights,
            num_experts=num_experts, num_topk=num_topk, hidden=hidden,
            expert_alignment=expert_alignment, num_recv_rows=num_rows,
            tokens_per_expert_list=tokens_per_expert_list, transport_state=(topk_idx, arena))
        return (recv_x if recv_scales is None else (recv_x, recv_scales)), recv_weights, handle

    def cached_dispatch(self, x: torch.Tensor, handle: DispatchHandle, fp8=None,
                        x_scales: Optional[torch.Tensor] = None):
        """Replays `handle`'s routing for new rows; returns recv_x or its FP8 pair."""
        self.check_errors()
        num_local = handle.num_local_experts
        topk_idx, arena = handle.transport_state
        self.dispatch_epoch += 1
        if self.num_ranks > 1:
            ops.dispatch_send(x, x_scales, topk_idx, None, handle.layout, True, fp8,
                              num_local=num_local, epoch=self.dispatch_epoch,
                              num_sms=self.num_sms, timeout_ns=self.timeout_ns,
                              errors=self.errors, **self._common())
        recv_x, recv_scales = self._empty_recv(handle.num_recv_rows, x.shape[1], fp8, x.device)
        if self.num_ranks == 1:
            ops.dispatch_local(recv_x, recv_scales, None, arena, x, x_scales, topk_idx, None,
                               handle.layout, True, fp8, num_local, self.num_sms)
        else:
            ops.dispatch_recv(recv_x, recv_scales, None, arena, x, x_scales, topk_idx, None,
                              handle.layout, True, fp8, num_local=num_local,
                              epoch=self.dispatch_epoch, num_sms=self.num_sms,
                              timeout_ns=self.timeout_ns, errors=self.errors, **self._common())
        return recv_x if recv_scales is None else (recv_x, recv_scales)

    # ------------------------------------------------------------------ combine
    def combine(self, y: torch.Tensor, handle: DispatchHandle, weighted: bool = False,
                grad_row_weights: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        self.check_errors()
        self.combine_epoch += 1
        common = dict(epoch=self.combine_epoch, num_sms=self.num_sms, timeout_ns=self.timeout_ns,
                      errors=self.errors, **self._common())
        if self.num_ranks > 1:
            ops.combine_send(y, handle, weighted, grad_row_weights, **common)
        out = torch.empty(handle.num_tokens, y.shape[1], dtype=y.dtype, device=y.device)
        out_weights = (torch.empty(handle.num_tokens, handle.num_topk, dtype=torch.float32,
                                   device=y.device) if grad_row_weights is not None else None)
        if self.num_ranks == 1:  # nothing to exchange: no protocol
            ops.combine_local(out, out_weights, y, handle, weighted, grad_row_weights,
                              self.num_sms)
        else:
            ops.combine_reduce(out, out_weights, y, handle, weighted, grad_row_weights, **common)
        return out, out_weights

    def destroy(self) -> None:
        self.sym.destroy()
        self.host_info.destroy()
        self.error_record.destroy()
