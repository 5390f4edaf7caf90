"""Benchmark: `python -m megatron_deepep.bench` (speed is shown here, never by timed tests).

Per shape (tokens, hidden, experts, top-k), bf16, random routing, on one GPU at EP=1 (or on every
GPU of the node with torchrun): µs and GB/s of dispatch and combine, the floor (bytes that must
move over the copy bandwidth measured in the same run) and the ratio to it, and Megatron's own
`MoEAlltoAllTokenDispatcher` (its six hooks) on the same inputs in the same run.

Definitions: dispatch bytes = N H 2 (read x) + M H 2 (write recv_x); combine bytes = M H 2 + N H 2;
GB/s = bytes / time; floor = bytes / (measured device copy bandwidth); ratio = floor / time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

logger = logging.getLogger("megatron_deepep.bench")

DEFAULT_SHAPES = [(4096, 7168, 256, 8), (8192, 4096, 64, 6), (4096, 2880, 128, 4)]


def time_cuda(fn: Callable, setup: Callable = None, iters: int = 30, warmup: int = 5) -> float:
    """Median µs of `fn()` by CUDA events; `setup(i)` runs untimed before each call."""
    times = []
    for i in range(warmup + iters):
        if setup is not None:
            setup(i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device copy bandwidth in bytes/s (read + write counted), the HBM ceiling of this run."""
    src = torch.empty(num_bytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_cuda(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() / (us * 1e-6)


def make_routing(num_tokens: int, num_experts: int, num_topk: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, device="cuda", generator=g)
    probs, idx = scores.topk(num_topk, dim=1)
    return idx, (probs / probs.sum(1, keepdim=True)).float()


def bench_ours(buf, xs, idxs, ws, num_experts: int, no_sync: bool) -> Dict[str, float]:
    state = {}
    bound = xs[0].shape[0] * idxs[0].shape[1] if no_sync else None

    def setup(i):
        state["i"] = i % len(xs)

    def run_dispatch():
        i = state["i"]
        state["res"] = buf.dispatch(xs[i], idxs[i], ws[i], num_experts=num_experts,
                                    num_max_recv_rows=bound)

    dispatch_us = time_cuda(run_dispatch, setup)
    recv_x, _, handle, _ = state["res"]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(10):  # host cost of one call (launches, checks, the host wait)
        setup(i)
        run_dispatch()
    host_us = (time.perf_counter() - t0) / 10 * 1e6
    torch.cuda.synchronize()
    ys = [recv_x.clone() for _ in range(2)]
    combine_us = time_cuda(lambda: buf.combine(ys[state["i"] % 2], handle), setup)
    return {"dispatch_us": dispatch_us, "combine_us": combine_us, "dispatch_host_us": host_us,
            "num_recv_rows": int(handle.tokens_per_expert.sum())}


def bench_megatron(xs, idxs, ws, num_experts: int) -> Dict[str, float]:
    """Megatron's alltoall dispatcher, its six hooks, on the same inputs (needs megatron-core)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            1, 1, expert_model_parallel_size=dist.get_world_size())
    num_tokens, hidden = xs[0].shape
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=8, num_moe_experts=num_experts,
        moe_router_topk=idxs[0].shape[1], moe_token_dispatcher_type="alltoall", bf16=True,
        params_dtype=torch.bfloat16, expert_model_parallel_size=dist.get_world_size(),
        add_bias_linear=False)
    ep = dist.get_world_size()
    local = num_experts // ep
    disp = MoEAlltoAllTokenDispatcher(local, list(range(dist.get_rank() * local,
                                                        (dist.get_rank() + 1) * local)),
                                      config=config, pg_collection=get_default_pg_collection())
    maps, dense = [], []
    for idx, w in zip(idxs, ws):
        rm = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device="cuda")
        rm.scatter_(1, idx, True)
        pr = torch.zeros(num_tokens, num_experts, dtype=torch.float32, device="cuda")
        pr.scatter_(1, idx, w)
        maps.append(rm)
        dense.append(pr)
    state = {}

    def setup(i):
        state["i"] = i % len(xs)

    def run_dispatch():
        i = state["i"]
        h, p = disp.dispatch_preprocess(xs[i].view(num_tokens, 1, hidden), maps[i], dense[i])
        h, p = disp.token_dispatch(h, p)
        state["out"] = disp.dispatch_postprocess(h, p)

    dispatch_us = time_cuda(run_dispatch, setup)
    permuted = state["out"][0].clone()

    def run_combine():
        h = disp.combine_preprocess(permuted)
        h = disp.token_combine(h)
        disp.combine_postprocess(h)

    combine_us = time_cuda(run_combine, setup)
    return {"dispatch_us": dispatch_us, "combine_us": combine_us}


def profile_kernels(buf, x, idx, w, num_experts: int, no_sync: bool) -> str:
    """Per-kernel GPU time of a few dispatch+combine calls (torch.profiler), to split kernel time
    from host gaps."""
    from torch.profiler import ProfilerActivity, profile
    bound = x.shape[0] * idx.shape[1] if no_sync else None
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            recv_x, _, handle, _ = buf.dispatch(x, idx, w, num_experts=num_experts,
                                                num_max_recv_rows=bound)
            buf.combine(recv_x, handle)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                     max_name_column_width=50)


def run(shapes, num_sms_list: List[int], out_dir: str, with_megatron: bool,
        profile_first: bool = False) -> List[dict]:
    from megatron_deepep.buffer import Buffer

    rank, ep = dist.get_rank(), dist.get_world_size()
    bw = copy_bandwidth()
    rows = []
    for num_tokens, hidden, num_experts, num_topk in shapes:
        xs = [torch.randn(num_tokens, hidden, device="cuda").to(torch.bfloat16) for _ in range(3)]
        routing = [make_routing(num_tokens, num_experts, num_topk, 17 + i + 100 * rank)
                   for i in range(3)]
        idxs, ws = [r[0] for r in routing], [r[1] for r in routing]
        entry = {"shape": [num_tokens, hidden, num_experts, num_topk], "ep": ep,
                 "copy_GBps": bw / 1e9}
        for num_sms in num_sms_list:
            buf = Buffer(dist.group.WORLD, num_tokens, hidden, num_topk, transport="nvlink",
                         num_sms=num_sms)
            for no_sync in (False, True):
                res = bench_ours(buf, xs, idxs, ws, num_experts, no_sync)
                entry[f"ours_sms{num_sms}_{'nosync' if no_sync else 'sync'}"] = res
            if profile_first and rank == 0 and not rows:
                table = profile_kernels(buf, xs[0], idxs[0], ws[0], num_experts, True)
                sys.stdout.write(f"profile, {num_sms} SMs:\n{table}\n")
            buf.destroy()
        rows_recv = entry[f"ours_sms{num_sms_list[0]}_sync"]["num_recv_rows"]
        entry["dispatch_bytes"] = (num_tokens + rows_recv) * hidden * 2
        entry["combine_bytes"] = entry["dispatch_bytes"]
        entry["floor_us"] = entry["dispatch_bytes"] / bw * 1e6
        if with_megatron:
            try:
                entry["megatron_alltoall"] = bench_megatron(xs, idxs, ws, num_experts)
            except Exception as exc:  # reported, not hidden: the table says why it is missing
                entry["megatron_alltoall"] = {"error": repr(exc)}
        rows.append(entry)
        torch.cuda.empty_cache()
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench.json"), "w") as f:
            json.dump(rows, f, indent=1)
        print_table(rows)
        plot(rows, os.path.join(out_dir, "bench.png"))
    return rows


def print_table(rows: List[dict]) -> None:
    lines = ["shape (N,H,E,K) | EP | variant | dispatch µs | GB/s | floor ratio | combine µs | "
             "GB/s | floor ratio"]
    for e in rows:
        floor = e["floor_us"]
        for key, res in e.items():
            if not isinstance(res, dict):
                continue
            if "error" in res:
                lines.append(f"{tuple(e['shape'])} | {e['ep']} | {key} | {res['error']}")
                continue
            d, c = res["dispatch_us"], res["combine_us"]
            host = (f" (host {res['dispatch_host_us']:.0f} µs/call)"
                    if "dispatch_host_us" in res else "")
            lines.append(
                f"{tuple(e['shape'])} | {e['ep']} | {key}{host} | {d:.1f} | "
                f"{e['dispatch_bytes'] / d / 1e3:.0f} | {floor / d:.2f} | {c:.1f} | "
                f"{e['combine_bytes'] / c / 1e3:.0f} | {floor / c:.2f}")
        lines.append(f"{tuple(e['shape'])} | floor {floor:.1f} µs at copy "
                     f"{e['copy_GBps']:.0f} GB/s")
    sys.stdout.write("\n".join(lines) + "\n")


def plot(rows: List[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib missing: no plot written")
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, op in zip(axes, ("dispatch_us", "combine_us")):
        labels = [str(tuple(e["shape"])) for e in rows]
        keys = [k for k, v in rows[0].items() if isinstance(v, dict) and op in v]
        width = 0.8 / (len(keys) + 1)
        for j, key in enumerate(keys):
            ax.bar([i + j * width for i in range(len(rows))],
                   [e[key].get(op, 0) for e in rows], width, label=key)
        ax.bar([i + len(keys) * width for i in range(len(rows))], [e["floor_us"] for e in rows],
               width, label="HBM floor", color="black")
        ax.set_xticks([i + 0.4 for i in range(len(rows))], labels, fontsize=7)
        ax.set_ylabel("µs (median)")
        ax.set_title(op.replace("_us", ""))
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=None,
                        help="semicolon-separated N,H,E,K tuples (default: the three of the issue)")
    parser.add_argument("--num-sms", default="24,132", help="SM budgets to run, comma-separated")
    parser.add_argument("--out", default=".bench_out", help="folder for bench.json/bench.png")
    parser.add_argument("--no-megatron", action="store_true", help="skip Megatron's dispatcher")
    parser.add_argument("--profile", action="store_true",
                        help="print per-kernel GPU times for the first shape")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if not torch.cuda.is_available():
        sys.stderr.write("megatron_deepep.bench needs a CUDA GPU; on a CPU machine run the tests "
                         "instead: python -m pytest tests -q\n")
        raise SystemExit(2)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    shapes = DEFAULT_SHAPES if args.shapes is None else [
        tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    sms = [min(int(s), torch.cuda.get_device_properties(0).multi_processor_count)
           for s in args.num_sms.split(",")]
    run(shapes, sms, args.out, not args.no_megatron, args.profile)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
