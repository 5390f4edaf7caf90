"""The public `Buffer`: expert-parallel dispatch and combine on one EP process group.

A Buffer builds one transport (`megatron_deepep.transport`: the EP = 1 kernels, the NVLink
kernels, or the pure-torch reference) and forwards every call to it after validating the
arguments; all transports implement the same semantics (`transport/reference.py`), so callers
and tests do not care which one runs.

Streams: kernel transports run on the Buffer's communication stream. Operations first wait for
`previous_event` (else for the current stream); with `async_finish=True` they return an
`EventHandle` to wait on, otherwise the current stream waits for them before returning. Every
call also starts after the Buffer's previous call, whichever stream that one ran on: calls share
the transport's epoch words and block counters, so two in flight at once would race on them.
"""

from __future__ import annotations

import itertools
import logging
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from megatron_deepep import knobs, ops, validate
from megatron_deepep import transport as transport_module
from megatron_deepep.events import EventHandle
from megatron_deepep.fp8.dispatch import Fp8Dispatch, check_fp8_argument
from megatron_deepep.handle import DispatchHandle
from megatron_deepep.kernels.cuda_calls import RawEvent
from megatron_deepep.layout import DispatchLayout

logger = logging.getLogger(__name__)

TRANSPORTS = transport_module.TRANSPORT_NAMES
DEFAULT_NUM_SMS = 24
DEFAULT_TIMEOUT_S = 100.0
_LINEAGES = itertools.count()


