"""`DeepEPTokenDispatcher`: Megatron's six-hook MoE dispatcher contract on `megatron_deepep`.

Notation (Megatron's): T local tokens (S/TP * B), H hidden, E experts, E_local = E / EP,
K = `moe_router_topk`, M received rows (expert-major, padded per expert to the alignment).

Hook mapping (`MoELayer` calls them in this order):

| hook                  | work                                                    | comm |
|-----------------------|---------------------------------------------------------|------|
| `dispatch_preprocess` | `routing_map [T,E]`, `probs [T,E]` -> `topk_idx [T,K]`,  | none |
|                       | `topk_weights [T,K]` (a `gather`: probs stay in graph)  |      |
| `token_dispatch`      | `autograd.dispatch`: rows once per rank, expanded to    | EP   |
|                       | expert-major rows on the receiver (permute fused);      | (ETP)|
|                       | expert TP > 1: all-gathered over the expert-TP group    |      |
| `dispatch_postprocess`| counts for the experts; pad-to-capacity reshuffle (in   | none |
|                       | `token_dispatch`, before the gather, with expert TP > 1)|      |
| `combine_preprocess`  | undo the pad-to-capacity reshuffle (expert TP > 1: in   | none |
|                       | `token_combine`, after the reduce-scatter)              |      |
| `token_combine`       | expert TP > 1: reduce-scatter over the expert-TP group; | (ETP)|
|                       | `autograd.combine`: per-token partials, reduced at home | EP   |
| `combine_postprocess` | view back to `[S/TP, B, H]`, add the shared experts     | none |

The probs handed to `token_dispatch` are the ones it uses (nothing cached in between), so
Megatron's A2A-overlap schedule may detach them between its nodes. Every forward builds a new
handle, so `moe` recompute (the layer's forward running twice) is safe. Ranks with no tokens take
part in every collective, forward and backward.
"""

from __future__ import annotations

import logging
import weakref
from typing import List, Optional

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from megatron_deepep.logs import log_once
from megatron_deepep.megatron import expert_tp, metrics, replan
from megatron_deepep.megatron.options import (
    check_config,
    fp8_format_for_option,
    physical_to_logical_for_layer,
    rank_capacity_factor,
    rank_capacity_rows,
    resolve_options,
)
from megatron_deepep.replicas import (  # noqa: F401 (re-exported)
    logical_to_physical_table,
    map_topk_to_physical,
)

logger = logging.getLogger(__name__)


