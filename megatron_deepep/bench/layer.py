"""Benchmark of one Megatron MoE layer, forward + backward, per dispatcher variant.

`python -m megatron_deepep.bench.layer` (one GPU, EP = 1, one process), or `--cpu` (a tiny shape
on the CPU with the pure-torch reference transport: a smoke test of this script, no speed).

Table A: a bf16 `MoELayer` (default H 4096, 64 experts, top-6, 8192 tokens, grouped
GEMM experts) with Megatron's `alltoall` dispatcher (twice: "alltoall (fused permute)", with
`moe_permute_fusion=True`, Transformer Engine's fused permute kernels, skipped saying why without
TE or a GPU, and "alltoall (unfused)"), `deepep` synchronizing (one host wait per
dispatch for the received row count), `deepep` sync-free (a rank capacity factor: a fixed row
bound, `DeepEPOptions.rank_capacity_factor`) and `deepep` sync-free captured in one CUDA graph
(forward + backward, replayed). Experts: Megatron's `TEGroupedMLP` when Transformer Engine imports
(`--experts auto`); it reads the counts on the host (`tokens_per_expert.tolist()`), so a graph
cannot hold it. The graph row therefore runs `GroupedMMExperts` (two `torch._grouped_mm` GEMMs
whose group offsets stay on the GPU), and `deepep-syncfree-gmm` runs the same experts eagerly,
the graph's like-for-like row. Table B (`--te`): TE layers under the blockwise FP8
recipe (`Float8BlockScaling`): `alltoall`, `deepep` bf16 dispatch, `deepep` FP8 dispatch
dequantized into `TEGroupedMLP`, and `deepep` FP8 dispatch handed to our FP8 experts
(`te_experts.with_fp8_experts`, what `MDEEP_FP8_EXPERTS=1` selects in the example), whose wgrad
columnwise copy comes from `cuda_src/fp8_columnwise.cu`, or (the `-dequant-colwise` row) from
dequantize + TE's `split_quantize`.

Measured per row: fwd+bwd ms = median over `--iters` calls issued back to back, by CUDA events
(`bench.time_cuda`; rotating inputs, grads set to None between calls, as a training step does);
host ms/layer = median wall time until the Python call (forward + backward, or the graph's
replay) returns, the GPU idle at its start (`bench.host_us` one call at a time); it includes the
host waits of a synchronizing variant. torch-flagged syncs = the synchronizing torch calls
in one call (`torch.cuda.set_sync_debug_mode`), whoever makes them: not a count of the
dispatcher's host waits (`SYNCS_NOTE`). Ratio =
fwd+bwd time / each alltoall row's (unfused, fused permute), same table and shape. A variant
that fails prints its error in its row and the run goes on. `--profile N` lists each row's N
kernels with the most GPU time, the kernels of the FP8 experts' columnwise copy whatever their
rank (`WATCHED_KERNELS`), and the row's total kernel time per call.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import statistics
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron_deepep.bench import run as bench
from megatron_deepep.bench.layer_variants import (
    BASELINE,
    FUSED_BASELINE,
    VARIANTS,
    Skip,
    Variant,
    autocast,
    build_layer,
    capture_forward_backward,
    cpu_stand_ins,
    grouped_mm_reason,
    init_megatron,
    te_reason,
    teardown,
)
from megatron_deepep.megatron import baselines

logger = logging.getLogger("megatron_deepep.bench.layer")

#: Shapes (tokens, hidden, experts, top-k, expert ffn hidden) of each table, and of `--cpu`.
SHAPES_A = [(8192, 4096, 64, 6, 1024)]
SHAPES_B = [(8192, 4096, 64, 6, 1024), (4096, 7168, 256, 8, 2048)]
SHAPES_CPU = [(64, 64, 8, 2, 128)]
NUM_INPUTS = 3  # rotated, so no call replays the previous one's inputs from L2
#: Kernels `--profile` lists whatever their rank: the FP8 experts' columnwise copy, by our kernel
#: or by our dequantize and TE's cast-transpose.
WATCHED_KERNELS = ("columnwise_from_rowwise", "dequantize_blockwise",
                   "block_scaled_1d_cast_transpose")


# ---- timing --------------------------------------------------------------------------------------
def _cpu_ms(fn: Callable, setup: Callable, iters: int, warmup: int) -> float:
    for i in range(warmup):
        setup(i)
        fn()
    times = []
    for i in range(iters):
        setup(i)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(fn: Callable, setup: Callable, iters: int, device: str) -> Dict[str, float]:
    """`{"fwd_bwd_ms", "host_ms"}` of `fn` (see the module docstring)."""
    if device == "cpu":  # everything is synchronous: the host time is the time
        return {"fwd_bwd_ms": _cpu_ms(fn, setup, iters, 2),
                "host_ms": _cpu_ms(fn, setup, max(iters // 2, 3), 0)}
    gpu_ms = bench.time_cuda(fn, setup, iters=iters, warmup=3) / 1e3
    host = []
    for i in range(max(iters // 2, 5)):
        setup(i)  # outside the timed call (host_us synchronizes before it starts the clock)
        host.append(bench.host_us(fn, lambda _: None, calls=1) / 1e3)
    return {"fwd_bwd_ms": gpu_ms, "host_ms": statistics.median(host)}


def count_syncs(fn: Callable) -> Optional[int]:
    """Synchronizing torch calls in one call of `fn` (`.tolist()`, `.item()`, ...: torch's sync
    debug mode warns on each). Host waits on mapped memory (the synchronizing deepep dispatch
    reads its row count that way) are not torch calls and are not counted."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message).lower() for w in caught)


