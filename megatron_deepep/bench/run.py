"""Benchmark of dispatch and combine, beside Megatron's all-to-all dispatcher.

`python -m megatron_deepep.bench` (one GPU), or under torchrun (every GPU of a node).

Per shape (tokens, hidden, experts, top-k), bf16, random routing, on one GPU at EP=1 (or on every
GPU of the node with torchrun): µs and GB/s of dispatch and combine, the floor (bytes that must
move over the copy bandwidth measured in the same run) and the ratio to it, and Megatron's own
`MoEAlltoAllTokenDispatcher` (its six hooks) on the same inputs in the same run, twice: with
Transformer Engine's fused permute (`moe_permute_fusion=True`, row "megatron alltoall (fused
permute)") and without ("megatron alltoall (unfused)"); without TE or a GPU the fused row says
why it was skipped (`megatron.baselines`).

Definitions: dispatch bytes = N H 2 (read x) + M H 2 (write recv_x); combine bytes = M H 2 + N H 2;
GB/s = bytes / time; floor = bytes / (measured device copy bandwidth); ratio = floor / time.
FP8 dispatch bytes = N H 2 (read bf16 x) + M (H + scale bytes) (write e4m3 rows and scales).
Variants: "sync" (exact output size, one host wait), "nosync" (a caller-given row bound, no host
synchronization), "cached" (a handle replayed, as combine's backward does). Calls are timed
back to back with CUDA events; host µs/call is measured apart.
Ceilings (bare kernels of `cuda_src/bench/ceiling.cu`, same run): the write-only rate, and at EP=1
the expand's traffic (each row read once, written K times) and the combine's (K rows summed into
one), with none of our bookkeeping. At EP=1 also, per SM budget, the expand's traffic with one block
per SM (as our expand runs) of 512 and of 1024 threads, bf16 rows and FP8-sized rows (one byte per
element plus the first `--fp8` format's scale bytes, no arithmetic): the store path's floor at
that budget (the faster block size of each), and its FP8 / bf16 ratio, printed beside each FP8
row's.

At EP > 1 a second table follows (`bench_peers.py` defines every figure): per rank and per
direction, the NVLink bytes and GB/s of our dispatch and combine, beside NCCL's
`all_to_all_single` of the same bytes and a bare peer-copy kernel's GB/s (the ceiling), with the
issue-20 targets (>= 340 GB/s with <= 24 SMs; >= 1.1x NCCL) marked met / not met. On an 8-GPU
node, everything in one call:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --standalone --nproc-per-node 8 -m megatron_deepep.bench --out .bench_ep8

`--nodes MxL` runs the internode transport on virtual nodes instead (M x L processes sharing
this machine's GPUs, `megatron_deepep.tools.multinode_check --spawn`): its correctness against the
reference and its timed sweep at the first shape (correctness, not speed: the processes take
turns on a GPU), then the model of DeepSeek-V3's shape on real nodes
(`megatron_deepep.tools.internode_model`: bytes per network link and NVLink at 2 x 8 and 8 x 8, with
and without node-limited routing, at assumed link rates, beside DeepEP's and HybridEP's reported
figures).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_deepep.ops.bench import ceiling as ceiling_ops
from megatron_deepep.bench import peers as bench_peers
from megatron_deepep.transport import bandwidth_refusal
from megatron_deepep.transport.topology import (MAX_INTERNODE_NODES, MAX_RANKS_PER_NODE,
                                                 MIN_INTERNODE_NODES)

logger = logging.getLogger("megatron_deepep.bench")

DEFAULT_SHAPES = [(4096, 7168, 256, 8), (8192, 4096, 64, 6), (4096, 2880, 128, 4)]


def time_cuda(fn: Callable, setup: Callable = None, iters: int = 30, warmup: int = 5) -> float:
    """Median µs of `fn()` by CUDA events, calls issued back to back (as DeepEP's bench does):
    the GPU time of one call, host gaps included whenever the host cannot keep ahead (a call's
    host wait drains the queue, so that wait's bubble counts). `setup(i)` runs before each."""
    for i in range(warmup):
        if setup is not None:
            setup(i)
        fn()
    torch.cuda.synchronize()
    events = []
    for i in range(iters):
        if setup is not None:
            setup(i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)


def host_us(fn: Callable, setup: Callable, calls: int = 20) -> float:
    """Host µs per call of `fn` (launches and checks; the GPU may still be running)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        setup(i)
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device copy bandwidth in bytes/s (read + write counted), the HBM ceiling of this run."""
    src = torch.empty(num_bytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_cuda(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() / (us * 1e-6)


def fill_bandwidth(num_bytes: int = 1 << 30) -> float:
    """Device write-only bandwidth in bytes/s, from `fill_kernel` (ceiling.cu; torch's `fill_`
    reaches ~20% less on H200): the ceiling of write-heavy kernels such as the expand."""
    dst = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    grid = 4 * torch.cuda.get_device_properties(dst.device).multi_processor_count
    us = time_cuda(lambda: ceiling_ops.fill(dst, grid), iters=20)
    return num_bytes / (us * 1e-6)


def expert_major_rows(topk_idx: torch.Tensor) -> torch.Tensor:
    """`[N * K]` int32: the output row of entry (n, k) in the EP=1 expert-major layout (experts
    ascending, tokens in order within an expert, no padding). Needs every id valid and a token's
    ids distinct, as `make_routing` gives."""
    num_tokens, num_topk = topk_idx.shape
    num_rows = num_tokens * num_topk
    token = torch.arange(num_tokens, device=topk_idx.device).repeat_interleave(num_topk)
    order = torch.argsort(topk_idx.flatten().long() * num_tokens + token)
    rows = torch.empty(num_rows, dtype=torch.int32, device=topk_idx.device)
    rows[order] = torch.arange(num_rows, dtype=torch.int32, device=topk_idx.device)
    return rows


def token_of_rows(dst_rows: torch.Tensor, num_topk: int) -> torch.Tensor:
    """`[N * K]` int64: the token each output row of `dst_rows [N * K]` (row of entry (n, k))
    comes from, so `x.index_select(0, token_of_rows(...))` is a fan-out's expected output."""
    num_tokens = dst_rows.shape[0] // num_topk
    tokens = torch.arange(num_tokens, dtype=torch.int64, device=dst_rows.device)
    return torch.empty(dst_rows.shape[0], dtype=torch.int64, device=dst_rows.device).scatter_(
        0, dst_rows.long(), tokens.repeat_interleave(num_topk))


def fan_out_us(x: torch.Tensor, topk_idx: torch.Tensor):
    """µs of `fan_out_copy` (ceiling.cu): each row of `x [N, H]` read once and written to its K
    expert-major rows of an `[N * K, H]` output, the EP=1 expand's traffic and nothing else.

    Returns:
        `(µs, the output [N * K, H] (checked against index_select), its rows [N * K] int32)`.
    """
    num_tokens, num_topk = topk_idx.shape
    num_rows = num_tokens * num_topk
    dst_rows = expert_major_rows(topk_idx)
    out = torch.empty(num_rows, x.shape[1], dtype=x.dtype, device=x.device)
    grid = 2 * torch.cuda.get_device_properties(x.device).multi_processor_count
    us = time_cuda(lambda: ceiling_ops.fan_out_copy(x, dst_rows, out, num_topk, grid), iters=20)
    if not torch.equal(out, x.index_select(0, token_of_rows(dst_rows, num_topk))):
        raise RuntimeError("fan_out_copy wrote wrong rows: its ceiling is not valid")
    return us, out, dst_rows


def sm_fan_out_us(x: torch.Tensor, dst_rows: torch.Tensor, num_topk: int, num_sms: int,
                  scale_bytes: int) -> Dict[str, float]:
    """The expand's traffic at an SM budget: `fan_out_copy` and `fan_out_fp8_bytes`
    (ceiling.cu) with `num_sms` blocks of 512 and of 1024 threads, each row of `x [N, H]` bf16
    written to its K rows `dst_rows [N * K]`, as bf16 and as one byte per element plus
    `scale_bytes` per row (rounded up to 16). Both outputs are checked (a wrong copy is no
    ceiling).

    FP8-sized rows are timed both ways `fan_out_fp8_bytes` stores (16-byte stores from
    strided loads, 8-byte stores from coalesced loads); the faster counts.

    Returns:
        `{"bf16_us": µs, "fp8_bytes_us": µs}` (the faster block size of each), the same per
        block size as `"bf16_us_<threads>"`, `"fp8_bytes_us_<threads>"`, and each store
        pattern's own as `"fp8_bytes_us_<threads>_wide"` and `"..._narrow"`.
    """
    num_tokens, hidden = x.shape
    num_rows = num_tokens * num_topk
    token_of_row = token_of_rows(dst_rows, num_topk)
    res = {}
    out = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    expected = x.index_select(0, token_of_row)
    for threads in (512, 1024):
        out.zero_()
        res[f"bf16_us_{threads}"] = time_cuda(lambda: ceiling_ops.fan_out_copy(
            x, dst_rows, out, num_topk, num_sms, threads), iters=20)
        if not torch.equal(out, expected):
            raise RuntimeError("fan_out_copy wrote wrong rows: its ceiling is not valid")
    del out, expected
    out = torch.empty(num_rows, hidden, dtype=torch.uint8, device=x.device)
    scales = torch.empty(num_rows, -(-scale_bytes // 16) * 16, dtype=torch.uint8,
                         device=x.device)
    expected = x.view(torch.uint8).view(num_tokens, hidden, 2)[..., 1].index_select(0, token_of_row)
    for threads in (512, 1024):
        for narrow in (False, True):
            out.zero_()
            us = time_cuda(lambda: ceiling_ops.fan_out_fp8_bytes(
                x, dst_rows, out, scales, num_topk, num_sms, threads, narrow), iters=20)
            if not torch.equal(out, expected):
                raise RuntimeError("fan_out_fp8_bytes wrote wrong rows: its ceiling is not valid")
            key = f"fp8_bytes_us_{threads}"
            res[key + ("_narrow" if narrow else "_wide")] = us
            res[key] = min(res.get(key, us), us)
    res["bf16_us"] = min(res["bf16_us_512"], res["bf16_us_1024"])
    res["fp8_bytes_us"] = min(res["fp8_bytes_us_512"], res["fp8_bytes_us_1024"])
    return res


def fan_in_us(rows: torch.Tensor, src_rows: torch.Tensor) -> float:
    """µs of `fan_in_sum` (ceiling.cu): for each token, its 8 rows of `rows [N * 8, H]` (given
    by `src_rows [N, 8]`) summed in fp32, written once: the EP=1 combine's traffic."""
    num_tokens = src_rows.shape[0]
    out = torch.empty(num_tokens, rows.shape[1], dtype=rows.dtype, device=rows.device)
    grid = 2 * torch.cuda.get_device_properties(rows.device).multi_processor_count
    return time_cuda(lambda: ceiling_ops.fan_in_sum(rows, src_rows, out, grid), iters=20)


def make_routing(num_tokens: int, num_experts: int, num_topk: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, device="cuda", generator=g)
    probs, idx = scores.topk(num_topk, dim=1)
    return idx, (probs / probs.sum(1, keepdim=True)).float()


def _rows_of(recv_x) -> torch.Tensor:
    return recv_x[0] if isinstance(recv_x, tuple) else recv_x


def bench_ours(buf, xs, idxs, ws, num_experts: int, fp8=None) -> Dict[str, dict]:
    """Our variants on one Buffer: dispatch with the host wait (exact size), without it (an
    upper bound), cached (the handle replayed), and combine; FP8 dispatch when `fp8` is given.
    """
    state = {"i": 0}
    # A true bound at any EP size: every rank's every row (tokens x top-k, from each rank) could
    # land here; tokens x top-k alone overflows whenever a rank receives more than it sends.
    bound = buf.num_ranks * xs[0].shape[0] * idxs[0].shape[1]

    def setup(i):
        state["i"] = i % len(xs)

    def run_dispatch(num_max_recv_rows=None):
        i = state["i"]
        state["res"] = buf.dispatch(xs[i], idxs[i], ws[i], num_experts=num_experts,
                                    num_max_recv_rows=num_max_recv_rows, fp8=fp8)

    out = {"sync": {"dispatch_us": time_cuda(run_dispatch, setup)}}
    recv_x, _, handle, _ = state["res"]
    out["sync"]["num_recv_rows"] = _rows_of(recv_x).shape[0]
    out["nosync"] = {"dispatch_us": time_cuda(lambda: run_dispatch(bound), setup),
                     "dispatch_host_us": host_us(lambda: run_dispatch(bound), setup)}
    x_same = xs[0]
    out["cached"] = {"dispatch_us": time_cuda(
        lambda: buf.dispatch(x_same, handle=handle, fp8=fp8), setup)}
    if fp8 is None:
        ys = [_rows_of(recv_x).clone() for _ in range(2)]
        out["sync"]["combine_us"] = time_cuda(lambda: buf.combine(ys[state["i"] % 2], handle),
                                              setup)
        out["sync"]["combine_host_us"] = host_us(
            lambda: buf.combine(ys[state["i"] % 2], handle), setup)
    return out


HOST_PROFILE_MODES = ("sync", "nosync", "cached")


def host_profile_calls(buf, x, idx, w, num_experts: int, fp8=None) -> Dict[str, Callable]:
    """One dispatch call per mode of `HOST_PROFILE_MODES`: "sync" (exact size, one host wait),
    "nosync" (a row bound, no host wait) and "cached" (the sync call's handle replayed)."""
    bound = buf.num_ranks * x.shape[0] * idx.shape[1]
    _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=num_experts, fp8=fp8)
    return {"sync": lambda: buf.dispatch(x, idx, w, num_experts=num_experts, fp8=fp8),
            "nosync": lambda: buf.dispatch(x, idx, w, num_experts=num_experts,
                                           num_max_recv_rows=bound, fp8=fp8),
            "cached": lambda: buf.dispatch(x, handle=handle, fp8=fp8)}


def profile_host(buf, x, idx, w, num_experts: int, calls: int = 200, fp8=None,
                 lines: int = 18) -> str:
    """Where the host time of a dispatch goes, per mode (`host_profile_calls`): host µs per
    call (timed without the profiler, the GPU kept busy but never waited for except by the
    sync call's own host wait), then the cProfile lines of the most internal time."""
    import cProfile
    import io
    import pstats
    label = "bf16" if fp8 is None else f"fp8 {fp8.fmt.name}"
    text = io.StringIO()
    for mode, fn in host_profile_calls(buf, x, idx, w, num_experts, fp8).items():
        for _ in range(5):
            fn()
        us = host_us(fn, lambda i: None, calls)
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        text.write(f"host profile, dispatch {mode} {label}: {us:.1f} µs/call (host), "
                   f"{calls} calls\n")
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(lines)
    return text.getvalue()


def bench_megatron(xs, idxs, ws, num_experts: int, permute_fusion: bool = False
                   ) -> Dict[str, float]:
    """Megatron's alltoall dispatcher, its six hooks, on the same inputs (needs megatron-core);
    `permute_fusion`: `moe_permute_fusion=True`, Transformer Engine's fused permute kernels."""
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
        add_bias_linear=False, moe_permute_fusion=permute_fusion)
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


def megatron_rows(xs, idxs, ws, num_experts: int, device: str = "cuda") -> Dict[str, dict]:
    """Both alltoall baselines, keyed by their labels ("megatron alltoall (fused permute)",
    "megatron alltoall (unfused)"): timings, `{"skipped": reason}` where TE's fused permute
    cannot run (`baselines.permute_fusion_reason`), or `{"error": ...}` when a run fails."""
    from megatron_deepep.megatron import baselines

    rows = {}
    for fused in (True, False):
        key = f"megatron {baselines.label(fused)}"
        reason = baselines.permute_fusion_reason(device) if fused else ""
        if reason:
            rows[key] = {"skipped": reason}
            continue
        try:
            rows[key] = bench_megatron(xs, idxs, ws, num_experts, permute_fusion=fused)
        except Exception as exc:  # reported, not hidden: the table says why it is missing
            rows[key] = {"error": repr(exc)}
    return rows


def profile_kernels(buf, x, idx, w, num_experts: int, fp8=None, calls: int = 5) -> str:
    """Per-kernel GPU time (torch.profiler) apart from host gaps: `calls` no-sync dispatch +
    combine calls in bf16, then, given `fp8`, `calls` no-sync and `calls` cached FP8
    dispatches (the calls of `host_profile_calls`); one table each."""
    from torch.profiler import ProfilerActivity, profile
    bound = buf.num_ranks * x.shape[0] * idx.shape[1]

    def bf16_call():
        recv_x, _, handle, _ = buf.dispatch(x, idx, w, num_experts=num_experts,
                                            num_max_recv_rows=bound)
        buf.combine(recv_x, handle)

    runs = [("dispatch+combine nosync bf16", bf16_call)]
    if fp8 is not None:
        fp8_calls = host_profile_calls(buf, x, idx, w, num_experts, fp8)
        runs += [(f"dispatch {mode} fp8 {fp8.fmt.name}", fp8_calls[mode])
                 for mode in ("nosync", "cached")]
    text = []
    for label, call in runs:
        call()  # warm: the kernels compiled and loaded outside the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                          max_name_column_width=50)
        text.append(f"kernels of {calls} calls, {label}:\n{table}")
    return "\n".join(text)


def _fp8_formats(names: str):
    """`--fp8`'s names (those `fp8=` takes) as specs; "off" and "auto" without TE drop out."""
    from megatron_deepep.fp8.dispatch import Fp8Dispatch
    specs = (Fp8Dispatch.named(n.strip(), "fp8") for n in names.split(",") if n.strip())
    return [spec for spec in specs if spec is not None]


def run(shapes, num_sms_list: List[int], out_dir: str, with_megatron: bool,
        profile_first: bool = False, fp8_names: str = "", profile_host_first: bool = False
        ) -> List[dict]:
    from megatron_deepep.buffer import Buffer

    rank, ep = dist.get_rank(), dist.get_world_size()
    bw = copy_bandwidth()
    write_bw = fill_bandwidth()
    fp8_specs = _fp8_formats(fp8_names)
    rows = []
    for num_tokens, hidden, num_experts, num_topk in shapes:
        xs = [torch.randn(num_tokens, hidden, device="cuda").to(torch.bfloat16) for _ in range(3)]
        routing = [make_routing(num_tokens, num_experts, num_topk, 17 + i + 100 * rank)
                   for i in range(3)]
        idxs, ws = [r[0] for r in routing], [r[1] for r in routing]
        entry = {"shape": [num_tokens, hidden, num_experts, num_topk], "ep": ep,
                 "copy_GBps": bw / 1e9, "fill_GBps": write_bw / 1e9, "variants": {}}
        for num_sms in num_sms_list:
            buf = Buffer(dist.group.WORLD, num_tokens, hidden, num_topk, transport="nvlink",
                         num_sms=num_sms)
            entry["transport"] = buf.transport_name  # the one that ran: local at EP = 1
            for mode, res in bench_ours(buf, xs, idxs, ws, num_experts).items():
                entry["variants"][f"ours {num_sms} SMs {mode}"] = res
            for spec in fp8_specs:
                for mode, res in bench_ours(buf, xs, idxs, ws, num_experts, spec).items():
                    res["fp8"] = spec.fmt.name
                    entry["variants"][f"ours {num_sms} SMs fp8 {spec.fmt.name} {mode}"] = res
            buf.destroy()
        if not rows:  # the first shape's inputs, for the profiles run after every measurement
            first = (num_tokens, hidden, num_topk, xs[0], idxs[0], ws[0], num_experts)
        num_rows = next(iter(entry["variants"].values()))["num_recv_rows"]
        entry["num_recv_rows"] = num_rows
        entry["dispatch_bytes"] = (num_tokens + num_rows) * hidden * 2
        entry["floor_us"] = entry["dispatch_bytes"] / bw * 1e6
        # What the write rate alone allows: writing the M expanded rows at the fill bandwidth;
        # and, at EP=1, the expand's own traffic (read once, write K times) on a bare kernel.
        entry["dispatch_write_floor_us"] = num_rows * hidden * 2 / write_bw * 1e6
        if ep == 1:
            entry["fan_out_copy_us"], expanded, dst_rows = fan_out_us(xs[0], idxs[0])
            if num_topk == 8:  # fan_in_sum is built for K = 8
                entry["fan_in_sum_us"] = fan_in_us(expanded, dst_rows.view(num_tokens, 8))
            del expanded
            scale_bytes = fp8_specs[0].fmt.scale_bytes_per_token(hidden) if fp8_specs else 0
            try:
                entry["sm_fan_out"] = {
                    str(num_sms): sm_fan_out_us(xs[0], dst_rows, num_topk, num_sms, scale_bytes)
                    for num_sms in num_sms_list}
            except RuntimeError as err:  # the rows measured so far still print
                logger.error("bench: the per-SM fan-out ceiling is not valid: %s", err)
        for spec in fp8_specs:  # read bf16 x once, write e4m3 rows and their scales
            fp8_bytes = num_tokens * hidden * 2 + num_rows * spec.fmt.bytes_per_token(hidden)
            entry[f"fp8_{spec.fmt.name}"] = {
                "dispatch_bytes": fp8_bytes, "floor_us": fp8_bytes / bw * 1e6,
                "wire_byte_ratio": spec.fmt.byte_ratio(hidden)}
        if ep > 1:  # NVLink bytes and GB/s, NCCL's all-to-all, the peer-copy ceiling
            entry["peers"] = bench_peers.measure(entry, idxs, fp8_specs, num_sms_list, time_cuda)
        if with_megatron:
            entry["variants"].update(megatron_rows(xs, idxs, ws, num_experts))
        rows.append(entry)
        torch.cuda.empty_cache()
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench.json"), "w") as f:
            json.dump(rows, f, indent=1)
        print_table(rows)
        plot(rows, os.path.join(out_dir, "bench.png"))
    if profile_first or profile_host_first:
        _profile_last(first, max(num_sms_list), profile_first, profile_host_first,
                      fp8_specs[0] if fp8_specs else None)
    return rows


def _profile_last(first, num_sms: int, kernels: bool, host: bool, fp8=None) -> None:
    """The profiles of the first shape, after all measurements: the torch profiler leaves its
    tracing hooks in the process, which slowed every later call (host and kernels) when it ran
    first. The host profile covers each dispatch mode in bf16, then with `fp8` (the first
    `--fp8` format) when one is given."""
    from megatron_deepep.buffer import Buffer

    num_tokens, hidden, num_topk, x, idx, w, num_experts = first
    buf = Buffer(dist.group.WORLD, num_tokens, hidden, num_topk, transport="nvlink",
                 num_sms=num_sms)
    if dist.get_rank() == 0 and kernels:
        table = profile_kernels(buf, x, idx, w, num_experts, fp8=fp8)
        sys.stdout.write(f"profile, {num_sms} SMs:\n{table}\n")
    if dist.get_rank() == 0 and host:
        for spec in (None,) if fp8 is None else (None, fp8):
            sys.stdout.write(f"host profile, {num_sms} SMs:\n"
                             f"{profile_host(buf, x, idx, w, num_experts, fp8=spec)}\n")
    buf.destroy()


def _cell(num_bytes: float, floor_us: float, us, refused: bool = False) -> str:
    if us is None:
        return "- | - | -"
    if refused:
        return f"{us:.1f} | - | -"
    return f"{us:.1f} | {num_bytes / us / 1e3:.0f} | {floor_us / us:.2f}"


def _ratio(sm_fan_out: dict) -> float:
    return sm_fan_out["fp8_bytes_us"] / sm_fan_out["bf16_us"]


def _per_block_size(sm_fan_out: dict, key: str) -> str:
    return " / ".join(f"{sm_fan_out[f'{key}_{t}']:.1f}" if f"{key}_{t}" in sm_fan_out else "-"
                      for t in (512, 1024)) + " µs"


def _sm_fan_out_ratio(entry: dict, key: str) -> str:
    """"; bare fan-out xR" for an "ours S SMs fp8 ..." row when the entry holds S's ceiling."""
    sm = entry.get("sm_fan_out", {}).get(key.split(" ")[1])
    return f"; bare fan-out x{_ratio(sm):.2f}" if sm else ""


def row_refusal(entry: dict) -> Optional[str]:
    """Why a bench row gets no GB/s (`transport.bandwidth_refusal` of the transport it records
    having run), or None; rows of files written before the bench recorded it are shown."""
    return bandwidth_refusal(entry["transport"]) if "transport" in entry else None


def print_table(rows: List[dict]) -> None:
    lines = ["shape (N,H,E,K) | EP | variant | dispatch µs | GB/s | floor ratio | combine µs | "
             "GB/s | floor ratio | host µs/call (dispatch, combine)"]
    for e in rows:
        shape = tuple(e["shape"])
        bf16_sync = {}
        refusal = row_refusal(e)
        if refusal:
            lines.append(f"{shape} | {e['ep']} | GB/s and floor ratios: none, {refusal}")
        for key, res in e["variants"].items():
            if "error" in res or "skipped" in res:
                why = res.get("error") or f"skipped: {res['skipped']}"
                lines.append(f"{shape} | {e['ep']} | {key} | {why}")
                continue
            fp8 = e.get(f"fp8_{res['fp8']}") if "fp8" in res else None
            num_bytes = fp8["dispatch_bytes"] if fp8 else e["dispatch_bytes"]
            floor = fp8["floor_us"] if fp8 else e["floor_us"]
            host = "/".join(f"{res[k]:.0f}" for k in ("dispatch_host_us", "combine_host_us")
                            if k in res)
            mode = key.rsplit(" ", 1)[-1]
            extra = ""
            if fp8 is None and key.startswith("ours"):
                bf16_sync[key.split(" SMs")[0] + mode] = res["dispatch_us"]
            elif fp8 is not None:
                base = bf16_sync.get(key.split(" SMs")[0] + mode)
                if base:
                    extra = (f" [wire bytes x{fp8['wire_byte_ratio']:.3f}, time "
                             f"x{res['dispatch_us'] / base:.2f} of bf16"
                             f"{_sm_fan_out_ratio(e, key)}]")
            lines.append(
                f"{shape} | {e['ep']} | {key}{extra} | "
                f"{_cell(num_bytes, floor, res['dispatch_us'], bool(refusal))} | "
                f"{_cell(e['dispatch_bytes'], e['floor_us'], res.get('combine_us'), bool(refusal))}"
                f" | {host}")
        lines.append(f"{shape} | floor {e['floor_us']:.1f} µs ({e['dispatch_bytes'] / 1e6:.0f} MB"
                     f" at copy {e['copy_GBps']:.0f} GB/s; M = {e['num_recv_rows']} rows); "
                     f"writing the M rows alone at fill {e['fill_GBps']:.0f} GB/s: "
                     f"{e['dispatch_write_floor_us']:.1f} µs"
                     + (f"; read once, write K times on a bare kernel (fan_out_copy): "
                        f"{e['fan_out_copy_us']:.1f} µs" if "fan_out_copy_us" in e else "")
                     + (f"; combine's traffic (read K, write 1; fan_in_sum): "
                        f"{e['fan_in_sum_us']:.1f} µs" if "fan_in_sum_us" in e else ""))
        for num_sms, sm in e.get("sm_fan_out", {}).items():
            lines.append(f"{shape} | bare fan-out at {num_sms} SMs (one block per SM, 512 / 1024 "
                         f"threads): bf16 rows {_per_block_size(sm, 'bf16_us')}, FP8-sized rows "
                         f"{_per_block_size(sm, 'fp8_bytes_us')} (best x{_ratio(sm):.2f})")
    lines += bench_peers.format_table(rows)  # EP > 1 only: nothing at EP = 1
    sys.stdout.write("\n".join(lines) + "\n")


def plot(rows: List[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install matplotlib): %s not written; "
                       "bench.json holds every figure", path)
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, op in zip(axes, ("dispatch_us", "combine_us")):
        labels = [str(tuple(e["shape"])) for e in rows]
        keys = [k for k, v in rows[0]["variants"].items() if op in v]
        width = 0.8 / (len(keys) + 1)
        for j, key in enumerate(keys):
            ax.bar([i + j * width for i in range(len(rows))],
                   [e["variants"].get(key, {}).get(op, 0) for e in rows], width, label=key)
        ax.bar([i + len(keys) * width for i in range(len(rows))], [e["floor_us"] for e in rows],
               width, label="HBM floor (bf16)", color="black")
        ax.set_xticks([i + 0.4 for i in range(len(rows))], labels, fontsize=7)
        ax.set_ylabel("µs (median)")
        ax.set_title(op.replace("_us", ""))
        ax.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_nodes(text: str) -> tuple:
    """`--nodes MxL` as (nodes, ranks per node).

    Raises:
        ValueError: not M x L within the internode transport's limits (2-32 nodes of 1-8
            ranks, `transport.topology`).
    """
    try:
        num_nodes, per_node = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--nodes {text!r}: expected MxL, e.g. 2x2") from None
    if not (MIN_INTERNODE_NODES <= num_nodes <= MAX_INTERNODE_NODES
            and 1 <= per_node <= MAX_RANKS_PER_NODE):
        raise ValueError(f"--nodes {text!r}: the internode transport takes "
                         f"{MIN_INTERNODE_NODES}-{MAX_INTERNODE_NODES} nodes of "
                         f"1-{MAX_RANKS_PER_NODE} ranks")
    return num_nodes, per_node


def run_virtual_nodes(nodes: tuple, shape: tuple, num_sms: int, fp8: str, out: str) -> int:
    """`--nodes`: the internode transport's check and sweep on virtual nodes at `shape` (N, H,
    E, K; E rounded up to a multiple of the rank count), then the model of DeepSeek-V3's shape.
    Returns the check's exit status (0: passed)."""
    from megatron_deepep.tools import internode_model, multinode_check

    num_nodes, per_node = nodes
    world = num_nodes * per_node
    tokens, hidden, experts, topk = shape
    if experts % world:
        experts = world * -(-experts // world)
    os.makedirs(out, exist_ok=True)
    argv = ["--spawn", str(world), "--num-ranks-per-node", str(per_node), "--transport",
            "internode", "--num-experts", str(experts), "--topk", str(topk), "--check-hidden",
            str(hidden), "--sweep-tokens", str(tokens), "--sweep-hidden", str(hidden),
            "--num-sms", str(num_sms), "--json", os.path.join(out, "nodes.json")]
    formats = [f for f in fp8.split(",") if f.strip()]
    if formats:
        argv += ["--fp8", formats[0]]
    sys.stdout.write(f"internode transport on {num_nodes} x {per_node} virtual nodes "
                     f"(processes sharing this machine's GPUs: correctness, not speed)\n")
    status = multinode_check.main(argv)
    sys.stdout.write("\nModel of DeepSeek-V3's shape on real nodes (from the layout; no kernel "
                     "runs):\n")
    internode_model.main(["--tokens", "4096", "--hidden", "7168", "--experts", "256", "--topk",
                          "8", "--nodes", "2", "8", "--ranks-per-node", "8", "--node-limited",
                          "4"])
    return status


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megatron_deepep.bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=None,
                        help="semicolon-separated N,H,E,K tuples: tokens per rank, hidden, "
                             "experts, top-k (default: " + ";".join(
                                 ",".join(str(v) for v in shape) for shape in DEFAULT_SHAPES)
                        + ")")
    parser.add_argument("--num-sms", default="24,132",
                        help="SM budgets to run, comma-separated (each capped at the GPU's SM "
                             "count)")
    parser.add_argument("--out", default=".bench_out", help="folder for bench.json/bench.png")
    parser.add_argument("--no-megatron", action="store_true", help="skip Megatron's dispatcher")
    parser.add_argument("--profile", action="store_true",
                        help="for the first shape at the largest SM budget: per-kernel GPU "
                             "times (torch.profiler) of no-sync bf16 dispatch + combine, and of "
                             "the no-sync and cached dispatch in the first --fp8 format")
    parser.add_argument("--profile-host", action="store_true",
                        help="for the first shape: host µs/call and a cProfile of the sync, "
                             "no-sync and cached dispatch, bf16 and the first --fp8 format")
    parser.add_argument("--fp8", default="blockwise_1x128,mxfp8_1x32",
                        help="FP8 formats to bench against bf16, comma-separated, as fp8= "
                             "takes them (blockwise, mxfp8 or a format name; '' for none)")
    parser.add_argument("--nodes", default=None, metavar="MxL",
                        help="the internode transport on M x L virtual nodes instead: its check "
                             "and sweep at the first shape (first SM budget, first FP8 format), "
                             "then the model of DeepSeek-V3's shape on real nodes")
    args = parser.parse_args(argv)
    try:
        nodes = parse_nodes(args.nodes) if args.nodes else None
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO)
    if not torch.cuda.is_available():
        sys.stderr.write("megatron_deepep.bench needs a CUDA GPU; on a CPU machine run the tests "
                         "instead (from the repository root): pip install torch==2.13.0 -e "
                         "\".[jit,test,megatron]\" && python -m pytest -q -rs tests\n")
        raise SystemExit(2)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    shapes = DEFAULT_SHAPES if args.shapes is None else [
        tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    if nodes is not None:  # the spawned ranks set up their own process group
        raise SystemExit(run_virtual_nodes(nodes, shapes[0], int(args.num_sms.split(",")[0]),
                                           args.fp8, args.out))
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    sms = [min(int(s), torch.cuda.get_device_properties(0).multi_processor_count)
           for s in args.num_sms.split(",")]
    run(shapes, sms, args.out, not args.no_megatron, args.profile, args.fp8,
        args.profile_host)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
