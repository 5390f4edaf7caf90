"""Which ranks of an EP group share a node, for the hierarchical internode transport.

Notation: R ranks in the EP group, P ranks per node (the NVLink domain, 1-8), R / P nodes. Ranks
of one node are contiguous: rank r sits on node `r // P` at local index `r % P` (Slurm's block
distribution and torchrun both number ranks node by node). A token crosses the network once per
destination node, to the rank with the same local index there (its "rail peer"), which forwards it
over NVLink.

`detect_topology` finds the nodes from the process group: every rank's host name goes round with
`all_gather_object` (any backend: NCCL, or gloo when processes share a GPU), and ranks on one host
form one node. `num_ranks_per_node` overrides the detection and declares virtual nodes, so several
processes on one GPU (or one host) model a cluster.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import List, Optional, Sequence, Tuple

import torch.distributed as dist

MAX_RANKS_PER_NODE = 8   # one NVLink domain (the IPC buffer's peer table)
MIN_INTERNODE_NODES = 2  # one node is the nvlink transport's job
MAX_INTERNODE_NODES = 32

_PLACEMENT_HINT = ("launch so that each node's ranks are contiguous (Slurm: --distribution=block, "
                   "the default; torchrun numbers ranks node by node) and build the EP group "
                   "from contiguous ranks, or pass num_ranks_per_node to declare the nodes")


@dataclasses.dataclass(frozen=True)
class Topology:
    """Nodes of an EP group, seen from one rank of it.

    Attributes:
        num_ranks: R, ranks in the EP group.
        num_ranks_per_node: P, ranks per node (1-8, odd counts included); divides R.
        rank: this process's rank in the EP group.
    """

    num_ranks: int
    num_ranks_per_node: int
    rank: int = 0

    def __post_init__(self):
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        if not 1 <= self.num_ranks_per_node <= MAX_RANKS_PER_NODE:
            raise ValueError(f"num_ranks_per_node must be in [1, {MAX_RANKS_PER_NODE}] (one NVLink "
                             f"domain), got {self.num_ranks_per_node}")
        if self.num_ranks % self.num_ranks_per_node:
            raise ValueError(f"num_ranks_per_node={self.num_ranks_per_node} must divide the EP "
                             f"group size num_ranks={self.num_ranks} (every node the same size)")
        if not 0 <= self.rank < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {self.rank}")

    @property
    def num_nodes(self) -> int:
        """R / P."""
        return self.num_ranks // self.num_ranks_per_node

    @property
    def node(self) -> int:
        """This rank's node."""
        return self.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        """This rank's index within its node."""
        return self.local_rank_of(self.rank)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {rank}")

    def node_of(self, rank: int) -> int:
        """The node holding `rank`."""
        self._check_rank(rank)
        return rank // self.num_ranks_per_node

    def local_rank_of(self, rank: int) -> int:
        """`rank`'s index within its node."""
        self._check_rank(rank)
        return rank % self.num_ranks_per_node

    def ranks_of_node(self, node: int) -> range:
        """The ranks of `node`, in order."""
        self._check_node(node)
        return range(node * self.num_ranks_per_node, (node + 1) * self.num_ranks_per_node)

    def rail_peer(self, rank: int, node: int) -> int:
        """The rank on `node` with the same local index as `rank` (where `rank`'s tokens for
        `node` cross the network to, and where they are forwarded from over NVLink)."""
        self._check_node(node)
        return node * self.num_ranks_per_node + self.local_rank_of(rank)

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node must be in [0, {self.num_nodes}), got {node}")

    def check_internode(self) -> None:
        """Raises ValueError unless the internode transport supports this topology (2-32 nodes)."""
        if self.num_nodes < MIN_INTERNODE_NODES:
            raise ValueError(
                f"the internode transport needs {MIN_INTERNODE_NODES}-{MAX_INTERNODE_NODES} nodes, "
                f"got 1 node (num_ranks={self.num_ranks}, num_ranks_per_node="
                f"{self.num_ranks_per_node}): one node is the nvlink transport's")
        if self.num_nodes > MAX_INTERNODE_NODES:
            raise ValueError(
                f"the internode transport supports at most {MAX_INTERNODE_NODES} nodes, got "
                f"{self.num_nodes} (num_ranks={self.num_ranks} / num_ranks_per_node="
                f"{self.num_ranks_per_node})")


def _host_name() -> str:
    """This machine's host name (a function, so tests can plant other names)."""
    return socket.gethostname()


def _local_world_size() -> Optional[int]:
    """torchrun's LOCAL_WORLD_SIZE (processes it started on this host), or None if unset."""
    text = os.environ.get("LOCAL_WORLD_SIZE")
    if text is None or not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={text!r}: expected an integer") from None


