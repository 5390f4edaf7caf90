"""Topology of an EP group: nodes, rail peers, detection from host names or an override."""

import os

import pytest

from megatron_deepep.transport import topology as topology_mod
from megatron_deepep.transport.topology import Topology, detect_topology, topology_from_hosts
from tests.helpers.distributed import run_distributed

def rail_peers(topo):
    """`[num_nodes]`: the rank with `topo.rank`'s local index on every node."""
    return tuple(topo.rail_peer(topo.rank, n) for n in range(topo.num_nodes))


SHAPES = [(2, 1), (2, 2), (3, 2), (2, 3), (4, 2), (2, 4), (1, 8), (32, 8), (5, 7)]


@pytest.mark.parametrize("num_nodes,per_node", SHAPES)
def test_topology_maps_ranks(num_nodes, per_node):
    num_ranks = num_nodes * per_node
    for rank in range(num_ranks):
        topo = Topology(num_ranks, per_node, rank)
        assert topo.num_nodes == num_nodes
        assert (topo.node, topo.local_rank) == (rank // per_node, rank % per_node)
        assert [topo.node_of(r) for r in range(num_ranks)] == [r // per_node
                                                               for r in range(num_ranks)]
        assert list(topo.ranks_of_node(topo.node)).count(rank) == 1
        for node in range(num_nodes):
            peer = topo.rail_peer(rank, node)
            assert topo.node_of(peer) == node
            assert topo.local_rank_of(peer) == topo.local_rank
            assert rail_peers(topo)[node] == peer
        assert rail_peers(topo)[topo.node] == rank
    if 2 <= num_nodes <= 32:
        Topology(num_ranks, per_node).check_internode()


@pytest.mark.parametrize("kwargs,words", [
    (dict(num_ranks=8, num_ranks_per_node=0), ["num_ranks_per_node", "[1, 8]", "got 0"]),
    (dict(num_ranks=16, num_ranks_per_node=16), ["num_ranks_per_node", "[1, 8]", "got 16"]),
    (dict(num_ranks=8, num_ranks_per_node=3), ["num_ranks_per_node=3", "num_ranks=8", "divide"]),
    (dict(num_ranks=0, num_ranks_per_node=1), ["num_ranks", ">= 1"]),
    (dict(num_ranks=4, num_ranks_per_node=2, rank=4), ["rank", "[0, 4)", "got 4"]),
])
def test_topology_rejects_bad_arguments(kwargs, words):
    with pytest.raises(ValueError) as err:
        Topology(**kwargs)
    for word in words:
        assert word in str(err.value)


def test_topology_rejects_bad_queries():
    topo = Topology(4, 2)
    with pytest.raises(ValueError, match=r"node must be in \[0, 2\), got 2"):
        topo.rail_peer(0, 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\), got -1"):
        topo.node_of(-1)


def test_check_internode_limits():
    with pytest.raises(ValueError, match=r"2-32 nodes, got 1 node .*nvlink"):
        Topology(8, 8).check_internode()
    with pytest.raises(ValueError, match=r"at most 32 nodes, got 33"):
        Topology(66, 2).check_internode()
    Topology(32, 1).check_internode()
    Topology(6, 3).check_internode()


def test_hosts_contiguous_nodes():
    hosts = ["a", "a", "a", "b", "b", "b"]
    topo = topology_from_hosts(hosts, rank=4)
    assert (topo.num_ranks, topo.num_ranks_per_node, topo.rank) == (6, 3, 4)
    assert rail_peers(topo) == (1, 4)
    assert topology_from_hosts(["h"] * 4, rank=0).num_nodes == 1


def test_hosts_override_declares_virtual_nodes():
    topo = topology_from_hosts(["h"] * 12, rank=7, num_ranks_per_node=3)
    assert (topo.num_nodes, topo.node, topo.local_rank) == (4, 2, 1)


@pytest.mark.parametrize("hosts,kwargs,words", [
    (["a", "b", "a", "b"], {}, ["contiguous", "'a' holds ranks [0, 2]", "Slurm", "torchrun"]),
    (["a", "a", "a", "b"], {}, ["same number", "'a': 3", "num_ranks_per_node"]),
    (["h"] * 16, {}, ["16 EP ranks", "at most 8", "num_ranks_per_node"]),
    (["h"] * 4, dict(num_ranks_per_node=3), ["num_ranks_per_node=3", "divide"]),
    (["h"] * 4, dict(local_world_sizes=[2] * 4, group_is_world=True),
     ["LOCAL_WORLD_SIZE", "[2]", "num_ranks_per_node"]),
])
def test_hosts_errors(hosts, kwargs, words):
    with pytest.raises(ValueError) as err:
        topology_from_hosts(hosts, rank=0, **kwargs)
    for word in words:
        assert word in str(err.value)


def test_local_world_size_checked_only_for_the_world_group():
    # An EP group that is a subset of the world may hold only some of a host's processes.
    topo = topology_from_hosts(["h"] * 4, rank=0, local_world_sizes=[8] * 4, group_is_world=False)
    assert topo.num_ranks_per_node == 4
    topo = topology_from_hosts(["h"] * 4, rank=0, local_world_sizes=[4] * 4, group_is_world=True)
    assert topo.num_ranks_per_node == 4


def _detect_worker(rank, world_size):
    import torch.distributed as dist

    os.environ.pop("LOCAL_WORLD_SIZE", None)
    # The override: 2 virtual nodes x 2 ranks on one host.
    topo = detect_topology(None, num_ranks_per_node=2)
    assert topo == Topology(4, 2, rank), topo
    assert rail_peers(topo) == tuple(n * 2 + rank % 2 for n in range(2))
    topo.check_internode()
    # Host names: all processes on this one host -> one node.
    topo = detect_topology(dist.group.WORLD)
    assert topo == Topology(4, 4, rank), topo
    # Planted host names: two hosts of two contiguous ranks.
    real = topology_mod._host_name
    try:
        topology_mod._host_name = lambda: f"node{rank // 2}"
        assert detect_topology() == Topology(4, 2, rank)
        topology_mod._host_name = lambda: f"node{rank % 2}"
        try:
            detect_topology()
            raise AssertionError("interleaved hosts were accepted")
        except ValueError as err:
            assert "contiguous" in str(err), err
    finally:
        topology_mod._host_name = real
    # LOCAL_WORLD_SIZE contradicting the host names (nodes sharing a host name).
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        detect_topology()
        raise AssertionError("LOCAL_WORLD_SIZE mismatch was accepted")
    except ValueError as err:
        assert "LOCAL_WORLD_SIZE" in str(err), err
    os.environ.pop("LOCAL_WORLD_SIZE")
    # A bad override fails on every rank alike.
    for bad, word in ((3, "divide"), (9, "[1, 8]")):
        try:
            detect_topology(num_ranks_per_node=bad)
            raise AssertionError(f"num_ranks_per_node={bad} was accepted")
        except ValueError as err:
            assert "num_ranks_per_node" in str(err) and word in str(err), err


def test_detect_topology_over_gloo():
    run_distributed(4, _detect_worker)


def _count_hosts_worker(rank, world):
    from megatron_deepep.transport import topology
    assert topology.count_hosts() == 1
    topology._host_name = lambda: f"node{rank // 2}"  # planted: two hosts of two ranks
    assert topology.count_hosts() == 2


def test_count_hosts():
    run_distributed(4, _count_hosts_worker)
