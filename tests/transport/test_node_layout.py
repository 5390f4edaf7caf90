"""Node layout and per-link row counts against a plain-loop oracle; node-limited routing."""

import pytest
import torch

from megatron_deepep.layout import compute_layout
from megatron_deepep.transport.node_layout import compute_node_layout, node_limited_topk
from megatron_deepep.transport.topology import Topology

SHAPES = [(2, 1), (2, 2), (3, 2), (2, 3), (4, 2), (2, 4)]  # (nodes, ranks per node)
ROUTINGS = ["random", "duplicates", "skewed", "empty", "uneven", "no_tokens"]


def network_crossings(layout) -> torch.Tensor:
    """`[N]`, int32: how often each token crosses the network (its destination nodes other
    than the source rank's own)."""
    remote = layout.is_token_in_node.clone()
    remote[:, layout.rank // layout.num_ranks_per_node] = False
    return remote.sum(dim=1, dtype=torch.int32)


def _oracle(idx, num_experts, num_ranks, per_node, rank):
    """Plain loops over tokens: what every link carries for source `rank`'s tokens."""
    num_nodes = num_ranks // per_node
    per_rank_experts = num_experts // num_ranks
    my_node, my_local = rank // per_node, rank % per_node
    in_node, per_rank = [], [0] * num_ranks
    network = [0] * num_nodes
    nvlink = [0] * num_nodes
    crossings = []
    for row in idx:
        ranks = set()
        for e in row:
            if e >= 0:
                ranks.add(e // per_rank_experts)
        nodes = {r // per_node for r in ranks}
        in_node.append([b in nodes for b in range(num_nodes)])
        crossings.append(len(nodes - {my_node}))
        for r in ranks:
            per_rank[r] += 1
        for b in nodes:
            if b != my_node:
                network[b] += 1  # one row to the rail peer (b, my_local)
            forwarder = b * per_node + my_local
            for r in ranks:
                if r // per_node == b and r != forwarder:
                    nvlink[b] += 1  # forwarded over NVLink inside node b
    per_node_count = [sum(col) for col in zip(*in_node)] if in_node else [0] * num_nodes
    return dict(in_node=in_node, per_rank=per_rank, per_node=per_node_count, network=network,
                nvlink=nvlink, crossings=crossings)


def _routing(kind, num_tokens, num_topk, num_experts, num_ranks, per_node, gen):
    if kind == "no_tokens":
        return torch.zeros(0, num_topk, dtype=torch.int64)
    if kind == "random":  # distinct experts per token
        return torch.rand(num_tokens, num_experts, generator=gen).topk(num_topk, dim=1).indices
    idx = torch.randint(0, num_experts, (num_tokens, num_topk), generator=gen)
    if kind == "duplicates":  # repeated experts and ranks within a token
        return idx
    if kind == "skewed":  # most entries on the first node's first rank
        hot = torch.rand(num_tokens, num_topk, generator=gen) < 0.8
        return torch.where(hot, idx % (num_experts // num_ranks), idx)
    if kind == "empty":  # -1 entries, some tokens with none at all
        drop = torch.rand(num_tokens, num_topk, generator=gen) < 0.5
        idx = torch.where(drop, torch.full_like(idx, -1), idx)
        idx[::3] = -1
        return idx
    if kind == "uneven":  # only the last node's last rank and node 0's rank 0 receive anything
        per_rank_experts = num_experts // num_ranks
        last = (num_ranks - 1) * per_rank_experts + idx % per_rank_experts
        return torch.where(idx % 2 == 0, last, idx % per_rank_experts)
    raise AssertionError(kind)


@pytest.mark.parametrize("num_nodes,per_node", SHAPES)
@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_node_layout_matches_oracle(num_nodes, per_node, kind, dtype):
    num_ranks = num_nodes * per_node
    num_experts, num_topk, num_tokens = num_ranks * 3, 4, 37
    gen = torch.Generator().manual_seed(num_ranks * 100 + ROUTINGS.index(kind))
    idx = _routing(kind, num_tokens, num_topk, num_experts, num_ranks, per_node, gen).to(dtype)
    rows = idx.tolist()
    for rank in range(num_ranks):
        topo = Topology(num_ranks, per_node, rank)
        layout = compute_node_layout(idx, num_experts, topo)
        want = _oracle(rows, num_experts, num_ranks, per_node, rank)
        assert layout.rank == rank and layout.num_nodes == num_nodes
        assert layout.is_token_in_node.tolist() == want["in_node"] or (
            not rows and layout.is_token_in_node.shape == (0, num_nodes))
        assert layout.num_tokens_per_rank.tolist() == want["per_rank"]
        assert layout.num_tokens_per_rank.view(num_nodes, per_node).tolist() == [
            want["per_rank"][b * per_node:(b + 1) * per_node] for b in range(num_nodes)]
        assert layout.num_tokens_per_node.tolist() == want["per_node"]
        assert layout.num_network_rows_per_node.tolist() == want["network"]
        assert layout.num_nvlink_rows_per_node.tolist() == want["nvlink"]
        assert network_crossings(layout).tolist() == want["crossings"]
        for t in (layout.num_tokens_per_rank, layout.num_tokens_per_node,
                  layout.num_network_rows_per_node, layout.num_nvlink_rows_per_node):
            assert t.dtype == torch.int32
        # Same per-rank facts as the intranode layout.
        flat = compute_layout(idx, num_experts, num_ranks)
        assert torch.equal(layout.is_token_in_rank, flat.is_token_in_rank)
        assert torch.equal(layout.num_tokens_per_rank, flat.num_tokens_per_rank)


def test_hand_worked_case():
    # 2 nodes x 2 ranks, one expert per rank; source rank 1 = (node 0, local 1).
    idx = torch.tensor([[0, 3], [1, 2], [3, -1], [-1, -1]])
    layout = compute_node_layout(idx, 4, Topology(4, 2, rank=1))
    assert layout.is_token_in_node.tolist() == [[True, True], [True, True], [False, True],
                                                [False, False]]
    assert layout.num_tokens_per_rank.tolist() == [1, 1, 1, 2]
    assert layout.num_network_rows_per_node.tolist() == [0, 3]  # tokens 0, 1, 2 to rank 3
    # Node 0: forwarder rank 1 sends token 0 to rank 0. Node 1: forwarder rank 3 sends token 1
    # to rank 2; tokens 0 and 2 stay on rank 3.
    assert layout.num_nvlink_rows_per_node.tolist() == [1, 1]
    assert network_crossings(layout).tolist() == [1, 1, 1, 0]


def test_node_layout_errors():
    topo = Topology(4, 2)
    with pytest.raises(ValueError, match="num_experts=6 must be a multiple of the EP size 4"):
        compute_node_layout(torch.zeros(2, 2, dtype=torch.int64), 6, topo)
    with pytest.raises(ValueError, match="topk_idx must be int32 or int64"):
        compute_node_layout(torch.zeros(2, 2), 8, topo)
    with pytest.raises(ValueError, match=r"topk_idx must be \[num_tokens, num_topk\]"):
        compute_node_layout(torch.zeros(2, dtype=torch.int64), 8, topo)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\), got 4"):
        compute_node_layout(torch.zeros(2, 2, dtype=torch.int64), 8, topo, rank=4)


NODE_LIMITED_CASES = [  # (nodes, ranks per node, experts, topk, M)
    (2, 2, 16, 4, 1), (4, 2, 32, 8, 2), (8, 8, 256, 8, 4), (3, 2, 24, 6, 2), (4, 1, 16, 3, 2),
    (4, 2, 32, 2, 3), (8, 2, 64, 8, 8),
]


@pytest.mark.parametrize("num_nodes,per_node,num_experts,topk,group_topk", NODE_LIMITED_CASES)
def test_node_limited_topk_matches_megatron_and_bounds_nodes(num_nodes, per_node, num_experts,
                                                             topk, group_topk):
    from megatron.core.transformer.moe.moe_utils import group_limited_topk

    num_tokens = 300
    gen = torch.Generator().manual_seed(num_experts + topk + group_topk)
    scores = torch.rand(num_tokens, num_experts, generator=gen).softmax(dim=-1)
    probs, idx = node_limited_topk(scores, num_groups=num_nodes, group_topk=group_topk,
                                   topk=topk)
    want_probs, want_idx = group_limited_topk(scores, topk=topk, num_tokens=num_tokens,
                                              num_experts=num_experts, num_groups=num_nodes,
                                              group_topk=group_topk)
    assert torch.equal(idx, want_idx)
    assert torch.equal(probs, want_probs)
    # A token's experts lie on at most M nodes (own node counted), so it crosses the network at
    # most M times, and at most M - 1 times when its own node is among them.
    num_ranks = num_nodes * per_node
    for rank in range(0, num_ranks, max(1, per_node - 1)):
        layout = compute_node_layout(idx, num_experts, Topology(num_ranks, per_node, rank))
        nodes_per_token = layout.is_token_in_node.sum(dim=1)
        crossings = network_crossings(layout)
        assert int(nodes_per_token.max()) <= group_topk
        assert int(crossings.max()) <= group_topk
        own = layout.is_token_in_node[:, layout.rank // layout.num_ranks_per_node]
        if own.any():
            assert int(crossings[own].max()) <= group_topk - 1
        assert int(layout.num_network_rows_per_node.sum()) == int(crossings.sum())
    if group_topk < num_nodes:  # the limit binds: plain top-k would exceed it somewhere
        plain = torch.topk(scores, k=topk, dim=-1).indices
        plain_nodes = compute_node_layout(plain, num_experts, Topology(num_ranks, per_node))
        if topk > group_topk:
            assert int(plain_nodes.is_token_in_node.sum(dim=1).max()) > group_topk


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_groups=3, group_topk=1, topk=2), "num_groups=3 must divide num_experts=16"),
    (dict(num_groups=4, group_topk=5, topk=2), r"group_topk=5 must be in \[1, num_groups=4\]"),
    (dict(num_groups=4, group_topk=0, topk=2), r"group_topk=0 must be in"),
    (dict(num_groups=4, group_topk=1, topk=5), r"topk=5 must be in \[1, group_topk \* experts"),
])
def test_node_limited_topk_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        node_limited_topk(torch.rand(3, 16), **kwargs)
    with pytest.raises(ValueError, match="scores must be"):
        node_limited_topk(torch.rand(16), num_groups=4, group_topk=1, topk=1)


def test_node_limited_on_empty_batch():
    probs, idx = node_limited_topk(torch.rand(0, 16), num_groups=4, group_topk=2, topk=4)
    assert idx.shape == (0, 4) and probs.shape == (0, 4)
    layout = compute_node_layout(idx, 16, Topology(8, 2, 5))
    assert layout.num_tokens_per_node.tolist() == [0] * 4
    assert layout.num_nvlink_rows_per_node.tolist() == [0] * 4
