"""How rows reach their expert ranks: every transport behind one interface (`base.Transport`).

| name        | EP group                  | moves rows with                                   |
|-------------|---------------------------|---------------------------------------------------|
| `local`     | 1 rank                    | the EP = 1 kernels: no peers, no symmetric buffer |
| `nvlink`    | 2-8 ranks of one node     | kernels over a CUDA-IPC symmetric buffer          |
| `internode` | 2-32 nodes x 1-8 ranks    | NVSHMEM puts between nodes, NVLink inside a node  |
| `reference` | any (CPU included)        | pure torch over `all_to_all_single`               |

`create` picks one for "auto" (and "nvlink" at EP = 1, where there are no peers) from the group
and the machine; the caller never asks its name again. An EP group that spans hosts (or declares
virtual nodes with `num_ranks_per_node`) gets `internode` under "auto", and the pure-torch
reference (a logged warning) where NVSHMEM cannot start. Each rank resolves on its own machine,
so the ranks then compare their choices (`agree`) and all raise, naming who chose what and why,
when they differ.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_deepep import knobs
from megatron_deepep.transport.base import Transport

logger = logging.getLogger(__name__)

TRANSPORT_NAMES = knobs.TRANSPORT_NAMES


def resolve(name: str, num_ranks: int, cuda_available: bool, num_nodes: int = 1) -> str:
    """The transport `name` means for an EP group of `num_ranks` ranks on `num_nodes` hosts.

    Raises:
        ValueError: an unknown name, or a transport that cannot serve this group here.
    """
    if name not in TRANSPORT_NAMES:
        raise ValueError(f"transport must be one of {TRANSPORT_NAMES}, got {name!r}")
    if name == "reference":
        return name
    if num_nodes > 1:
        if not cuda_available:
            if name == "auto":
                return "reference"
            raise ValueError(f"transport={name!r} runs CUDA kernels, but torch sees no CUDA "
                             "device here; use transport='reference' (pure torch) or 'auto'")
        if name in ("auto", "internode"):
            return "internode"
        raise ValueError(f"transport={name!r} reaches peers through CUDA IPC inside one node, "
                         f"but this EP group spans {num_nodes} nodes; use transport='internode' "
                         "or 'auto' (or 'reference': pure torch, correct on any network)")
    if name == "internode":
        raise ValueError(f"transport='internode' serves EP groups that span 2 or more nodes; "
                         f"this one ({num_ranks} ranks) runs on one node: use 'auto' or "
                         "'nvlink', or pass num_ranks_per_node to declare virtual nodes")
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
    if name == "internode":
        from megatron_deepep.transport.internode import InternodeTransport
        return InternodeTransport
    if name == "reference":
        from megatron_deepep.transport.reference import ReferenceTransport
        return ReferenceTransport
    raise ValueError(f"no transport class for {name!r}")


def size_hint(name: str, num_ranks: int, num_max_tokens_per_rank: int, hidden: int,
              num_topk: int, *, cuda_available: bool,
              num_ranks_per_node: Optional[int] = None) -> int:
    """Bytes of device memory one rank of the transport `name` resolves to holds. Nodes are
    `num_ranks_per_node` ranks each; None: one node of up to 8 ranks, nodes of 8 ranks for a
    larger group, and nodes of min(num_ranks, 8) for "internode"."""
    from megatron_deepep.transport.regions import MAX_RANKS

    per_node = num_ranks_per_node
    if per_node is None and (name == "internode" or (name == "auto" and num_ranks > MAX_RANKS)):
        per_node = min(num_ranks, MAX_RANKS)
    num_nodes = max(1, num_ranks // per_node) if per_node is not None else 1
    resolved = resolve(name, num_ranks, cuda_available, num_nodes)
    cls = transport_class(resolved)
    if resolved == "internode":
        return cls.size_hint(num_ranks, num_max_tokens_per_rank, hidden, num_topk, per_node)
    return cls.size_hint(num_ranks, num_max_tokens_per_rank, hidden, num_topk)


# The transports whose times say something of our kernels, NVLink and the network.
KERNEL_TRANSPORTS = ("local", "nvlink", "internode")


def bandwidth_refusal(name: str) -> Optional[str]:
    """Why the times of the transport `name` (a Buffer's `transport_name`: the one that ran)
    give no NVLink or network GB/s, or None when they do. Benchmarks print and record no GB/s
    of the reference transport, which `auto` falls back to without CUDA or NVSHMEM."""
    if name in KERNEL_TRANSPORTS:
        return None
    return (f"the {name} transport ran (pure torch over all_to_all_single, the fallback "
            f"without CUDA or NVSHMEM): its times are torch's collectives, not our kernels, "
            f"NVLink or the network, so no GB/s is given")


class TransportMismatchError(RuntimeError):
    """The ranks of an EP group resolved different transports (or some could not resolve one);
    raised on every rank, before any transport is built."""


def _resolve_here(name: str, num_ranks: int, num_nodes: int) -> Tuple[str, str]:
    """This rank's transport for `name` and why (not collective: each rank judges its own
    machine, so the ranks compare the results afterwards).

    Raises:
        ValueError: `resolve`'s, for a transport this rank cannot serve.
    """
    cuda = torch.cuda.is_available()
    where = (f"{num_ranks} ranks on {num_nodes} node{'s' if num_nodes > 1 else ''}, "
             f"{'a CUDA device' if cuda else 'no CUDA device'}")
    resolved = resolve(name, num_ranks, cuda, num_nodes)
    if name != "auto":
        return resolved, f"asked for transport={name!r} ({where})"
    if resolved == "internode":
        from megatron_deepep.kernels.nvshmem_link import NvshmemUnavailable
        from megatron_deepep.transport.nvshmem_heap import check_available
        try:
            check_available()
        except NvshmemUnavailable as exc:  # logged as a warning by `log_auto_choice`
            return "reference", f"auto: {where}, no NVSHMEM ({type(exc).__name__}: {exc})"
        return resolved, f"auto: {where}, NVSHMEM available"
    return resolved, f"auto: {where}"


def _rank_ranges(ranks: List[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"."""
    spans: List[List[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def agree(name: str, choice: Tuple[str, str], group, timeout_s: float = 100.0) -> str:
    """Every rank's (transport, reason) goes round the group; returns the one transport.

    Every rank of `group` must call (`rendezvous.gather_objects`; any backend), before any
    transport is built, so a rank that resolved differently fails the whole group at once
    instead of leaving its peers waiting for data that never comes.

    Args:
        choice: this rank's (transport, reason), or ("error", the message) when it could not
            resolve one.
        timeout_s: how long to wait for the other ranks (the Buffer's `timeout_s`).

    Returns:
        The transport every rank resolved ("error" when none could: each raises its own).

    Raises:
        TransportMismatchError: on every rank, naming each rank's choice and reason.
        PeerTimeoutError: a rank did not arrive within `timeout_s` (it never built its Buffer).
    """
    from megatron_deepep.transport.rendezvous import gather_objects

    choices = gather_objects(tuple(choice), group, timeout_s=timeout_s,
                             what="the choice of transport")
    if len({c[0] for c in choices}) == 1:
        return choices[0][0]  # "error" on every rank: each raises its own ValueError
    ranks_of: Dict[Tuple[str, str], List[int]] = {}
    for rank, c in enumerate(choices):
        ranks_of.setdefault(tuple(c), []).append(rank)
    lines = [f"  {_rank_ranges(ranks)}: "
             + (f"could not resolve one ({reason})" if chosen == "error"
                else f"{chosen} ({reason})")
             for (chosen, reason), ranks in sorted(ranks_of.items(), key=lambda kv: kv[1][0])]
    raise TransportMismatchError(
        f"megatron_deepep: the {len(choices)} ranks of the EP group did not agree on one "
        f"transport for transport={name!r}; every rank must run the same one, so none is "
        "built:\n" + "\n".join(lines) + "\nGive every rank the same software and devices, or "
        "name the transport explicitly (transport='reference' runs anywhere).")


def create(name: str, group, num_max_tokens_per_rank: int, hidden: int, num_topk: int, *,
           num_sms: int, timeout_s: float,
           num_ranks_per_node: Optional[int] = None) -> Transport:
    """Builds the transport `name` resolves to for `group` (collective: the ranks first check
    that they all resolved the same one, `agree`, then the kernel transports set up their
    buffers). `num_ranks_per_node` declares nodes of that many contiguous ranks (virtual
    nodes); by default nodes are the ranks' hosts.

    Raises:
        TransportMismatchError: the ranks resolved different transports (on every rank).
        ValueError: a transport that cannot serve this group (on every rank: `agree` carries
            the rank's message to the others).
    """
    num_ranks = dist.get_world_size(group)
    num_nodes = 1
    if num_ranks_per_node is not None:
        from megatron_deepep.transport.topology import Topology
        num_nodes = Topology(num_ranks, num_ranks_per_node).num_nodes  # validates it
    elif name != "reference" and num_ranks > 1:
        from megatron_deepep.transport.topology import count_hosts
        num_nodes = count_hosts(group, timeout_s)
    try:
        resolved, reason = _resolve_here(name, num_ranks, num_nodes)
    except ValueError as exc:
        if num_ranks == 1:
            raise
        agree(name, ("error", str(exc)), group, timeout_s)  # raises unless every rank failed alike
        raise
    if num_ranks > 1:
        resolved = agree(name, (resolved, reason), group, timeout_s)
    if name == "auto":
        cuda_available = torch.cuda.is_available()
        why = None
        if resolved == "reference":
            why = reason if cuda_available else "torch sees no CUDA device"
        log_auto_choice(resolved, num_ranks, num_nodes, cuda_available, why)
    kwargs = dict(num_sms=num_sms, timeout_s=timeout_s)
    if resolved == "internode":
        kwargs["num_ranks_per_node"] = num_ranks_per_node
    if resolved in ("nvlink", "internode"):
        from megatron_deepep.transport.devices import check_one_gpu_per_rank
        check_one_gpu_per_rank(group, torch.cuda.current_device(),
                               declared=num_ranks_per_node is not None)
    return transport_class(resolved)(group, num_max_tokens_per_rank, hidden, num_topk,
                                     **kwargs)


_LOGGED_CHOICES = set()


def log_auto_choice(resolved: str, num_ranks: int, num_nodes: int, cuda_available: bool,
                    why: Optional[str] = None) -> None:
    """Logs what `auto` chose, once per process and choice: INFO, or a WARNING naming `why`
    when it falls back to the pure-torch reference on a machine with CUDA (slow, and never
    what a GPU job wants)."""
    key = (resolved, num_ranks, num_nodes, why)
    if key in _LOGGED_CHOICES:
        return
    _LOGGED_CHOICES.add(key)
    group = (f"an EP group of {num_ranks} rank{'s' * (num_ranks != 1)} on {num_nodes} "
             f"node{'s' * (num_nodes != 1)}")
    if resolved == "reference" and cuda_available:
        logger.warning("megatron_deepep: transport='auto' falls back to the pure-torch "
                       "reference for %s on a machine with CUDA (%s); the dispatch runs "
                       "through all_to_all_single, not our kernels", group, why)
        return
    logger.info("megatron_deepep: transport='auto' chose %r for %s%s", resolved, group,
                f" ({why})" if why else "")


__all__ = ["KERNEL_TRANSPORTS", "TRANSPORT_NAMES", "Transport", "TransportMismatchError", "agree",
           "bandwidth_refusal", "create", "log_auto_choice", "resolve", "size_hint",
           "transport_class"]