class _Inputs:
    """Rotating inputs `[N, 1, H]` (leaves that want grad) and output gradients."""

    def __init__(self, shape, device: str):
        num_tokens, hidden = shape[0], shape[1]
        gen = torch.Generator(device=device).manual_seed(7)
        self.xs = [torch.randn(num_tokens, 1, hidden, device=device, generator=gen)
                   .to(torch.bfloat16).requires_grad_(True) for _ in range(NUM_INPUTS)]
        self.grads = [torch.randn(num_tokens, 1, hidden, device=device, generator=gen)
                      .to(torch.bfloat16) for _ in range(NUM_INPUTS)]


def top_kernels(fn: Callable, setup: Callable, count: int, calls: int = 3,
                watch: Tuple[str, ...] = WATCHED_KERNELS) -> Tuple[List[dict], float]:
    """The `count` kernels with the most device time over `calls` calls of `fn` (torch's
    profiler), then any other kernel whose name contains a `watch` string.

    Returns:
        `([{"name", "us_per_call", "share", "rank", "watched"}], total kernel µs per call)`;
        share of all kernel time, rank by time (1: the most), watched: listed for `watch`
        only (below the top `count`).
    """
    from torch.profiler import ProfilerActivity, profile

    setup(0)
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            setup(i)
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if _device_us(e) > 0]
    total = sum(_device_us(e) for e in events) or 1.0
    events.sort(key=_device_us, reverse=True)
    listed = [(rank, e) for rank, e in enumerate(events, 1)
              if rank <= count or any(w in e.key for w in watch)]
    return ([{"name": e.key[:90], "us_per_call": _device_us(e) / calls,
              "share": _device_us(e) / total, "rank": rank, "watched": rank > count}
             for rank, e in listed],
            total / calls)