class Buffer:
    """Dispatch/combine state for one EP group, reused across calls.

    Args:
        group: the EP `torch.distributed` process group (NCCL, or gloo when ranks share a GPU).
        num_max_tokens_per_rank: N_max, the most tokens any rank dispatches in one call.
        hidden: the widest row any call dispatches, in elements of `dtype`.
        dtype: the row dtype `hidden` counts (torch.bfloat16, the default, torch.float16 or
            torch.float32): the buffers hold rows of `hidden * dtype.itemsize` bytes, so a
            Buffer for fp32 rows of H takes `hidden=H, dtype=torch.float32`. Narrower rows fit
            too (a bf16 row of up to 2 H elements in that Buffer).
        num_topk: the largest top-k any call uses (at most 16).
        transport: "auto" (with CUDA: the EP = 1 kernels for one rank, the NVLink kernels for
            2-8 ranks of one node, the internode kernels for a group spanning nodes; without:
            the pure-torch reference), "local", "nvlink", "internode" or "reference". None
            (the default): `MDEEP_TRANSPORT`, else "auto".
        num_sms: SM budget of the communication kernels (the rest stay free for compute).
            None (the default): `MDEEP_NUM_SMS`, else 24.
        timeout_s: how long any cross-GPU wait may last before it fails naming the peer.
        num_ranks_per_node: declares nodes of this many contiguous ranks (virtual nodes: e.g.
            4 processes on one GPU with 2 model 2 nodes x 2 GPUs); None: `MDEEP_RANKS_PER_NODE`,
            else the nodes are the ranks' hosts.

    Raises:
        ValueError: an argument out of its range, or any `MDEEP_*` variable set to a bad value
            (`knobs.check_environment`), named.
    """

    def __init__(self, group, num_max_tokens_per_rank: int, hidden: int, num_topk: int, *,
                 transport: Optional[str] = None, num_sms: Optional[int] = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, num_ranks_per_node: Optional[int] = None,
                 dtype: torch.dtype = torch.bfloat16):
        knobs.check_environment()
        transport = _transport_or_knob(transport)
        num_sms = num_sms if num_sms is not None else knobs.get("NUM_SMS", DEFAULT_NUM_SMS)
        if num_ranks_per_node is None:
            num_ranks_per_node = knobs.get("RANKS_PER_NODE")
        _check_limits(num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden,
                      num_topk=num_topk, dtype=dtype)
        _check_transport(transport)
        validate.check_int("num_sms", num_sms, low=1)
        timeout_s = validate.check_timeout("timeout_s", timeout_s)
        group = validate.check_group(group)
        if num_ranks_per_node is not None:
            validate.check_int("num_ranks_per_node", num_ranks_per_node, low=1)
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden = hidden
        self.dtype = dtype
        #: Bytes of the widest row; the transports size their buffers in 2-byte elements.
        self.row_bytes = hidden * dtype.itemsize
        self.num_topk = num_topk
        self.num_sms = num_sms
        self.timeout_s = timeout_s
        self._transport = transport_module.create(
            transport, group, num_max_tokens_per_rank, self._hidden_2b, num_topk,
            num_sms=num_sms, timeout_s=timeout_s, num_ranks_per_node=num_ranks_per_node)
        self.device = self._transport.device  # None: the transport follows its inputs
        self._comm_stream = (torch.cuda.Stream(device=self.device)
                             if self.device is not None else None)
        # Set when get_buffer grows past this Buffer: calls then go to the larger one.
        self._successor: Optional[Buffer] = None
        # Stamped on every handle this Buffer makes; a successor keeps its predecessor's, so
        # handles of a replaced Buffer stay valid and handles of other Buffers are refused.
        self._lineage = next(_LINEAGES)
        # Set by the first call captured in a CUDA graph: the graph replays into this Buffer's
        # memory, so `get_buffer` must never replace it.
        self.captured = False
        # Orders each call after the previous one (async on the comm stream, sync on the
        # caller's): they share the transport's epoch words and block counters.
        self._call_order = CallOrder(RawEvent) if self._comm_stream is not None else None
        logger.info("megatron_deepep Buffer: rank %d/%d, transport %s, %d bytes", self.rank,
                    self.num_ranks, self._transport.name, self.num_bytes)

    # ----------------------------------------------------------------------------------------
    @staticmethod
    def size_hint(num_max_tokens_per_rank: int, hidden: int, num_ranks: int, num_topk: int,
                  transport: str = "auto", num_ranks_per_node: Optional[int] = None,
                  dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of device memory each rank's transport holds for these limits on GPUs (0 for
        the EP = 1 kernels and the reference: they hold none between calls). Needs no GPU.

        Args:
            num_max_tokens_per_rank: N_max.
            hidden: the widest row, in elements of `dtype`.
            num_ranks: the EP size.
            num_topk: the largest top-k.
            transport: as for `Buffer`; "auto" gives the transport the group gets on GPUs
                (EP = 1: local; one node: nvlink; several nodes: internode), also on a machine
                without one.
            num_ranks_per_node: ranks per node; None: one node for up to 8 ranks, nodes of 8
                ranks for larger groups ("internode": nodes of min(num_ranks, 8) ranks).
            dtype: the row dtype `hidden` counts (as for `Buffer`).
        """
        _check_limits(num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden,
                      num_topk=num_topk, dtype=dtype)
        validate.check_int("num_ranks", num_ranks, low=1)
        _check_transport(transport)
        if num_ranks_per_node is not None:
            validate.check_int("num_ranks_per_node", num_ranks_per_node, low=1, high=8)
        # Sized as on GPUs: the answer does not depend on the machine asking.
        return transport_module.size_hint(
            transport, num_ranks, num_max_tokens_per_rank, hidden * dtype.itemsize // 2,
            num_topk, cuda_available=True, num_ranks_per_node=num_ranks_per_node)

    @property
    def _hidden_2b(self) -> int:
        """The row size in 2-byte elements: the unit the transports and handles count in."""
        return self.row_bytes // 2

    def _buffer_rows(self) -> str:
        return f"hidden={self.hidden}, dtype={self.dtype}"

    @property
    def transport_name(self) -> str:
        """The transport serving this Buffer ("local", "nvlink", "internode" or "reference")."""
        return self._current()._transport.name

    @property
    def num_bytes(self) -> int:
        """Device memory this rank's transport holds (0 for the local and reference ones)."""
        return self._current()._transport.num_bytes

    def __repr__(self) -> str:
        current = self._current()
        num_nodes = getattr(current._transport, "num_nodes", 1)
        return (f"Buffer(transport={current.transport_name!r}, rank={self.rank}, "
                f"num_ranks={self.num_ranks}, num_nodes={num_nodes}, "
                f"num_max_tokens_per_rank={current.num_max_tokens_per_rank}, "
                f"hidden={current.hidden}, num_topk={current.num_topk}, "
                f"num_bytes={current.num_bytes})")

    def _current(self) -> "Buffer":
        """This Buffer, or the larger one `get_buffer` replaced it with (whose transport takes
        this one's handles: its limits are at least as large, and it is the same kind)."""
        buf = self
        while buf._successor is not None:
            buf = buf._successor
        return buf

    # ----------------------------------------------------------------------------------------
    def _device_of(self, x: torch.Tensor) -> Optional[torch.device]:
        return self.device if self.device is not None else getattr(x, "device", None)

    def _run(self, fn, inputs, previous_event: Optional[EventHandle], async_finish: bool):
        """Runs `fn` on the comm stream (NVLink) or inline (reference); returns (result, event).

        Every call starts after this Buffer's previous call (`CallOrder`), whichever stream
        that one ran on, besides `previous_event` (else the current stream)."""
        capturing = is_capturing()
        if capturing:
            self._enter_capture()
        if self._comm_stream is None:
            return fn(), EventHandle(None)
        if previous_event is None and not async_finish:
            # The caller's stream would wait for the comm stream anyway: launching on it gives
            # the same order without two cross-stream event pairs per call. It is named by its
            # raw handle, and CallOrder's events take raw handles (a torch Stream object costs
            # ~5 µs a call).
            current = ops.current_raw_stream()
            capture = _capture_of(current) if capturing else None
            self._call_order.before(current, capture)
            result = fn()
            self._call_order.after(current, capture)
            return result, EventHandle(None)
        compute = torch.cuda.current_stream()
        capture = _capture_of(compute) if capturing else None
        if previous_event is not None and previous_event.event is not None:
            self._comm_stream.wait_event(previous_event.event)
        else:
            self._comm_stream.wait_stream(compute)
        self._call_order.before(self._comm_stream, capture)
        # Outputs are allocated on the current stream and written on the comm stream; a
        # synchronous call ends with the current stream waiting, so no record_stream is needed.
        with ops.launch_on(self._comm_stream):
            result = fn()
        self._call_order.after(self._comm_stream, capture)
        if async_finish:
            for t in list(inputs) + list(_flatten(result)):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(self._comm_stream)
            event = torch.cuda.Event()
            event.record(self._comm_stream)
            return result, EventHandle(event, extra_tensors=tuple(inputs))
        compute.wait_stream(self._comm_stream)
        return result, EventHandle(None)

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventHandle] = None,
                            async_finish: bool = False
                            ) -> Tuple[DispatchLayout, EventHandle]:
        """Computes where each token goes (no host synchronization).

        Args:
            topk_idx: `[N, K]`, int64 or int32, expert ids in `[-1, num_experts)`.
            num_experts: E.

        Returns:
            The `DispatchLayout` and an event.
        """
        if self._successor is not None:
            return self._current().get_dispatch_layout(topk_idx, num_experts, previous_event,
                                                       async_finish)
        validate.check_tensor("topk_idx", topk_idx, ndim=2, dtypes=(torch.int32, torch.int64),
                              device=self._device_of(topk_idx))
        validate.check_num_experts(num_experts, self.num_ranks)
        validate.check_num_tokens("topk_idx", topk_idx.shape[0], self.num_max_tokens_per_rank)
        validate.check_num_topk(topk_idx.shape[1], self.num_topk)
        if not topk_idx.is_cuda:  # a host check costs no synchronization here
            validate.check_expert_ids_on_host(topk_idx, num_experts)
        _check_call_options(previous_event, async_finish)
        return self._run(lambda: self._transport.get_dispatch_layout(topk_idx, num_experts),
                         [topk_idx], previous_event, async_finish)

    def dispatch(self, x, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, *,
                 num_experts: Optional[int] = None, handle: Optional[DispatchHandle] = None,
                 layout: Optional[DispatchLayout] = None, expert_alignment: int = 1,
                 num_max_recv_rows: Optional[int] = None,
                 previous_event: Optional[EventHandle] = None, async_finish: bool = False,
                 fp8: Optional[Fp8Dispatch] = None
                 ) -> Tuple[object, Optional[torch.Tensor], DispatchHandle, EventHandle]:
        """Sends every token once per destination rank and expands it into expert-major rows.

        Args:
            x: `[N, H]`, torch.bfloat16, torch.float16 or torch.float32 (`H * element_size`
                a multiple of 16 bytes, at most the Buffer's `row_bytes`), contiguous; every
                transport copies the bytes as they are. With `fp8`, either bf16 `[N, H]`
                (quantized inside
                the send; other dtypes are refused) or a pre-quantized pair
                `(x_fp8 [N, H] torch.float8_e4m3fn, x_scales [N, ceil(H / block)]
                fmt.scale_dtype)`.
            topk_idx: `[N, K]`, int64 or int32, expert ids, -1 for none. An id a token names
                at several k is kept, not merged: every transport gives the expert one row per
                such k, and `combine` sums them all (unchanged rows: still `K * x`; weighted:
                each k's weight times its row). Nothing refuses it: on GPUs that would
                synchronize with the host.
            topk_weights: `[N, K]`, float32.
            num_experts: E, a multiple of the EP size.
            handle: a previous dispatch's handle: replay its routing for new rows (cached
                dispatch; no topk arguments, no host synchronization).
            layout: a precomputed `get_dispatch_layout` result for `topk_idx`.
            expert_alignment: pad each local expert's segment with zero rows to a multiple of it.
            num_max_recv_rows: an upper bound on the received rows. Given, the call never
                synchronizes with the host (CUDA-graph safe); rows past the used ones are
                unspecified, and a bound that is too small is reported as an error.
            previous_event: wait for this event instead of the current stream.
            async_finish: return an event instead of making the current stream wait.
            fp8: None (bf16 rows on the wire) or an `Fp8Dispatch` (`Fp8Dispatch.named(
                "blockwise")`, `Fp8Dispatch(MXFP8_1x32, output="bf16")`): its format travels
                and its output says what `recv_x` is: "fp8", the pair `(recv_x_fp8 [M, H]
                float8_e4m3fn, recv_scales [M, num_blocks])`, padding rows all zero bytes;
                "bf16", `recv_x [M, H]` bf16, dequantized on the receiver. Needs H % 16 == 0.
                Each token is quantized on its own (TE's recipe rules), so the rows are those
                of the bf16 dispatch of `fp8.quantize(x)`.

        Returns:
            `recv_x [M, H]` (rows grouped by local expert, each expert's rows ordered by source
            rank, source token and k; the pair above for FP8 output), `recv_weights [M]` float32
            (None for cached dispatch), the handle and an event.
        """
        if self._successor is not None:
            return self._current().dispatch(
                x, topk_idx, topk_weights, num_experts=num_experts, handle=handle,
                layout=layout, expert_alignment=expert_alignment,
                num_max_recv_rows=num_max_recv_rows, previous_event=previous_event,
                async_finish=async_finish, fp8=fp8)
        _check_call_options(previous_event, async_finish)
        x, x_scales, spec = self._dispatch_input(x, fp8)
        device = self._device_of(x)
        if spec is None:
            validate.check_tensor("x", x, ndim=2, dtypes=self._row_dtypes(), device=device)
            validate.check_hidden("x", x.shape[1], x.element_size(), self.row_bytes,
                                  self._buffer_rows())
        elif x_scales is None:
            validate.check_fp8_input(x)
            validate.check_tensor("x", x, ndim=2, dtypes=(torch.bfloat16,), device=device)
            validate.check_fp8_hidden("x", x.shape[1], self._hidden_2b)
        else:
            validate.check_fp8_hidden("x_fp8", x.shape[1], self._hidden_2b)
        # FP8 arguments reach the transport only when FP8 is asked for.
        fp8_kwargs = {} if spec is None else dict(fp8=spec, x_scales=x_scales)
        inputs = [x] if x_scales is None else [x, x_scales]
        validate.check_num_tokens("x", x.shape[0], self.num_max_tokens_per_rank)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("cached dispatch (handle=...) takes no topk_idx/topk_weights")
            self._check_handle(handle)
            if tuple(x.shape) != (handle.num_tokens, handle.hidden):
                raise ValueError(f"cached dispatch: x has shape {tuple(x.shape)}, the handle was"
                                 f" made for {(handle.num_tokens, handle.hidden)}")
            recv_x, event = self._run(
                lambda: self._transport.cached_dispatch(x, handle, **fp8_kwargs), inputs,
                previous_event, async_finish)
            return recv_x, None, handle, event
        if topk_idx is None or topk_weights is None or num_experts is None:
            raise ValueError("dispatch needs topk_idx, topk_weights and num_experts "
                             "(or a handle for cached dispatch)")
        validate.check_routing(x, topk_idx, topk_weights, max_topk=self.num_topk, device=device)
        validate.check_num_experts(num_experts, self.num_ranks)
        validate.check_alignment(expert_alignment)
        if num_max_recv_rows is not None:
            validate.check_int("num_max_recv_rows", num_max_recv_rows, low=0)
        if layout is not None:
            validate.check_layout(layout, num_tokens=x.shape[0], num_experts=num_experts,
                                  num_ranks=self.num_ranks)

        def run():
            return self._transport.dispatch(x, topk_idx, topk_weights, num_experts,
                                            expert_alignment, num_max_recv_rows, layout,
                                            **fp8_kwargs)

        (recv_x, recv_weights, new_handle), event = self._run(
            run, inputs + [topk_idx, topk_weights], previous_event, async_finish)
        new_handle.buffer_lineage = self._lineage
        return recv_x, recv_weights, new_handle, event

    def cached_dispatch(self, x, handle: DispatchHandle, *,
                        previous_event: Optional[EventHandle] = None, async_finish: bool = False,
                        fp8: Optional[Fp8Dispatch] = None) -> Tuple[object, EventHandle]:
        """Replays a previous dispatch's routing for new rows: no layout, no count exchange, no
        host synchronization (what combine's backward runs). `dispatch(x, handle=handle)` is
        the same call.

        Args:
            x: `[N, H]` rows of the handle's shape, as for `dispatch`.
            handle: the `DispatchHandle` a `dispatch` of this Buffer (or the one it grew from)
                returned.
            previous_event, async_finish, fp8: as for `dispatch`.

        Returns:
            `recv_x` (in the handle's row order; the FP8 pair for FP8 output) and an event.
        """
        recv_x, _, _, event = self.dispatch(x, handle=handle, previous_event=previous_event,
                                            async_finish=async_finish, fp8=fp8)
        return recv_x, event

    def _check_handle(self, handle) -> None:
        validate.check_handle(handle, hidden=self._hidden_2b, num_topk=self.num_topk,
                              num_ranks=self.num_ranks, max_tokens=self.num_max_tokens_per_rank)
        if handle.buffer_lineage != self._lineage:
            raise ValueError("handle was made by another Buffer (another group, or another "
                             "Buffer on this group); pass it to the Buffer whose dispatch "
                             "returned it")

    def _dispatch_input(self, x, fp8):
        """Splits `x` into (rows, scales or None, `Fp8Dispatch` or None), checking the pair."""
        spec = check_fp8_argument(fp8)
        if isinstance(x, (tuple, list)):
            validate.check_x_sequence(x, spec is not None)
            x_fp8, x_scales = validate.check_fp8_pair(x, spec.fmt, device=self.device)
            return x_fp8, x_scales, spec
        if isinstance(x, torch.Tensor) and x.dtype == torch.float8_e4m3fn:
            raise ValueError("x is float8_e4m3fn without its scales: pass the pair "
                             "(x_fp8, x_scales) with fp8=Fp8Dispatch(...) (e.g. "
                             "fp8=Fp8Dispatch.named('blockwise'))")
        return x, None, spec

    def combine(self, y: torch.Tensor, handle: DispatchHandle, *, weighted: bool = False,
                grad_row_weights: Optional[torch.Tensor] = None,
                previous_event: Optional[EventHandle] = None, async_finish: bool = False
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventHandle]:
        """Reduces expert rows back to their source tokens.

        Args:
            y: `[M, H]` in the dispatch's row order, torch.bfloat16, torch.float16 or
                torch.float32 (the output's dtype; fp32 rows are summed without rounding).
            handle: the dispatch's handle.
            weighted: multiply each row by its routing weight first (Megatron's experts already
                apply the probs, so its dispatcher leaves this off).
            grad_row_weights: optional `[M]` float32 per-row values gathered back per (token, k)
                into `[N, K]` (dispatch's backward uses it for the routing-weight gradient).

        Returns:
            `out [N, H]` (fp32 accumulation, rounded once), the `[N, K]` gathered
            `grad_row_weights` or None, and an event.
        """
        if self._successor is not None:
            return self._current().combine(y, handle, weighted=weighted,
                                           grad_row_weights=grad_row_weights,
                                           previous_event=previous_event,
                                           async_finish=async_finish)
        self._check_handle(handle)
        validate.check_bool("weighted", weighted)
        _check_call_options(previous_event, async_finish)
        validate.check_tensor("y", y, ndim=2, dtypes=self._row_dtypes(), device=self._device_of(y))
        if tuple(y.shape) != (handle.num_recv_rows, handle.hidden):
            raise ValueError(f"combine: y has shape {tuple(y.shape)}, the handle expects "
                             f"{(handle.num_recv_rows, handle.hidden)}")
        if grad_row_weights is not None:
            validate.check_tensor("grad_row_weights", grad_row_weights, ndim=1,
                                  dtypes=(torch.float32,), device=self._device_of(y))
            if grad_row_weights.shape[0] != handle.num_recv_rows:
                raise ValueError(f"grad_row_weights has {grad_row_weights.shape[0]} rows, the "
                                 f"handle expects {handle.num_recv_rows}")
        (out, weights), event = self._run(
            lambda: self._transport.combine(y, handle, weighted, grad_row_weights),
            [y], previous_event, async_finish)
        return out, weights, event

    def _row_dtypes(self):
        return self._transport.row_dtypes

    def _enter_capture(self) -> None:
        """A call is being captured in a CUDA graph: refused for transports that cannot be
        replayed (`Transport.graph_capture_refusal`), else remembered (`captured`)."""
        refusal = self._transport.graph_capture_refusal
        if refusal is not None:
            raise RuntimeError(
                f"megatron_deepep: the {self._transport.name} transport cannot run inside a "
                f"CUDA-graph capture: {refusal}")
        self.captured = True

    def check_errors(self) -> None:
        """Raises the first error a kernel recorded (a stalled peer, a bad expert id)."""
        self._current()._transport.check_errors()

    def destroy(self) -> None:
        """Frees the transport's memory and closes peer mappings (collective; idempotent). A
        Buffer that `get_buffer` replaced has nothing left to free."""
        if self._transport is not None:
            self._transport.destroy()
            self._transport = None

    def _retire(self, successor: "Buffer") -> None:
        """Frees this Buffer's transport and sends its later calls (a pending backward, a
        cached dispatch of an earlier handle) to `successor`. Collective, like `destroy`:
        every rank grows at the same call."""
        self.destroy()
        self._successor = successor
        successor._lineage = self._lineage


