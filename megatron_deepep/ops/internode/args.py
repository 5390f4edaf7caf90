"""The one argument struct of every internode kernel and the launch they share
(`cuda_src/common/args.cuh`'s `InternodeArgs`; the kernels in `cuda_src/internode/`, linked
against NVSHMEM by `kernels.nvshmem_link`). The transport fills the fields of the call
(`fields`: every name of InternodeArgs); each wrapper picks the template arguments and the grid.
All kernels of one family (a staging's dispatch or combine kernels for one top-k, index type
and wire format, or row dtype) are linked into one module on first use (one link, one module
init)."""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_deepep.kernels import jit, nvshmem_link
from megatron_deepep.kernels.jit import F32, I32, I64, U32, U64, KernelArgs, Ptr
from megatron_deepep.ops.launch import launch_stream, wire_format


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


INTERNODE_THREADS = 512
INTERNODE_NOTIFY_THREADS = 256  # one thread per local expert (kMaxLocalExperts)
INTERNODE_FIELDS = tuple(name for name, _ in InternodeArgs._fields_)


def launch_internode(source: str, family: Tuple[str, ...], name: str, template_args: tuple,
                     num_blocks: int, threads: int, fields: dict,
                     cooperative: bool = False) -> None:
    """Launches `name<template_args...>` from the module of `family` (its name expressions)
    linked from `cuda_src/<source>`, on the launch stream; `cooperative` for the persistent ring
    kernels, whose blocks wait for each other (all must be resident at once:
    docs/internode.md)."""
    expr = name
    if template_args:
        expr += "<" + ", ".join(jit.render_template_arg(a) for a in template_args) + ">"
    kernel = nvshmem_link.get_kernels(source, family, torch.cuda.current_device())[expr]
    kernel.launch(num_blocks, threads, InternodeArgs.fill(**fields), launch_stream(),
                  cooperative=cooperative)


def internode_wire(fp8, hidden: int) -> dict:
    """The FP8 fields of `InternodeArgs` (`fp8`: an `Fp8Dispatch` or None): the wire row's bytes
    (e4m3 data then its scales, or the bf16 row) and the quantizer's epsilon."""
    _, _, amax_epsilon = wire_format(fp8)
    wire_bytes = 2 * hidden if fp8 is None else fp8.fmt.bytes_per_token(hidden)
    return dict(wire_bytes=wire_bytes, amax_epsilon=amax_epsilon)
