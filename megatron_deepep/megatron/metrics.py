"""Per-layer, per-step communication and load metrics of the `deepep` dispatcher.

Switched on by one flag: `MDEEP_METRICS=1`, `register_deepep_dispatcher(metrics=True)`, or the
`moe_mdeep_metrics` config field of a patched Megatron (`--moe-mdeep-metrics`).

In forward, each MoE layer only records CUDA events around its dispatch and combine and adds its
count tensors into device accumulators: no host synchronization. Once per step, `flush()` waits
for the step's last event, reads the event times, gathers the counts over the EP group (one small
all_gather per layer) and derives:

| name (tracker)          | meaning                                                         |
|-------------------------|-----------------------------------------------------------------|
| `deepep_dispatch_ms`    | forward dispatch time in the step, summed over micro-batches,   |
|                         | mean over EP ranks                                              |
| `deepep_combine_ms`     | the same for combine                                            |
| `deepep_bytes_sent_MB`  | dispatch payload this rank sent to other ranks (rows x row bytes)|
|                         | in the step, mean over EP ranks; combine sends `recv` back      |
| `deepep_bytes_recv_MB`  | dispatch payload received from other ranks                      |
| `deepep_dispatch_GBps`  | `bytes_sent / dispatch time` (algorithmic bandwidth, peers only)|
| `deepep_combine_GBps`   | `bytes_recv / combine time` (combine sends the partials back)   |
| `deepep_load_imbalance` | max over mean of the tokens per logical expert (all E experts;  |
|                         | the copies of a replicated expert add up)                       |
| `deepep_rank_imbalance` | max over mean of the tokens each EP rank's experts receive      |
| `deepep_idle_share`     | `1 - min/max` rank load: the share of the expert phase the       |
|                         | least-loaded rank waits for the most loaded one (token counts)  |
| `deepep_expert_ms`      | expert compute time: from the end of the dispatch to the start  |
|                         | of the combine (postprocess, experts, preprocess), summed over  |
|                         | micro-batches, mean over EP ranks                               |
| `deepep_comm_share`     | `(dispatch_ms + combine_ms) / expert_ms`: above about 20% EP    |
|                         | scaling has reached its limit for the configuration             |
| `deepep_idle_share_time`| `1 - min/max` of the ranks' expert times: the worst rank's idle |
|                         | share of the expert phase, measured from time (next to the      |
|                         | count-based `deepep_idle_share`)                                |
| `deepep_tokens_dropped` | routed (token, expert) entries dropped in the step, summed over |
|                         | EP ranks: the router's capacity drops plus rows a               |
|                         | pad-to-capacity segment could not hold                          |

Expert time is read from the events the dispatch and combine spans already record (the end of
one, the start of the other), at `flush()`: nothing more is synchronized in forward. Under
Megatron's EP A2A overlap the interval also holds the other micro-batch's work. Sync-free
dispatch budgets (`num_max_recv_rows`) cannot drop rows (a budget that is too small raises), and
the dispatcher sizes its output exactly, so drops come from capacity only.

When a layer's `comm_share` rises above `MDEEP_COMM_SHARE_WARN` percent (default 20; 0: off),
EP rank 0 logs one warning for that layer, with what usually helps; it warns again only after
the share has fallen back below the limit and crossed it anew.

Under an expert map (`--moe-mdeep-expert-map`, or one a re-placement set) `tokens_per_expert`
counts physical slots and the line also holds the step's `physical_to_logical` (`balance` folds
the counts back); `tokens_per_logical_expert` holds the counts per logical expert either way.
Tokens per expert and per rank (vectors) go to the JSON-lines file only
(`metrics_dir/deepep_metrics_rank<R>.jsonl`, one line per step), which `python -m
megatron_deepep.tools.plot_metrics`
renders. Under `moe` recompute only the pass that builds the graph is counted; evaluation passes
(no grad) are counted only without recompute.

Megatron integration: `register_deepep_dispatcher` (through `megatron.patching`) wraps
Megatron's step-end MoE report (0.16: `moe_utils.track_moe_metrics`; 0.19+:
`MoEMetricsTracker.report`) so that it first flushes these metrics into the MoE metrics tracker;
they then reach TensorBoard / W&B with the aux losses (per layer with `--moe-per-layer-logging`).
The recorded values are divided by the report's `loss_scale`, so the logged values are the
step values above.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import os
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_deepep import knobs
from megatron_deepep.megatron.options import resolve_options

logger = logging.getLogger(__name__)

TRACKER_NAMES = (
    "deepep_dispatch_ms", "deepep_combine_ms", "deepep_bytes_sent_MB", "deepep_bytes_recv_MB",
    "deepep_dispatch_GBps", "deepep_combine_GBps", "deepep_load_imbalance",
    "deepep_rank_imbalance", "deepep_idle_share", "deepep_expert_ms", "deepep_comm_share",
    "deepep_idle_share_time", "deepep_tokens_dropped",
)

#: What usually lowers a high `comm_share` (the warning says it).
COMM_SHARE_ADVICE = (
    "FP8 dispatch (--moe-mdeep-fp8-dispatch blockwise: about half the bytes), node-limited "
    "routing (--moe-router-num-groups <nodes> --moe-router-group-topk <M>), a smaller EP group "
    "(--expert-model-parallel-size), or more tokens per rank (micro-batch size x sequence "
    "length)")


class Span:
    """One timed operation: CUDA events on GPU machines, `perf_counter` elsewhere."""

    def __init__(self):
        self._cuda = torch.cuda.is_available()
        if self._cuda:
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.end_event = torch.cuda.Event(enable_timing=True)
            self.start_event.record()
        else:
            self.t0 = time.perf_counter()
            self.t1 = None

    def stop(self) -> "Span":
        if self._cuda:
            self.end_event.record()
        else:
            self.t1 = time.perf_counter()
        return self

    def synchronize(self) -> None:
        if self._cuda:
            self.end_event.synchronize()

    def elapsed_ms(self) -> float:
        """Milliseconds between start and stop (call after `synchronize`)."""
        if self._cuda:
            return float(self.start_event.elapsed_time(self.end_event))
        return (self.t1 - self.t0) * 1e3

    def ms_until(self, later: "Span") -> float:
        """Milliseconds from this span's stop to `later`'s start (both synchronized)."""
        if self._cuda:
            return float(self.end_event.elapsed_time(later.start_event))
        return (later.t0 - self.t1) * 1e3


class _LayerStats:
    """Accumulators of one MoE layer within one step (device tensors, no syncs)."""

    def __init__(self, ep_group, ep_rank: int, ep_size: int, num_local_experts: int,
                 num_layers: int, device):
        self.ep_group, self.ep_rank, self.ep_size = ep_group, ep_rank, ep_size
        self.num_local_experts = num_local_experts
        self.num_layers = num_layers
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.dispatch_spans: List[Span] = []
        self.combine_spans: List[Span] = []
        self.tokens_per_local_expert = torch.zeros(self.num_local_experts, dtype=torch.int64,
                                                   device=self.device)
        self.tokens_sent_per_rank = torch.zeros(self.ep_size, dtype=torch.int64,
                                                device=self.device)
        self.tokens_recv_per_rank = torch.zeros(self.ep_size, dtype=torch.int64,
                                                device=self.device)
        self.tokens_dropped = torch.zeros((), dtype=torch.int64, device=self.device)
        self.row_bytes = 0
        self.num_calls = 0
        self.physical_to_logical = None


class MetricsCollector:
    """Process-wide collector the dispatchers report to (see the module docstring).

    Args:
        metrics_dir: directory for the per-step JSON lines; None writes none.
    """

    def __init__(self, metrics_dir: Optional[str] = None):
        self.metrics_dir = metrics_dir
        self._layers: Dict[int, _LayerStats] = {}
        self._anon_keys: Dict[int, int] = {}
        self._step = 0
        self.last_results: Dict[int, dict] = {}
        self.recorded_names = set()
        self._comm_share_high: Dict[int, bool] = {}  # layer -> above the warning limit

    def start(self) -> Span:
        """Starts timing an operation (records an event on the current stream)."""
        return Span()

    def _layer_key(self, dispatcher) -> int:
        number = getattr(dispatcher, "layer_number", None)
        if number is not None:
            return int(number)
        # Unbound dispatcher (tests, custom models): number layers by first appearance.
        key = id(dispatcher)
        if key not in self._anon_keys:
            self._anon_keys[key] = len(self._anon_keys) + 1
        return self._anon_keys[key]

    @staticmethod
    def _counts_this_call(dispatcher) -> bool:
        config = dispatcher.config
        recompute = (getattr(config, "recompute_granularity", None) == "selective"
                     and "moe" in (getattr(config, "recompute_modules", None) or []))
        return torch.is_grad_enabled() or not recompute

    def record(self, dispatcher, handle, dispatch_span: Span, combine_span: Span,
               row_bytes: int, tokens_dropped: Optional[torch.Tensor] = None) -> None:
        """Adds one forward dispatch + combine of `dispatcher` (no host synchronization).

        The expert time is the interval between `dispatch_span`'s stop and `combine_span`'s
        start. `tokens_dropped`: a 0-d int64 tensor (any device) of this call's dropped
        (token, expert) entries, or None.
        """
        if not self._counts_this_call(dispatcher):
            return
        key = self._layer_key(dispatcher)
        stats = self._layers.get(key)
        device = handle.num_recv_tokens_per_expert.device
        if stats is None:
            num_layers = (dispatcher.config.num_layers
                          + (getattr(dispatcher.config, "mtp_num_layers", None) or 0))
            stats = _LayerStats(dispatcher.ep_group, dispatcher.ep_rank,
                                max(dispatcher.ep_size, 1), dispatcher.num_local_experts,
                                max(num_layers, key), device)
            self._layers[key] = stats
        stats.dispatch_spans.append(dispatch_span)
        stats.combine_spans.append(combine_span)
        stats.tokens_per_local_expert += handle.num_recv_tokens_per_expert.to(stats.device)
        stats.tokens_sent_per_rank += handle.num_tokens_per_rank.to(stats.device)
        stats.tokens_recv_per_rank += handle.num_recv_tokens_per_rank.to(stats.device)
        if tokens_dropped is not None:
            stats.tokens_dropped += tokens_dropped.to(stats.device)
        stats.row_bytes = row_bytes
        stats.num_calls += 1
        if stats.num_calls == 1:
            stats.physical_to_logical = getattr(dispatcher, "physical_to_logical", None)

    # ------------------------------------------------------------------------------------------
    def flush(self, iteration: Optional[int] = None) -> Dict[int, dict]:
        """Ends the step: reads the events once, reduces over EP, returns `{layer: metrics}`.

        Collective over every EP group that recorded layers: call it on all ranks (Megatron's
        report hook does).
        """
        results = {}
        for key in sorted(self._layers):
            stats = self._layers[key]
            if stats.num_calls == 0:
                continue
            results[key] = self._reduce_layer(stats)
            self._warn_comm_share(key, results[key], stats.ep_rank)
            stats.reset()
        step = self._step if iteration is None else int(iteration)
        self._step = step + 1
        self.last_results = results
        if results and self.metrics_dir:
            self._write_jsonl(step, results)
        return results

    def _reduce_layer(self, stats: _LayerStats) -> dict:
        for span in stats.dispatch_spans[-1:] + stats.combine_spans[-1:]:
            span.synchronize()
        dispatch_ms = sum(s.elapsed_ms() for s in stats.dispatch_spans)
        combine_ms = sum(s.elapsed_ms() for s in stats.combine_spans)
        expert_ms = sum(d.ms_until(c) for d, c in zip(stats.dispatch_spans, stats.combine_spans))
        me = stats.ep_rank
        peer = torch.ones(stats.ep_size, dtype=torch.bool)
        peer[me] = False
        sent_rows = stats.tokens_sent_per_rank.cpu()[peer].sum().item()
        recv_rows = stats.tokens_recv_per_rank.cpu()[peer].sum().item()
        local = torch.tensor(
            [dispatch_ms, combine_ms, sent_rows * stats.row_bytes, recv_rows * stats.row_bytes,
             stats.num_calls, expert_ms, stats.tokens_dropped.item()]
            + stats.tokens_per_local_expert.cpu().tolist(),
            dtype=torch.float64)
        table = _all_gather_rows(local, stats.ep_group, stats.ep_size)  # [R, 7 + E_local]
        dispatch_all, combine_all = table[:, 0], table[:, 1]
        sent_all, recv_all = table[:, 2], table[:, 3]
        expert_all = table[:, 5].clamp(min=0.0)
        tokens_per_expert = table[:, 7:].reshape(-1)
        tokens_per_rank = table[:, 7:].sum(dim=1)
        tokens_per_logical = tokens_per_expert
        if stats.physical_to_logical is not None:  # copies add up to their logical expert
            index = torch.tensor(stats.physical_to_logical, dtype=torch.long)
            tokens_per_logical = torch.zeros(int(index.max()) + 1, dtype=table.dtype)
            tokens_per_logical.index_add_(0, index, tokens_per_expert)
        d_ms, c_ms = dispatch_all.mean().item(), combine_all.mean().item()
        e_ms = expert_all.mean().item()
        sent_mean, recv_mean = sent_all.mean().item(), recv_all.mean().item()
        result = {
            "num_micro_batches": int(stats.num_calls),
            "dispatch_ms": d_ms,
            "combine_ms": c_ms,
            "dispatch_ms_max": dispatch_all.max().item(),
            "combine_ms_max": combine_all.max().item(),
            "bytes_sent": sent_mean,
            "bytes_recv": recv_mean,
            "dispatch_GBps": _gbps(sent_mean, d_ms),
            "combine_GBps": _gbps(recv_mean, c_ms),
            "tokens_per_expert": [int(v) for v in tokens_per_expert.tolist()],
            "tokens_per_rank": [int(v) for v in tokens_per_rank.tolist()],
            "tokens_per_logical_expert": [int(v) for v in tokens_per_logical.tolist()],
            "load_imbalance": _max_over_mean(tokens_per_logical),
            "rank_imbalance": _max_over_mean(tokens_per_rank),
            "idle_share": _idle_share(tokens_per_rank),
            "expert_ms": e_ms,
            "expert_ms_per_rank": expert_all.tolist(),
            "comm_share": (d_ms + c_ms) / e_ms if e_ms > 0 else 0.0,
            "idle_share_time": _idle_share(expert_all),
            "tokens_dropped": int(table[:, 6].sum().item()),
            "num_layers": stats.num_layers,
        }
        if stats.physical_to_logical is not None:  # tokens_per_expert counts physical slots
            result["physical_to_logical"] = list(stats.physical_to_logical)
        return result

    def _warn_comm_share(self, layer: int, m: dict, ep_rank: int) -> None:
        """Logs once per layer and crossing of `MDEEP_COMM_SHARE_WARN` (EP rank 0 only)."""
        limit = knobs.get("COMM_SHARE_WARN") / 100.0
        high = limit > 0 and m["comm_share"] > limit
        was_high = self._comm_share_high.get(layer, False)
        self._comm_share_high[layer] = high
        if high and not was_high and ep_rank == 0:
            logger.warning(
                "megatron_deepep: layer %d: EP communication (dispatch %.3f ms + combine %.3f "
                "ms) is %.0f%% of expert compute (%.3f ms), above MDEEP_COMM_SHARE_WARN=%g%%: "
                "EP scaling is at its limit for this configuration. What usually helps: %s",
                layer, m["dispatch_ms"], m["combine_ms"], 100 * m["comm_share"],
                m["expert_ms"], 100 * limit, COMM_SHARE_ADVICE)

    def _write_jsonl(self, step: int, results: Dict[int, dict]) -> None:
        any_stats = next(iter(self._layers.values()))
        if any_stats.ep_rank != 0:
            return
        rank = dist.get_rank() if dist.is_initialized() else 0
        os.makedirs(self.metrics_dir, exist_ok=True)
        path = os.path.join(self.metrics_dir, f"deepep_metrics_rank{rank}.jsonl")
        line = {"step": step, "layers": {str(k): v for k, v in results.items()}}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    # ------------------------------------------------------------------------------------------
    def flush_to_tracker(self, loss_scale=1.0, iteration: Optional[int] = None) -> Dict[int, dict]:
        """`flush()`, then records the scalars into Megatron's MoE metrics tracker.

        Values are divided by `loss_scale` (Megatron multiplies by it when reporting).
        """
        results = self.flush(iteration)
        scale = float(loss_scale) if loss_scale else 1.0
        for layer, m in results.items():
            scalars = {
                "deepep_dispatch_ms": m["dispatch_ms"],
                "deepep_combine_ms": m["combine_ms"],
                "deepep_bytes_sent_MB": m["bytes_sent"] / 1e6,
                "deepep_bytes_recv_MB": m["bytes_recv"] / 1e6,
                "deepep_dispatch_GBps": m["dispatch_GBps"],
                "deepep_combine_GBps": m["combine_GBps"],
                "deepep_load_imbalance": m["load_imbalance"],
                "deepep_rank_imbalance": m["rank_imbalance"],
                "deepep_idle_share": m["idle_share"],
                "deepep_expert_ms": m["expert_ms"],
                "deepep_comm_share": m["comm_share"],
                "deepep_idle_share_time": m["idle_share_time"],
                "deepep_tokens_dropped": m["tokens_dropped"],
            }
            for name, value in scalars.items():
                _tracker_record(name, value / scale, layer, m["num_layers"])
                self.recorded_names.add(name)
        return results


def _gbps(num_bytes: float, ms: float) -> float:
    return num_bytes / (ms * 1e-3) / 1e9 if ms > 0 else 0.0


def _max_over_mean(values: torch.Tensor) -> float:
    mean = values.float().mean().item() if values.numel() else 0.0
    return values.max().item() / mean if mean > 0 else 1.0


def _idle_share(loads: torch.Tensor) -> float:
    top = loads.max().item() if loads.numel() else 0.0
    return 1.0 - loads.min().item() / top if top > 0 else 0.0


def _all_gather_rows(local: torch.Tensor, group, size: int) -> torch.Tensor:
    if size == 1 or group is None or not dist.is_initialized():
        return local.unsqueeze(0)
    wire = local
    if dist.get_backend(group) == "nccl":
        wire = local.cuda()
    out = [torch.empty_like(wire) for _ in range(size)]
    dist.all_gather(out, wire, group=group)
    return torch.stack(out).cpu()


def _tracker_record(name: str, value: float, layer_number: int, num_layers: int) -> None:
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    tensor = torch.tensor(value, dtype=torch.float32, device=device)
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        get_moe_metrics_tracker = None
    if get_moe_metrics_tracker is not None:
        get_moe_metrics_tracker().record(name, tensor, layer_number=layer_number,
                                         num_layers=num_layers, needs_dp_avg=False)
        return
    from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker
    save_to_aux_losses_tracker(name, tensor, layer_number, num_layers)


_COLLECTOR: Optional[MetricsCollector] = None


def get_collector(metrics_dir: Optional[str] = None) -> MetricsCollector:
    """The process-wide collector (created on first use; `metrics_dir` set if given)."""
    global _COLLECTOR
    if _COLLECTOR is None:
        _COLLECTOR = MetricsCollector(metrics_dir)
    elif metrics_dir is not None:
        _COLLECTOR.metrics_dir = metrics_dir
    return _COLLECTOR


def flush(iteration: Optional[int] = None) -> Dict[int, dict]:
    """Ends a step in a custom training loop (no Megatron tracker): returns the metrics."""
    return get_collector().flush(iteration)


# ----------------------------------------------------------------------------------------------
# Megatron report hooks
# ----------------------------------------------------------------------------------------------
_HOOK_MARK = "_megatron_deepep_metrics_hook"


# Depth of nested Megatron report calls: 0.19's deprecated `track_moe_metrics` calls
# `MoEMetricsTracker.report`, and both are hooked; only the outermost one flushes.
_REPORT_DEPTH = [0]


@contextlib.contextmanager
def _report_call():
    """Marks a hooked Megatron report call; yields True for the outermost one."""
    _REPORT_DEPTH[0] += 1
    try:
        yield _REPORT_DEPTH[0] == 1
    finally:
        _REPORT_DEPTH[0] -= 1


def _flush_collector(params, args, kwargs) -> bool:
    """Flushes the active collector into Megatron's tracker before a report; False if none.

    First raises any error the dispatch kernels recorded (`buffer.check_buffers`): a step whose
    dispatches all replay in CUDA graphs makes no eager call that would.
    """
    from megatron_deepep.buffer import check_buffers

    check_buffers()
    if _COLLECTOR is None:
        return False
    bound = dict(zip(params, args), **kwargs)
    _COLLECTOR.flush_to_tracker(bound.get("loss_scale", 1.0), bound.get("iteration"))
    return True


def is_report_hook(function) -> bool:
    """Whether `function` is one of our report wrappers (`wrap_*` below)."""
    return bool(getattr(function, _HOOK_MARK, False))


def wrap_track_moe_metrics(original):
    """`moe_utils.track_moe_metrics` (0.16's report; a deprecated wrapper around the tracker's
    report on 0.19) that first flushes our metrics; `patching` installs it."""
    params = list(inspect.signature(original).parameters)

    @functools.wraps(original)
    def track_moe_metrics(*args, **kwargs):
        # 0.16 reports every tracker entry; `track_names` only selects what it reduces
        # over PP/DP, so ours (already reduced over EP) stay out of it. 0.19 forwards to
        # the tracker's report, whose hook adds them to `track_names` there.
        with _report_call() as outermost:
            if outermost:
                _flush_collector(params, args, kwargs)
            return original(*args, **kwargs)

    setattr(track_moe_metrics, _HOOK_MARK, True)
    return track_moe_metrics


def wrap_tracker_report(report):
    """`moe_logging.MoEMetricsTracker.report` (0.17+) that first flushes our metrics and lists
    our names in `track_names`; `patching` installs it. A step's metrics are flushed once, by
    the outermost of the two hooks."""
    rparams = list(inspect.signature(report).parameters)

    @functools.wraps(report)
    def wrapped_report(*args, **kwargs):
        with _report_call() as outermost:
            if outermost:
                _flush_collector(rparams, args, kwargs)
            # 0.17+ syncs and logs only the `track_names` it is given.
            args, kwargs = _extend_track_names(rparams, args, kwargs)
            return report(*args, **kwargs)

    setattr(wrapped_report, _HOOK_MARK, True)
    return wrapped_report


def _metrics_enabled() -> bool:
    """Metrics are on in this process: a collector exists, or the dispatcher option says so
    (a pipeline stage without MoE layers builds no dispatcher, hence no collector)."""
    if _COLLECTOR is not None:
        return True
    return bool(resolve_options(None).metrics)


def _extend_track_names(params, args, kwargs):
    """Adds our names to an explicit `track_names` list (returns new args, kwargs).

    All of `TRACKER_NAMES` whenever metrics are on, recorded here or not: the tracker
    all-reduces each listed name over the pipeline stages, so a stage without MoE layers (no
    dispatcher, nothing recorded) must list the same names, or the stages that do would hang.
    Megatron's `force_initialize` gives that stage zeros of the right size.
    """
    names = list(TRACKER_NAMES) if _metrics_enabled() else []
    if not names or "track_names" not in params:
        return args, kwargs
    index = params.index("track_names")
    args = list(args)
    if index < len(args):
        current = args[index]
    else:
        current = kwargs.get("track_names")
    if current is None:
        return tuple(args), kwargs
    if isinstance(current, str):
        current = [current]
    extended = list(current) + [n for n in names if n not in current]
    if index < len(args):
        args[index] = extended
    else:
        kwargs["track_names"] = extended
    return tuple(args), kwargs
