"""One thin typed wrapper per CUDA operation: picks template arguments and launches.

One module per source in `cuda_src/`, named after it (`ops.dispatch` wraps `dispatch.cu`,
`ops.internode.ring` wraps `internode/ring.cu`, `ops.bench.ceiling` wraps `bench/ceiling.cu`);
`launch` holds what they share. The only package that calls `kernels`. Callers (the transports)
have validated the user's arguments; wrappers assert internal invariants (dtypes, contiguity)
and pass raw pointers. Every launch goes on the torch stream that is current when it is called,
or on `launch_on`'s.

Every kernel takes one argument struct (`cuda_src/common/args.cuh`); the `KernelArgs`
subclasses mirror them field by field and are filled by name (a missing field is an error).
The CPU tests compile their sizes and offsets against the CUDA side (`KERNEL_ARGS`).

This module is the face the transports use: it re-exports the product kernels' wrappers (the
benchmark- and test-only ones stay in `ops.bench`).
"""

from __future__ import annotations

from typing import Sequence

from megatron_deepep.kernels.jit import NvrtcUnavailable  # noqa: F401 (callers above ops catch it)
from megatron_deepep.ops.bench.ceiling import (  # noqa: F401
    FanInArgs, FanOutArgs, FanOutBytesArgs, FillArgs, PeerCopyArgs)
from megatron_deepep.ops.bench.internode_leg import LegArgs  # noqa: F401
from megatron_deepep.ops.bench.quantize import QuantizeArgs  # noqa: F401
from megatron_deepep.ops.combine import (  # noqa: F401
    CombineFusedArgs, CombineLocalArgs, CombineReduceArgs, CombineSendArgs, combine_fused,
    combine_local, combine_reduce, combine_send)
from megatron_deepep.ops.dispatch import (  # noqa: F401
    DISPATCH_STAGE_MAX_BYTES, DispatchFusedArgs, DispatchLocalArgs, DispatchRecvArgs,
    DispatchSendArgs, dispatch_fused, dispatch_local, dispatch_recv, dispatch_send,
    local_quantizes_rows)
from megatron_deepep.ops.fp8 import DequantizeArgs, dequantize_rows  # noqa: F401
from megatron_deepep.ops.fp8_columnwise import (  # noqa: F401
    COLUMNWISE_THREADS, ColumnwiseArgs, columnwise_from_rowwise)
from megatron_deepep.ops.internode import (  # noqa: F401
    INTERNODE_FIELDS, INTERNODE_KERNELS, INTERNODE_NET_KERNELS, INTERNODE_RING_KERNELS,
    INTERNODE_SOURCES, INTERNODE_STAGING_KERNELS, INTERNODE_THREADS, NET_ROLE_GROUPS_PER_RANK,
    NVSHMEM_SOURCES, InternodeArgs,
    internode_combine_expressions, internode_combine_forward, internode_combine_reduce,
    internode_combine_send, internode_dispatch_recv, internode_dispatch_send,
    internode_expressions, internode_families, internode_forward, internode_net_combine,
    internode_net_combine_expressions, internode_net_dispatch, internode_net_expressions,
    internode_node_layout, internode_notify, internode_ring_combine,
    internode_ring_combine_expressions, internode_ring_count, internode_ring_dispatch,
    internode_ring_expressions, internode_wire, net_ring_min_blocks)
from megatron_deepep.ops.launch import (  # noqa: F401
    COMM_THREADS, ROW_DTYPE_CODES, ROW_DTYPE_NAMES, ErrorSink, addr, as_wire_rows,
    current_raw_stream, launch_on, launch_stream, on_launch_stream, row_dtype_code)
from megatron_deepep.ops.layout import (  # noqa: F401
    LAYOUT_CHUNK_ENTRIES, LAYOUT_MAX_CHUNK_ENTRIES, LAYOUT_THREADS, LayoutArgs, LocalRecv,
    dispatch_layout, layout_chunk_tokens, layout_plan)
from megatron_deepep.ops.notify import NotifyArgs, notify_counts  # noqa: F401

