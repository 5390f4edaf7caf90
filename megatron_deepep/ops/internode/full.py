"""Full staging's kernels (`cuda_src/internode/full.cu`, the default staging): the node's
NVLink staging holds a slot for every (source rank, token slot). Its families hold node layout,
notify, send, forward and receive (dispatch) and the partials, the forwarder's sums and the
reduce (combine); node layout, notify, send and reduce are launched through `common`."""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_deepep.kernels import jit
from megatron_deepep.ops.internode.args import INTERNODE_THREADS, launch_internode
from megatron_deepep.ops.launch import index_type_name, row_dtype_code, wire_format

SOURCE = "internode/full.cu"
INTERNODE_KERNELS = ("internode_node_layout", "internode_notify", "internode_dispatch_send",
                     "internode_forward", "internode_dispatch_recv", "internode_combine_send",
                     "internode_combine_forward", "internode_combine_reduce")
KERNELS = INTERNODE_KERNELS  # every kernel of the source


def internode_expressions(num_topk: int, index_type: str, fp8=None) -> Tuple[str, ...]:
    """The dispatch kernels of the internode transport for one top-k, topk_idx index type ("int"
    or "long long") and wire format (`fp8`: an `Fp8Dispatch` or None): one linked module."""
    fmt, dequant, _ = wire_format(fp8)
    k, idx, both = num_topk, index_type, ("false", "true")
    dq = jit.render_template_arg(dequant)
    return (("internode_node_layout", "internode_notify", f"internode_forward<{k}>")
            + tuple(f"internode_dispatch_send<{k}, {c}, {idx}, {fmt}>" for c in both)
            + tuple(f"internode_dispatch_recv<{k}, {c}, {fmt}, {dq}>" for c in both))


def internode_combine_expressions(num_topk: int, row_dtype: int) -> Tuple[str, ...]:
    """The combine kernels of the internode transport for one top-k and row dtype code
    (`ROW_DTYPE_CODES`): one linked module."""
    k, dt, both = num_topk, row_dtype, ("false", "true")
    return (tuple(f"internode_combine_send<{k}, {w}, {g}, {dt}>" for w in both for g in both)
            + tuple(f"internode_combine_forward<{k}, {g}, {dt}>" for g in both)
            + tuple(f"internode_combine_reduce<{k}, {g}, {dt}>" for g in both))


def _dispatch_family(topk_idx: torch.Tensor, fp8) -> Tuple[str, ...]:
    return internode_expressions(topk_idx.shape[1], index_type_name(topk_idx), fp8)


def _combine_family(topk_idx: torch.Tensor, y: torch.Tensor) -> Tuple[str, ...]:
    return internode_combine_expressions(topk_idx.shape[1], row_dtype_code(y))


def internode_forward(topk_idx: torch.Tensor, fp8, num_sms: int, fields: dict) -> None:
    """Copies every received wire row into the staging of its destination ranks in this node."""
    launch_internode(SOURCE, _dispatch_family(topk_idx, fp8), "internode_forward",
                     (topk_idx.shape[1],), num_sms, INTERNODE_THREADS, fields)


def internode_dispatch_recv(topk_idx: torch.Tensor, cached: bool, fp8, num_sms: int,
                            fields: dict) -> None:
    """Expands the staged rows of every source into the expert-major recv_x (dequantized, or
    FP8 rows and scales, as `fp8` asks)."""
    fmt, dequant, _ = wire_format(fp8)
    launch_internode(SOURCE, _dispatch_family(topk_idx, fp8), "internode_dispatch_recv",
                     (topk_idx.shape[1], cached, fmt, dequant), num_sms, INTERNODE_THREADS,
                     fields)


def internode_combine_send(topk_idx: torch.Tensor, y: torch.Tensor, weighted: bool,
                           with_weights: bool, num_sms: int, fields: dict) -> None:
    """One partial row per staged token (rows of `y`'s dtype), to the token's forwarder in this
    node."""
    launch_internode(SOURCE, _combine_family(topk_idx, y), "internode_combine_send",
                     (topk_idx.shape[1], weighted, with_weights, row_dtype_code(y)), num_sms,
                     INTERNODE_THREADS, fields)


def internode_combine_forward(topk_idx: torch.Tensor, y: torch.Tensor, with_weights: bool,
                              num_sms: int, fields: dict) -> None:
    """Sums this node's partials per forwarded token and puts them back to the sources."""
    launch_internode(SOURCE, _combine_family(topk_idx, y), "internode_combine_forward",
                     (topk_idx.shape[1], with_weights, row_dtype_code(y)), num_sms,
                     INTERNODE_THREADS, fields)
