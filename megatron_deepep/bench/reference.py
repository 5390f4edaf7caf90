"""Where the reference transport's time goes: every collective and host read, per call site.

The pure-torch `reference` transport runs wherever no kernel transport can (CPU, gloo). This
command runs the EP part of one MoE layer the way Megatron's `deepep` dispatcher does (autograd
dispatch, an expert stand-in, autograd combine, backward) on R gloo processes of this machine,
and records, on rank 0, each collective the transport calls (its call site, how long it took,
waiting for the peers included) and each host read of a tensor value (`tolist`, `item`, `int`,
`bool`, ...: a device synchronization on a GPU):

    python -m megatron_deepep.bench.reference                  # the CPU demo's MoE layer shape
    python -m megatron_deepep.bench.reference --ranks 4 --tokens 1024 --hidden 512 --experts 8

Defaults are the CPU demonstration's MoE layer (`examples/compare_dispatchers.py --cpu`): 256
tokens per rank, hidden 128 bf16, 4 experts, top-2, 2 ranks. Megatron's `alltoall` dispatcher
runs 7 collectives per layer and step for the same work (an all-gather of the per-expert counts
and two all-to-alls, tokens and probs, in the forward dispatch; one in the combine; three in the
backward), for comparison with the table's total.
"""

from __future__ import annotations

import argparse
import contextlib
import linecache
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: The collectives recorded (those torch.distributed has; the rest are left alone).
COLLECTIVES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor",
               "all_reduce", "broadcast", "gather", "scatter", "barrier", "all_gather_object")
#: Tensor methods that read a value on the host (a device synchronization on a GPU).
HOST_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # megatron_deepep/


#: Pass-through helpers: a collective called in one is named by its caller's line.
_HELPERS = ("all_to_all", "_all_to_all", "wait")


def _call_site(skip: int = 2) -> str:
    """`function:what` of the innermost package frame that called into torch (`what`: the
    assigned name, else the `dist.` call, else the first call on the line; a helper of
    `_HELPERS` names its caller instead)."""
    frame = sys._getframe(skip)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if (path.startswith(_PACKAGE_DIR) and path != os.path.abspath(__file__)
                and frame.f_code.co_name not in _HELPERS):
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            called = re.search(r"dist\.(\w+)\(", line)
            if " = " in line:
                what = line.split(" = ")[0].strip().split(", ")[-1]
            elif called:
                what = "dist." + called.group(1)
            else:
                what = line.split("(")[0]
            return f"{frame.f_code.co_name}:{what}"
        frame = frame.f_back
    return "?"


class _TimedWork:
    """An async collective's work handle whose `wait` records the collective, launch to
    completion (the transport launches with `async_op=True` and waits with a timeout)."""

    def __init__(self, work, record):
        self._work, self._record = work, record

    def wait(self, *args, **kwargs):
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._record()

    def __getattr__(self, name):
        return getattr(self._work, name)


class Recorder:
    """Records collectives and host reads made inside the transport's calls.

    Use as a context manager around the measured iterations; `phase(name)` marks a transport
    call (only what happens inside one, while entered, is recorded). Events are `(phase, kind,
    site, seconds, bytes)`; phases are `(phase, seconds)`.
    """

    def __init__(self):
        self.events: List[Tuple[str, str, str, float, int]] = []
        self.phases: List[Tuple[str, float]] = []
        self._phase: Optional[str] = None
        self._saved: Dict[Tuple[object, str], object] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        outer, self._phase = self._phase, name if self._phase is None else self._phase
        start = time.perf_counter()
        try:
            yield
        finally:
            if outer is None and self._saved:  # only while entered
                self.phases.append((name, time.perf_counter() - start))
            self._phase = outer

    def _wrap(self, owner, attr: str, kind: str) -> None:
        original = getattr(owner, attr)
        self._saved[(owner, attr)] = original
        recorder = self

        def wrapper(*args, **kwargs):
            if recorder._phase is None:
                return original(*args, **kwargs)
            phase, site, start = recorder._phase, _call_site(), time.perf_counter()
            result = original(*args, **kwargs)
            tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
            num_bytes = 0
            if kind == "collective":
                sent = (args[1] if attr in ("all_to_all_single", "all_gather") and len(args) > 1
                        else tensor)
                if isinstance(sent, torch.Tensor):
                    num_bytes = sent.numel() * sent.element_size()

            def record():
                recorder.events.append((phase, f"{kind} {attr}", site,
                                        time.perf_counter() - start, num_bytes))

            if kind == "collective" and kwargs.get("async_op"):
                return _TimedWork(result, record)
            record()
            return result

        setattr(owner, attr, wrapper)

    def __enter__(self):
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._wrap(dist, name, "collective")
        for name in HOST_READS:
            self._wrap(torch.Tensor, name, "host read")
        return self

    def __exit__(self, *exc):
        for (owner, attr), original in self._saved.items():
            setattr(owner, attr, original)
        self._saved.clear()
        return False


