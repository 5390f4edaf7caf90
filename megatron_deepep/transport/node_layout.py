"""Node layout: which nodes every token goes to, and the rows each link carries (pure torch).

Notation: N tokens on the source rank, K = top-k, E experts, R ranks, P ranks per node,
R / P nodes; rank r sits on node `r // P` at local index `r % P` and owns experts
`[r * E / R, (r + 1) * E / R)`. Node b's experts are therefore the contiguous block
`[b * E * P / R, (b + 1) * E * P / R)`.

The hierarchical internode path, for a token of source rank s = (node a, local index i):

* dispatch: for every destination node b != a, one row crosses the network from s to its rail
  peer (b, i); on its own node s is the forwarder itself. The forwarder (b, i) then sends the row
  over NVLink to every destination rank (b, j), j != i; the row for (b, i) itself stays there.
* combine reverses it with the same row counts: every expert rank (b, j), j != i, sends one
  reduced partial row per token over NVLink to (b, i); the forwarder sums its node's partials and
  sends one row per (token, node b != a) back over the network.

So per source rank and destination node b:
    network rows  = tokens with an expert on node b            (0 for b = a)
    NVLink rows   = sum over j != i of tokens with an expert on rank (b, j)
and bytes = rows x row bytes: 2 H for bf16, H + 4 ceil(H / 128) for FP8 e4m3 with 1x128 fp32
scales (what the wire carries per token, metadata excluded). Combine rows are bf16 (2 H).

Group-limited routing (Megatron's `--moe-router-num-groups` = nodes, `--moe-router-group-topk`
= M, DeepSeek-V3's node-limited routing) is `node_limited_topk`: every token's experts lie on at
most M nodes, its own node counted among them when chosen. A token therefore crosses the network
at most M times, and at most M - 1 times when its own node is one of the M.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Tuple

import torch


class NodeShape(Protocol):
    """What the node layout needs of a topology (`transport.topology.Topology` has it)."""

    num_ranks: int
    num_ranks_per_node: int
    rank: int


@dataclasses.dataclass
class NodeLayout:
    """Destination nodes of one source rank's tokens and the rows on each link, all on the device
    of `topk_idx`.

    Attributes:
        rank: the source rank (whose tokens these are).
        num_ranks_per_node: P.
        is_token_in_rank: `[N, R]`, bool: token n has at least one expert on rank r.
        is_token_in_node: `[N, num_nodes]`, bool: token n has at least one expert on node b.
        num_tokens_per_rank: `[R]`, int32: tokens with an expert on rank r (once per rank).
        num_tokens_per_node: `[num_nodes]`, int32: tokens with an expert on node b.
        num_network_rows_per_node: `[num_nodes]`, int32: rows this rank sends over the network
            to its rail peer on node b (one per token in node b; 0 for its own node).
        num_nvlink_rows_per_node: `[num_nodes]`, int32: rows the forwarder on node b (this rank's
            rail peer there, or this rank on its own node) sends over NVLink for these tokens.
    """

    rank: int
    num_ranks_per_node: int
    is_token_in_rank: torch.Tensor
    is_token_in_node: torch.Tensor
    num_tokens_per_rank: torch.Tensor
    num_tokens_per_node: torch.Tensor
    num_network_rows_per_node: torch.Tensor
    num_nvlink_rows_per_node: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.is_token_in_rank.shape[0]

    @property
    def num_ranks(self) -> int:
        return self.is_token_in_rank.shape[1]

    @property
    def num_nodes(self) -> int:
        return self.is_token_in_node.shape[1]


def _check_topk_idx(topk_idx: torch.Tensor) -> None:
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be [num_tokens, num_topk], got shape "
                         f"{tuple(topk_idx.shape)}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")


def compute_node_layout(topk_idx: torch.Tensor, num_experts: int, topology: NodeShape,
                        rank: int = None) -> NodeLayout:
    """Computes the node layout of one source rank in pure torch (no host synchronization).

    Args:
        topk_idx: `[N, K]`, int32 or int64, expert ids in `[-1, num_experts)` (-1 = none).
        num_experts: E, a multiple of `topology.num_ranks`.
        topology: the EP group's nodes (`num_ranks`, `num_ranks_per_node`, `rank`).
        rank: the source rank; default `topology.rank`.

    Returns:
        The `NodeLayout`; see its attributes.
    """
    _check_topk_idx(topk_idx)
    num_ranks, per_node = topology.num_ranks, topology.num_ranks_per_node
    rank = topology.rank if rank is None else rank
    if num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} must be a multiple of the EP size "
                         f"{num_ranks}")
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be in [0, {num_ranks}), got {rank}")
    num_tokens = topk_idx.shape[0]
    num_nodes = num_ranks // per_node
    device = topk_idx.device

    idx = topk_idx.long()
    # Entries with no expert go to an extra column that is dropped.
    dest_rank = torch.where(idx >= 0, idx // (num_experts // num_ranks),
                            torch.full_like(idx, num_ranks))
    hit = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.bool, device=device)
    hit.scatter_(1, dest_rank, torch.ones_like(dest_rank, dtype=torch.bool))
    is_token_in_rank = hit[:, :num_ranks].contiguous()
    is_token_in_node = is_token_in_rank.view(num_tokens, num_nodes, per_node).any(dim=2)

    num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
    num_tokens_per_node = is_token_in_node.sum(dim=0, dtype=torch.int32)
    node, local = divmod(rank, per_node)
    num_network_rows_per_node = num_tokens_per_node.clone()
    num_network_rows_per_node[node] = 0
    per_node_rank = num_tokens_per_rank.view(num_nodes, per_node)
    num_nvlink_rows_per_node = per_node_rank.sum(dim=1, dtype=torch.int32) - per_node_rank[:, local]

    return NodeLayout(
        rank=rank,
        num_ranks_per_node=per_node,
        is_token_in_rank=is_token_in_rank,
        is_token_in_node=is_token_in_node,
        num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_node=num_tokens_per_node,
        num_network_rows_per_node=num_network_rows_per_node,
        num_nvlink_rows_per_node=num_nvlink_rows_per_node,
    )


def node_limited_topk(scores: torch.Tensor, *, num_groups: int, group_topk: int,
                      topk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k routing, as Megatron's `moe_utils.group_limited_topk` computes it.

    The experts form `num_groups` contiguous groups (with `num_groups` = nodes, a group is the
    experts of one node); each token picks the `group_topk` groups with the largest sum of their
    top-`(topk // group_topk)` scores, then its `topk` experts among those groups only.

    Args:
        scores: `[N, E]`, float: the router's scores.
        num_groups: groups (nodes); divides E.
        group_topk: M, groups per token, in `[1, num_groups]`.
        topk: experts per token, at most `group_topk * E / num_groups`.

    Returns:
        `(probs [N, topk], topk_idx [N, topk] int64)`, sorted by score like `torch.topk`.
        N = 0 is legal (Megatron's reshape to `[N, -1]` is not).
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [num_tokens, num_experts], got shape "
                         f"{tuple(scores.shape)}")
    num_tokens, num_experts = scores.shape
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide num_experts={num_experts}")
    if not 1 <= group_topk <= num_groups:
        raise ValueError(f"group_topk={group_topk} must be in [1, num_groups={num_groups}]")
    experts_per_group = num_experts // num_groups
    if not 1 <= topk <= group_topk * experts_per_group:
        raise ValueError(f"topk={topk} must be in [1, group_topk * experts per group = "
                         f"{group_topk * experts_per_group}]")
    group_scores = scores.view(num_tokens, num_groups, experts_per_group).topk(
        topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(
        num_tokens, num_groups, experts_per_group).reshape(num_tokens, num_experts)
    masked_scores = scores.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(masked_scores, k=topk, dim=-1)
