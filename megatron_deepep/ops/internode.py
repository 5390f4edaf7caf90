"""The internode transport's kernels (cuda_src/internode.cu; NVSHMEM-linked by
`kernels.nvshmem_link`). Every kernel takes the same `InternodeArgs`; the transport fills the
fields of the call and each wrapper picks the template arguments and the grid."""

from __future__ import annotations

from typing import Callable, Tuple

import torch

from megatron_deepep.kernels import jit, nvshmem_link
from megatron_deepep.kernels.jit import F32, I32, I64, U32, U64, KernelArgs, Ptr
from megatron_deepep.ops.launch import index_type_name, launch_stream, row_dtype_code, wire_format


class InternodeArgs(KernelArgs):
    c_name = "mdeep::InternodeArgs"
    _fields_ = [
        ("heap", Ptr), ("notify_recv", I64), ("notify_send", I64), ("signals", I64),
        ("flags", I64), ("net_send", I64), ("net_recv", I64), ("stage_rows", I64),
        ("stage_meta", I64), ("comb_stage", I64), ("comb_send", I64), ("comb_recv", I64),
        ("row_stride", I64), ("record_stride", I64), ("meta_stride", I64),
        ("weight_stride", I64), ("max_tokens", I32), ("chunk_tokens", I32), ("rank", I32),
        ("num_ranks", I32), ("ranks_per_node", I32), ("num_nodes", I32), ("pe_of_rank", Ptr),
        ("epoch_word", Ptr), ("timeout_ns", U64), ("error_claim", Ptr), ("error_record", Ptr),
        ("block_counters", Ptr), ("chunks_seen", Ptr), ("topk_idx", Ptr),
        ("topk_weights", Ptr), ("pos_in_expert", Ptr), ("num_tokens_per_rank", Ptr),
        ("num_tokens_per_expert", Ptr), ("is_token_in_rank", Ptr),
        ("token_slot_in_rank", Ptr), ("num_tokens_per_node", Ptr),
        ("token_slot_in_node", Ptr), ("node_slot_token", Ptr), ("num_tokens", I32),
        ("num_experts", I32), ("num_local", I32), ("hidden", I32), ("num_topk", I32),
        ("alignment", I32), ("max_recv_rows", I32), ("num_recv_tokens_per_rank", Ptr),
        ("num_recv_tokens_per_expert", Ptr), ("tokens_per_expert", Ptr),
        ("expert_row_start", Ptr), ("src_expert_offset", Ptr), ("fwd_count", Ptr),
        ("fwd_slots", Ptr), ("slot_rows", Ptr), ("host_info", Ptr), ("host_epoch", U32),
        ("x", Ptr),
        ("recv_x", Ptr), ("recv_weights", Ptr), ("max_rows", I32), ("y", Ptr), ("out", Ptr),
        ("out_weights", Ptr), ("grad_row_weights", Ptr), ("x_scales", Ptr),
        ("recv_scales", Ptr), ("amax_epsilon", F32), ("wire_bytes", I64),
        ("ring_words", I64), ("ring_seen", Ptr), ("ring_base", Ptr), ("ring_slots", I32),
        ("net_words", I64), ("net_counters", I64), ("rail_counts", I64), ("net_sent", Ptr),
        ("net_chunks", I32)]


# Sources whose kernels call NVSHMEM's device API: nvshmem_link builds them (tests/
# test_nvshmem_link.py links them in the CPU tier), not the plain NVRTC path.
NVSHMEM_SOURCES = ("bench/internode_leg.cu", "internode.cu")

INTERNODE_KERNELS = ("internode_node_layout", "internode_notify", "internode_dispatch_send",
                     "internode_forward", "internode_dispatch_recv", "internode_combine_send",
                     "internode_combine_forward", "internode_combine_reduce")
# Ring staging (MDEEP_INTERNODE_STAGING=ring) adds these; it shares node layout, notify, send and
# reduce with the full staging's kernels.
INTERNODE_RING_KERNELS = ("internode_ring_count", "internode_ring_dispatch",
                          "internode_ring_combine")
# The network ring (MDEEP_INTERNODE_NET_RING_CHUNKS, on top of ring staging) adds these; it shares
# node layout and notify, and replaces every other kernel.
INTERNODE_NET_KERNELS = ("internode_net_dispatch", "internode_net_combine")


# ---------------------------------------------------------------------------------------------
# The internode transport (cuda_src/internode.cu; NVSHMEM-linked). Every kernel takes the same
# `InternodeArgs`; the transport fills the fields of the call (`fields`: every name of
# InternodeArgs) and each wrapper picks the template arguments and the grid. All kernels of one
# (top-k, topk_idx dtype) are linked into one module on first use (one link, one module init).

