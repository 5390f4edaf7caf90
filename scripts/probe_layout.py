#!/usr/bin/env python3
"""Layout probe: the layout kernel's device time per chunk size (tokens per block).

`ops.layout` picks the largest chunk that fits the kernel's shared-memory bitmaps; smaller
chunks mean more blocks, each with less serial work (fewer bitmap words to clear and count),
but a longer decoupled look-back. Each result is checked against `layout.compute_layout`.

    python scripts/probe_layout.py [--shapes 4096,8,256 8192,6,64 4096,4,128]

Prints µs per (shape, chunk_tokens) and a table at the end. Needs a GPU; a measurement script,
not part of the library.
"""

from __future__ import annotations

import argparse

import torch

from megatron_deepep import ops
from megatron_deepep.layout import compute_layout
from megatron_deepep.transport.errors import ERROR_RECORD_WORDS, error_from_record
from megatron_deepep.transport.ipc import MappedHostArray


def kernel_us(fn, name: str, iters: int = 30) -> float:
    """Mean device µs of kernel `name` over `iters` calls of `fn` (torch.profiler), so the
    host's launch time is not counted."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times = [e.device_time for e in prof.key_averages() if name in e.key]
    return times[0] if times else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["4096,8,256", "8192,6,64", "4096,4,128"],
                        help="tokens,topk,experts")
    parser.add_argument("--largest-only", action="store_true",
                        help="only the chunk size the library picks")
    args = parser.parse_args()
    claim = torch.zeros(1, dtype=torch.int32, device="cuda")
    record = MappedHostArray(ERROR_RECORD_WORDS)
    sink = ops.ErrorSink(claim.data_ptr(), record.device_ptr)
    rows = []
    for text in args.shapes:
        num_tokens, topk, num_experts = (int(v) for v in text.split(","))
        scores = torch.rand(num_tokens, num_experts, device="cuda")
        ids = scores.topk(topk, dim=1).indices
        expected = compute_layout(ids.cpu(), num_experts, 1)
        largest = ops.layout_chunk_tokens(num_experts, topk,
                                          ops.LAYOUT_MAX_CHUNK_ENTRIES)
        chunks = {largest} if args.largest_only else {largest, largest // 2, largest // 4,
                                                        largest // 8, 8, 4}
        for chunk in sorted(chunks):
            if chunk < 1:
                continue
            got = ops.layout(ids, num_experts, 1, 0, sink, chunk_tokens=chunk)
            torch.cuda.synchronize()
            exc = error_from_record(record.words, 1.0)
            ok = exc is None and all(torch.equal(getattr(got, f).cpu(), getattr(expected, f))
                                     for f in ("pos_in_expert", "num_tokens_per_expert",
                                               "token_slot_in_rank"))
            us = kernel_us(lambda: ops.layout(ids, num_experts, 1, 0, sink, chunk_tokens=chunk),
                           "layout_kernel")
            blocks = -(-num_tokens // chunk)
            rows.append((text, chunk, blocks, us, ok))
            print(f"layout {text} chunk {chunk} ({blocks} blocks): {us:.1f} µs, "
                  f"{'ok' if ok else 'WRONG'}", flush=True)
    print("\n| tokens,topk,experts | chunk tokens | blocks | µs | matches |")
    print("|---|---|---|---|---|")
    for text, chunk, blocks, us, ok in rows:
        print(f"| {text} | {chunk} | {blocks} | {us:.1f} | {ok} |")
    record.destroy()


if __name__ == "__main__":
    main()
