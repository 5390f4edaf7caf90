"""The test harness's own environment variables (`MDEEP_TEST_*`): read by the tests, parsed like
the package's knobs, and kept out of the users' knob table.

    MDEEP_TEST_PROCS=2,8 MDEEP_TEST_CALLS=300 python -m pytest -m gpu tests/gpu
"""

from typing import Dict

from megatron_deepep.knobs import PREFIX, Knob, read

_TABLE = (
    Knob("TEST_PROCS", "ints", (1, 2, 3, 4, 8), "1,2,3,4,8", "EP sizes (processes: sharing the "
         "GPU under gloo, one per GPU under nccl) the GPU tier runs", "tests"),
    Knob("TEST_BACKEND", "str", "gloo", "gloo", "control plane of the GPU tier's multi-process "
         "tests: `gloo` (the ranks share the GPU) or `nccl` (one process per GPU, device = rank, "
         "NCCL default group, a gloo side group for the CPU reference; skipped with fewer GPUs "
         "than ranks)", "tests"),
    Knob("TEST_NODES", "str", "2x1,2x2,3x2,2x3,4x2,2x4", "2x1,2x2,3x2,2x3,4x2,2x4",
         "virtual node shapes (nodes x ranks per node) the GPU tier's internode test runs",
         "tests"),
    Knob("TEST_CALLS", "int", 1000, "1000", "back-to-back calls of the GPU tier's long test",
         "tests"),
)

TEST_KNOBS: Dict[str, Knob] = {knob.name: knob for knob in _TABLE}


def get(name: str):
    """The parsed value of `MDEEP_<name>` (`name` as "TEST_PROCS"), else its default."""
    return read(TEST_KNOBS[name])


__all__ = ["PREFIX", "TEST_KNOBS", "get"]