# Every kernel's argument struct (checked against the CUDA kernels by the CPU tests).
KERNEL_ARGS = {
    ("layout.cu", "layout_kernel"): LayoutArgs, ("notify.cu", "notify_kernel"): NotifyArgs,
    ("dispatch.cu", "dispatch_send"): DispatchSendArgs,
    ("dispatch.cu", "dispatch_recv"): DispatchRecvArgs,
    ("dispatch.cu", "dispatch_local"): DispatchLocalArgs,
    ("dispatch.cu", "dispatch_fused"): DispatchFusedArgs,
    ("combine.cu", "combine_send"): CombineSendArgs,
    ("combine.cu", "combine_reduce"): CombineReduceArgs,
    ("combine.cu", "combine_local"): CombineLocalArgs,
    ("combine.cu", "combine_fused"): CombineFusedArgs,
    ("fp8.cu", "dequantize_blockwise"): DequantizeArgs,
    ("fp8.cu", "dequantize_mxfp8"): DequantizeArgs,
    ("fp8_columnwise.cu", "columnwise_from_rowwise"): ColumnwiseArgs,
    ("bench/ceiling.cu", "fill_kernel"): FillArgs, ("bench/ceiling.cu", "fan_out_copy"): FanOutArgs,
    ("bench/ceiling.cu", "fan_out_fp8_bytes"): FanOutBytesArgs,
    ("bench/ceiling.cu", "fan_in_sum"): FanInArgs, ("bench/ceiling.cu", "peer_copy"): PeerCopyArgs,
    ("bench/internode_leg.cu", "internode_leg_send"): LegArgs,
    ("bench/internode_leg.cu", "internode_leg_wait"): LegArgs,
    ("bench/quantize.cu", "quantize_blockwise"): QuantizeArgs,
    ("bench/quantize.cu", "quantize_mxfp8"): QuantizeArgs,
    **{(INTERNODE_SOURCES[staging], name): InternodeArgs
       for staging, names in INTERNODE_STAGING_KERNELS.items() for name in names},
}


# (kFmt, kDequant) pairs of dispatch_recv beyond bf16: every FP8 wire format, kept or dequantized.
FP8_RECV_VARIANTS = [(fmt, dequant) for fmt in (1, 2, 3) for dequant in (False, True)]


def kernel_names(num_topk: int, fp8: bool = False,
                 row_dtypes: Sequence[str] = ("bf16",)) -> dict:
    """Every instantiation a top-k needs, per source file (for compile checks and warm-up).

    Args:
        num_topk: K.
        fp8: list the FP8 dispatch variants instead of the bf16 ones for dispatch.cu.
        row_dtypes: the row dtypes (`ROW_DTYPE_NAMES` keys) to list combine kernels for
            (dispatch copies bytes: one set of dispatch kernels serves every dtype).
    """
    codes = [ROW_DTYPE_CODES[ROW_DTYPE_NAMES[name]] for name in row_dtypes]
    names = {"layout.cu": [], "notify.cu": ["notify_kernel"], "dispatch.cu": [],
             "combine.cu": []}
    send_fmts = (1, 2, 3) if fp8 else (0,)
    recv_variants = FP8_RECV_VARIANTS if fp8 else [(0, False)]
    for index_type in ("long long", "int"):
        names["layout.cu"].append(f"layout_kernel<{index_type}, {num_topk}>")
        for cached in ("false", "true"):
            prefix = f"{num_topk}, {cached}, {index_type}"
            names["dispatch.cu"] += [f"dispatch_send<{prefix}, {fmt}>" for fmt in send_fmts]
            names["dispatch.cu"] += [f"{kind}<{prefix}, {fmt}, {str(dq).lower()}>"
                                     for kind in ("dispatch_recv", "dispatch_local",
                                                  "dispatch_fused")
                                     for fmt, dq in recv_variants]
    for weighted in ("false", "true"):
        for with_weights in ("false", "true"):
            for kind in ("combine_send", "combine_reduce", "combine_local", "combine_fused"):
                names["combine.cu"] += [f"{kind}<{num_topk}, {weighted}, {with_weights}, {code}>"
                                        for code in codes]
    return names
