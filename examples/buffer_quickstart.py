"""The Buffer API in one file: dispatch, experts, combine (unweighted and weighted), cached
dispatch, autograd. The README's "Use the Buffer" snippet is its marked block (a test checks,
and runs the file).

    torchrun --nproc-per-node 2 examples/buffer_quickstart.py    # gloo on the CPU, NCCL on GPUs
    python examples/buffer_quickstart.py                         # one rank (EP = 1)

On GPUs every rank takes the GPU of its local rank and the kernels run (compiled on first use);
without one, the ranks talk over gloo and the Buffer runs the pure-torch reference transport.
Each rank prints what it received and one line per check; the exit status is 1 if one failed.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "RANK" not in os.environ:  # plain `python`: one rank, set up as torchrun would
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))

# --- the README's snippet starts here ----------------------------------------------------------
import os
import torch
import torch.distributed as dist
import megatron_deepep as mdeep

on_gpu = torch.cuda.is_available()
if on_gpu:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))       # torchrun sets LOCAL_RANK
dist.init_process_group("nccl" if on_gpu else "gloo")          # e.g. under torchrun
ep_group = dist.new_group(list(range(dist.get_world_size())))  # in Megatron: the EP group
num_tokens, hidden, num_topk, num_experts = 512, 1024, 4, 8 * dist.get_world_size()
buf = mdeep.Buffer(ep_group, num_max_tokens_per_rank=num_tokens, hidden=hidden, num_topk=num_topk)
# or mdeep.get_buffer(ep_group, num_tokens, hidden, num_topk): one Buffer that grows
x = torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device="cuda" if on_gpu else "cpu")
topk_weights, topk_idx = torch.rand(num_tokens, num_experts, device=x.device).topk(num_topk)
recv_x, recv_weights, handle, _ = buf.dispatch(x, topk_idx, topk_weights, num_experts=num_experts)
#   recv_x [M, H]: local expert e's rows by source rank, token, k; handle.tokens_per_expert [E_l]
expert_out = recv_x.clone()                  # your experts here: rows in, rows out
out, _, _ = buf.combine(expert_out, handle)  # [N, H]: the sum over k, NOT weighted (K * x here)
weighted, _, _ = buf.combine(expert_out, handle, weighted=True)  # the sum of weight * row
grad_rows, _ = buf.cached_dispatch(torch.randn_like(out), handle)  # same routing, no host sync
# --- the README's snippet ends here ------------------------------------------------------------

rank, world = dist.get_rank(), dist.get_world_size()
checks = [
    # Unchanged expert rows: the unweighted combine gives each token back times its K experts.
    ("combine == K * x", torch.equal(out.float(), num_topk * x.float())),
    ("combine(weighted=True) == sum_k w_k * x",
     torch.allclose(weighted.float(), topk_weights.sum(1, keepdim=True) * x.float(), rtol=2e-2,
                    atol=2e-2)),
]
# Cached dispatch sends other rows along the same routing: a fresh dispatch of the same rows.
g = torch.randn_like(out)
checks.append(("cached dispatch == dispatch of the same rows",
               grad_rows.shape == recv_x.shape and torch.equal(
                   buf.cached_dispatch(g, handle)[0],
                   buf.dispatch(g, topk_idx, topk_weights, num_experts=num_experts)[0])))
# Autograd: dispatch's backward is a combine, combine's backward a cached dispatch. For
# y = sum_k w_k x and loss mean(y^2): x.grad = (sum_k w_k) * 2 y / y.numel().
x.requires_grad_(True)
rows, row_weights, grad_handle = mdeep.autograd.dispatch(buf, x, topk_idx, topk_weights,
                                                         num_experts=num_experts)
y = mdeep.autograd.combine(buf, rows * row_weights.unsqueeze(1).to(rows.dtype), grad_handle)
y.float().square().mean().backward()
expected_grad = topk_weights.sum(1, keepdim=True) * 2 * y.detach().float() / y.numel()
checks.append(("autograd: x.grad == (sum_k w_k) * dloss/dy",
               x.grad is not None and torch.allclose(x.grad.float(), expected_grad, rtol=2e-2,
                                                     atol=2e-2 * float(expected_grad.abs().max()))))

sizes = handle.tokens_per_expert_list
print(f"rank {rank}/{world} ({buf.transport_name} transport): {num_tokens} tokens x "
      f"top-{num_topk} -> {recv_x.shape[0]} rows for experts {rank * len(sizes)}-"
      f"{(rank + 1) * len(sizes) - 1} ({sizes} rows each)", flush=True)
for name, ok in checks:
    print(f"rank {rank}: {'ok  ' if ok else 'FAIL'} {name}", flush=True)
buf.destroy()
dist.destroy_process_group()
sys.exit(0 if all(ok for _, ok in checks) else 1)
