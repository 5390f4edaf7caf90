"""The EP = 1 dispatch calls that Nsight Compute profiles (`dev/gpu/fp8.sh`, piece `ncu`).

One process, one `Buffer`, DeepSeek-V3's shape (4096 tokens, hidden 7168, 256 experts, top-8)
unless told otherwise: per format (bf16, then each FP8 format of `--fp8`) two fresh no-sync
dispatches (the layout kernel, then dispatch_local) and two cached ones (dispatch_local alone),
at `--num-sms` blocks. Under `ncu` each kernel is replayed alone; outside it the script prints
each call's µs (CUDA events, one call each: a sanity check, not a benchmark).

`--check`: instead, per FP8 format and hidden size of `--check-hidden`, the fresh and the cached
FP8 dispatch against the bf16 dispatch of the same call quantized by the reference quantizer
(`Fp8Format.quantize`; quantization is per row, so the two must agree bit for bit); exits 1 on
a mismatch.

`--host`: instead, per format (bf16, then each of `--fp8`) and mode (sync: exact size with the
host wait; nosync: a row bound; cached: the handle replayed), the host µs per call (the calls
issued back to back, the GPU left to lag) and the µs per call by CUDA events around the same
calls; then, on a GPU, the bench's cProfile of `--host-calls` calls per mode of the first FP8
format: where a call's host time goes.

`--timeline`: instead, per format (bf16, then each of `--fp8`) and mode (sync, nosync),
`--timeline-calls` back-to-back calls, each call and the sync call's host wait stamped by the
host clock: the medians of the host's time before the wait, in it and after it, and between
calls, beside the GPU's µs per call (CUDA events). Where the host's time outside the wait
exceeds the GPU's, the calls are host-bound.

`--queued`: instead, per format and mode (nosync, cached) and for the layout kernel alone
(`get_dispatch_layout`), the GPU's µs per call with the host far ahead: the stream is held by a
sleep kernel while `--queued-calls` calls are queued behind it, and CUDA events time the calls
from the second to the last. No host time and no launch gap a busy queue hides: what the
kernels of one call cost back to back. `--num-sms` may then list several budgets ("24,48,132"):
one Buffer each, in turn, in one process (the crossover sweep, `dev/gpu/fp8_crossover.py`).
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from megatron_deepep.buffer import Buffer
from megatron_deepep.fp8.dispatch import Fp8Dispatch

# The CPU runs the script on the reference transport (a check of the script, not the kernels).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="4096,7168,256,8", help="N,H,E,K")
    parser.add_argument("--num-sms", default="132",
                        help="SM budget; with --queued a comma-separated list of budgets")
    parser.add_argument("--fp8", default="blockwise_1x128,mxfp8_1x32")
    parser.add_argument("--check", action="store_true", help="bit-exactness check instead")
    parser.add_argument("--host", action="store_true", help="host time per call instead")
    parser.add_argument("--host-calls", type=int, default=200)
    parser.add_argument("--timeline", action="store_true", help="one call's timeline instead")
    parser.add_argument("--timeline-calls", type=int, default=40)
    parser.add_argument("--queued", action="store_true",
                        help="GPU µs per call with the host ahead instead")
    parser.add_argument("--queued-calls", type=int, default=30)
    parser.add_argument("--check-hidden", default="7168,2880,4096",
                        help="hidden sizes of --check, comma-separated")
    args = parser.parse_args()
    num_tokens, hidden, num_experts, num_topk = (int(v) for v in args.shape.split(","))
    budgets = [int(v) for v in args.num_sms.split(",")]
    if len(budgets) > 1 and not args.queued:
        parser.error("--num-sms takes one budget except with --queued")
    args.num_sms = budgets[0]
    join_as_one_rank("29541")
    if args.queued and len(budgets) > 1:
        x, idx, weights, specs = make_inputs(num_tokens, hidden, num_experts, num_topk, args.fp8)
        for num_sms in budgets:
            buf = Buffer(dist.group.WORLD, num_tokens, hidden, num_topk, num_sms=num_sms)
            queued(buf, x, idx, weights, num_experts, specs, args.queued_calls,
                   label_prefix=f"{num_sms} SMs ")
            buf.destroy()
        dist.destroy_process_group()
        return
    if args.check:
        failed = check(num_tokens, num_experts, num_topk, args)
        dist.destroy_process_group()
        raise SystemExit(1 if failed else 0)
    buf = Buffer(dist.group.WORLD, num_tokens, hidden, num_topk, num_sms=args.num_sms)
    x, idx, weights, specs = make_inputs(num_tokens, hidden, num_experts, num_topk, args.fp8)
    if args.timeline:
        timeline(buf, x, idx, weights, num_experts, specs, args.timeline_calls)
    elif args.queued:
        queued(buf, x, idx, weights, num_experts, specs, args.queued_calls,
               label_prefix=f"{args.num_sms} SMs ")
    elif args.host:
        host_times(buf, x, idx, weights, num_experts, specs, args.host_calls)
    else:
        profiled_calls(buf, x, idx, weights, num_experts, specs)
    buf.destroy()
    dist.destroy_process_group()


def profiled_calls(buf, x, idx, weights, num_experts: int, specs) -> None:
    """The calls Nsight Compute profiles: per format two fresh no-sync dispatches and two cached
    ones, each timed by CUDA events (a sanity check, not a benchmark)."""
    bound = x.shape[0] * idx.shape[1]
    for name, fp8 in specs:
        for mode in ("fresh", "fresh", "cached", "cached"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            if mode == "fresh":
                _, _, handle, _ = buf.dispatch(x, idx, weights, num_experts=num_experts,
                                               num_max_recv_rows=bound, fp8=fp8)
            else:
                buf.dispatch(x, handle=handle, fp8=fp8)
            end.record()
            torch.cuda.synchronize()
            print(f"fp8_profile: {name} {mode}: {start.elapsed_time(end) * 1e3:.1f} µs",
                  flush=True)


def join_as_one_rank(default_port: str) -> None:
    """This process as rank 0 of a gloo group of one (MASTER_PORT, else `default_port`), on
    GPU 0 where there is one."""
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", default_port))
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo")


def make_inputs(num_tokens: int, hidden: int, num_experts: int, num_topk: int, fp8_names: str):
    """Seeded inputs: `x [N, H]` bf16, `idx [N, K]` int64 top-k of random scores, `weights
    [N, K]` float32 (rows sum to 1), and the formats `[(name, Fp8Dispatch or None)]`, bf16
    first, then each of the comma-separated `fp8_names`."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(num_tokens, hidden, device=DEVICE, generator=g).bfloat16()
    scores = torch.rand(num_tokens, num_experts, device=DEVICE, generator=g)
    probs, idx = scores.topk(num_topk, dim=1)
    weights = (probs / probs.sum(1, keepdim=True)).float()
    specs = [("bf16", None)] + [(n, Fp8Dispatch.named(n, "fp8"))
                                for n in fp8_names.split(",") if n]
    return x, idx, weights, specs