def routing_map_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int):
    """Turns Megatron's dense routing into top-k lists (local, no host synchronization).

    Args:
        routing_map: `[T, E]`, bool, at most `topk` True per row (fewer after token dropping)
            with nonzero probs. Under `--moe-pad-expert-input-to-capacity` Megatron's router
            also routes tokens with prob 0 to fill each expert's capacity; those routes are
            dropped here when a row has more than `topk` (they add nothing to the output or to
            any gradient, and the dispatcher pads every expert to its capacity itself).
        probs: `[T, E]`, float, 0 off-route; may require grad.
        topk: K.

    Returns:
        `topk_idx [T, K]` int64 (routed experts in ascending id order, -1 for empty entries) and
        `topk_weights [T, K]` float32 (a differentiable gather of `probs`, 0 for empty entries).
    """
    num_tokens, num_experts = routing_map.shape
    k = min(topk, num_experts)
    # Key: E - e for routed experts (plus E when the prob is nonzero), 0 otherwise. Its top-k
    # are the routed experts, nonzero probs first, then sorted into ascending ids.
    rank_key = torch.arange(num_experts, 0, -1, device=routing_map.device, dtype=torch.int32)
    key = routing_map.to(torch.int32) * (rank_key + (probs != 0).to(torch.int32) * num_experts)
    top_key, top_idx = torch.topk(key, k, dim=1, sorted=True)
    top_idx = torch.where(top_key > 0, top_idx, num_experts).sort(dim=1).values
    valid = top_idx < num_experts
    top_idx = torch.where(valid, top_idx, 0)
    topk_idx = torch.where(valid, top_idx, torch.full_like(top_idx, -1))
    weights = probs.gather(1, top_idx).float()
    topk_weights = weights * valid.to(weights.dtype)
    if k < topk:
        pad = topk - k
        topk_idx = torch.cat([topk_idx, topk_idx.new_full((num_tokens, pad), -1)], dim=1)
        topk_weights = torch.cat([topk_weights, topk_weights.new_zeros(num_tokens, pad)], dim=1)
    return topk_idx, topk_weights


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class DeepEPTokenDispatcher(MoETokenDispatcher):
    """MoE token dispatcher whose EP communication runs on `megatron_deepep`.

    Args:
        num_local_experts: E_local.
        local_expert_indices: the global ids of this rank's experts (a contiguous block).
        config: the TransformerConfig.
        pg_collection: the process groups; `ep` carries the dispatch and combine, `expt_tp`
            (expert tensor parallelism) the all-gather and reduce-scatter around them.

    Expert tensor parallelism (`--expert-tensor-parallel-size` > 1, see `expert_tp`): as
    Megatron's `alltoall`, the EP-dispatched rows are all-gathered across the
    expert-TP group and sorted expert-major; the combine reduce-scatters the expert outputs
    back first. The counts are read on the host (one small all-gather), so a rank capacity
    factor is refused at configuration; pad-to-capacity (equal segments) stays sync-free.

    FP8 dispatch (`--moe-mdeep-fp8-dispatch`, see `DeepEPOptions.fp8_dispatch`): tokens travel
    as e4m3 plus block scales (about half the bytes). The experts receive TE's own quantized
    tensor (no second quantization in TE's GEMM) when TE is installed, its active recipe
    produces the same format (`Float8BlockScaling` with 1x128 activation blocks, or
    `MXFP8BlockScaling`), the experts take quantized input (not `TEGroupedMLP`, whose
    `GroupedLinear` refuses it), the layer is not in pad-to-capacity mode and either grad mode is
    off, the recipe's backward works from dequantized data or the experts make the columnwise
    copy themselves (`te_experts.FP8GroupedMLP`, `takes_fp8_rows`); else they receive bf16
    rows dequantized on the receiver (cast to the input dtype), which works with any experts.
    The backward is the bf16 combine of the gradients (straight-through).

    Expert placement (`--moe-mdeep-expert-map`, see `DeepEPOptions.expert_map`): routed logical
    experts go to their physical slots (a replicated expert's tokens spread over its copies by
    token index), so a `megatron_deepep.tools.balance` plan applies at a restart: the plugin
    builds the plan's slots per rank and loads the logical-order checkpoint into them
    (`replica_experts`; without it, permute the weights with `balance.permute_expert_weights`).
    This layer's E_local is then the plan's slots per rank (E / EP for a plan without copies);
    `set_physical_to_logical` changes the map at a step boundary.

    Raises:
        ValueError: for settings it does not support (expert tensor parallelism with a
            rank capacity factor, `moe_enable_deepep`, FP8 dispatch with hidden % 16 != 0),
            naming the flag.
    """

    # Sync-free state (set per instance; class defaults for instances built without __init__).
    rank_capacity_factor: Optional[float] = None
    _sync_free = False
    _used_rows = None

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config,
                 pg_collection=None) -> None:
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
            pg_collection = get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.options = resolve_options(config)
        check_config(config, self.options, expert_tp_size=self.tp_size, ep_size=self.ep_size)

        self.ep_rank = _group_rank(self.ep_group)
        expected = list(range(self.ep_rank * num_local_experts,
                              (self.ep_rank + 1) * num_local_experts))
        if self.local_expert_indices != expected:
            raise ValueError(
                f"deepep dispatcher needs contiguous expert placement: EP rank {self.ep_rank} "
                f"should own experts {expected}, got {self.local_expert_indices}")

        # Per-expert segment alignment, padded in the kernel (Megatron must not pad again).
        self.expert_alignment = 1
        if getattr(config, "moe_router_padding_for_quantization", False):
            from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
            self.expert_alignment = int(get_align_size_for_quantization(config)) or 1
        self.drop_and_pad = bool(config.moe_pad_expert_input_to_capacity)
        # Sync-free dispatch (a per-rank row bound; see `DeepEPOptions.rank_capacity_factor`).
        self.rank_capacity_factor = rank_capacity_factor(config, self.options)

        self.hidden_shape = None
        self._topk_idx = None
        self._probs_dtype = None
        self._handle = None
        self._pad_dest = None
        self._etp_layout = None  # expert TP > 1: this dispatch's `expert_tp.ExpertTPLayout`
        self._buffer = None
        self._layer_ref = None
        self._metrics_pending = None
        self._used_rows = None
        self._sync_free = False
        self._tokens_dropped = None
        self._expert_map = None  # (table, copies, num_physical) once resolved; False: none
        self._physical_to_logical = None
        # The tensors `dispatch_preprocess` leaves for the later hooks. Megatron returns them as
        # outputs of a graph that ends after the preprocess (`moe_preprocess` under the
        # transformer_engine impl; `moe_router` / `moe_preprocess` under the local impl, whose
        # router graph covers the preprocess) and sets them back before the eager dispatch:
        # replays run none of this Python. Everything else the preprocess sets is fixed by the
        # graph's static shapes (`hidden_shape`, `_probs_dtype`).
        self.cudagraph_attrs = ["_topk_idx"]
        if self.options.metrics:
            self.cudagraph_attrs.append("_tokens_dropped")

    # ------------------------------------------------------------------------------------------
    def bind_layer(self, layer) -> None:
        """Remembers the owning MoELayer (weakly): metrics read its `layer_number`."""
        self._layer_ref = weakref.ref(layer)

    @property
    def layer_number(self) -> Optional[int]:
        layer = self._layer_ref() if self._layer_ref is not None else None
        return getattr(layer, "layer_number", None)

    def set_shared_experts(self, shared_experts) -> None:
        """Overlaps the shared experts with dispatch/combine (`--moe-shared-expert-overlap`).

        Placement: TP gather in preprocess, fc1 after the dispatch, fc2 and the TP scatter after
        the combine, the sum in `combine_postprocess`, all on the shared experts' side stream.
        """
        super().set_shared_experts(shared_experts)
        if getattr(shared_experts, "use_shared_expert_gate", False):
            self.cudagraph_attrs.append("shared_experts.gate_score")
        self.cudagraph_attrs.append("shared_experts.cached_fc1_input")  # set by pre_forward_comm

    # ------------------------------------------------------------------------------------------
    def _row_dtype(self, hidden: torch.Tensor) -> torch.dtype:
        """The Buffer's row dtype: the layer's `params_dtype` (bf16, fp16 or fp32 layers), or
        the rows' own dtype where that is wider."""
        dtypes = [d for d in (getattr(self.config, "params_dtype", None), hidden.dtype)
                  if d in (torch.bfloat16, torch.float16, torch.float32)]
        return max(dtypes, key=lambda d: d.itemsize, default=torch.bfloat16)

    def _get_buffer(self, hidden: torch.Tensor):
        from megatron_deepep.buffer import get_buffer

        num_tokens = hidden.shape[0]
        n_max = self.options.num_max_tokens_per_rank
        if n_max is None:
            n_max = max(4096, _next_pow2(num_tokens))
            if self._buffer is not None:
                n_max = max(n_max, self._buffer.num_max_tokens_per_rank)
        if num_tokens > n_max:
            raise ValueError(
                f"deepep: this rank dispatches {num_tokens} tokens, more than "
                f"num_max_tokens_per_rank={n_max} (set moe_mdeep_num_max_tokens_per_rank / "
                f"MDEEP_NUM_MAX_TOKENS_PER_RANK, the same on every rank)")
        self._buffer = get_buffer(self.ep_group, num_max_tokens_per_rank=n_max,
                                  hidden=hidden.shape[1], dtype=self._row_dtype(hidden),
                                  num_topk=self.topk,
                                  transport=self.options.transport,
                                  num_sms=self.options.num_sms,
                                  num_ranks_per_node=self.options.ranks_per_node)
        return self._buffer

    def _fp8_spec(self):
        """This call's `Fp8Dispatch` (None: bf16 dispatch); see the class docstring."""
        from megatron_deepep.fp8.dispatch import Fp8Dispatch

        fmt, reason = fp8_format_for_option(self.options.fp8_dispatch)
        if fmt is None:
            if self.options.fp8_dispatch != "off":
                log_once(logger, "megatron_deepep: fp8_dispatch=%s dispatches bf16: %s",
                         self.options.fp8_dispatch, reason)
            return None
        from megatron_deepep.megatron import te_experts

        experts = self._experts()
        handoff, reason = False, te_experts.experts_refuse_fp8_reason(experts)
        if not reason:
            handoff, reason = fp8_handoff(
                fmt, torch.is_grad_enabled(), self.drop_and_pad,
                experts_make_columnwise=te_experts.experts_take_fp8_rows(experts))
        if handoff and self.rank_capacity_factor is not None:
            handoff, reason = False, "sync-free dispatch zeroes the rows past the used ones"
        if handoff and self.tp_size > 1:
            handoff, reason = False, "expert tensor parallelism all-gathers bf16 rows"
        if not handoff:
            log_once(logger, "megatron_deepep: FP8 dispatch %s hands bf16 rows to the experts "
                     "(dequantized on the receiver): %s", fmt.name, reason)
        return Fp8Dispatch(fmt, "fp8" if handoff else "bf16")

    def _physical_map(self):
        """`(table, copies, num_physical)` of the expert map in force (the `expert_map`
        option, or the resumed checkpoint's plan under `replan`), or None (contiguous)."""
        if self._expert_map is None:
            expert_map = replan.expert_map_in_force(self.options, self.ep_size)
            p2l = physical_to_logical_for_layer(expert_map, self.layer_number)
            self._set_map(p2l, "the expert map from " + replan.map_origin(
                self.options, getattr(self, "config", None)))
        return self._expert_map or None

    def _set_map(self, p2l: Optional[List[int]], source: str) -> None:
        self._expert_map, self._physical_to_logical = False, None
        if p2l is None:
            return
        num_physical = self.num_local_experts * max(self.ep_size, 1)
        if len(p2l) != num_physical:
            raise ValueError(
                f"{source} has {len(p2l)} physical slots; this layer has {num_physical} "
                f"(EP {self.ep_size} x {self.num_local_experts} local experts)")
        table, copies = logical_to_physical_table(p2l, self.num_experts)
        self._expert_map = (table, copies, num_physical)
        self._physical_to_logical = list(p2l)

    def set_physical_to_logical(self, physical_to_logical: Optional[List[int]]) -> None:
        """Changes this layer's placement at a step boundary (a re-placement).

        The expert weights and optimizer state must have moved to match first
        (`replicas.move_slots`); the next dispatch routes by the new table and the metrics
        record the new map. None: the contiguous placement.

        Raises:
            ValueError: the map does not fit this layer (slot count, expert ids).
        """
        self._set_map(None if physical_to_logical is None else list(physical_to_logical),
                      "set_physical_to_logical")

    @property
    def physical_to_logical(self) -> Optional[List[int]]:
        """The logical expert of each physical slot under the expert map (None: contiguous)."""
        self._physical_map()
        return self._physical_to_logical

    def _experts(self):
        """The owning MoELayer's experts module (None before `bind_layer`)."""
        layer = self._layer_ref() if self._layer_ref is not None else None
        return getattr(layer, "experts", None)

    def _metrics(self):
        if not self.options.metrics:
            return None
        from megatron_deepep.buffer import is_capturing

        if is_capturing():  # timing events cannot be captured, and replays run no Python
            log_once(logger, "megatron_deepep: metrics skip the layers whose dispatch a CUDA "
                     "graph captures (they replay without Python)")
            return None
        return metrics.get_collector(self.options.metrics_dir)

    # ------------------------------------------------------------------------------------------
    def dispatch_preprocess(self, tokens: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor):
        """Local only: `[S/TP, B, H]` -> `[T, H]`; dense routing -> `topk_weights [T, K]`."""
        self.hidden_shape = tokens.shape
        hidden = tokens.reshape(-1, self.hidden_shape[-1])
        self._probs_dtype = probs.dtype
        self._topk_idx, topk_weights = routing_map_to_topk(routing_map, probs, self.topk)
        if self.options.metrics:  # capacity drops: routed entries the router took away
            k = min(self.topk, routing_map.shape[1])
            self._tokens_dropped = (self._topk_idx[:, :k] < 0).sum()
        expert_map = self._physical_map()
        if expert_map is not None:
            table, copies, num_physical = expert_map
            if table.device != self._topk_idx.device:  # moved once, not per call
                table, copies = table.to(self._topk_idx.device), copies.to(self._topk_idx.device)
                self._expert_map = (table, copies, num_physical)
            self._topk_idx = map_topk_to_physical(self._topk_idx, table, copies)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(tokens.view(self.hidden_shape))
        return hidden, topk_weights

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """EP dispatch: returns `(recv_x [M, H], recv_weights [M])`, expert-major (expert TP
        > 1: the rows of the whole expert-TP group)."""
        from megatron_deepep.autograd import dispatch

        buffer = self._get_buffer(hidden_states)
        collector = self._metrics()
        timer = collector.start() if collector is not None else None
        spec = self._fp8_spec()
        x = hidden_states.contiguous()
        if spec is not None:
            x = x.to(torch.bfloat16)  # FP8 rows are quantized from bf16 (TE's input rules)
        expert_map = self._physical_map()
        bound = self.num_max_recv_rows(x.shape[0])
        self._sync_free = bound is not None
        recv_x, recv_weights, handle = dispatch(
            buffer, x, self._topk_idx, probs.float().contiguous(),
            num_experts=expert_map[2] if expert_map is not None else self.num_experts,
            expert_alignment=self.expert_alignment, fp8=spec, num_max_recv_rows=bound)
        if spec is not None and spec.dequantize and recv_x.dtype != hidden_states.dtype:
            recv_x = recv_x.to(hidden_states.dtype)
        if self.options.replan is not None:
            from megatron_deepep.buffer import is_capturing
            if not is_capturing():  # the loads the next checkpoint's plan is made from
                replan.record(self, handle.num_recv_tokens_per_expert)
        if collector is not None:
            from megatron_deepep.fp8.dispatch import row_bytes
            self._metrics_pending = (timer.stop(), handle,
                                     row_bytes(spec, x.shape[1], x.element_size()))
        self._etp_layout = None
        if self.tp_size > 1:
            if self.drop_and_pad:  # capacity segments first: equal sizes on every TP rank
                recv_x, recv_weights, _ = self._pad_to_capacity(recv_x, recv_weights, handle)
                self._etp_layout = expert_tp.padded_layout(
                    self._capacity_rows(handle.num_tokens), self.num_local_experts, self.tp_group)
            else:
                self._etp_layout = expert_tp.gather_layout(handle.tokens_per_expert_list,
                                                           self.tp_group, recv_x.device)
            recv_x, recv_weights = expert_tp.gather_rows(recv_x, recv_weights,
                                                         self._etp_layout, self.tp_group)
        self._handle = handle
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(recv_x)
        return recv_x, recv_weights

    def num_max_recv_rows(self, num_tokens: int) -> Optional[int]:
        """The row bound of a sync-free dispatch of `num_tokens` tokens (None: synchronous).

        Pad-to-capacity: every local expert's capacity segment (the router already dropped what
        exceeds it). Else, with a rank capacity factor: `options.rank_capacity_rows`.
        """
        if self.drop_and_pad:
            return self.num_local_experts * self._capacity_rows(num_tokens)
        if self.rank_capacity_factor is not None:
            return rank_capacity_rows(self.rank_capacity_factor, num_tokens, self.topk,
                                      self.num_local_experts, self.expert_alignment)
        return None

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Returns `(rows, tokens_per_expert, permuted_probs)` for SequentialMLP/TEGroupedMLP.

        Synchronous dispatch: `tokens_per_expert` is int64 `[E_local]` on the CPU (the dispatch
        already knows the counts on the host, so the experts' `.tolist()` costs nothing);
        segments already carry the quantization padding. Sync-free dispatch: the rows are the
        bound's `M`, `tokens_per_expert` is int64 on the rows' device (no host read here) and
        the last expert's count also covers the unused rows after the used ones, which are
        zero, with prob 0 (they add nothing to any output or gradient).
        """
        handle = self._handle
        permuted_probs = probs.to(self._probs_dtype) if self._probs_dtype is not None else probs
        self._used_rows = None
        if self._etp_layout is not None:  # gathered (and padded) in `token_dispatch`
            tokens_per_expert = self._etp_layout.tokens_per_expert
        elif self.drop_and_pad:
            hidden_states, permuted_probs, tokens_per_expert = self._pad_to_capacity(
                hidden_states, permuted_probs, handle)
        elif not self._sync_free:
            tokens_per_expert = torch.tensor(handle.tokens_per_expert_list, dtype=torch.int64)
        else:
            tokens_per_expert, self._used_rows = _bounded_counts(handle.tokens_per_expert,
                                                                 hidden_states.shape[0])
            hidden_states = _ZeroUnusedRows.apply(hidden_states, self._used_rows)
            permuted_probs = permuted_probs.masked_fill(~self._used_rows, 0)
        return hidden_states, tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        """Local only: undoes the pad-to-capacity layout; sync-free, zeroes the unused rows'
        gradient (else the identity)."""
        if self._used_rows is not None:
            hidden_states = _ZeroUnusedRows.apply(hidden_states, self._used_rows)
        if self.drop_and_pad and self._etp_layout is None:  # else after the TP scatter
            hidden_states = self._unpad(hidden_states)
        return hidden_states

    def _unpad(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Capacity segments back to the dispatch's rows (`_pad_to_capacity`'s inverse)."""
        padded = torch.cat([hidden_states, hidden_states.new_zeros(1, hidden_states.shape[1])])
        return padded.index_select(0, self._pad_dest)

    def token_combine(self, hidden_states: torch.Tensor):
        """EP combine: `[M, H]` expert rows -> `[T, H]` per-token sums (fp32 accumulation);
        expert TP > 1: the rows are reduce-scattered over the expert-TP group first."""
        from megatron_deepep.autograd import combine

        if self._etp_layout is not None:
            hidden_states = expert_tp.scatter_rows(hidden_states, self._etp_layout,
                                                   self.tp_group, self._probs_dtype)
            if self.drop_and_pad:
                hidden_states = self._unpad(hidden_states)
        collector = self._metrics()
        timer = collector.start() if collector is not None else None
        out = combine(self._buffer, hidden_states.contiguous(), self._handle)
        if collector is not None:
            combine_timer = timer.stop()
            pending, self._metrics_pending = self._metrics_pending, None
            if pending is not None:
                dispatch_timer, handle, row_bytes = pending
                collector.record(self, handle, dispatch_timer, combine_timer, row_bytes=row_bytes,
                                 tokens_dropped=self._tokens_dropped)
                self._tokens_dropped = None
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(out)
            self.shared_experts.post_forward_comm()
        return out

    def combine_postprocess(self, hidden_states: torch.Tensor):
        """Local only: back to `[S/TP, B, H]`, plus the overlapped shared-expert output."""
        output = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            shared_output = self.shared_experts.get_output()
            output = output + shared_output
        return output

    # ------------------------------------------------------------------------------------------
    def _capacity_rows(self, num_tokens: int) -> int:
        """Rows per local expert under pad-to-capacity: EP sources times the router capacity."""
        from megatron.core.transformer.moe.moe_utils import get_capacity

        capacity = get_capacity(num_tokens=num_tokens * self.topk, num_experts=self.num_experts,
                                capacity_factor=self.config.moe_expert_capacity_factor)
        rows = int(capacity) * self.ep_size
        align = self.expert_alignment
        return (rows + align - 1) // align * align

    def _pad_to_capacity(self, rows: torch.Tensor, probs: torch.Tensor, handle):
        """Moves each local expert's rows into a fixed-size segment (static expert shapes).

        The router already dropped tokens over capacity, so every source sends at most
        `capacity` rows per expert; the segment holds `capacity * EP` rows, zeros after the used
        ones. Differentiable (index_add forward, index_select backward).
        """
        num_tokens = handle.num_tokens
        seg = self._capacity_rows(num_tokens)
        e_local, m = self.num_local_experts, rows.shape[0]
        device = rows.device
        padded_counts = handle.tokens_per_expert.to(device=device, dtype=torch.long)
        used_counts = handle.num_recv_tokens_per_expert.to(device=device, dtype=torch.long)
        ends = torch.cumsum(padded_counts, 0)
        starts = ends - padded_counts
        # Rows past the last segment (a sync-free bound's unused tail) map to no expert.
        expert_of_row = torch.searchsorted(ends, torch.arange(m, device=device), right=True)
        in_segment = expert_of_row < e_local
        expert_of_row = expert_of_row.clamp(max=e_local - 1)
        pos = torch.arange(m, device=device) - starts[expert_of_row]
        keep = in_segment & (pos < used_counts[expert_of_row]) & (pos < seg)
        if self.options.metrics and self._tokens_dropped is not None:  # rows past a segment
            self._tokens_dropped = self._tokens_dropped + (
                in_segment & (pos >= seg) & (pos < used_counts[expert_of_row])).sum()
        dump = e_local * seg
        dest = torch.where(keep, expert_of_row * seg + pos, torch.full_like(pos, dump))
        self._pad_dest = dest
        out = rows.new_zeros(dump + 1, rows.shape[1]).index_add(0, dest, rows)[:dump]
        out_probs = probs.new_zeros(dump + 1).index_add(0, dest, probs)[:dump]
        tokens_per_expert = torch.full((e_local,), seg, dtype=torch.int64)
        return out, out_probs, tokens_per_expert


def _bounded_counts(counts: torch.Tensor, num_rows: int):
    """Expert row counts of a sync-free dispatch fitted to its `num_rows` rows, on the device.

    Args:
        counts: `[E_local]` padded rows per local expert (the kernel's `tokens_per_expert`).
        num_rows: M, the bound the rows were allocated for.

    Returns:
        `(tokens_per_expert [E_local] int64 summing to M, used [M] bool)`: the counts cut at M
        (rows past the bound were never received: an overflow, which the Buffer reports as an
        error at its next call) with the unused tail added to the last expert, and which rows
        hold received tokens.
    """
    ends = torch.cumsum(counts.to(torch.int64), 0).clamp(max=num_rows)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    fitted = ends - starts
    fitted[-1] += num_rows - ends[-1]
    used = torch.arange(num_rows, device=counts.device) < ends[-1]
    return fitted, used


class _ZeroUnusedRows(torch.autograd.Function):
    """`rows * used[:, None]`, forward and backward: the unused rows of a sync-free dispatch
    (unspecified memory) are zero for the experts, and their gradient is zero too (the
    combine's backward leaves them unspecified)."""

    @staticmethod
    def forward(ctx, rows, used):
        ctx.save_for_backward(used)
        return rows.masked_fill(~used.unsqueeze(1), 0)

    @staticmethod
    def backward(ctx, grad):
        (used,) = ctx.saved_tensors
        return grad.masked_fill(~used.unsqueeze(1), 0), None


def fp8_handoff(fmt, training: bool, drop_and_pad: bool = False,
                experts_make_columnwise: bool = False):
    """Whether the experts get TE quantized tensors for rows of `fmt`: `(ok, reason)`.

    They do when TE's active recipe produces `fmt` and TE can use rowwise-only input, or the
    experts make the columnwise copy themselves (`te_experts.FP8GroupedMLP`; see
    `fp8.te_bridge.handoff_reason`), and the layer does not reshuffle rows to capacity (that
    reshuffle is bf16 torch code).
    """
    from megatron_deepep.fp8 import te_bridge

    if drop_and_pad:
        return False, "moe_pad_expert_input_to_capacity reshuffles the rows in bf16"
    return te_bridge.handoff_reason(fmt, training,
                                    experts_make_columnwise=experts_make_columnwise)


def _group_rank(group) -> int:
    import torch.distributed as dist

    if group is None or not dist.is_initialized():
        return 0
    return dist.get_rank(group)