def topology_from_hosts(hosts: Sequence[str], rank: int,
                        num_ranks_per_node: Optional[int] = None,
                        local_world_sizes: Optional[Sequence[Optional[int]]] = None,
                        group_is_world: bool = False) -> Topology:
    """The topology from every rank's host name (the host-side core of `detect_topology`).

    Args:
        hosts: `[R]`, the host name of every rank of the group, in group-rank order.
        rank: this process's rank in the group.
        num_ranks_per_node: if given, declares nodes of this many contiguous ranks (virtual nodes)
            and the host names are not used.
        local_world_sizes: `[R]`, LOCAL_WORLD_SIZE as every rank saw it (None where unset).
            Checked against the host names only when the group is the whole world
            (`group_is_world`), since an EP group may hold only some of a node's processes.
        group_is_world: the group is the default (whole-world) group.

    Raises:
        ValueError: naming the argument or the launch setting at fault: ranks per node outside
            1-8, nodes of different sizes, a node's ranks not contiguous, LOCAL_WORLD_SIZE
            contradicting the host names.
    """
    num_ranks = len(hosts)
    if num_ranks_per_node is not None:
        return Topology(num_ranks, num_ranks_per_node, rank)  # validates it

    ranks_of_host = {}
    for r, host in enumerate(hosts):
        ranks_of_host.setdefault(host, []).append(r)
    sizes = {host: len(ranks) for host, ranks in ranks_of_host.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"every node must hold the same number of EP ranks; ranks per host: "
                         f"{sizes} (pass num_ranks_per_node to declare nodes explicitly)")
    per_node = next(iter(sizes.values()))
    for host, ranks in ranks_of_host.items():
        if ranks != list(range(ranks[0], ranks[0] + per_node)):
            raise ValueError(f"the ranks of one node must be contiguous in the EP group, but host "
                             f"{host!r} holds ranks {ranks}: {_PLACEMENT_HINT}")
    if per_node > MAX_RANKS_PER_NODE:
        raise ValueError(
            f"{per_node} EP ranks share host {hosts[0]!r}, more than one NVLink domain "
            f"(at most {MAX_RANKS_PER_NODE} ranks per node); if several nodes report the same host "
            f"name, or processes share GPUs on purpose, pass num_ranks_per_node")
    if group_is_world and local_world_sizes is not None:
        seen = set(local_world_sizes)
        if None not in seen and seen != {per_node}:
            raise ValueError(
                f"host names put {per_node} ranks on each node, but LOCAL_WORLD_SIZE is "
                f"{sorted(seen)}: nodes may share a host name (containers); pass "
                f"num_ranks_per_node")
    return Topology(num_ranks, per_node, rank)


def count_hosts(group=None, timeout_s: float = 100.0) -> int:
    """How many hosts the ranks of `group` run on (every rank must call: host names go round,
    `rendezvous.gather_objects`, waiting at most `timeout_s` for the others)."""
    from megatron_deepep.transport.rendezvous import gather_objects

    hosts = gather_objects(_host_name(), group, timeout_s=timeout_s, what="the count of hosts")
    return len(set(hosts))


def detect_topology(group=None, num_ranks_per_node: Optional[int] = None) -> Topology:
    """Finds the nodes of an EP process group.

    Every rank's host name and LOCAL_WORLD_SIZE go round with `all_gather_object` (a collective:
    every rank of `group` must call this). Ranks on one host form one node.

    Args:
        group: the EP process group (None: the default group).
        num_ranks_per_node: declares nodes of this many contiguous ranks instead (virtual nodes:
            4 processes on one GPU with `num_ranks_per_node=2` model 2 nodes x 2 GPUs). Still a
            collective, so that every rank checks the same group.

    Returns:
        This rank's `Topology`. One node is legal here (the nvlink transport's case); the
        internode transport calls `Topology.check_internode()`.

    Raises:
        ValueError: see `topology_from_hosts`.
    """
    if num_ranks_per_node is not None and not 1 <= num_ranks_per_node <= MAX_RANKS_PER_NODE:
        raise ValueError(f"num_ranks_per_node must be in [1, {MAX_RANKS_PER_NODE}] (one NVLink "
                         f"domain), got {num_ranks_per_node}")
    num_ranks = dist.get_world_size(group)
    rank = dist.get_rank(group)
    mine = (_host_name(), _local_world_size())
    gathered: List[Tuple[str, Optional[int]]] = [None] * num_ranks
    dist.all_gather_object(gathered, mine, group=group)
    hosts = [host for host, _ in gathered]
    local_world_sizes = [lws for _, lws in gathered]
    group_is_world = num_ranks == dist.get_world_size()
    return topology_from_hosts(hosts, rank, num_ranks_per_node, local_world_sizes, group_is_world)