def top_host_functions(fn: Callable, setup: Callable, count: int, calls: int = 5) -> List[dict]:
    """The `count` functions with the most own host time over `calls` calls of `fn` (cProfile;
    its overhead inflates Python-heavy paths alike, so read the order, not the absolute time):
    `[{"name", "us_per_call", "calls_per_call", "cum_us_per_call"}]`."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    for i in range(calls):
        setup(i)
        profiler.enable()
        fn()
        profiler.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    entries = []
    for (path, line, name), (_, num_calls, own, cumulative, _) in \
            pstats.Stats(profiler).stats.items():
        where = f"{os.path.basename(path)}:{line}" if line else "~"
        entries.append({"name": f"{where}({name})"[:90], "us_per_call": own / calls * 1e6,
                        "calls_per_call": num_calls / calls,
                        "cum_us_per_call": cumulative / calls * 1e6})
    entries.sort(key=lambda e: e["us_per_call"], reverse=True)
    return entries[:count]


def _device_us(event) -> float:
    # torch renamed the field (cuda_time_total -> device_time_total); self time avoids counting
    # a kernel twice through its launching op
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def _eager_step(layer, inputs: _Inputs, fp8: bool):
    """`(fn, setup)` of one eager forward + backward on the rotating inputs."""
    state = {"i": 0}

    def setup(i):
        state["i"] = i % NUM_INPUTS
        layer.zero_grad(set_to_none=True)
        inputs.xs[state["i"]].grad = None

    def fn():
        i = state["i"]
        with autocast(fp8):
            out, _ = layer(inputs.xs[i])
        out.backward(inputs.grads[i])

    return fn, setup


def _graph_step(layer, inputs: _Inputs):
    """`(replay, setup, rel)`: forward + backward captured in one CUDA graph (as
    tests/gpu/test_parity_graphs_gpu.py does); `rel` is the replay's output against an eager
    run of the same layer on the same input (relative Frobenius norm)."""
    static_x = inputs.xs[0].detach().clone().requires_grad_(True)
    static_g = inputs.grads[0].clone()
    graph, static_out = capture_forward_backward(layer, static_x, static_g)

    def setup(i):
        static_x.data.copy_(inputs.xs[i % NUM_INPUTS].detach())
        static_g.copy_(inputs.grads[i % NUM_INPUTS])

    setup(1)
    graph.replay()
    got = static_out.detach().clone()
    with torch.no_grad():
        want, _ = layer(inputs.xs[1].detach())
    rel = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()
    return graph.replay, setup, rel


def run_variant(variant: Variant, shape, device: str, experts: str, iters: int,
                capacity_factor: float, inputs: _Inputs, profile_top: int = 0,
                host_profile_top: int = 0) -> dict:
    """One row: times, host time, syncs, experts, notes; raises Skip or the variant's error."""
    if variant.graph and device == "cpu":
        raise Skip("CUDA graphs need a GPU (--cpu)")
    if variant.permute_fusion:
        reason = baselines.permute_fusion_reason(device)
        if reason:
            raise Skip(reason)
    if variant.grouped_mm:
        reason = grouped_mm_reason(device)
        if reason:
            raise Skip(reason)
    if variant.grouped_mm and not variant.graph and experts == "grouped_mm":
        raise Skip("same as deepep-syncfree (its experts are GroupedMMExperts already)")
    fp8 = variant.table == "B"
    layer, experts_name = build_layer(variant, shape, device, experts, capacity_factor)
    layer.train()
    seen = {}

    def record_input(module, args):
        seen.setdefault("experts_input", type(args[0]).__name__)

    hook = layer.experts.register_forward_pre_hook(record_input)
    row = {"experts": experts_name}
    try:
        if variant.graph:
            fn, setup, row["graph_vs_eager_rel"] = _graph_step(layer, inputs)
        else:
            fn, setup = _eager_step(layer, inputs, fp8)
            setup(0)
            fn()  # first call: kernels compile, buffers grow
        row.update(measure(fn, setup, iters, device))
        setup(0)
        row["syncs"] = count_syncs(fn)
        if profile_top and device == "cuda":
            row["top_kernels"], row["kernel_us_per_call"] = top_kernels(
                fn, setup, profile_top, calls=max(iters, 3))
        if host_profile_top:
            row["top_host"] = top_host_functions(fn, setup, host_profile_top)
    finally:
        hook.remove()
    row["experts_input"] = seen.get("experts_input")
    dispatcher = layer.token_dispatcher
    # The transport our dispatcher's Buffer ran (None for Megatron's own dispatchers).
    buffer = getattr(dispatcher, "_buffer", None)
    row["transport"] = buffer.transport_name if buffer is not None else None
    if variant.sync_free:
        row["rank_capacity_factor"] = capacity_factor
        row["num_max_recv_rows"] = dispatcher.num_max_recv_rows(shape[0])
    del layer, fn, setup, dispatcher, buffer
    return row


