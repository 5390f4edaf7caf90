"""How rows reach their expert ranks: every transport behind one interface (`base.Transport`).

| name        | EP group                  | moves rows with                                   |
|-------------|---------------------------|---------------------------------------------------|
| `local`     | 1 rank                    | the EP = 1 kernels: no peers, no symmetric buffer |
| `nvlink`    | 2-8 ranks of one node     | kernels over a CUDA-IPC symmetric buffer          |
| `reference` | any (CPU included)        | pure torch over `all_to_all_single`               |

`create` picks one for "auto" (and "nvlink" at EP = 1, where there are no peers) from the group
and the machine; the caller never asks its name again.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from megatron_deepep.transport.base import Transport

logger = logging.getLogger(__name__)

TRANSPORT_NAMES = ("auto", "local", "nvlink", "reference")


def resolve(name: str, num_ranks: int, cuda_available: bool) -> str:
    """The transport `name` means for an EP group of `num_ranks` ranks.

    Raises:
        ValueError: an unknown name, or a transport that cannot serve this group here.
    """
    if name not in TRANSPORT_NAMES:
        raise ValueError(f"transport must be one of {TRANSPORT_NAMES}, got {name!r}")
    if name == "reference":
        return name
    if not cuda_available:
        if name == "auto":
            return "reference"
        raise ValueError(f"transport={name!r} runs CUDA kernels, but torch sees no CUDA device "
                         "here; use transport='reference' (pure torch) or 'auto'")
    if name == "local" and num_ranks != 1:
        raise ValueError(f"transport='local' serves an EP group of 1 rank, this one has "
                         f"{num_ranks}")
    if num_ranks == 1:
        return "local"
    from megatron_deepep.transport.regions import MAX_RANKS
    if num_ranks > MAX_RANKS:
        raise ValueError(f"the NVLink transport spans one node: the EP group has {num_ranks} "
                         f"ranks, more than {MAX_RANKS}; transport='reference' serves any size")
    return "nvlink"


def transport_class(name: str) -> type:
    """The `Transport` subclass of a resolved name."""
    if name == "local":
        from megatron_deepep.transport.local import LocalTransport
        return LocalTransport
    if name == "nvlink":
        from megatron_deepep.transport.nvlink import NVLinkTransport
        return NVLinkTransport
    if name == "reference":
        from megatron_deepep.transport.reference import ReferenceTransport
        return ReferenceTransport
    raise ValueError(f"no transport class for {name!r}")


def create(name: str, group, num_max_tokens_per_rank: int, hidden: int, num_topk: int, *,
           num_sms: int, timeout_s: float) -> Transport:
    """Builds the transport `name` resolves to for `group` (collective for `nvlink`)."""
    resolved = resolve(name, dist.get_world_size(group), torch.cuda.is_available())
    return transport_class(resolved)(group, num_max_tokens_per_rank, hidden, num_topk,
                                     num_sms=num_sms, timeout_s=timeout_s)


__all__ = ["TRANSPORT_NAMES", "Transport", "create", "resolve", "transport_class"]
