"""CPU tier: the ranks of an EP group agree on one transport before any data moves.

Each rank resolves `transport="auto"` on its own machine; a rank that sees no CUDA device, or
cannot start NVSHMEM, would otherwise build a different transport than its peers and leave them
waiting. Here one rank of 2-4 gloo ranks is made to resolve differently (its CUDA check or its
NVSHMEM check monkeypatched): every rank must raise, naming each rank's choice and reason, and
none may hang (the launcher's timeout is short).
"""

from __future__ import annotations

import pytest
import torch

from megatron_deepep import transport
from megatron_deepep.buffer import Buffer
from tests.helpers.distributed import run_distributed

WORLD = torch.distributed.group.WORLD


def _mismatch(rank, world, odd_rank, scenario):
    from megatron_deepep.kernels.nvshmem_link import NvshmemUnavailable
    from megatron_deepep.transport import nvshmem_heap
    if scenario == "cuda" and rank == odd_rank:
        torch.cuda.is_available = lambda: True  # this rank alone "sees" a GPU
    kwargs = {}
    if scenario == "nvshmem":  # 2 virtual nodes; one rank cannot start NVSHMEM
        torch.cuda.is_available = lambda: True
        kwargs["num_ranks_per_node"] = 1

        def check_available():
            if rank == odd_rank:
                raise NvshmemUnavailable("import error: libnvshmem_host.so.3: cannot open "
                                         "shared object file")
        nvshmem_heap.check_available = check_available
    with pytest.raises(transport.TransportMismatchError) as info:
        Buffer(WORLD, 16, 64, 2, transport="auto", **kwargs)
    message = str(info.value)
    if rank == 0:
        print(f"\n--- {scenario}, {world} ranks, odd rank {odd_rank} ---\n{message}")
    assert f"the {world} ranks of the EP group did not agree" in message
    others = [r for r in range(world) if r != odd_rank]
    if scenario == "cuda":
        assert (f"rank {odd_rank}: nvlink (auto: {world} ranks on 1 node, a CUDA device)"
                in message)
        assert f": reference (auto: {world} ranks on 1 node, no CUDA device)" in message
    else:
        assert (f"rank {odd_rank}: reference (auto: 2 ranks on 2 nodes, a CUDA device, no "
                "NVSHMEM (NvshmemUnavailable: import error: libnvshmem_host.so.3") in message
        assert (f"rank {others[0]}: internode (auto: 2 ranks on 2 nodes, a CUDA device, "
                "NVSHMEM available)") in message
    # The group still works afterwards: nothing is half-built, no collective is left open.
    torch.cuda.is_available = lambda: False
    assert Buffer(WORLD, 16, 64, 2, transport="reference").transport_name == "reference"


@pytest.mark.parametrize("world, odd_rank", [(2, 1), (3, 0), (4, 2)])
def test_one_rank_seeing_a_gpu_fails_every_rank(world, odd_rank):
    run_distributed(world, _mismatch, odd_rank, "cuda", timeout_s=60)


def test_one_rank_without_nvshmem_fails_every_rank():
    run_distributed(2, _mismatch, 1, "nvshmem", timeout_s=60)


def _one_rank_cannot_serve(rank, world):
    if rank == 1:
        torch.cuda.is_available = lambda: True
    with pytest.raises(transport.TransportMismatchError) as info:
        Buffer(WORLD, 16, 64, 2, transport="nvlink")
    message = str(info.value)
    if rank == 0:
        print(f"\n--- explicit nvlink, {world} ranks ---\n{message}")
    assert "ranks 0, 2: could not resolve one (transport='nvlink' runs CUDA kernels" in message
    assert "rank 1: nvlink (asked for transport='nvlink' (3 ranks on 1 node, a CUDA device))" \
        in message


def test_a_rank_that_cannot_resolve_fails_the_others_too():
    run_distributed(3, _one_rank_cannot_serve, timeout_s=60)


def _all_fail_alike(rank, world):
    with pytest.raises(ValueError, match="no CUDA device") as info:
        Buffer(WORLD, 16, 64, 2, transport="nvlink")
    assert not isinstance(info.value, transport.TransportMismatchError)


def test_ranks_that_all_fail_alike_raise_their_own_error():
    run_distributed(2, _all_fail_alike, timeout_s=60)


def test_rank_ranges():
    assert transport._rank_ranges([3]) == "rank 3"
    assert transport._rank_ranges([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"