class CallOrder:
    """Keeps one Buffer's calls in issue order across streams.

    A call without `previous_event` and `async_finish` launches on the caller's stream, an
    asynchronous one on the comm stream; without this, a synchronous call issued while an
    asynchronous one still runs (Megatron overlapping one micro-batch's dispatch with another's
    combine, or a caller mixing both kinds) would run beside it on the same epoch words and
    block counters. Each call's stream waits for the event recorded after the previous call
    when that one ran on another stream (a stream keeps its own order).

    Inside a CUDA-graph capture only events of the same capture are waited for (an event of
    eager work or of another capture cannot be waited on there): a replay runs in the order of
    the stream it is launched on.

    Streams are torch Streams or raw handles (`jit.RawStream`): what is used of them is
    `cuda_stream` and `device_index`.

    Args:
        new_event: makes an event with `record(stream)` and `wait(stream)` (`RawEvent`).
    """

    # `capture` below: None for an eager call, else the id of the capture recording it
    # (`UNKNOWN_CAPTURE` when it could not be read: such a call is left unordered).
    UNKNOWN_CAPTURE = -1

    def __init__(self, new_event):
        self._new_event = new_event
        self._last = None  # (event, raw stream handle, capture) of the previous call
        # Eager calls re-record one event per stream (a wait already issued keeps the record
        # it saw), instead of making and freeing an event per call.
        self._eager_events = {}

    def before(self, stream, capture: Optional[int] = None) -> None:
        """Makes `stream` wait for the previous call unless that one ran on `stream` itself."""
        if self._last is None or capture == self.UNKNOWN_CAPTURE:
            return
        event, last_stream, last_capture = self._last
        if last_stream != stream.cuda_stream and last_capture == capture:
            event.wait(stream)

    def after(self, stream, capture: Optional[int] = None) -> None:
        """Records the end of the call just launched on `stream`."""
        if capture == self.UNKNOWN_CAPTURE:
            return
        handle = stream.cuda_stream
        if capture is None:
            # Keyed by device too: the legacy default stream is handle 0 on every device.
            key = (handle, getattr(stream, "device_index", None))
            event = self._eager_events.get(key)
            if event is None:
                event = self._eager_events[key] = self._new_event()
        else:  # a capture records into its own graph: a new event, never an eager one
            event = self._new_event()
        event.record(stream)
        self._last = (event, handle, capture)


