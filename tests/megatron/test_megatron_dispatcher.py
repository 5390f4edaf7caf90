"""DeepEPTokenDispatcher on gloo ranks, driven through Megatron's six hooks.

Each case builds a real TransformerConfig and real parallel_state process groups, routes random
tokens (some ranks with none), runs the six hooks around per-expert linear "experts" that apply
the permuted probs (as Megatron's experts do), and compares the output and the gradients of the
hidden states and of the dense probs with a pure-torch oracle that never communicates.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed

H = 32


def _make_routing(num_tokens, num_experts, topk, seed, drop_frac=0.0, capacity=None):
    """Dense probs [T, E] (softmax top-k, 0 off-route) and routing_map [T, E] bool."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    scores = torch.softmax(logits, dim=-1)
    top_vals, top_idx = torch.topk(scores, min(topk, num_experts), dim=1)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    routing_map.scatter_(1, top_idx, True)
    if drop_frac > 0:
        routing_map &= torch.rand(num_tokens, num_experts, generator=gen) >= drop_frac
    if capacity is not None:  # "position" drop policy: the first `capacity` tokens per expert
        keep_rank = torch.cumsum(routing_map.int(), dim=0)
        routing_map &= keep_rank <= capacity
    probs = torch.zeros(num_tokens, num_experts)
    probs[routing_map] = scores[routing_map]
    return probs, routing_map


def _expert_weights(num_experts, seed=1234):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_experts, H, H, generator=gen) / math.sqrt(H)


def _run_experts(rows, tokens_per_expert, permuted_probs, weights, local_ids):
    """Per-expert linear layer times the permuted prob (Megatron's experts apply the probs)."""
    counts = tokens_per_expert.tolist()
    assert sum(counts) == rows.shape[0], (counts, rows.shape)
    outs = []
    for e, chunk, p in zip(local_ids, torch.split(rows, counts),
                           torch.split(permuted_probs, counts)):
        outs.append((chunk.float() @ weights[e]) * p.float().unsqueeze(1))
    return torch.cat(outs).to(rows.dtype) if outs else rows.new_zeros(0, H)


def _oracle(x, probs, routing_map, weights):
    mixed = torch.einsum("th,ehk->tek", x.float(), weights)           # [T, E, H]
    return (mixed * (probs * routing_map).unsqueeze(-1)).sum(1)


def _hooks(dispatcher, x3, routing_map, probs, weights, log=None):
    """The six hooks in MoELayer's order; returns the output `[S, B, H]`."""
    hidden, p = dispatcher.dispatch_preprocess(x3, routing_map, probs)
    hidden, p = dispatcher.token_dispatch(hidden, p)
    rows, tokens_per_expert, permuted_probs = dispatcher.dispatch_postprocess(hidden, p)
    if log is not None:
        log["tokens_per_expert"] = tokens_per_expert.clone()
        log["rows"] = rows.shape[0]
        log["probs_dtype"] = permuted_probs.dtype
    y = _run_experts(rows, tokens_per_expert, permuted_probs, weights,
                     dispatcher.local_expert_indices)
    y = dispatcher.combine_preprocess(y)
    y = dispatcher.token_combine(y)
    return dispatcher.combine_postprocess(y)


def _config(world_size, num_experts, topk, **kwargs):
    from megatron.core.transformer.transformer_config import TransformerConfig

    if topk == 1:
        kwargs.setdefault("moe_router_pre_softmax", True)
    return TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=4,
                             num_moe_experts=num_experts, moe_router_topk=topk,
                             expert_model_parallel_size=world_size,
                             moe_token_dispatcher_type="deepep", use_cpu_initialization=True,
                             add_bias_linear=False, **kwargs)


