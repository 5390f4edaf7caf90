"""CPU tier: one-allocation arenas and lazily viewed dataclass fields. (The kernels' argument
structs are checked against CUDA by tests/kernels/test_kernel_args.py.)"""

import pytest
import torch

from megatron_deepep.arena import ArenaPlan
from megatron_deepep.handle import DispatchHandle, RecvLayout, recv_fields
from megatron_deepep.layout import DispatchLayout, compute_layout, layout_fields


def test_arena_views_share_memory_and_do_not_overlap():
    plan = ArenaPlan(layout_fields(5, 3, 8, 2) + recv_fields(2, 4, 7, 3))
    arena = plan.allocate("cpu")
    arena.tensor.fill_(-7)
    views = {name: arena.view(name) for name in plan.fields}
    for name, view in views.items():
        assert tuple(view.shape) == plan.fields[name][1], name
        assert view.dtype == plan.fields[name][2], name
        assert view.data_ptr() == arena.address(name), name
        assert arena.address(name) % 16 == 0, name
    # Each array written with its own value stays intact: no two arrays share a byte.
    for i, (name, view) in enumerate(views.items()):
        view.copy_(torch.full(view.shape, i % 2 == 0, dtype=torch.bool)
                   if view.dtype == torch.bool else torch.full(view.shape, i, dtype=view.dtype))
    for i, (name, view) in enumerate(views.items()):
        want = (i % 2 == 0) if view.dtype == torch.bool else i
        assert bool((view == want).all()), name
    used = max(off * 4 + v.numel() * v.element_size() for (off, _, _), v in
               zip(plan.fields.values(), views.values()))
    assert used <= plan.num_words * 4


def test_arena_rejects_other_dtypes():
    with pytest.raises(TypeError, match="float32"):
        ArenaPlan([("x", (3,), torch.float32)])


def test_lazy_layout_fields_match_eager_ones():
    idx = torch.tensor([[0, 5], [3, -1], [7, 7]])
    eager = compute_layout(idx, 8, 2)
    arena = ArenaPlan(layout_fields(3, 2, 8, 2)).allocate("cpu")
    for name in arena.plan.fields:
        arena.view(name).copy_(getattr(eager, name))
    lazy = DispatchLayout.from_arena(arena)
    assert "pos_in_expert" not in lazy.__dict__  # no view until read
    assert lazy.num_tokens == 3 and lazy.num_ranks == 2
    assert lazy.address("pos_in_expert") == arena.address("pos_in_expert")
    for name in arena.plan.fields:
        assert torch.equal(getattr(lazy, name), getattr(eager, name)), name
    assert lazy.address("pos_in_expert") == lazy.pos_in_expert.data_ptr()
    assert eager.address("slot_token") == eager.slot_token.data_ptr()
    with pytest.raises(AttributeError, match="no_such_field"):
        lazy.no_such_field


def test_lazy_handle_reads_its_arrays_from_the_arena():
    arena = ArenaPlan(recv_fields(1, 4, 6, 2)).allocate("cpu")
    arena.view("slot_rows").fill_(3)
    arena.view("num_recv_tokens_per_rank").fill_(6)
    handle = DispatchHandle.from_arena(
        arena, layout=None, recv=RecvLayout.from_arena(arena), recv_weights=None,
        num_experts=4, num_topk=2, hidden=16, expert_alignment=1, num_recv_rows=12)
    assert handle.address("recv_weights") == 0
    assert tuple(handle.slot_rows.shape) == (1, 6, 2) and int(handle.slot_rows.sum()) == 36
    assert handle.num_recv_tokens_per_rank.tolist() == [6]
    assert handle.tokens_per_expert_list is None  # the dataclass default
    assert handle.recv.address("expert_row_start") == arena.address("expert_row_start")