def _synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def host_times(buf, x, idx, weights, num_experts: int, specs, calls: int) -> None:
    """Prints host and CUDA-event µs per call of each format and mode (the bench's
    `host_profile_calls`), then, on a GPU, the bench's cProfile of each mode for the first FP8
    format (of bf16 when none is given)."""
    import time

    from megatron_deepep.bench.run import host_profile_calls, profile_host

    on_gpu = DEVICE == "cuda"
    for name, fp8 in specs:
        for mode, call in host_profile_calls(buf, x, idx, weights, num_experts, fp8).items():
            for _ in range(5):
                call()
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if on_gpu else []
            _synchronize()
            t0 = time.perf_counter()
            for event in events[:1]:
                event.record()
            for _ in range(calls):
                call()
            for event in events[1:]:
                event.record()
            host_us = (time.perf_counter() - t0) / calls * 1e6
            _synchronize()
            gpu = (f"{events[0].elapsed_time(events[1]) * 1e3 / calls:.1f} µs/call" if on_gpu
                   else "n/a (CPU)")
            print(f"fp8_profile host: {name} {mode}: host {host_us:.1f} µs/call, events {gpu}",
                  flush=True)
    if on_gpu:
        _, fp8 = specs[1] if len(specs) > 1 else specs[0]
        print(profile_host(buf, x, idx, weights, num_experts, calls, fp8=fp8, lines=25))


def queued(buf, x, idx, weights, num_experts: int, specs, calls: int,
           label_prefix: str = "") -> None:
    """Prints the GPU's µs per call of the layout kernel alone and, per format, of the nosync
    and cached dispatch, `calls` calls queued behind a sleep kernel (the host far ahead); each
    label starts with `label_prefix` (the script's: "132 SMs ")."""
    from megatron_deepep.bench.run import host_profile_calls

    runs = [(label_prefix + "layout", lambda: buf.get_dispatch_layout(idx, num_experts))]
    for name, fp8 in specs:
        fns = host_profile_calls(buf, x, idx, weights, num_experts, fp8)
        runs += [(f"{label_prefix}{name} {mode}", fns[mode]) for mode in ("nosync", "cached")]
    for label, fn in runs:
        for _ in range(3):
            fn()
        if DEVICE != "cuda":
            print(f"fp8_profile queued: {label}: n/a (CPU)", flush=True)
            continue
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        _synchronize()
        # ~25 ms at 2 GHz, far longer than queueing the calls; each call's outputs are freed
        # at once, so the caching allocator hands the next call the same blocks (no cudaMalloc).
        torch.cuda._sleep(50_000_000)
        for i in range(calls):
            fn()
            if i == 0:
                events[0].record()
        events[1].record()
        _synchronize()
        per_call = events[0].elapsed_time(events[1]) * 1e3 / (calls - 1)
        print(f"fp8_profile queued: {label}: GPU {per_call:.1f} µs/call", flush=True)


