"""The Buffer API in one file: dispatch, experts, combine (unweighted and weighted), cached
dispatch, autograd. The README's "Use the Buffer" snippet is taken from it (a test runs it).

    torchrun --nproc-per-node 2 examples/buffer_quickstart.py    # gloo on the CPU, NCCL on GPUs
    python examples/buffer_quickstart.py                         # one rank (EP = 1)

On GPUs every rank takes the GPU of its local rank and the kernels run (compiled on first use);
without one, the ranks talk over gloo and the Buffer runs the pure-torch reference transport.
Each rank prints one line per step, and exits non-zero if a check fails.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import megatron_deepep as mdeep  # noqa: E402


def main() -> int:
    if "RANK" not in os.environ:  # plain `python`: one rank, as torchrun would set it up
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda" if on_gpu else "cpu")

    # --- the README's snippet starts here -------------------------------------------------
    dist.init_process_group("nccl" if on_gpu else "gloo")          # e.g. under torchrun
    ep_group = dist.new_group(list(range(dist.get_world_size())))  # in Megatron: the EP group
    num_tokens, hidden, num_topk, num_experts = 512, 1024, 4, 8 * dist.get_world_size()
    buf = mdeep.Buffer(ep_group, num_max_tokens_per_rank=num_tokens, hidden=hidden,
                       num_topk=num_topk)
    # or mdeep.get_buffer(ep_group, num_tokens, hidden, num_topk): one Buffer that grows

    x = torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device=device)
    scores = torch.randn(num_tokens, num_experts, device=device).softmax(dim=-1)
    topk_weights, topk_idx = scores.topk(num_topk, dim=-1)   # [N, K] fp32, [N, K] int64
    recv_x, recv_weights, handle, _ = buf.dispatch(x, topk_idx, topk_weights,
                                                   num_experts=num_experts)
    #   recv_x [M, H]: local expert e's rows, ordered by source rank, token, k
    #   handle.tokens_per_expert [E_local] (device), .tokens_per_expert_list (host)
    expert_out = recv_x.clone()                  # your experts here: rows in, rows out
    out, _, _ = buf.combine(expert_out, handle)  # [N, H]: the sum over k, NOT weighted
    weighted, _, _ = buf.combine(expert_out, handle, weighted=True)  # sum of weight * row
    grad_out = torch.randn_like(out)                  # e.g. combine's backward: [N, H] ...
    grad_rows, _ = buf.cached_dispatch(grad_out, handle)  # ... to [M, H], same routing, no sync
    # --- the README's snippet ends here ---------------------------------------------------

    rank = dist.get_rank()
    checks = []
    # Unchanged expert rows: the unweighted combine gives back each token times its K experts.
    checks.append(("combine == K * x", torch.equal(out.float(), num_topk * x.float())))
    want = (topk_weights.sum(dim=1, keepdim=True) * x.float()).to(x.dtype)
    checks.append(("combine(weighted=True) == sum_k w_k * x",
                   torch.allclose(weighted.float(), want.float(), rtol=2e-2, atol=2e-2)))
    checks.append(("cached dispatch rows", tuple(grad_rows.shape) == tuple(recv_x.shape)))

    # Autograd: dispatch's backward is a combine, combine's backward a cached dispatch.
    x.requires_grad_(True)
    rows, row_weights, grad_handle = mdeep.autograd.dispatch(buf, x, topk_idx, topk_weights,
                                                             num_experts=num_experts)
    y = mdeep.autograd.combine(buf, rows * row_weights.unsqueeze(1).to(rows.dtype), grad_handle)
    y.float().square().mean().backward()
    checks.append(("autograd: x.grad", x.grad is not None and x.grad.shape == x.shape))

    sizes = handle.tokens_per_expert_list
    print(f"rank {rank}/{dist.get_world_size()} ({buf.transport_name} transport): "
          f"{num_tokens} tokens x top-{num_topk} -> {recv_x.shape[0]} rows for experts "
          f"{rank * len(sizes)}-{(rank + 1) * len(sizes) - 1} ({sizes} rows each)", flush=True)
    for name, ok in checks:
        print(f"rank {rank}: {'ok  ' if ok else 'FAIL'} {name}", flush=True)
    buf.destroy()
    dist.destroy_process_group()
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