def _instrument(transport, recorder: Recorder) -> None:
    """Marks each call of `transport` as a phase (on the instance: the class is untouched)."""
    for method in ("get_dispatch_layout", "dispatch", "cached_dispatch", "combine"):
        bound = getattr(transport, method)

        def marked(*args, _bound=bound, _method=method, **kwargs):
            name = _method
            if _method == "combine" and (kwargs.get("grad_row_weights") is not None
                                         or (len(args) > 3 and args[3] is not None)):
                name = "combine (dispatch backward)"
            if _method == "cached_dispatch":
                name = "cached_dispatch (combine backward)"
            with recorder.phase(name):
                return _bound(*args, **kwargs)

        setattr(transport, method, marked)
    collectives = getattr(transport, "collectives", None)
    if getattr(collectives, "num_ranks", 1) > 1:  # `enter` writes where this rank is
        enter = collectives.enter

        def recorded_enter(what, _enter=enter):
            if recorder._phase is None or not recorder._saved:
                return _enter(what)
            start = time.perf_counter()
            try:
                return _enter(what)
            finally:
                recorder.events.append((recorder._phase, "store write", f"enter:{what}",
                                        time.perf_counter() - start, 0))

        collectives.enter = recorded_enter


def _routing(num_tokens: int, num_experts: int, topk: int, seed: int):
    """A seeded softmax router's top-k (ids ascending, as the dispatcher hands them over)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, idx = torch.topk(torch.softmax(logits, dim=1), topk, dim=1)
    idx, order = idx.sort(dim=1)
    return idx, weights.gather(1, order)


def _layer_step(buffer, x, topk_idx, topk_weights, num_experts: int) -> None:
    """One MoE layer's EP work, forward and backward, as the dispatcher runs it."""
    from megatron_deepep import autograd

    x = x.detach().requires_grad_()
    w = topk_weights.detach().requires_grad_()
    recv_x, recv_w, handle = autograd.dispatch(buffer, x, topk_idx, w, num_experts=num_experts)
    y = recv_x * recv_w.unsqueeze(1).to(recv_x.dtype)  # the experts' stand-in
    out = autograd.combine(buffer, y, handle)
    out.float().sum().backward()


def profile_layer_steps(group, *, tokens: int, hidden: int, experts: int, topk: int,
                        iters: int, warmup: int) -> Tuple[Recorder, List[float]]:
    """Runs `warmup` then `iters` recorded layer steps on the reference transport of `group`
    (collective: every rank calls it); returns the recorder and each step's wall seconds."""
    from megatron_deepep.buffer import Buffer

    rank = dist.get_rank(group)
    n_max = max(4096, 1 << max(0, tokens - 1).bit_length())  # as the dispatcher picks it
    buffer = Buffer(group, n_max, hidden, topk, transport="reference")
    recorder = Recorder()
    _instrument(buffer._transport, recorder)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(rank))
    x = x.to(torch.bfloat16)
    wall = []
    for it in range(warmup + iters):
        topk_idx, weights = _routing(tokens, experts, topk, 7 * it + rank)
        dist.barrier(group)  # every rank starts the step together
        if it < warmup:
            _layer_step(buffer, x, topk_idx, weights, experts)
            continue
        with recorder:
            start = time.perf_counter()
            _layer_step(buffer, x, topk_idx, weights, experts)
            wall.append(time.perf_counter() - start)
    return recorder, wall


