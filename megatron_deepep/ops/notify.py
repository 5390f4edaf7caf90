"""The notify kernel (cuda_src/notify.cu): counts to every peer over NVLink, then this
rank's receive layout."""

from __future__ import annotations

import torch

from megatron_deepep.arena import Arena
from megatron_deepep.kernels import jit
from megatron_deepep.kernels.jit import I32, U32, U64, KernelArgs, Ptr
from megatron_deepep.layout import DispatchLayout
from megatron_deepep.ops.launch import ErrorSink, launch_stream

NOTIFY_THREADS = 256


class NotifyArgs(KernelArgs):
    c_name = "mdeep::NotifyArgs"
    _fields_ = [
        ("peer_bases", Ptr), ("rank", I32), ("num_ranks", I32), ("epoch_word", Ptr),
        ("num_tokens_per_rank", Ptr), ("num_tokens_per_expert", Ptr), ("num_local", I32),
        ("hidden", I32), ("num_topk", I32), ("alignment", I32), ("max_recv_rows", I32),
        ("num_recv_tokens_per_rank", Ptr), ("num_recv_tokens_per_expert", Ptr),
        ("tokens_per_expert", Ptr), ("expert_row_start", Ptr), ("src_expert_offset", Ptr),
        ("host_info", Ptr), ("host_epoch", U32), ("timeout_ns", U64), ("error_claim", Ptr),
        ("error_record", Ptr)]


def notify_counts(peer_bases: torch.Tensor, rank: int, num_ranks: int, epoch_word: int,
           lay: DispatchLayout, num_local: int, hidden: int, num_topk: int, alignment: int,
           max_recv_rows: int, recv: Arena, host_info_ptr: int, host_epoch: int, timeout_ns: int,
           errors: ErrorSink) -> None:
    """Exchanges counts with every peer and writes the receive layout (the `recv_fields`
    arrays of `recv`) on the device. `epoch_word`: the address of the device word holding the
    call's epoch (the transport advances it before the call); `host_info_ptr` (non-zero for a
    synchronous call): where the row count is published with `host_epoch`."""
    kernel = jit.get_kernel("notify.cu", "notify_kernel")
    a = recv.address
    args = NotifyArgs.fill(
        peer_bases=peer_bases.data_ptr(), rank=rank, num_ranks=num_ranks,
        epoch_word=epoch_word, num_tokens_per_rank=lay.address("num_tokens_per_rank"),
        num_tokens_per_expert=lay.address("num_tokens_per_expert"), num_local=num_local,
        hidden=hidden, num_topk=num_topk, alignment=alignment, max_recv_rows=max_recv_rows,
        num_recv_tokens_per_rank=a("num_recv_tokens_per_rank"),
        num_recv_tokens_per_expert=a("num_recv_tokens_per_expert"),
        tokens_per_expert=a("tokens_per_expert"), expert_row_start=a("expert_row_start"),
        src_expert_offset=a("src_expert_offset"), host_info=host_info_ptr,
        host_epoch=host_epoch & 0xFFFFFFFF, timeout_ns=timeout_ns, error_claim=errors.claim,
        error_record=errors.record)
    kernel.launch(1, NOTIFY_THREADS, args, launch_stream())