INTERNODE_THREADS = 512
INTERNODE_NOTIFY_THREADS = 256  # one thread per local expert (kMaxLocalExperts)
INTERNODE_FIELDS = tuple(name for name, _ in InternodeArgs._fields_)


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


def internode_families(staging: str) -> Tuple[Callable, Callable]:
    """The (dispatch, combine) expression functions of a staging mode: "full", "ring" or "net"
    (ring staging with the network ring)."""
    return {"full": (internode_expressions, internode_combine_expressions),
            "ring": (internode_ring_expressions, internode_ring_combine_expressions),
            "net": (internode_net_expressions, internode_net_combine_expressions)}[staging]


def _internode(family: Tuple[str, ...], name: str, template_args: tuple, num_blocks: int,
               threads: int, fields: dict, cooperative: bool = False) -> None:
    """Launches one kernel of `family`; `cooperative` for the persistent ring kernels, whose
    blocks wait for each other (all must be resident at once: docs/internode.md)."""
    expr = name
    if template_args:
        expr += "<" + ", ".join(jit.render_template_arg(a) for a in template_args) + ">"
    kernel = nvshmem_link.get_kernels("internode.cu", family, torch.cuda.current_device())[expr]
    kernel.launch(num_blocks, threads, InternodeArgs.fill(**fields), launch_stream(),
                  cooperative=cooperative)


def _dispatch_family(topk_idx: torch.Tensor, fp8, ring: bool = False,
                     net: bool = False) -> Tuple[str, ...]:
    expressions = internode_families("net" if net else "ring" if ring else "full")[0]
    return expressions(topk_idx.shape[1], index_type_name(topk_idx), fp8)


def _combine_family(topk_idx: torch.Tensor, y: torch.Tensor,
                    ring: bool = False, net: bool = False) -> Tuple[str, ...]:
    expressions = internode_families("net" if net else "ring" if ring else "full")[1]
    return expressions(topk_idx.shape[1], row_dtype_code(y))


def internode_wire(fp8, hidden: int) -> dict:
    """The FP8 fields of `InternodeArgs` (`fp8`: an `Fp8Dispatch` or None): the wire row's bytes
    (e4m3 data then its scales, or the bf16 row) and the quantizer's epsilon."""
    _, _, amax_epsilon = wire_format(fp8)
    wire_bytes = 2 * hidden if fp8 is None else fp8.fmt.bytes_per_token(hidden)
    return dict(wire_bytes=wire_bytes, amax_epsilon=amax_epsilon)


def internode_node_layout(topk_idx: torch.Tensor, fp8, num_nodes: int, fields: dict,
                          ring: bool = False, net: bool = False) -> None:
    """Node-level layout (token_slot_in_node, node_slot_token, num_tokens_per_node) from
    is_token_in_rank: one block per node. `ring` / `net`: from ring staging's / the network
    ring's module."""
    _internode(_dispatch_family(topk_idx, fp8, ring, net), "internode_node_layout", (),
               num_nodes, INTERNODE_THREADS, fields)


def internode_notify(topk_idx: torch.Tensor, fp8, fields: dict, ring: bool = False,
                     net: bool = False) -> None:
    """Counts to every PE, then this rank's receive layout and forwarding counts (`net`: also
    the rail counts, into the handle's `ring_base`)."""
    _internode(_dispatch_family(topk_idx, fp8, ring, net), "internode_notify", (), 1,
               INTERNODE_NOTIFY_THREADS, fields)


def internode_dispatch_send(topk_idx: torch.Tensor, cached: bool, fp8, num_sms: int,
                            fields: dict, ring: bool = False) -> None:
    """Packs (quantizes, for `fp8`) and puts every token once per destination node."""
    _internode(_dispatch_family(topk_idx, fp8, ring), "internode_dispatch_send",
               (topk_idx.shape[1], cached, index_type_name(topk_idx), wire_format(fp8)[0]), num_sms,
               INTERNODE_THREADS, fields)


def internode_forward(topk_idx: torch.Tensor, fp8, num_sms: int, fields: dict) -> None:
    """Copies every received wire row into the staging of its destination ranks in this node."""
    _internode(_dispatch_family(topk_idx, fp8), "internode_forward", (topk_idx.shape[1],),
               num_sms, INTERNODE_THREADS, fields)