def _capture_of(stream) -> int:
    """The id of the graph capture `stream` is recording (`CallOrder.UNKNOWN_CAPTURE` when the
    driver does not say)."""
    from megatron_deepep.kernels.cuda_calls import stream_capture_id
    capture = stream_capture_id(stream.cuda_stream)
    return CallOrder.UNKNOWN_CAPTURE if capture is None else capture


def _check_limits(*, num_max_tokens_per_rank, hidden, num_topk, dtype=torch.bfloat16) -> None:
    """Raises ValueError naming the argument unless the Buffer limits are usable."""
    validate.check_row_dtype("dtype", dtype)
    for name, value in (("num_max_tokens_per_rank", num_max_tokens_per_rank),
                        ("hidden", hidden), ("num_topk", num_topk)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if num_topk > validate.MAX_TOPK:
        raise ValueError(f"num_topk={num_topk} exceeds the limit {validate.MAX_TOPK}")
    per_vector = validate.ROW_ALIGN_BYTES // dtype.itemsize
    if hidden % per_vector:
        raise ValueError(f"hidden={hidden} gives {validate.ROW_DTYPE_NAMES[dtype]} rows of "
                         f"{hidden * dtype.itemsize} bytes; "
                         f"rows must be a multiple of {validate.ROW_ALIGN_BYTES} bytes (hidden a "
                         f"multiple of {per_vector})")


def _transport_or_knob(transport: Optional[str]) -> str:
    """`transport`, else `MDEEP_TRANSPORT`, else "auto"."""
    return transport if transport is not None else knobs.get("TRANSPORT", "auto")


def _check_transport(transport) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")


def _check_call_options(previous_event, async_finish) -> None:
    if previous_event is not None and not isinstance(previous_event, EventHandle):
        raise ValueError(f"previous_event must be an EventHandle (the event a call returned) or "
                         f"None, got {type(previous_event).__name__}")
    validate.check_bool("async_finish", async_finish)


def _flatten(obj):
    if isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _flatten(item)
    elif isinstance(obj, DispatchHandle):
        yield from (obj.recv_weights, obj.slot_rows, obj.recv.tokens_per_expert)
    else:
        yield obj


_BUFFERS = {}


def is_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA). A capture
    needs torch's CUDA state, so an uninitialized one answers first: `is_initialized` reads a
    flag, where `is_available` cost ~4 µs a call on an H100 host."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def check_buffers() -> None:
    """Raises the first error a kernel of any live `get_buffer` Buffer recorded.

    Calls check on their own (every call starts with it); a step whose calls all replay in CUDA
    graphs runs none, so an error (a row bound too small: `num_max_recv_rows`) surfaces here,
    at Megatron's step-end MoE report (`metrics` calls this), instead of never. Reads host
    memory only.
    """
    for buf in list(_BUFFERS.values()):
        if buf._transport is not None:
            buf.check_errors()


