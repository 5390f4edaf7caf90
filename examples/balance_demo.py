"""Load balance during training that keeps the model the same, on CPU.

    torchrun --nproc-per-node 4 examples/balance_demo.py

A small MoE (32 experts, top-2, a router skewed by a Zipf prior) trains over EP = 4 gloo ranks
with `megatron_deepep`'s reference transport (`Buffer` and the autograd dispatch / combine),
twice from the same seed: once with the contiguous placement, once with re-placement on (every
`--replan-every` steps a `balance` plan from the recorded loads, with one copy slot per rank,
applied at the step's end: weights and Adam state move between ranks). The copies of a
replicated expert sum their gradients before the step (`replicas.sum_replica_grads`), so they
stay one expert. Rank 0 prints one line:

    balance demo: idle share before 0.xxx, after 0.xxx; max |loss difference| 1.2e-06

idle share: the worst rank's count-based idle share `1 - mean / max` of the tokens each EP
rank's experts receive, averaged over the steps after the first re-placement (the same steps
in both runs); loss difference: the largest difference of the two runs' global losses, step by
step. `--device cuda` runs the same on GPUs (one per rank, or shared) with the GPU transports.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_deepep import Buffer
from megatron_deepep.autograd import combine, dispatch
from megatron_deepep.replicas import (
    ReplicaLayout,
    logical_to_physical_table,
    map_topk_to_physical,
    rows_for_slots,
    sum_replica_grads,
)
from megatron_deepep.tools.rebalance import Rebalancer, apply_placement

LINE_PREFIX = "balance demo:"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--ffn", type=int, default=32)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank per step")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--replan-every", type=int, default=5,
                   help="re-plan from the loads of this many steps (the first plan ends step "
                        "N-1, then every N)")
    p.add_argument("--redundant", type=int, default=None,
                   help="copy slots in total (default: one per rank)")
    p.add_argument("--zipf", type=float, default=1.2, help="exponent of the router's prior")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-dir", default=None,
                   help="rank 0 writes the re-placed run's steps here as the dispatcher's "
                        "metrics lines (deepep_metrics_rank0.jsonl), for "
                        "python -m megatron_deepep.tools.report")
    p.add_argument("--device", default="cpu", help="cpu or cuda (rank r on GPU r mod count)")
    p.add_argument("--transport", default=None,
                   help="the Buffer's transport (default: reference on CPU, auto on CUDA)")
    return p.parse_args(argv)


class TinyMoE:
    """Router (replicated, data parallel) and per-slot experts `[S, H, F]`, `[S, F, H]`."""

    def __init__(self, args, layout: ReplicaLayout, device):
        gen = torch.Generator().manual_seed(args.seed)
        e, h, f = args.experts, args.hidden, args.ffn
        self.gate = (torch.randn(h, e, generator=gen) / math.sqrt(h)).to(device)
        prior = -args.zipf * torch.log(torch.arange(1, e + 1, dtype=torch.float32))
        self.prior = prior.to(device)  # a fixed Zipf prior: expert i ~ 1 / (i + 1) ** zipf
        w1 = torch.randn(e, h, f, generator=gen) / math.sqrt(h)
        w2 = torch.randn(e, f, h, generator=gen) / math.sqrt(f)
        self.teacher = (torch.randn(h, h, generator=gen) / math.sqrt(h)).to(device)
        self.w1 = rows_for_slots(layout, w1).to(device).requires_grad_(True)
        self.w2 = rows_for_slots(layout, w2).to(device).requires_grad_(True)
        self.gate.requires_grad_(True)
        self.params = [self.gate, self.w1, self.w2]


def _step_data(args, rank: int, step: int, device):
    gen = torch.Generator().manual_seed(args.seed * 100003 + step * 101 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen)
    return x.to(device)


def train(args, rebalance: bool, rank: int, world: int, group, device) -> dict:
    """One run; returns `losses` (global, per step) and `idle` (per step) on every rank."""
    num_redundant = (world if args.redundant is None else args.redundant) if rebalance else 0
    planner = Rebalancer(args.experts, world, interval=args.replan_every,
                         num_redundant=num_redundant, min_gain=0.0)
    layout = ReplicaLayout(tuple(planner.initial_map()), world, rank)
    model = TinyMoE(args, layout, device)
    opt = torch.optim.Adam(model.params, lr=args.lr)
    transport = args.transport or ("reference" if device.type == "cpu" else "auto")
    buffer = Buffer(group if group is not None else dist.group.WORLD,
                    num_max_tokens_per_rank=args.tokens, hidden=2 * args.hidden,
                    num_topk=args.topk, transport=transport)
    s = layout.slots_per_rank
    losses: List[float] = []
    idle: List[float] = []
    placed_at: List[int] = []
    for step in range(args.steps):
        x = _step_data(args, rank, step, device)
        target = torch.tanh(x @ model.teacher)
        scores = torch.softmax(x @ model.gate + model.prior, dim=-1)
        weights, logical_idx = torch.topk(scores, args.topk, dim=-1)
        table, copies = logical_to_physical_table(layout.physical_to_logical, args.experts)
        idx = map_topk_to_physical(logical_idx, table, copies)
        t0 = time.perf_counter()
        recv_x, recv_w, handle = dispatch(buffer, x, idx, weights, num_experts=world * s)
        t1 = time.perf_counter()
        outs = []
        for slot, (rows, w) in enumerate(zip(recv_x.split(handle.tokens_per_expert_list),
                                             recv_w.split(handle.tokens_per_expert_list))):
            hid = torch.nn.functional.gelu(rows @ model.w1[slot])
            outs.append((hid @ model.w2[slot]) * w.unsqueeze(1))
        t2 = time.perf_counter()
        y = combine(buffer, torch.cat(outs), handle)
        times = [1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (time.perf_counter() - t2)]
        loss = ((y - target) ** 2).sum() / (args.tokens * world * args.hidden)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        # Copies of one logical expert: one gradient, the same in every copy (in flight while
        # the router's gradient is summed).
        pending = sum_replica_grads(layout, [[model.w1.grad[i], model.w2.grad[i]]
                                             for i in range(s)], group, async_op=True)
        # Data-parallel router: sum its gradient over the ranks (each loss is a part of one).
        dist.all_reduce(model.gate.grad, group=group)
        pending.wait()
        opt.step()
        # Counts (integers, identical on every rank after the all-reduce).
        stats = torch.cat([
            torch.bincount(logical_idx.reshape(-1), minlength=args.experts),
            torch.bincount(idx.reshape(-1) // s, minlength=world),
            torch.bincount(idx.reshape(-1), minlength=world * s),
            torch.zeros(1, dtype=torch.int64, device=device)]).to(torch.float64)
        stats[-1] = loss.detach().double()
        dist.all_reduce(stats, group=group)
        rank_load = stats[args.experts:args.experts + world]
        idle.append(1.0 - (rank_load.mean() / rank_load.max()).item())
        losses.append(stats[-1].item())
        if rebalance and args.metrics_dir and rank == 0:
            per_slot = stats[args.experts + world:-1]
            _write_metrics(args.metrics_dir, step, layout, stats[:args.experts], rank_load,
                           per_slot, times)
        if rebalance:
            planner.record(stats[:args.experts].tolist())
            plan = planner.maybe_plan(layout.physical_to_logical)
            if plan is not None:
                state = [opt.state[model.w1], opt.state[model.w2]]
                slot_tensors = [[model.w1.data[i], model.w2.data[i]]
                                + [st[k][i] for st in state for k in ("exp_avg", "exp_avg_sq")]
                                for i in range(s)]
                layout = apply_placement(layout, plan.physical_to_logical, slot_tensors, group)
                placed_at.append(step + 1)
    buffer.destroy()
    return {"losses": losses, "idle": idle, "placed_at": placed_at,
            "w1": model.w1.detach().clone(), "layout": layout}


def _write_metrics(folder, step, layout, logical, rank_load, per_slot, times) -> None:
    """One step as the dispatcher's metrics line (`megatron.metrics`), layer 1."""
    os.makedirs(folder, exist_ok=True)
    dispatch_ms, expert_ms, combine_ms = times
    record = {
        "dispatch_ms": dispatch_ms, "combine_ms": combine_ms, "expert_ms": expert_ms,
        "comm_share": (dispatch_ms + combine_ms) / expert_ms if expert_ms > 0 else 0.0,
        "tokens_per_expert": [int(v) for v in per_slot.tolist()],
        "tokens_per_logical_expert": [int(v) for v in logical.tolist()],
        "tokens_per_rank": [int(v) for v in rank_load.tolist()],
        "load_imbalance": (logical.max() / logical.mean()).item(),
        "idle_share": 1.0 - (rank_load.min() / rank_load.max()).item(),
        "physical_to_logical": list(layout.physical_to_logical), "tokens_dropped": 0}
    with open(os.path.join(folder, "deepep_metrics_rank0.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "layers": {"1": record}}) + "\n")


def run(rank: int, world: int, argv: Optional[Sequence[str]] = None, group=None) -> str:
    """Both runs on this rank; returns the result line (the same on every rank)."""
    args = parse_args(argv)
    torch.set_num_threads(1)  # ranks share the cores
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    before = train(args, False, rank, world, group, device)
    after = train(args, True, rank, world, group, device)
    if not after["placed_at"]:
        raise RuntimeError("balance demo: no re-placement happened; raise --steps or lower "
                           "--replan-every")
    first = after["placed_at"][0]
    idle_before = sum(before["idle"][first:]) / len(before["idle"][first:])
    idle_after = sum(after["idle"][first:]) / len(after["idle"][first:])
    diff = max(abs(a - b) for a, b in zip(before["losses"], after["losses"]))
    return (f"{LINE_PREFIX} idle share before {idle_before:.3f}, after {idle_after:.3f}; "
            f"max |loss difference| {diff:.1e}")


def parse_line(line: str) -> dict:
    """The three figures of a result line (for tests)."""
    import re

    m = re.fullmatch(r"balance demo: idle share before ([0-9.]+), after ([0-9.]+); "
                     r"max \|loss difference\| ([0-9.e+-]+)", line.strip())
    if m is None:
        raise ValueError(f"not a balance demo line: {line!r}")
    return {"before": float(m.group(1)), "after": float(m.group(2)),
            "loss_diff": float(m.group(3))}


def main() -> None:
    if "RANK" not in os.environ:  # one line and the command, not torch's rendezvous error
        sys.exit("balance_demo.py runs one process per EP rank under torchrun: "
                 "torchrun --nproc-per-node 4 examples/balance_demo.py")
    backend = "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        line = run(rank, world, sys.argv[1:])
        if rank == 0:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