# ---- the run -------------------------------------------------------------------------------------
class _LogCapture(logging.Handler):
    """The package's log lines during one variant (e.g. why FP8 rows were dequantized)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: List[str] = []

    def emit(self, record):
        if record.name.startswith("megatron_deepep") and record.name != logger.name:
            self.lines.append(record.getMessage()[:300])


def run(tables: Dict[str, List[Tuple[int, ...]]], variant_names: List[str], device: str,
        experts: str, iters: int, capacity_factor: float, profile_top: int = 0,
        host_profile_top: int = 0) -> List[dict]:
    """Every selected variant of every table on its shapes; one row dict each."""
    rows = []
    te_skip = te_reason() if "B" in tables else ""
    if experts == "auto":  # table A is bf16: TE importing is enough
        from megatron_deepep.fp8 import te_bridge

        experts = "te" if device == "cuda" and te_bridge.te_available()[0] else \
            "grouped_mm" if not grouped_mm_reason(device) else "sequential"
    for table, shapes in tables.items():
        variants = [v for v in VARIANTS if v.table == table and v.name in variant_names]
        for shape in shapes:
            inputs = _Inputs(shape, device) if variants else None
            for variant in variants:
                row = {"table": table, "variant": variant.name, "label": variant.label,
                       "shape": list(shape), "dispatcher": variant.dispatcher}
                capture = _LogCapture()
                logging.getLogger("megatron_deepep").addHandler(capture)
                try:
                    if table == "B" and te_skip:
                        raise Skip(te_skip)
                    row.update(run_variant(variant, shape, device, experts, iters,
                                           capacity_factor, inputs, profile_top,
                                           host_profile_top))
                except Skip as exc:
                    row["skipped"] = str(exc)
                except Exception as exc:  # the row says what failed; the next one runs
                    row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                    logger.exception("variant %s %s failed", variant.name, shape)
                finally:
                    logging.getLogger("megatron_deepep").removeHandler(capture)
                if capture.lines:
                    row["log"] = capture.lines
                rows.append(row)
                logger.info("%s", json.dumps(row))
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
            del inputs
    _add_ratios(rows)
    return rows


def _add_ratios(rows: List[dict]) -> None:
    """`ratio_to_alltoall` (vs the unfused alltoall row) and `ratio_to_alltoall_fused` (vs the
    fused-permute row, where it ran) of every timed row, same table and shape."""
    for key, baseline in (("ratio_to_alltoall", BASELINE), ("ratio_to_alltoall_fused",
                                                           FUSED_BASELINE)):
        base = {(r["table"], tuple(r["shape"])): r.get("fwd_bwd_ms") for r in rows
                if r["variant"] == baseline[r["table"]]}
        for r in rows:
            ref = base.get((r["table"], tuple(r["shape"])))
            if ref and r.get("fwd_bwd_ms") is not None:
                r[key] = r["fwd_bwd_ms"] / ref


#: What the syncs column counts, printed under the table.
SYNCS_NOTE = (
    "torch-flagged syncs/call: the synchronizing torch calls in one forward + backward "
    "(`torch.cuda.set_sync_debug_mode`), whoever makes them; host waits on events, streams or "
    "mapped memory are not among them. deepep-sync waits for its row count on mapped memory "
    "(once per dispatch, not counted) and hands the experts host counts: 0. deepep-syncfree's "
    "dispatcher never waits; its 1 is `TEGroupedMLP`'s `tokens_per_expert.tolist()` on the "
    "device counts (the graph rows' `GroupedMMExperts` make none).")


def markdown_table(rows: List[dict]) -> str:
    """The rows as a markdown table (variant with the transport it ran, shape, experts, times,
    torch-flagged syncs, ratio), then `SYNCS_NOTE`."""
    lines = ["| table | variant | shape (N,H,E,K,F) | experts | fwd+bwd ms | host ms/layer | "
             "torch-flagged syncs/call | x alltoall (unfused) | x alltoall (fused permute) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = ",".join(str(v) for v in r["shape"])
        name = r.get("label", r["variant"])
        if "fwd_bwd_ms" not in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else \
                f"ERROR {r.get('error', 'no result')}"
            lines.append(f"| {r['table']} | {name} | {shape} | {why} | | | | | |")
            continue
        experts = r["experts"]
        if r.get("experts_input") not in (None, "Tensor", "Parameter"):
            experts += f" (input {r['experts_input']})"
        if "graph_vs_eager_rel" in r:
            experts += f" (replay vs eager output: rel {r['graph_vs_eager_rel']:.1e})"
        syncs = "-" if r.get("syncs") is None else str(r["syncs"])
        ratios = " | ".join(f"{r[k]:.2f}" if k in r else "-"
                            for k in ("ratio_to_alltoall", "ratio_to_alltoall_fused"))
        variant = name + (f" ({r['transport']})" if r.get("transport") else "")
        lines.append(f"| {r['table']} | {variant} | {shape} | {experts} | "
                     f"{r['fwd_bwd_ms']:.3f} | {r['host_ms']:.3f} | {syncs} | {ratios} |")
    return "\n".join(lines) + "\n\n" + SYNCS_NOTE


def kernel_tables(rows: List[dict]) -> str:
    """Each profiled row's top kernels (`--profile`) and top host functions
    (`--host-profile`), one block per row."""
    lines = []
    for r in rows:
        shape = ",".join(str(v) for v in r["shape"])
        if r.get("top_kernels"):
            lines.append(" ".join((r["table"], r["variant"], shape))
                         + ": top kernels (us/call, share)")
            # plain concatenation: under Python 3.12.1, inside the whole test suite, f-strings
            # here lost their one-space literals between fields (cause not found)
            lines += ["  " + format(k["us_per_call"], "9.1f") + " " + format(k["share"], "6.1%")
                      + "  " + k["name"] + _rank_note(k)
                      for k in r["top_kernels"]]
            if "kernel_us_per_call" in r:
                lines.append("  " + format(r["kernel_us_per_call"], "9.1f")
                             + "          total kernel time per call")
        if r.get("top_host"):
            lines.append(" ".join((r["table"], r["variant"], shape))
                         + ": top host functions (own us/call, calls/call, cumulative us/call)")
            lines += ["  " + format(k["us_per_call"], "9.1f") + " "
                      + format(k["calls_per_call"], "7.1f") + " "
                      + format(k["cum_us_per_call"], "9.1f") + "  " + k["name"]
                      for k in r["top_host"]]
    return "\n".join(lines)


def _rank_note(kernel: dict) -> str:
    """" (rank R)" for a watched kernel listed below the top ones, else ""."""
    return " (rank " + str(kernel["rank"]) + ")" if kernel.get("watched") else ""


def environment(device: str) -> dict:
    """Versions and the device, for the JSON."""
    info = {"device": device, "torch": torch.__version__}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import megatron.core

        info["megatron_core"] = getattr(megatron.core, "__version__", "?")
    except ImportError:
        pass
    try:
        import transformer_engine

        info["transformer_engine"] = transformer_engine.__version__
    except Exception:  # absent or broken: table B says why
        pass
    return info


def _parse_shapes(text: str) -> List[Tuple[int, ...]]:
    shapes = []
    for item in text.split(";"):
        values = [int(v) for v in item.split(",") if v.strip()]
        if len(values) == 4:  # default expert ffn hidden: a quarter of H
            values.append(values[1] // 4)
        if len(values) != 5:
            raise SystemExit(f"--shapes: expected N,H,E,K[,F] per shape, got {item!r}")
        shapes.append(tuple(values))
    return shapes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_deepep.bench.layer",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=None,
                        help="table A's shapes, semicolon-separated N,H,E,K[,F] (tokens, hidden, "
                             "experts, top-k, expert ffn hidden; default "
                             + ";".join(",".join(map(str, s)) for s in SHAPES_A) + ")")
    parser.add_argument("--te-shapes", default=None,
                        help="table B's shapes, same format (default "
                             + ";".join(",".join(map(str, s)) for s in SHAPES_B) + ")")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variants (default: every one of the tables run): "
                             + ", ".join(v.name for v in VARIANTS))
    parser.add_argument("--iters", type=int, default=20, help="timed calls per variant")
    parser.add_argument("--te", action="store_true",
                        help="also table B: TE layers, blockwise FP8 recipe (needs TE)")
    parser.add_argument("--cpu", action="store_true",
                        help="tiny shape on the CPU, reference transport (smoke test, no speed)")
    parser.add_argument("--experts", default="auto",
                        choices=["auto", "te", "grouped_mm", "sequential"],
                        help="table A's experts: TEGroupedMLP (te), GroupedMMExperts, Megatron's "
                             "SequentialMLP; auto: te when TE imports on a GPU, else grouped_mm")
    parser.add_argument("--rank-capacity-factor", type=float, default=1.0,
                        help="the sync-free rows' bound: factor x tokens x top-k rows (EP = 1 "
                             "receives exactly tokens x top-k)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also list each variant's N kernels with the most GPU time "
                             "(torch profiler, --iters calls), the FP8 experts' columnwise-copy "
                             "kernels whatever their rank, and the total kernel time")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="also list each variant's N functions with the most own host time "
                             "(cProfile, 5 calls): where a host-bound layer's time goes")
    parser.add_argument("--out", default=".bench_out/bench_layer.json", help="JSON output file")
    return parser


def main(argv=None) -> List[dict]:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    warnings.filterwarnings("ignore")
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.stderr.write("megatron_deepep.bench.layer needs a CUDA GPU (or --cpu for the smoke "
                         "test)\n")
        raise SystemExit(2)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    shapes_a = SHAPES_CPU if args.cpu else SHAPES_A
    shapes_b = SHAPES_CPU if args.cpu else SHAPES_B
    tables = {"A": _parse_shapes(args.shapes) if args.shapes else shapes_a}
    if args.te:
        tables["B"] = _parse_shapes(args.te_shapes) if args.te_shapes else shapes_b
    names = [v.name for v in VARIANTS if v.table in tables]
    if args.variants:
        names = [n.strip() for n in args.variants.split(",") if n.strip()]
        unknown = sorted(set(names) - {v.name for v in VARIANTS})
        if unknown:
            raise SystemExit(f"--variants: unknown {unknown}; known: "
                             f"{[v.name for v in VARIANTS]}")
    tables = {t: s for t, s in tables.items() if any(v.table == t and v.name in names
                                                     for v in VARIANTS)}
    if args.cpu:  # two processes' worth of threads on a small CI box swing by 100x
        torch.set_num_threads(1)
    stand_ins = cpu_stand_ins() if args.cpu else contextlib.nullcontext()
    with stand_ins:
        init_megatron(device)
        try:
            rows = run(tables, names, device, args.experts, args.iters,
                       args.rank_capacity_factor, args.profile, args.host_profile)
        finally:
            teardown()
    report = {"environment": environment(device), "iters": args.iters, "rows": rows}
    if os.path.dirname(args.out):
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    kernels = kernel_tables(rows)
    if kernels:
        sys.stdout.write(kernels + "\n")
    sys.stdout.write(markdown_table(rows) + "\n")
    sys.stdout.write(f"(EP 1, {report['environment'].get('gpu', device)}; JSON: {args.out})\n")
    return rows


if __name__ == "__main__":
    main()
