#!/usr/bin/env python3
"""Phase probe: where the EP = 1 dispatch's time goes between the layout kernel and the expand.

Builds the kernels with `MDEEP_STAMPS=1` (cuda_src/common/stamps.cuh: thread 0 of each block
prints globaltimer stamps at its phase ends), runs no-sync and cached dispatches back to back, and
reports, in µs from the call's first stamp (median over calls, the first dropped), when the
first and the last block ended each phase:
  layout: marked its chunk, published its counts, saw every earlier chunk's, summed them,
  wrote positions, finished (the tail: the last block's receive layout);
  expand: started, passed `griddepcontrol.wait`, finished;
and the same for the layout kernel alone (`Buffer.get_dispatch_layout`, no expand beside it).
The stamps cost something (a printf per block at its end, which also seems to delay the
expand's wait): compare phases within a kernel, not totals, with the benchmark.

    python scripts/probe_phases.py [--shapes "4096,7168,256,8;8192,4096,64,6"]

Needs a GPU; a measurement script, not part of the library.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
from collections import defaultdict
from typing import Callable, Dict, List

LAYOUT_PHASES = ("marked", "published", "waited", "summed", "positions", "tail")
EXPAND_PHASES = ("start", "wait over", "done")


def _enable_stamps() -> None:
    defines = os.environ.get("MEGATRON_DEEPEP_JIT_DEFINES", "")
    os.environ["MEGATRON_DEEPEP_JIT_DEFINES"] = ",".join(d for d in (defines, "MDEEP_STAMPS=1")
                                                         if d)


def captured_stdout(fn: Callable[[], None]) -> str:
    """What the kernels launched by `fn` printf'd (the process's fd 1 during fn and a sync)."""
    import torch

    torch.cuda.synchronize()
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        saved = os.dup(1)
        os.dup2(tmp.fileno(), 1)
        try:
            fn()
            torch.cuda.synchronize()
            ctypes.CDLL(None).fflush(None)  # the driver prints through C stdio's buffer
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        return tmp.read().decode(errors="replace")


def parse_calls(text: str, num_calls: int) -> List[Dict[str, List[List[int]]]]:
    """The stamp lines of `num_calls` back-to-back calls, split per call: `[{kernel: [[ns 0..7]
    per block]}]`. A kernel's blocks of call i all start before those of call i + 1 (stream
    order), so each kernel's blocks sorted by start split into equal groups."""
    blocks = defaultdict(list)
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 11 and parts[0] == "mdeep-stamps":
            blocks[parts[1]].append([int(v) for v in parts[3:]])
    calls = [dict() for _ in range(num_calls)]
    for kernel, stamps in blocks.items():
        if len(stamps) % num_calls:
            raise RuntimeError(f"{len(stamps)} {kernel} stamp lines for {num_calls} calls "
                               f"(the printf buffer overflowed?)")
        per_call = len(stamps) // num_calls
        stamps.sort()
        for i in range(num_calls):
            calls[i][kernel] = stamps[i * per_call:(i + 1) * per_call]
    return calls


def phases_us(stamps: Dict[str, List[List[int]]]) -> Dict[str, tuple]:
    """One call's phase ends, (first, last) over blocks, in µs from the call's earliest stamp."""
    layout, expand = stamps.get("layout", []), stamps.get("expand", [])
    origin = min(b[0] for b in (layout or expand))

    def us(ns: int) -> float:
        return (ns - origin) / 1e3

    out = {}
    for i, name in enumerate(LAYOUT_PHASES):
        seen = [b[i + 1] for b in layout if b[i + 1]]
        if seen:
            out[f"layout {name} (first / last block)"] = (us(min(seen)), us(max(seen)))
    for i, name in enumerate(EXPAND_PHASES if expand else ()):
        out[f"expand {name} (first / last block)"] = (us(min(b[i] for b in expand)),
                                                      us(max(b[i] for b in expand)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="4096,7168,256,8;8192,4096,64,6",
                        help="semicolon-separated N,H,E,K tuples")
    parser.add_argument("--calls", type=int, default=12, help="back-to-back calls per kind")
    args = parser.parse_args()
    _enable_stamps()
    import torch
    import torch.distributed as dist

    from megatron_deepep.bench import make_routing
    from megatron_deepep.buffer import Buffer

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29541"))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    table = []
    for text in args.shapes.split(";"):
        num_tokens, hidden, num_experts, num_topk = (int(v) for v in text.split(","))
        x = torch.randn(num_tokens, hidden, device="cuda").to(torch.bfloat16)
        idx, w = make_routing(num_tokens, num_experts, num_topk, 17)
        buf = Buffer(dist.group.WORLD, num_tokens, hidden, num_topk, transport="nvlink",
                     num_sms=num_sms)
        bound = num_tokens * num_topk
        state = {}

        def nosync():
            state["res"] = buf.dispatch(x, idx, w, num_experts=num_experts,
                                        num_max_recv_rows=bound)

        def cached():
            buf.dispatch(x, handle=state["res"][2])

        def layout_only():
            buf.get_dispatch_layout(idx, num_experts)

        for name, fn in (("no-sync", nosync), ("cached", cached), ("layout only", layout_only)):
            captured_stdout(fn)  # warm-up (and compiles), stamps dropped

            def back_to_back():
                for _ in range(args.calls):
                    fn()

            per_call = defaultdict(list)
            for stamps in parse_calls(captured_stdout(back_to_back), args.calls)[1:]:
                for key, value in phases_us(stamps).items():
                    per_call[key].append(value)
            for key, values in per_call.items():
                first, last = (statistics.median(v[j] for v in values) for j in (0, 1))
                table.append((text, name, key, first, last))
        buf.destroy()
    print("\n| shape | dispatch | phase end | µs from the call's start: first / last block |")
    print("|---|---|---|---|")
    for text, name, key, first, last in table:
        print(f"| {text} | {name} | {key} | {first:.2f} / {last:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