def internode_dispatch_recv(topk_idx: torch.Tensor, cached: bool, fp8, num_sms: int,
                            fields: dict) -> None:
    """Expands the staged rows of every source into the expert-major recv_x (dequantized, or
    FP8 rows and scales, as `fp8` asks)."""
    fmt, dequant, _ = wire_format(fp8)
    _internode(_dispatch_family(topk_idx, fp8), "internode_dispatch_recv",
               (topk_idx.shape[1], cached, fmt, dequant), num_sms, INTERNODE_THREADS, fields)


def internode_combine_send(topk_idx: torch.Tensor, y: torch.Tensor, weighted: bool,
                           with_weights: bool, num_sms: int, fields: dict) -> None:
    """One partial row per staged token (rows of `y`'s dtype), to the token's forwarder in this
    node."""
    _internode(_combine_family(topk_idx, y), "internode_combine_send",
               (topk_idx.shape[1], weighted, with_weights, row_dtype_code(y)), num_sms,
               INTERNODE_THREADS, fields)


def internode_combine_forward(topk_idx: torch.Tensor, y: torch.Tensor, with_weights: bool,
                              num_sms: int, fields: dict) -> None:
    """Sums this node's partials per forwarded token and puts them back to the sources."""
    _internode(_combine_family(topk_idx, y), "internode_combine_forward",
               (topk_idx.shape[1], with_weights, row_dtype_code(y)), num_sms, INTERNODE_THREADS,
               fields)


def internode_combine_reduce(topk_idx: torch.Tensor, y: torch.Tensor, with_weights: bool,
                             num_sms: int, fields: dict, ring: bool = False) -> None:
    """Sums each token's partials over its destination nodes, in node order."""
    _internode(_combine_family(topk_idx, y, ring), "internode_combine_reduce",
               (topk_idx.shape[1], with_weights, row_dtype_code(y)), num_sms, INTERNODE_THREADS,
               fields)


def internode_ring_count(topk_idx: torch.Tensor, fp8, num_nodes: int, fields: dict) -> None:
    """Ring staging, on the forwarder: waits for its rail peers' rows, then counts them per
    (node rank, source node) into the handle's `ring_base`: one block per source node."""
    _internode(_dispatch_family(topk_idx, fp8, True), "internode_ring_count",
               (topk_idx.shape[1],), num_nodes, INTERNODE_THREADS, fields)


def internode_ring_dispatch(topk_idx: torch.Tensor, cached: bool, fp8, num_blocks: int,
                            fields: dict) -> None:
    """Ring staging: forwards the received rows through the node's rings and expands the rows
    the rings bring into recv_x, in one kernel of `num_blocks` co-resident blocks."""
    fmt, dequant, _ = wire_format(fp8)
    _internode(_dispatch_family(topk_idx, fp8, True), "internode_ring_dispatch",
               (topk_idx.shape[1], cached, fmt, dequant), num_blocks, INTERNODE_THREADS, fields,
               cooperative=True)


def internode_ring_combine(topk_idx: torch.Tensor, y: torch.Tensor, weighted: bool,
                           with_weights: bool, num_blocks: int, fields: dict) -> None:
    """Ring staging: sends the partials through the node's rings and sums the forwarded tokens'
    partials, putting them back by chunks, in one kernel of `num_blocks` co-resident blocks."""
    _internode(_combine_family(topk_idx, y, True), "internode_ring_combine",
               (topk_idx.shape[1], weighted, with_weights, row_dtype_code(y)), num_blocks,
               INTERNODE_THREADS, fields, cooperative=True)


# Warp groups per rank of the network ring's kernels (kNetGroupsPerRank in internode.cu): their
# grid needs at least this many x L warps, so that every role has a warp.
NET_ROLE_GROUPS_PER_RANK = 3


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
    _internode(_dispatch_family(topk_idx, fp8, net=True), "internode_net_dispatch",
               (topk_idx.shape[1], cached, index_type_name(topk_idx), fmt, dequant), num_blocks,
               INTERNODE_THREADS, fields, cooperative=True)


def internode_net_combine(topk_idx: torch.Tensor, y: torch.Tensor, weighted: bool,
                          with_weights: bool, num_blocks: int, fields: dict) -> None:
    """Network ring: sends the partials through the node's rings, sums the forwarded tokens'
    partials and puts them back by chunks, and sums this rank's tokens' rows from every node
    into `out`, in one kernel of `num_blocks` co-resident blocks."""
    assert num_blocks >= net_ring_min_blocks(fields["ranks_per_node"]), num_blocks
    _internode(_combine_family(topk_idx, y, net=True), "internode_net_combine",
               (topk_idx.shape[1], weighted, with_weights, row_dtype_code(y)), num_blocks,
               INTERNODE_THREADS, fields, cooperative=True)
