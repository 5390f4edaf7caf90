"""The network leg alone (cuda_src/bench/internode_leg.cu; NVSHMEM-linked): put with signal
between PEs and the wait, for `bench.network` and the GPU tier. Not part of the product set."""

from __future__ import annotations

import torch

from megatron_deepep.kernels import nvshmem_link
from megatron_deepep.kernels.jit import I32, I64, U64, KernelArgs, Ptr
from megatron_deepep.ops.launch import ErrorSink, launch_stream


class LegArgs(KernelArgs):
    c_name = "mdeep::LegArgs"
    _fields_ = [("recv", Ptr), ("send", Ptr), ("signals", Ptr), ("bytes", I64),
                ("expected", U64), ("timeout_ns", U64), ("peer", I32), ("source", I32),
                ("error_claim", Ptr), ("error_record", Ptr), ("info", Ptr)]


# ---------------------------------------------------------------------------------------------
# The network leg (NVSHMEM-linked kernels: nvshmem_link builds and loads them).

LEG_SEND_THREADS = 256


def internode_leg_send(recv: torch.Tensor, send: torch.Tensor, signals: torch.Tensor,
                       peer: int, num_blocks: int, errors: ErrorSink) -> None:
    """Puts `send [bytes]` uint8 into slot [my PE] of PE `peer`'s symmetric `recv
    [num_pes * bytes]` in `num_blocks` chunks, each adding 1 to the peer's `signals [num_pes]`
    int64 word of this PE; `peer` < 0 sends nothing."""
    args = LegArgs.fill(recv=recv.data_ptr(), send=send.data_ptr(), signals=signals.data_ptr(),
                        bytes=send.numel(), expected=0, timeout_ns=0, peer=peer, source=-1,
                        error_claim=errors.claim, error_record=errors.record, info=0)
    nvshmem_link.get_kernel("bench/internode_leg.cu", "internode_leg_send").launch(
        num_blocks, LEG_SEND_THREADS, args, launch_stream())


def internode_leg_wait(signals: torch.Tensor, source: int, expected: int, timeout_ns: int,
                       errors: ErrorSink, info: torch.Tensor) -> None:
    """Waits until `signals[source] >= expected` (or records a timeout naming `source`);
    `info [2]` int64 gets (my PE, number of PEs) as the kernel saw them."""
    args = LegArgs.fill(recv=0, send=0, signals=signals.data_ptr(), bytes=0, expected=expected,
                        timeout_ns=timeout_ns, peer=-1, source=source, error_claim=errors.claim,
                        error_record=errors.record, info=info.data_ptr())
    nvshmem_link.get_kernel("bench/internode_leg.cu", "internode_leg_wait").launch(
        1, 32, args, launch_stream())
