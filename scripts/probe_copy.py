"""What the HBM gives a dispatch-shaped copy on this GPU, next to our expand kernel.

Prints µs and TB/s for: a 1:1 device copy (the bench's floor), a pure write of the expanded
rows, torch's own gather (`index_select`) of the same rows, and our cached dispatch at EP=1
(the expand kernel alone). Usage: python scripts/probe_copy.py [N H E K]
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from megatron_deepep.bench import make_routing, time_cuda
from megatron_deepep.buffer import Buffer


def main() -> None:
    n, h, e, k = (int(v) for v in (sys.argv[1:5] or (4096, 7168, 256, 8)))
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    dist.init_process_group("gloo")
    x = torch.randn(n, h, device="cuda").to(torch.bfloat16)
    idx, w = make_routing(n, e, k, 5)
    src = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    rows = []
    us = time_cuda(lambda: dst.copy_(src))
    rows.append(("copy 512 MiB (read+write)", us, 2 * src.numel()))
    out = torch.empty(n * k, h, dtype=torch.bfloat16, device="cuda")
    us = time_cuda(lambda: out.fill_(1.0))
    rows.append(("fill expanded rows (write only)", us, out.numel() * 2))
    order = torch.sort(idx.view(-1), stable=True).indices // k  # expert-major source tokens
    us = time_cuda(lambda: torch.index_select(x, 0, order, out=out))
    rows.append(("torch index_select gather", us, (n + n * k) * h * 2))
    buf = Buffer(dist.group.WORLD, n, h, k, transport="nvlink", num_sms=132)
    recv, _, handle, _ = buf.dispatch(x, idx, w, num_experts=e)
    us = time_cuda(lambda: buf.dispatch(x, handle=handle))
    rows.append(("ours: cached dispatch (expand)", us, (n + recv.shape[0]) * h * 2))
    for name, us, num_bytes in rows:
        print(f"{name:36s} {us:8.1f} µs  {num_bytes / us / 1e6:6.2f} TB/s")
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
