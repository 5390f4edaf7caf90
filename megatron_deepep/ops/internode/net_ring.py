"""The network ring's kernels (`cuda_src/internode/net_ring.cu`,
MDEEP_INTERNODE_NET_RING_CHUNKS > 0 on top of ring staging): the network regions become K chunk
slots per rail peer. Its families hold node layout and notify as with full staging, then the
one kernel that sends, forwards and expands (dispatch), and the one kernel of partials, the
forwarder's sums and the source's reduce (combine); node layout and notify are launched through
`common`."""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_deepep.kernels import jit
from megatron_deepep.ops.internode.args import INTERNODE_THREADS, launch_internode
from megatron_deepep.ops.launch import index_type_name, row_dtype_code, wire_format

SOURCE = "internode/net_ring.cu"
# The network ring's own kernels; it shares node layout and notify, and replaces every other.
INTERNODE_NET_KERNELS = ("internode_net_dispatch", "internode_net_combine")
KERNELS = ("internode_node_layout", "internode_notify") + INTERNODE_NET_KERNELS
# Warp groups per rank of the network ring's kernels (kNetGroupsPerRank in net_ring.cu): their
# grid needs at least this many x L warps, so that every role has a warp.
NET_ROLE_GROUPS_PER_RANK = 3


def internode_net_expressions(num_topk: int, index_type: str, fp8=None) -> Tuple[str, ...]:
    """The dispatch kernels of the network ring for one top-k, index type and wire format: node
    layout and notify as with full staging, then the one kernel that sends, forwards and expands
    (one linked module)."""
    fmt, dequant, _ = wire_format(fp8)
    k, idx, both = num_topk, index_type, ("false", "true")
    dq = jit.render_template_arg(dequant)
    return (("internode_node_layout", "internode_notify")
            + tuple(f"internode_net_dispatch<{k}, {c}, {idx}, {fmt}, {dq}>" for c in both))


def internode_net_combine_expressions(num_topk: int, row_dtype: int) -> Tuple[str, ...]:
    """The combine kernel of the network ring for one top-k and row dtype code: partials, the
    forwarder's sums and the source's reduce in one kernel."""
    k, dt, both = num_topk, row_dtype, ("false", "true")
    return tuple(f"internode_net_combine<{k}, {w}, {g}, {dt}>" for w in both for g in both)


def net_ring_min_blocks(ranks_per_node: int) -> int:
    """The fewest blocks of INTERNODE_THREADS that give every role of the network ring's
    kernels a warp (3 L warps)."""
    warps = INTERNODE_THREADS // 32
    return -(-NET_ROLE_GROUPS_PER_RANK * ranks_per_node // warps)


def internode_net_dispatch(topk_idx: torch.Tensor, cached: bool, fp8, num_blocks: int,
                           fields: dict) -> None:
    """Network ring: sends this rank's chunks, forwards the chunks its rail peers sent through
    the node's rings and expands the rows the rings bring into recv_x, in one kernel of
    `num_blocks` co-resident blocks (at least `net_ring_min_blocks`)."""
    assert num_blocks >= net_ring_min_blocks(fields["ranks_per_node"]), num_blocks
    fmt, dequant, _ = wire_format(fp8)
    family = internode_net_expressions(topk_idx.shape[1], index_type_name(topk_idx), fp8)
    launch_internode(SOURCE, family, "internode_net_dispatch",
                     (topk_idx.shape[1], cached, index_type_name(topk_idx), fmt, dequant),
                     num_blocks, INTERNODE_THREADS, fields, cooperative=True)


def internode_net_combine(topk_idx: torch.Tensor, y: torch.Tensor, weighted: bool,
                          with_weights: bool, num_blocks: int, fields: dict) -> None:
    """Network ring: sends the partials through the node's rings, sums the forwarded tokens'
    partials and puts them back by chunks, and sums this rank's tokens' rows from every node
    into `out`, in one kernel of `num_blocks` co-resident blocks."""
    assert num_blocks >= net_ring_min_blocks(fields["ranks_per_node"]), num_blocks
    family = internode_net_combine_expressions(topk_idx.shape[1], row_dtype_code(y))
    launch_internode(SOURCE, family, "internode_net_combine",
                     (topk_idx.shape[1], weighted, with_weights, row_dtype_code(y)), num_blocks,
                     INTERNODE_THREADS, fields, cooperative=True)
