"""CPU tier: the reference transport against the single-process oracle on 1 to 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from megatron_deepep.buffer import Buffer
from megatron_deepep.layout import compute_layout
from tests.helpers.cases import expert_scale, make_inputs
from tests.helpers.distributed import run_distributed
from tests.helpers.oracle import oracle_combine, oracle_dispatch

CASES = [
    # kind, tokens per rank, hidden, experts, top-k, alignment
    ("random", 24, 64, 8, 2, 1),
    ("skewed", 17, 32, 12, 3, 4),
    ("dropped", 9, 48, 16, 4, 1),
    ("empty", 5, 16, 4, 1, 1),
    ("uneven", None, 24, 8, 2, 8),
]


def _check_rank(rank, world_size, seed, kind, num_tokens, hidden, num_experts, num_topk, align):
    if kind == "uneven":  # rank 0 sends nothing, the others differ
        num_tokens = [0] + [3 + 5 * r for r in range(1, world_size)]
        kind = "random"
    xs, idxs, ws = make_inputs(seed, world_size, num_tokens, hidden, num_experts, num_topk, kind)
    expected = oracle_dispatch(xs, idxs, ws, num_experts, align)
    n_max = max(x.shape[0] for x in xs) or 1
    buf = Buffer(None, n_max, hidden, num_topk, transport="reference")
    recv_x, recv_w, handle, _ = buf.dispatch(xs[rank], idxs[rank], ws[rank],
                                             num_experts=num_experts, expert_alignment=align)
    exp_x, exp_w, exp_sizes, exp_src = expected[rank]
    assert torch.equal(recv_x, exp_x)
    assert torch.equal(recv_w, exp_w)
    assert handle.tokens_per_expert_list == exp_sizes
    assert handle.tokens_per_expert.tolist() == exp_sizes

    ys = [expert_scale(e[0], e[2]) for e in expected]
    out, _, _ = buf.combine(ys[rank], handle)
    exp_out = oracle_combine(ys, [e[3] for e in expected], [x.shape[0] for x in xs])[rank]
    torch.testing.assert_close(out.float(), exp_out.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(out, exp_out), "same summation order and rounding must be bit-exact"

    weighted, _, _ = buf.combine(ys[rank], handle, weighted=True)
    exp_weighted = oracle_combine(ys, [e[3] for e in expected], [x.shape[0] for x in xs],
                                  weights=[e[1] for e in expected])[rank]
    assert torch.equal(weighted, exp_weighted)

    again, _, _, _ = buf.dispatch(xs[rank] * 2, handle=handle)
    assert torch.equal(again, exp_x * 2)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reference_matches_oracle(world_size, case):
    kind, num_tokens, hidden, num_experts, num_topk, align = case
    if num_experts % world_size:
        num_experts *= world_size
    run_distributed(world_size, _check_rank, 1234 + world_size, kind, num_tokens, hidden,
                    num_experts, num_topk, align)


def test_layout_definition():
    idx = torch.tensor([[0, 3], [3, -1], [1, 0], [-1, -1]])
    layout = compute_layout(idx, num_experts=4, num_ranks=2)
    assert layout.num_tokens_per_rank.tolist() == [2, 2]
    assert layout.num_tokens_per_expert.tolist() == [2, 1, 0, 2]
    assert layout.is_token_in_rank.tolist() == [[True, True], [False, True], [True, False],
                                                [False, False]]
    assert layout.token_slot_in_rank.tolist() == [[0, 0], [-1, 1], [1, -1], [-1, -1]]
    assert layout.slot_token[0, :2].tolist() == [0, 2]
    assert layout.slot_token[1, :2].tolist() == [0, 1]
    assert layout.pos_in_expert.tolist() == [[0, 0], [1, -1], [0, 1], [-1, -1]]
