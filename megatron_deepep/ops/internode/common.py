"""The kernels several node stagings share, and the table of stagings. Node layout and notify
(`cuda_src/internode/common.cuh`) open every staging's dispatch; send and reduce
(`cuda_src/internode/send_reduce.cuh`) are full and ring staging's network leg. Each source of
a staging includes the shared kernels it runs, so a wrapper here launches from the module of
the staging in use (`ring` / `net`: ring staging's / the network ring's)."""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

from megatron_deepep.ops.internode import full as full_staging
from megatron_deepep.ops.internode import net_ring as net_staging
from megatron_deepep.ops.internode import ring as ring_staging
from megatron_deepep.ops.internode.args import (INTERNODE_NOTIFY_THREADS, INTERNODE_THREADS,
                                                launch_internode)
from megatron_deepep.ops.launch import index_type_name, row_dtype_code, wire_format

# Staging ("full", "ring", or "net": ring staging with the network ring) -> its module.
_STAGINGS = {"full": full_staging, "ring": ring_staging, "net": net_staging}
# Staging -> the source its kernels are linked from, and every kernel that source holds.
INTERNODE_SOURCES: Dict[str, str] = {name: m.SOURCE for name, m in _STAGINGS.items()}
INTERNODE_STAGING_KERNELS: Dict[str, Tuple[str, ...]] = {
    name: m.KERNELS for name, m in _STAGINGS.items()}


def internode_families(staging: str) -> Tuple[Callable, Callable]:
    """The (dispatch, combine) expression functions of a staging mode: "full", "ring" or "net"
    (ring staging with the network ring)."""
    return {"full": (full_staging.internode_expressions,
                     full_staging.internode_combine_expressions),
            "ring": (ring_staging.internode_ring_expressions,
                     ring_staging.internode_ring_combine_expressions),
            "net": (net_staging.internode_net_expressions,
                    net_staging.internode_net_combine_expressions)}[staging]


def _staging(ring: bool, net: bool) -> str:
    return "net" if net else "ring" if ring else "full"


def _launch_dispatch(topk_idx: torch.Tensor, fp8, staging: str, name: str,
                     template_args: tuple, num_blocks: int, threads: int, fields: dict) -> None:
    family = internode_families(staging)[0](topk_idx.shape[1], index_type_name(topk_idx), fp8)
    launch_internode(INTERNODE_SOURCES[staging], family, name, template_args, num_blocks,
                     threads, fields)


def internode_node_layout(topk_idx: torch.Tensor, fp8, num_nodes: int, fields: dict,
                          ring: bool = False, net: bool = False) -> None:
    """Node-level layout (token_slot_in_node, node_slot_token, num_tokens_per_node) from
    is_token_in_rank: one block per node. `ring` / `net`: from ring staging's / the network
    ring's module."""
    _launch_dispatch(topk_idx, fp8, _staging(ring, net), "internode_node_layout", (),
                     num_nodes, INTERNODE_THREADS, fields)


def internode_notify(topk_idx: torch.Tensor, fp8, fields: dict, ring: bool = False,
                     net: bool = False) -> None:
    """Counts to every PE, then this rank's receive layout and forwarding counts (`net`: also
    the rail counts, into the handle's `ring_base`)."""
    _launch_dispatch(topk_idx, fp8, _staging(ring, net), "internode_notify", (), 1,
                     INTERNODE_NOTIFY_THREADS, fields)


def internode_dispatch_send(topk_idx: torch.Tensor, cached: bool, fp8, num_sms: int,
                            fields: dict, ring: bool = False) -> None:
    """Packs (quantizes, for `fp8`) and puts every token once per destination node."""
    _launch_dispatch(topk_idx, fp8, _staging(ring, False), "internode_dispatch_send",
                     (topk_idx.shape[1], cached, index_type_name(topk_idx), wire_format(fp8)[0]),
                     num_sms, INTERNODE_THREADS, fields)


def internode_combine_reduce(topk_idx: torch.Tensor, y: torch.Tensor, with_weights: bool,
                             num_sms: int, fields: dict, ring: bool = False) -> None:
    """Sums each token's partials over its destination nodes, in node order."""
    staging = _staging(ring, False)
    family = internode_families(staging)[1](topk_idx.shape[1], row_dtype_code(y))
    launch_internode(INTERNODE_SOURCES[staging], family, "internode_combine_reduce",
                     (topk_idx.shape[1], with_weights, row_dtype_code(y)), num_sms,
                     INTERNODE_THREADS, fields)