def _rank_main(rank: int, world: int, args, init_file: str, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        recorder, wall = profile_layer_steps(
            None, tokens=args.tokens, hidden=args.hidden, experts=args.experts, topk=args.topk,
            iters=args.iters, warmup=args.warmup)
        results[rank] = dict(events=recorder.events, phases=recorder.phases, wall=wall)
    finally:
        dist.destroy_process_group()


def summarize(events, phases, iters: int) -> Dict[str, object]:
    """Per (phase, kind, site): calls and µs per iteration, mean µs and bytes per call; per
    phase: calls, collectives, host reads and store writes, µs and the part outside them, per
    iteration."""
    sites = defaultdict(lambda: [0, 0.0, 0])
    for phase, kind, site, seconds, num_bytes in events:
        row = sites[(phase, kind, site)]
        row[0] += 1
        row[1] += seconds
        row[2] += num_bytes
    per_phase = defaultdict(lambda: [0, 0.0, 0.0, 0, 0, 0])
    column = {"collective": 3, "host read": 4, "store write": 5}
    for name, seconds in phases:
        per_phase[name][0] += 1
        per_phase[name][1] += seconds
    for phase, kind, _, seconds, _ in events:
        per_phase[phase][2] += seconds
        per_phase[phase][next(i for k, i in column.items() if kind.startswith(k))] += 1
    return {
        "sites": [dict(phase=p, kind=k, site=s, calls=n / iters, us=1e6 * t / iters,
                       us_per_call=1e6 * t / n, bytes_per_call=b / n)
                  for (p, k, s), (n, t, b) in sites.items()],
        "phases": [dict(phase=p, calls=n / iters, us=1e6 * t / iters,
                        other_us=1e6 * (t - c) / iters, collectives=nc / iters,
                        host_reads=nh / iters, store_writes=ns / iters)
                   for p, (n, t, c, nc, nh, ns) in per_phase.items()],
    }


def format_table(summary, wall_us: float) -> str:
    """The summary as two markdown tables (sites, then phases) and a totals line."""
    lines = ["| phase | what | call site | per iter | µs per call | µs per iter | bytes |",
             "|---|---|---|---:|---:|---:|---:|"]
    for row in summary["sites"]:
        lines.append(f"| {row['phase']} | {row['kind']} | `{row['site']}` | {row['calls']:.0f} "
                     f"| {row['us_per_call']:.0f} | {row['us']:.0f} "
                     f"| {row['bytes_per_call']:.0f} |")
    lines += ["", "| phase | calls | collectives | host reads | store writes | µs | of which "
              "in none of them |", "|---|---:|---:|---:|---:|---:|---:|"]
    total = [0.0, 0.0, 0.0, 0.0]
    for row in summary["phases"]:
        lines.append(f"| {row['phase']} | {row['calls']:.0f} | {row['collectives']:.0f} "
                     f"| {row['host_reads']:.0f} | {row['store_writes']:.0f} | {row['us']:.0f} "
                     f"| {row['other_us']:.0f} |")
        total[0] += row["collectives"]
        total[1] += row["host_reads"]
        total[2] += row["store_writes"]
        total[3] += row["us"]
    lines.append(f"\nper layer step (forward + backward): {total[0]:.0f} collectives, "
                 f"{total[1]:.0f} host reads, {total[2]:.0f} store writes, {total[3]:.0f} µs in "
                 f"the transport (mean), "
                 f"{wall_us:.0f} µs wall (median; Megatron's alltoall: 7 collectives)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="gloo processes (EP size)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (bf16 rows)")
    parser.add_argument("--experts", type=int, default=4, help="experts (a multiple of ranks)")
    parser.add_argument("--topk", type=int, default=2, help="experts per token")
    parser.add_argument("--iters", type=int, default=200, help="measured layer steps")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured layer steps first")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.Manager().dict()
        mp.spawn(_rank_main, args=(args.ranks, args, os.path.join(tmp, "init"), results),
                 nprocs=args.ranks)
        rank0 = dict(results[0])
    summary = summarize(rank0["events"], rank0["phases"], args.iters)
    sys.stdout.write(f"reference transport, {args.ranks} gloo ranks, {args.tokens} tokens x "
                     f"hidden {args.hidden} bf16, {args.experts} experts, top-{args.topk}, "
                     f"{args.iters} layer steps (rank 0):\n\n")
    sys.stdout.write(format_table(summary, 1e6 * statistics.median(rank0["wall"])) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
