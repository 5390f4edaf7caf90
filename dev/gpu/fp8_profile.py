"""The EP = 1 dispatch calls that Nsight Compute profiles (`dev/gpu/fp8.sh`, piece `ncu`).

One process, one `Buffer`, DeepSeek-V3's shape (4096 tokens, hidden 7168, 256 experts, top-8)
unless told otherwise: per format (bf16, then each FP8 format of `--fp8`) two fresh no-sync
dispatches (the layout kernel, then dispatch_local) and two cached ones (dispatch_local alone),
at `--num-sms` blocks. Under `ncu` each kernel is replayed alone; outside it the script prints
each call's µs (CUDA events, one call each: a sanity check, not a benchmark).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from megatron_deepep.buffer import Buffer
from megatron_deepep.fp8.dispatch import Fp8Dispatch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="4096,7168,256,8", help="N,H,E,K")
    parser.add_argument("--num-sms", type=int, default=132)
    parser.add_argument("--fp8", default="blockwise_1x128,mxfp8_1x32")
    args = parser.parse_args()
    num_tokens, hidden, num_experts, num_topk = (int(v) for v in args.shape.split(","))
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29541"))
    torch.cuda.set_device(0)
    dist.init_process_group("gloo")
    buf = Buffer(dist.group.WORLD, num_tokens, hidden, num_topk, num_sms=args.num_sms)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=g).bfloat16()
    scores = torch.rand(num_tokens, num_experts, device="cuda", generator=g)
    probs, idx = scores.topk(num_topk, dim=1)
    weights = (probs / probs.sum(1, keepdim=True)).float()
    bound = num_tokens * num_topk
    specs = [("bf16", None)] + [(n, Fp8Dispatch.named(n, "fp8"))
                                for n in args.fp8.split(",") if n]
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
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