def timeline(buf, x, idx, weights, num_experts: int, specs, calls: int) -> None:
    """Prints, per format and mode, the medians (µs) of one call's host pieces over `calls`
    back-to-back calls (the first five left out), stamped by `time.perf_counter_ns` (no
    profiler: its per-op cost would change what it measures), and the GPU's µs per call (CUDA
    events around the calls)."""
    import time

    from megatron_deepep.bench.run import host_profile_calls

    status = getattr(buf._transport, "status", None)  # None: the reference transport (CPU)
    wait = status.wait_num_rows if status is not None else None
    stamps = []

    def stamped_wait(epoch):
        stamps.append(("wait", time.perf_counter_ns()))
        rows = wait(epoch)
        stamps.append(("waited", time.perf_counter_ns()))
        return rows

    if status is not None:
        status.wait_num_rows = stamped_wait
    on_gpu = DEVICE == "cuda"
    for name, fp8 in specs:
        fns = host_profile_calls(buf, x, idx, weights, num_experts, fp8)
        for mode in ("sync", "nosync"):
            for _ in range(5):
                fns[mode]()
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if on_gpu else []
            _synchronize()
            stamps.clear()
            for event in events[:1]:
                event.record()
            for _ in range(calls):
                stamps.append(("call", time.perf_counter_ns()))
                fns[mode]()
                stamps.append(("return", time.perf_counter_ns()))
            for event in events[1:]:
                event.record()
            _synchronize()
            gpu = events[0].elapsed_time(events[1]) * 1e3 / calls if on_gpu else float("nan")
            _print_timeline(f"{name} {mode}", list(stamps), gpu)
    if status is not None:
        status.wait_num_rows = wait


def _print_timeline(label: str, stamps, gpu_us: float) -> None:
    """The medians of `timeline`'s host pieces from its (kind, ns) stamps."""
    calls, current = [], None
    for kind, ns in stamps:
        if kind == "call":
            current = {"call": ns}
        elif current is not None:
            current[kind] = ns
            if kind == "return":
                calls.append(current)
    rows = {"host per call": [], "before wait": [], "in wait": [], "after wait": [],
            "between calls": []}
    for prev, call in zip(calls[4:], calls[5:]):
        rows["host per call"].append(call["return"] - prev["return"])
        rows["between calls"].append(call["call"] - prev["return"])
        if "wait" in call and "waited" in call:
            rows["before wait"].append(call["wait"] - call["call"])
            rows["in wait"].append(call["waited"] - call["wait"])
            rows["after wait"].append(call["return"] - call["waited"])
    print(f"fp8_profile timeline: {label}: GPU {gpu_us:.1f} µs/call; host (medians) "
          + ", ".join(f"{key} {statistics.median_high(v) / 1e3:.1f}"
                      for key, v in rows.items() if v) + " µs",
          flush=True)


def check(num_tokens: int, num_experts: int, num_topk: int, args) -> int:
    """The fresh and cached FP8 dispatch against quantize(bf16 dispatch); the failures' count."""
    failed = 0
    for hidden in (int(h) for h in args.check_hidden.split(",")):
        buf = Buffer(dist.group.WORLD, num_tokens, hidden, num_topk, num_sms=args.num_sms)
        g = torch.Generator(device=DEVICE).manual_seed(hidden)
        x = torch.randn(num_tokens, hidden, device=DEVICE, generator=g).bfloat16()
        x[0] = 0  # an all-zero row: its scales follow formats.py's rule
        x[1] *= 1e4
        scores = torch.rand(num_tokens, num_experts, device=DEVICE, generator=g)
        scores[: num_tokens // 4, :8] += 2  # skewed: a quarter of the tokens on experts 0-7
        idx = scores.topk(num_topk, dim=1).indices
        idx[2, 1:] = -1  # a token with one expert
        weights = torch.rand(num_tokens, num_topk, device=DEVICE, generator=g)
        ref_x, _, _, _ = buf.dispatch(x, idx, weights, num_experts=num_experts)
        for name in args.fp8.split(","):
            fp8 = Fp8Dispatch.named(name, "fp8")
            exp = [t.cpu() for t in fp8.fmt.quantize(ref_x.cpu())]
            (data, scales), _, handle, _ = buf.dispatch(x, idx, weights,
                                                        num_experts=num_experts, fp8=fp8)
            cached = buf.dispatch(x, handle=handle, fp8=fp8)[0]
            for mode, (d, s) in (("fresh", (data, scales)), ("cached", cached)):
                same = (torch.equal(d.cpu().view(torch.uint8), exp[0].view(torch.uint8))
                        and torch.equal(s.cpu().view(torch.uint8), exp[1].view(torch.uint8)))
                failed += not same
                print(f"fp8_profile: check {name} H={hidden} {mode}: "
                      f"{'bit-exact' if same else 'MISMATCH'} ({d.shape[0]} rows)", flush=True)
        buf.destroy()
    return failed


if __name__ == "__main__":
    main()