def _case(rank, world_size, pg, *, num_experts, topk, tokens, dtype=torch.float32,
          drop_frac=0.0, pad_to_capacity=False, align=None, recompute=False, seed=0):
    from megatron_deepep.megatron import DeepEPTokenDispatcher

    extra = {}
    capacity = None
    num_tokens = tokens[rank]
    if pad_to_capacity:
        from megatron.core.transformer.moe.moe_utils import get_capacity
        extra = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
                     moe_token_drop_policy="position")
        capacity = get_capacity(num_tokens * topk, num_experts, 1.0)
    config = _config(world_size, num_experts, topk, **extra)
    if align is not None:
        # Needs fp8 in __post_init__ (TE); the dispatcher only reads the flag and the size.
        config.moe_router_padding_for_quantization = True
        # Megatron sizes the padding from the fp8 recipe (0.19 gives 0 without fp8).
        config.fp8 = "e4m3"
    num_local = num_experts // world_size
    local_ids = list(range(rank * num_local, (rank + 1) * num_local))
    dispatcher = DeepEPTokenDispatcher(num_local, local_ids, config=config, pg_collection=pg)
    if align is not None:
        assert dispatcher.expert_alignment == align

    probs, routing_map = _make_routing(num_tokens, num_experts, topk, seed * 100 + rank,
                                       drop_frac=drop_frac, capacity=capacity)
    gen = torch.Generator().manual_seed(seed * 100 + rank + 50)
    x = torch.randn(num_tokens, 1, H, generator=gen).to(dtype)
    grad_out = torch.randn(num_tokens, 1, H, generator=gen).to(dtype)
    weights = _expert_weights(num_experts)

    x_a = x.clone().requires_grad_(True)
    probs_a = probs.clone().requires_grad_(True)
    log = {}
    if recompute:
        from torch.utils.checkpoint import checkpoint

        out = checkpoint(lambda a, b: _hooks(dispatcher, a, routing_map, b, weights, log),
                         x_a, probs_a, use_reentrant=True, preserve_rng_state=False)
    else:
        out = _hooks(dispatcher, x_a, routing_map, probs_a, weights, log)
    assert out.shape == x.shape and out.dtype == dtype
    # The Buffer counts the layer's rows in its params_dtype (fp32 here): no 2-byte arithmetic.
    assert (dispatcher._buffer.hidden, dispatcher._buffer.dtype) == (H, config.params_dtype)
    (out.float() * grad_out.float()).sum().backward()

    x_b = x.float().clone().requires_grad_(True)
    probs_b = probs.clone().requires_grad_(True)
    ref = _oracle(x_b.view(-1, H), probs_b, routing_map, weights)
    (ref * grad_out.float().view(-1, H)).sum().backward()

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float().view(-1, H), ref, **tol)
    torch.testing.assert_close(x_a.grad.float(), x_b.grad.view_as(x_a), **tol)
    torch.testing.assert_close(probs_a.grad, probs_b.grad, **tol)

    # Counts: every rank agrees with the global routing map.
    global_counts = routing_map.sum(0).long()
    dist.all_reduce(global_counts, group=pg.ep)
    want = global_counts[local_ids]
    tokens_per_expert = log["tokens_per_expert"]
    assert tokens_per_expert.device.type == "cpu" and tokens_per_expert.dtype == torch.int64
    assert log["probs_dtype"] == probs.dtype
    if pad_to_capacity:
        seg = capacity * world_size
        assert tokens_per_expert.tolist() == [seg] * num_local, tokens_per_expert
        assert (want <= seg).all()
    elif align is not None:
        assert (tokens_per_expert % align == 0).all()
        excess = tokens_per_expert - want
        assert (excess >= 0).all() and (excess < align).all()
    else:
        assert tokens_per_expert.tolist() == want.tolist()


CASES_2 = [
    dict(num_experts=8, topk=2, tokens=[24, 17]),
    dict(num_experts=8, topk=2, tokens=[0, 19], seed=1),                 # a rank with no tokens
    dict(num_experts=4, topk=3, tokens=[13, 9], drop_frac=0.3, seed=2),  # capacity drops
    dict(num_experts=8, topk=2, tokens=[16, 16], pad_to_capacity=True, seed=3),
    dict(num_experts=8, topk=2, tokens=[21, 5], align=16, seed=4),
    dict(num_experts=8, topk=2, tokens=[12, 20], recompute=True, seed=5),
    dict(num_experts=8, topk=2, tokens=[20, 11], dtype=torch.bfloat16, seed=6),
    dict(num_experts=2, topk=1, tokens=[7, 0], seed=7),
]
CASES_4 = [
    dict(num_experts=8, topk=2, tokens=[16, 0, 9, 25]),
    dict(num_experts=16, topk=4, tokens=[10, 12, 0, 3], drop_frac=0.2, seed=1),
    dict(num_experts=8, topk=2, tokens=[12, 12, 12, 12], pad_to_capacity=True, seed=2),
    dict(num_experts=4, topk=2, tokens=[9, 30, 1, 4], align=16, recompute=True, seed=3),
]


