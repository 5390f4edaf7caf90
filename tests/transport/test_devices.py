"""CPU tier: the one-GPU-per-rank check (`transport/devices.py`) on gloo ranks with faked
(host, PCI bus id) places: a WARNING names the ranks of a host that share a GPU, unless sharing
was declared (virtual nodes, `MDEEP_SHARED_GPU=1`)."""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from megatron_deepep.transport.devices import check_one_gpu_per_rank, shared_gpus
from tests.helpers import WarningCapture
from tests.helpers.distributed import run_distributed


def test_shared_gpus_groups_ranks_by_host_and_bus_id():
    assert shared_gpus([("a", "0000:01:00.0"), ("a", "0000:02:00.0")]) == []
    assert shared_gpus([("a", "0000:01:00.0"), ("b", "0000:01:00.0")]) == []  # two hosts
    assert shared_gpus([("a", "x"), ("a", "y"), ("a", "x"), ("b", "x"), ("b", "x")]) == [
        [0, 2], [3, 4]]


# Per case: each rank's (host, bus id), whether sharing is declared (argument, knob), and the
# ranks the warning must name (None: no warning).
CASES = {
    "distinct": ([("a", "0000:01:00.0"), ("a", "0000:02:00.0"), ("b", "0000:01:00.0"),
                  ("b", "0000:02:00.0")], False, "0", None),
    "forgot_set_device": ([("a", "0000:01:00.0")] * 2 + [("b", "0000:01:00.0")] * 2, False, "0",
                          ["ranks 0, 1 on a GPU 0000:01:00.0", "ranks 2, 3 on b GPU"]),
    "declared_virtual_nodes": ([("a", "0000:01:00.0")] * 4, True, "0", None),
    "declared_by_knob": ([("a", "0000:01:00.0")] * 4, False, "1", None),
}


def _check_case(rank, world_size, name):
    places, declared, knob, named = CASES[name]
    os.environ["MDEEP_SHARED_GPU"] = knob
    capture = WarningCapture()
    logger = logging.getLogger("megatron_deepep.transport.devices")
    logger.addHandler(capture)
    host, bus_id = places[rank]
    try:
        groups = check_one_gpu_per_rank(dist.group.WORLD, 0, declared=declared, bus_id=bus_id,
                                        host=host)
    finally:
        logger.removeHandler(capture)
    sharing = shared_gpus(places)
    assert groups == sharing, (groups, sharing)
    if named is None:
        assert capture.messages == [], capture.messages
    else:
        (message,) = capture.messages
        for part in named + ["torch.cuda.set_device", "MDEEP_SHARED_GPU=1"]:
            assert part in message, (part, message)


def _check_cases(rank, world_size):
    for name in CASES:
        _check_case(rank, world_size, name)


def test_ranks_sharing_a_gpu_get_a_warning_unless_declared():
    run_distributed(4, _check_cases)
