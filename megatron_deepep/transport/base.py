"""The interface every transport implements, so `Buffer` never asks which one it holds.

A transport moves the rows of one EP group: it computes the layout, dispatches (sends each
token once per destination rank and expands it there into expert-major rows), replays a
dispatch for new rows (cached dispatch) and combines. The semantics are those of
`transport/reference.py`; `Buffer` validates the user's arguments before calling in.

Adding a transport (e.g. the internode one) is one module with a `Transport` subclass plus its
kernels in `ops`, and one entry in `transport/__init__.py`'s `TRANSPORTS` and `_resolve`.
"""

from __future__ import annotations

import abc
from typing import Optional, Tuple

import torch

from megatron_deepep.handle import DispatchHandle
from megatron_deepep.layout import DispatchLayout


class Transport(abc.ABC):
    """Dispatch and combine for one EP group.

    Attributes:
        name: the name users select it by ("local", "nvlink", "reference").
        row_dtypes: dtypes of the rows `dispatch` and `combine` accept.
        device: the GPU its kernels run on; None when it follows its inputs' device (then
            `Buffer` runs it inline instead of on a communication stream).
        num_bytes: device memory it holds for its peers (0 where none).
        graph_capture_refusal: why its calls cannot be captured in a CUDA graph (None: they
            can, given a row bound: no host synchronization, and nothing per call kept on the
            host that a replay would need to change).
    """

    name: str = ""
    row_dtypes: Tuple[torch.dtype, ...] = (torch.bfloat16,)
    device: Optional[torch.device] = None
    num_bytes: int = 0
    graph_capture_refusal: Optional[str] = "it was not written for CUDA graphs"

    @staticmethod
    @abc.abstractmethod
    def size_hint(num_ranks: int, num_max_tokens_per_rank: int, hidden: int,
                  num_topk: int) -> int:
        """Bytes of device memory one rank holds for these limits."""

    @abc.abstractmethod
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> DispatchLayout:
        """Where each token of `topk_idx [N, K]` goes (see `layout.py`)."""

    @abc.abstractmethod
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 num_experts: int, expert_alignment: int = 1,
                 num_max_recv_rows: Optional[int] = None,
                 layout: Optional[DispatchLayout] = None, fp8=None,
                 x_scales: Optional[torch.Tensor] = None):
        """See `Buffer.dispatch`. `fp8` is an `Fp8Dispatch` or None, `x_scales` the scales of a
        pre-quantized `x`.

        Returns:
            `(recv_x or (recv_x_fp8, recv_scales), recv_weights [M] float32, handle)`.
        """

    @abc.abstractmethod
    def cached_dispatch(self, x: torch.Tensor, handle: DispatchHandle, fp8=None,
                        x_scales: Optional[torch.Tensor] = None):
        """Replays `handle`'s routing for new rows `x [N, H]`; returns recv_x or its FP8 pair."""

    @abc.abstractmethod
    def combine(self, y: torch.Tensor, handle: DispatchHandle, weighted: bool = False,
                grad_row_weights: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Reduces `y [M, H]` back to `[N, H]`; see `Buffer.combine`."""

    def check_errors(self) -> None:
        """Raises the first error a kernel recorded (a stalled peer, a bad expert id)."""

    def destroy(self) -> None:
        """Frees what the transport holds (collective where peers map it; idempotent)."""