class _FakeSharedExperts:
    """Follows SharedExpertMLP's overlap state machine and records the call order."""

    use_shared_expert_gate = False

    def __init__(self):
        self.calls = []

    def pre_forward_comm(self, x):
        self.calls.append("pre")
        self.x = x

    def linear_fc1_forward_and_act(self, overlapped_comm_output=None):
        self.calls.append("fc1")
        self.h = self.x * 2

    def linear_fc2_forward(self, overlapped_comm_output=None):
        self.calls.append("fc2")
        self.o = self.h + 1

    def post_forward_comm(self):
        self.calls.append("post")

    def get_output(self):
        self.calls.append("get")
        return self.o


def _shared_case(rank, world_size, pg):
    from megatron_deepep.megatron import DeepEPTokenDispatcher

    config = _config(world_size, 8, 2, moe_shared_expert_intermediate_size=64,
                     moe_shared_expert_overlap=True)
    num_local = 8 // world_size
    local_ids = list(range(rank * num_local, (rank + 1) * num_local))
    dispatcher = DeepEPTokenDispatcher(num_local, local_ids,
                                       config=config, pg_collection=pg)
    shared = _FakeSharedExperts()
    dispatcher.set_shared_experts(shared)
    probs, routing_map = _make_routing(10 + rank, 8, 2, seed=77 + rank)
    x = torch.randn(10 + rank, 1, H)
    weights = _expert_weights(8)
    out = _hooks(dispatcher, x, routing_map, probs, weights)
    ref = _oracle(x.view(-1, H), probs, routing_map, weights).view_as(x) + (2 * x + 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert shared.calls == ["pre", "fc1", "fc2", "post", "get"], shared.calls


def _refusal_cases(rank, world_size):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron_deepep.megatron import DeepEPTokenDispatcher

    ps.initialize_model_parallel(expert_model_parallel_size=1,
                                 expert_tensor_parallel_size=world_size)
    try:  # expert TP > 1 runs synchronous only (tests/megatron/test_parity_matrix.py: its parity)
        config = _config(1, 8, 2, expert_tensor_parallel_size=world_size)
        dispatcher = DeepEPTokenDispatcher(8, list(range(8)), config=config,
                                           pg_collection=get_default_pg_collection())
        assert dispatcher.tp_size == world_size
        config = _config(1, 8, 2, expert_tensor_parallel_size=world_size)
        config.moe_mdeep_rank_capacity_factor = 2.0  # set after __post_init__'s check
        with pytest.raises(ValueError, match="expert-tensor-parallel-size .*rank-capacity"):
            DeepEPTokenDispatcher(8, list(range(8)), config=config,
                                  pg_collection=get_default_pg_collection())
    finally:
        ps.destroy_model_parallel()
    with pytest.raises(ValueError, match="moe-enable-deepep"):
        _config(world_size, 8, 2, moe_enable_deepep=True)


def _worker(rank, world_size, cases, extra):
    warnings.filterwarnings("ignore")
    import megatron_deepep.megatron as mdm
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    mdm.register_deepep_dispatcher(transport="reference")
    ps.initialize_model_parallel(expert_model_parallel_size=world_size)
    try:
        pg = get_default_pg_collection()
        for case in cases:
            _case(rank, world_size, pg, **case)
        if extra:
            _shared_case(rank, world_size, pg)
    finally:
        ps.destroy_model_parallel()
    if extra:
        _refusal_cases(rank, world_size)


@pytest.mark.parametrize("world_size,cases", [(2, CASES_2), (4, CASES_4)])
def test_six_hooks_match_oracle(world_size, cases):
    run_distributed(world_size, _worker, cases, world_size == 2, timeout_s=170)


def test_routing_map_to_topk_keeps_probs_in_graph():
    from megatron_deepep.megatron import routing_map_to_topk

    probs, routing_map = _make_routing(6, 5, 2, seed=3, drop_frac=0.3)
    probs.requires_grad_(True)
    idx, w = routing_map_to_topk(routing_map, probs, 3)
    assert idx.shape == (6, 3) and w.dtype == torch.float32
    for t in range(6):
        want = sorted(torch.nonzero(routing_map[t]).flatten().tolist())
        got = [e for e in idx[t].tolist() if e >= 0]
        assert got == want
        assert torch.equal(w[t][idx[t] < 0], torch.zeros(int((idx[t] < 0).sum())))
    w.sum().backward()
    assert torch.equal(probs.grad, routing_map.float())
    # Zero tokens.
    idx0, w0 = routing_map_to_topk(routing_map[:0], probs[:0], 2)
    assert idx0.shape == (0, 2) and w0.shape == (0, 2)
