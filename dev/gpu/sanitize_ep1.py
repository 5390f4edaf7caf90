#!/usr/bin/env python3
"""EP = 1 dispatch (sync, no-sync, cached) and combine at a few hidden sizes, for a memory checker.

Run under NVIDIA's checker (it ships with the CUDA toolkit), e.g.

    compute-sanitizer --tool memcheck python3 dev/gpu/sanitize_ep1.py [--shapes N,H,E,K;...]

Each call is checked against the reference transport (dispatch bit-exact, combine within
bf16 rounding), so the script also fails on its own when a kernel writes a wrong row. Hidden
sizes cover a row held in registers only (2048), one staged partly in shared memory (2880,
4104) and one staged up to the 224 KB cap (7168). Needs a GPU.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist

from megatron_deepep import Buffer

log = logging.getLogger("sanitize_ep1")

SHAPES = ((300, 2048, 64, 8), (257, 2880, 32, 4), (129, 4104, 16, 6), (300, 7168, 256, 8))


def check_shape(num_tokens: int, hidden: int, num_experts: int, num_topk: int) -> None:
    """Every call kind once against the reference transport; raises AssertionError."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(hidden)
    x = torch.randn(num_tokens, hidden, device=dev, generator=g).to(torch.bfloat16)
    idx = torch.rand(num_tokens, num_experts, device=dev, generator=g).topk(num_topk).indices
    idx[::7, -1] = -1  # some entries routed nowhere
    w = torch.rand(num_tokens, num_topk, device=dev, generator=g)
    buf = Buffer(dist.group.WORLD, num_tokens, hidden, num_topk, transport="local")
    ref = Buffer(dist.group.WORLD, num_tokens, hidden, num_topk, transport="reference")
    try:
        recv, recv_w, handle, _ = buf.dispatch(x, idx, w, num_experts=num_experts)
        recv_ref, recv_w_ref, handle_ref, _ = ref.dispatch(x, idx, w, num_experts=num_experts)
        exact = dict(rtol=0, atol=0)
        torch.testing.assert_close(recv, recv_ref, **exact)
        torch.testing.assert_close(recv_w, recv_w_ref, **exact)
        bound = num_tokens * num_topk
        recv_nosync, _, _, _ = buf.dispatch(x, idx, w, num_experts=num_experts,
                                            num_max_recv_rows=bound)
        torch.testing.assert_close(recv_nosync[:recv.shape[0]], recv, **exact)
        recv_cached, _, _, _ = buf.dispatch(x, handle=handle)
        torch.testing.assert_close(recv_cached, recv, **exact)
        out, _, _ = buf.combine(recv, handle, weighted=True)
        out_ref, _, _ = ref.combine(recv_ref, handle_ref, weighted=True)
        torch.testing.assert_close(out.float(), out_ref.float(), rtol=1e-2, atol=1e-2)
        torch.cuda.synchronize()
    finally:
        buf.destroy()
        ref.destroy()
    log.info("shape %s: dispatch (sync, no-sync, cached) and combine match the reference",
             (num_tokens, hidden, num_experts, num_topk))


def _shapes(text: str):
    try:
        shapes = [tuple(int(v) for v in item.split(",")) for item in text.split(";") if item]
    except ValueError:
        shapes = []
    if not shapes or any(len(shape) != 4 for shape in shapes):
        raise argparse.ArgumentTypeError(
            f"expected semicolon-separated N,H,E,K tuples (tokens, hidden, experts, top-k), "
            f"got {text!r}")
    return shapes


def build_parser() -> argparse.ArgumentParser:
    default = ";".join(",".join(str(v) for v in shape) for shape in SHAPES)
    parser = argparse.ArgumentParser(
        description="Runs every EP = 1 call kind (dispatch sync, no-sync and cached, combine) "
                    "at a few shapes and checks it against the pure-torch reference; meant to "
                    "run under compute-sanitizer. Needs a CUDA GPU.")
    parser.add_argument("--shapes", type=_shapes, default=list(SHAPES),
                        help=f"semicolon-separated N,H,E,K tuples: tokens, hidden, experts, "
                             f"top-k (default: {default})")
    parser.add_argument("--master-port", type=int,
                        default=int(os.environ.get("MASTER_PORT", "29541")),
                        help="TCP port of the 1-process NCCL group (default: $MASTER_PORT or "
                             "29541)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("sanitize_ep1.py needs a CUDA GPU (torch sees none here)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(args.master_port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    try:
        for shape in args.shapes:
            check_shape(*shape)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