def get_buffer(group, num_max_tokens_per_rank: int, hidden: int, num_topk: int, *,
               transport: Optional[str] = None, dtype: torch.dtype = torch.bfloat16,
               **kwargs) -> Buffer:
    """A process-wide Buffer for `group` that grows (never shrinks) when a call needs more.

    `hidden` counts elements of `dtype` (as for `Buffer`); rows are compared in bytes, so a
    Buffer made for fp32 rows of H serves bf16 rows of up to 2 H without growing.

    Growing replaces the Buffer by a larger one and retires the old one: handles it made (the
    autograd context of a micro-batch still waiting for its backward, a cached dispatch) stay
    valid, and calls on the old Buffer object go to the new one. Every rank of the group must
    ask for the same sizes in the same order (growth is collective).
    """
    _check_limits(num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden,
                  num_topk=num_topk, dtype=dtype)
    transport = _transport_or_knob(transport)
    _check_transport(transport)
    unknown = sorted(set(kwargs) - {"num_sms", "timeout_s", "num_ranks_per_node"})
    if unknown:
        raise TypeError(f"get_buffer got unexpected keyword argument(s) {unknown}; it takes "
                        f"transport, num_sms, timeout_s and num_ranks_per_node")
    group = validate.check_group(group)
    key = (id(group), transport)
    buf = _BUFFERS.get(key)
    if buf is not None and (buf.num_max_tokens_per_rank >= num_max_tokens_per_rank
                            and buf.row_bytes >= hidden * dtype.itemsize
                            and buf.num_topk >= num_topk):
        return buf
    if buf is not None and buf.captured:
        raise ValueError(
            f"megatron_deepep: a CUDA graph replays into the Buffer of this EP group "
            f"(num_max_tokens_per_rank={buf.num_max_tokens_per_rank}, {buf._buffer_rows()}, "
            f"num_topk={buf.num_topk}), and a call now needs num_max_tokens_per_rank="
            f"{num_max_tokens_per_rank}, hidden={hidden}, dtype={dtype}, num_topk={num_topk}; "
            f"growing would free "
            f"memory the graph uses. Size it for the largest call before the capture "
            f"(--moe-mdeep-num-max-tokens-per-rank / MDEEP_NUM_MAX_TOKENS_PER_RANK)")
    if is_capturing():
        raise RuntimeError(
            "megatron_deepep: a Buffer cannot be created inside a CUDA-graph capture (it "
            "allocates and exchanges memory handles); run one eager step (Megatron's graph "
            "warm-up steps do) before capturing")
    if buf is not None:
        num_max_tokens_per_rank = max(num_max_tokens_per_rank, buf.num_max_tokens_per_rank)
        # The wider rows in the requested dtype (both byte counts are multiples of 16).
        hidden = max(hidden * dtype.itemsize, buf.row_bytes) // dtype.itemsize
        num_topk = max(num_topk, buf.num_topk)
        # The old transport goes first: its memory is free before the new one's is taken.
        buf.destroy()
    new = Buffer(group, num_max_tokens_per_rank, hidden, num_topk, transport=transport,
                 dtype=dtype, **kwargs)
    if buf is not None:
        buf._retire(new)
    _BUFFERS[key] = new
    return new
