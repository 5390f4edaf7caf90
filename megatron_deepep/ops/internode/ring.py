"""Ring staging's kernels (`cuda_src/internode/ring.cu`, MDEEP_INTERNODE_STAGING=ring): the
node's staging bounded to L rings per rank. Its families hold node layout, notify and send as
with full staging, then the ring count and the one kernel that forwards and expands (dispatch),
and the one kernel that sends the partials and sums them on the forwarder, then reduce as with
full staging (combine); the shared ones are launched through `common`."""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_deepep.kernels import jit
from megatron_deepep.ops.internode.args import INTERNODE_THREADS, launch_internode
from megatron_deepep.ops.launch import index_type_name, row_dtype_code, wire_format

SOURCE = "internode/ring.cu"
# Ring staging's own kernels; it shares node layout, notify, send and reduce with full staging.
INTERNODE_RING_KERNELS = ("internode_ring_count", "internode_ring_dispatch",
                          "internode_ring_combine")
KERNELS = ("internode_node_layout", "internode_notify", "internode_dispatch_send",
           "internode_combine_reduce") + INTERNODE_RING_KERNELS


def internode_ring_expressions(num_topk: int, index_type: str, fp8=None) -> Tuple[str, ...]:
    """The dispatch kernels of ring staging for one top-k, index type and wire format: node
    layout, notify and send as with full staging, then the ring count and the one kernel that
    forwards and expands (one linked module)."""
    fmt, dequant, _ = wire_format(fp8)
    k, idx, both = num_topk, index_type, ("false", "true")
    dq = jit.render_template_arg(dequant)
    return (("internode_node_layout", "internode_notify", f"internode_ring_count<{k}>")
            + tuple(f"internode_dispatch_send<{k}, {c}, {idx}, {fmt}>" for c in both)
            + tuple(f"internode_ring_dispatch<{k}, {c}, {fmt}, {dq}>" for c in both))


def internode_ring_combine_expressions(num_topk: int, row_dtype: int) -> Tuple[str, ...]:
    """The combine kernels of ring staging for one top-k and row dtype code: the one kernel that
    sends the partials and sums them on the forwarder, then reduce as with full staging."""
    k, dt, both = num_topk, row_dtype, ("false", "true")
    return (tuple(f"internode_ring_combine<{k}, {w}, {g}, {dt}>" for w in both for g in both)
            + tuple(f"internode_combine_reduce<{k}, {g}, {dt}>" for g in both))


def _dispatch_family(topk_idx: torch.Tensor, fp8) -> Tuple[str, ...]:
    return internode_ring_expressions(topk_idx.shape[1], index_type_name(topk_idx), fp8)


def internode_ring_count(topk_idx: torch.Tensor, fp8, num_nodes: int, fields: dict) -> None:
    """Ring staging, on the forwarder: waits for its rail peers' rows, then counts them per
    (node rank, source node) into the handle's `ring_base`: one block per source node."""
    launch_internode(SOURCE, _dispatch_family(topk_idx, fp8), "internode_ring_count",
                     (topk_idx.shape[1],), num_nodes, INTERNODE_THREADS, fields)


def internode_ring_dispatch(topk_idx: torch.Tensor, cached: bool, fp8, num_blocks: int,
                            fields: dict) -> None:
    """Ring staging: forwards the received rows through the node's rings and expands the rows
    the rings bring into recv_x, in one kernel of `num_blocks` co-resident blocks."""
    fmt, dequant, _ = wire_format(fp8)
    launch_internode(SOURCE, _dispatch_family(topk_idx, fp8), "internode_ring_dispatch",
                     (topk_idx.shape[1], cached, fmt, dequant), num_blocks, INTERNODE_THREADS,
                     fields, cooperative=True)


def internode_ring_combine(topk_idx: torch.Tensor, y: torch.Tensor, weighted: bool,
                           with_weights: bool, num_blocks: int, fields: dict) -> None:
    """Ring staging: sends the partials through the node's rings and sums the forwarded tokens'
    partials, putting them back by chunks, in one kernel of `num_blocks` co-resident blocks."""
    family = internode_ring_combine_expressions(topk_idx.shape[1], row_dtype_code(y))
    launch_internode(SOURCE, family, "internode_ring_combine",
                     (topk_idx.shape[1], weighted, with_weights, row_dtype_code(y)), num_blocks,
                     INTERNODE_THREADS, fields, cooperative=True)
