"""One GPU per rank: a kernel transport's ranks of one host should each drive their own GPU.

A job that forgets `torch.cuda.set_device` puts every rank of a host on GPU 0; the kernels
still run (the processes share the GPU, as the GPU tier's one-GPU set-up does on purpose), only
slowly and with every rank's memory on one device. At Buffer construction the ranks exchange
(host name, PCI bus id) and a WARNING names the ranks that share a GPU, unless sharing was
declared: virtual nodes (`num_ranks_per_node`) or `MDEEP_SHARED_GPU=1`.
"""

from __future__ import annotations

import logging
import socket
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from megatron_deepep import knobs

logger = logging.getLogger(__name__)


def gpu_bus_id(device_index: int) -> str:
    """The PCI bus id (domain:bus:device.function) of CUDA device `device_index`."""
    from cuda.bindings import driver
    from megatron_deepep.kernels.cuda_calls import cu_check
    device = cu_check(driver.cuDeviceGet(device_index), f"cuDeviceGet({device_index})")
    raw = cu_check(driver.cuDeviceGetPCIBusId(32, device), "cuDeviceGetPCIBusId")
    text = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
    return text.split("\x00", 1)[0].lower()


def shared_gpus(places: Sequence[Tuple[str, str]]) -> List[List[int]]:
    """Groups of ranks (more than one each) that share a GPU, given each rank's (host, bus id).

    Args:
        places: `[(host name, PCI bus id)]` indexed by rank of the group.

    Returns:
        The sharing ranks per GPU, in rank order (empty when every rank has its own).
    """
    by_gpu: Dict[Tuple[str, str], List[int]] = {}
    for rank, place in enumerate(places):
        by_gpu.setdefault(tuple(place), []).append(rank)
    return [ranks for ranks in by_gpu.values() if len(ranks) > 1]


def check_one_gpu_per_rank(group, device_index: int, *, declared: bool,
                           bus_id: Optional[str] = None,
                           host: Optional[str] = None) -> List[List[int]]:
    """Exchanges every rank's (host, PCI bus id) and warns when ranks of a host share a GPU.

    A collective over `group`: every rank calls it, declared or not (the exchange keeps the
    ranks in step).

    Args:
        group: the EP process group.
        device_index: this rank's CUDA device.
        declared: sharing was asked for (virtual nodes, `MDEEP_SHARED_GPU`): no warning.
        bus_id, host: this rank's place (default: the device's PCI bus id, the host name).

    Returns:
        The groups of ranks that share a GPU.
    """
    declared = declared or bool(knobs.get("SHARED_GPU"))
    place = (host or socket.gethostname(), bus_id or gpu_bus_id(device_index))
    places: List[Optional[Tuple[str, str]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(places, place, group=group)
    groups = shared_gpus(places)
    if groups and not declared:
        described = "; ".join(f"ranks {', '.join(map(str, ranks))} on {places[ranks[0]][0]} "
                              f"GPU {places[ranks[0]][1]}" for ranks in groups)
        logger.warning(
            "megatron_deepep: ranks of one host share a GPU (%s): each rank should drive its "
            "own (torch.cuda.set_device(local_rank) before building the Buffer). Sharing one "
            "GPU is for testing: declare it with %sSHARED_GPU=1 or num_ranks_per_node",
            described, knobs.PREFIX)
    return groups
