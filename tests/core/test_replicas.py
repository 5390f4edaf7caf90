"""Copies of a logical expert train as one expert (`megatron_deepep.replicas`), CPU + gloo.

* bit identity: a small MoE over 3 ranks with copies (summed gradients, Adam) keeps every copy
  of each replicated expert bit-identical over several steps, and tracks the run without a map
  to fp32 rounding; without the gradient sum the copies drift (the check can fail);
* re-placement at a step boundary moves weights and Adam state exactly;
* checkpoint round trip: a run with a map saves logical order, a run without loads it, and
  back, weights and optimizer state alike.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megatron_deepep.tools import balance
from megatron_deepep.tools.rebalance import Rebalancer, apply_placement, predicted_idle_share
from megatron_deepep.replicas import (
    ReplicaLayout,
    logical_to_physical_table,
    map_topk_to_physical,
    move_slots,
    rows_for_slots,
    sum_replica_grads,
)
from tests.helpers.distributed import run_distributed

E, K, H, T = 6, 2, 8, 40
# 3 ranks x 3 slots: expert 0 in three copies (one per rank), expert 1 in two.
MAP = (0, 1, 2, 0, 1, 3, 0, 4, 5)


def logical_rows(layout: ReplicaLayout, slots: torch.Tensor) -> torch.Tensor:
    """Every rank's per-slot tensor `[S, ...]` gathered into logical order `[E, ...]` (each
    expert from its first copy): the checkpoint a run writes, as this test reads it."""
    parts = [torch.empty_like(slots) for _ in range(layout.num_ranks)]
    dist.all_gather(parts, slots.contiguous())
    first = [layout.first_slot(e) for e in range(layout.num_experts)]
    return torch.cat(parts)[first]


def _train(rank, world, p2l, steps, sum_grads=True):
    """A few Adam steps of a tiny MoE whose experts sit as `p2l` says; returns its layout,
    per-slot weights, optimizer and the global losses."""
    from megatron_deepep import Buffer
    from megatron_deepep.autograd import combine, dispatch

    torch.manual_seed(0)
    layout = ReplicaLayout(tuple(p2l), world, rank)
    gen = torch.Generator().manual_seed(3)
    gate = torch.randn(H, E, generator=gen)
    prior = -1.5 * torch.log(torch.arange(1, E + 1, dtype=torch.float32))
    w1_all = torch.randn(E, H, H, generator=gen) / math.sqrt(H)
    w1 = rows_for_slots(layout, w1_all).requires_grad_(True)
    opt = torch.optim.Adam([w1], lr=1e-2)
    buffer = Buffer(dist.group.WORLD, num_max_tokens_per_rank=T, hidden=2 * H, num_topk=K,
                    transport="reference")
    table, copies = logical_to_physical_table(layout.physical_to_logical, E)
    s = layout.slots_per_rank
    losses, history = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(T, H, generator=g)
        weights, logical = torch.topk(torch.softmax(x @ gate + prior, -1), K, dim=-1)
        idx = map_topk_to_physical(logical, table, copies)
        recv_x, recv_w, handle = dispatch(buffer, x, idx, weights, num_experts=world * s)
        outs = [torch.tanh(rows @ w1[i]) * w.unsqueeze(1) for i, (rows, w) in enumerate(zip(
            recv_x.split(handle.tokens_per_expert_list),
            recv_w.split(handle.tokens_per_expert_list)))]
        y = combine(buffer, torch.cat(outs), handle)
        loss = (y ** 2).mean() / world
        opt.zero_grad()
        loss.backward()
        if sum_grads:
            sum_replica_grads(layout, [[w1.grad[i]] for i in range(s)])
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
        history.append(w1.detach().clone())
    buffer.destroy()
    return layout, w1, opt, losses, history


def _bit_identity_worker(rank, world):
    torch.set_num_threads(1)
    layout, w1, _, losses, history = _train(rank, world, MAP, steps=6)
    for step, weights in enumerate(history):
        gathered = [torch.empty_like(weights) for _ in range(world)]
        dist.all_gather(gathered, weights)
        physical = torch.cat(gathered)
        for e in layout.replicated:
            slots = [p for p, x in enumerate(MAP) if x == e]
            for p in slots[1:]:
                assert torch.equal(physical[p], physical[slots[0]]), \
                    f"step {step}: expert {e} slot {p} differs from slot {slots[0]}"
    # The same model as the run without a map (each expert once, contiguous): same losses and
    # the same logical weights, to fp32 rounding.
    plain_layout, plain_w1, _, plain_losses, _ = _train(rank, world, list(range(E)), steps=6)
    assert max(abs(a - b) for a, b in zip(losses, plain_losses)) < 1e-6
    torch.testing.assert_close(logical_rows(layout, w1.detach()),
                               logical_rows(plain_layout, plain_w1.detach()),
                               rtol=1e-5, atol=1e-6)
    # Control: without the sum the copies drift apart after one step.
    _, drift_w1, _, _, _ = _train(rank, world, MAP, steps=1, sum_grads=False)
    gathered = [torch.empty_like(drift_w1) for _ in range(world)]
    dist.all_gather(gathered, drift_w1.detach())
    physical = torch.cat(gathered)
    assert not torch.equal(physical[0], physical[3]), "copies equal without the gradient sum"


def test_replicas_stay_bit_identical_over_steps():
    run_distributed(3, _bit_identity_worker, timeout_s=180)


def _move_worker(rank, world):
    torch.set_num_threads(1)
    layout, w1, opt, _, _ = _train(rank, world, MAP, steps=2)
    state = opt.state[w1]
    before = [logical_rows(layout, t.detach()) for t in (w1, state["exp_avg"],
                                                          state["exp_avg_sq"])]
    new_map = (5, 4, 3, 2, 1, 0, 0, 1, 0)
    s = layout.slots_per_rank
    slots = [[w1.data[i], state["exp_avg"][i], state["exp_avg_sq"][i]] for i in range(s)]
    new = apply_placement(layout, new_map, slots)
    for old_rows, t in zip(before, (w1.detach(), state["exp_avg"], state["exp_avg_sq"])):
        assert torch.equal(t, rows_for_slots(new, old_rows))  # exact: bits move unchanged
        assert torch.equal(logical_rows(new, t), old_rows)
    # Mixed dtypes move in one call per dtype.
    half = [[torch.full((2,), float(e), dtype=torch.bfloat16), torch.tensor([e, -e])]
            for e in new.local_logical]
    move_slots(new, layout, half)
    assert [int(h[0][0]) for h in half] == layout.local_logical
    assert [h[1].tolist() for h in half] == [[e, -e] for e in layout.local_logical]


def test_move_slots_carries_weights_and_adam_state_exactly():
    run_distributed(3, _move_worker, timeout_s=180)


def _checkpoint_worker(rank, world, path):
    """Map -> logical checkpoint -> no map, and no map -> checkpoint -> map."""
    torch.set_num_threads(1)
    for src, dst in ((MAP, tuple(range(E))), (tuple(range(E)), MAP)):
        layout, w1, opt, _, _ = _train(rank, world, src, steps=2)
        state = opt.state[w1]
        ckpt = {name: logical_rows(layout, t.detach()) for name, t in
                (("w1", w1), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"]))}
        if rank == 0:
            torch.save(ckpt, path)
        dist.barrier()
        loaded = torch.load(path)
        # The destination layout's run: its slots from the logical checkpoint.
        dst_layout = ReplicaLayout(dst, world, rank)
        w1_dst = rows_for_slots(dst_layout, loaded["w1"])
        for e, row in zip(dst_layout.local_logical, w1_dst):
            assert torch.equal(row, ckpt["w1"][e])
        # The round trip back gives the original slots bit for bit.
        again = logical_rows(dst_layout, w1_dst)
        assert torch.equal(rows_for_slots(layout, again), w1.detach())
        for name in ("exp_avg", "exp_avg_sq"):
            dst_rows = rows_for_slots(dst_layout, loaded[name])
            assert torch.equal(rows_for_slots(layout, logical_rows(dst_layout, dst_rows)),
                               state[name])
        dist.barrier()


def test_checkpoint_round_trip_map_and_no_map(tmp_path):
    run_distributed(3, _checkpoint_worker, str(tmp_path / "experts.pt"), timeout_s=180)


def test_layout_and_table_checks():
    layout = ReplicaLayout(MAP, 3, 1)
    assert layout.slots_per_rank == 3 and layout.num_experts == E
    assert layout.local_logical == [0, 1, 3]
    assert layout.replicated == [0, 1]
    assert not layout.is_first_copy(0) and layout.is_first_copy(2)
    with pytest.raises(ValueError, match="do not split"):
        ReplicaLayout(MAP, 2, 0)
    with pytest.raises(ValueError, match="no physical slot"):
        ReplicaLayout((0, 0, 2, 2), 2, 0)
    with pytest.raises(ValueError, match="slot_grads has 2"):
        sum_replica_grads(layout, [[torch.zeros(1)]] * 2)


def test_rebalancer_plans_after_interval_and_only_when_it_pays():
    r = Rebalancer(8, 2, interval=2, num_redundant=2)
    assert r.initial_map() == [0, 1, 2, 3, 4, 0, 4, 5, 6, 7]
    loads = balance.synthetic_loads("zipf:8:1.2").tolist()
    r.record(loads)
    assert r.maybe_plan(r.initial_map()) is None  # one step recorded of two
    r.record(loads)
    plan = r.maybe_plan(r.initial_map())
    assert plan is not None and plan.slots_per_rank == 5
    assert plan.idle_share < predicted_idle_share(torch.tensor(loads), r.initial_map(), 2)
    r.record(loads)
    r.record(loads)
    assert r.maybe_plan(plan.physical_to_logical) is None  # already balanced: kept
    with pytest.raises(ValueError, match="multiple"):
        Rebalancer(8, 2, interval=1, num_redundant=1)
    with pytest.raises(ValueError, match="interval"):
        Rebalancer(8, 2, interval=0)
