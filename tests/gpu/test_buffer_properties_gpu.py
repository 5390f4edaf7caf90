"""GPU tier: Buffer on the kernel transports against the oracle, on examples Hypothesis draws.

The property of `tests/core/test_buffer_properties.py` (`tests/helpers/buffer_properties.py`:
token counts with 0, hidden sizes, top-k 1-16, experts per rank, -1 ids, skew, row and index
dtypes, alignment, cached dispatch, no-sync row bounds) on `transport="auto"` at the EP sizes of
`MDEEP_TEST_PROCS` up to 8 (the EP = 1 kernels, then NVLink; processes share the GPU under gloo,
one per GPU under `MDEEP_TEST_BACKEND=nccl`), and on the internode transport at 2 x 1 virtual
nodes. Dispatch and cached dispatch bit-exact; combine bit-exact on one node (the same order and
rounding as the reference), within fp32 tolerance across nodes.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import knobs as test_knobs
from tests.helpers.distributed import cpu_group, run_distributed, tier_backend, use_rank_device

pytest.importorskip("hypothesis", reason="the property tests need hypothesis: pip install "
                    "-e '.[test]'")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

EXAMPLES = 200
NUM_PROCS = [n for n in test_knobs.get("TEST_PROCS") if n <= 8]
INTERNODE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_SYMMETRIC_SIZE": "2G"}


def _kernels(rank, world, per_node, max_examples):
    from tests.helpers.buffer_properties import make_buffer, run_property

    if per_node is not None:
        os.environ.update(INTERNODE_ENV)
    use_rank_device(rank, gloo_device=0 if per_node is not None else None)
    kwargs = dict(transport="auto", num_sms=8, timeout_s=30)
    if per_node is not None:
        kwargs["num_ranks_per_node"] = per_node
    buf = make_buffer(group=torch.distributed.group.WORLD, **kwargs)
    expected = "internode" if per_node is not None else "local" if world == 1 else "nvlink"
    assert buf.transport_name == expected, buf.transport_name
    done = run_property(rank, world, buf, torch.device("cuda"), max_examples,
                        exact_combine=per_node is None, group=cpu_group())
    buf.destroy()
    assert done["examples"] == max_examples, done
    if rank == 0:
        print(f"\n{expected} transport, {world} rank(s): {done['examples']} examples in "
              f"{done['seconds']:.1f} s")


@pytest.mark.parametrize("num_procs", NUM_PROCS)
def test_kernel_buffer_matches_the_oracle_on_drawn_examples(num_procs):
    run_distributed(num_procs, _kernels, None, EXAMPLES, backend=tier_backend(),
                    timeout_s=1200)


def test_internode_buffer_matches_the_oracle_on_drawn_examples(monkeypatch, require_nvshmem):
    for name, value in INTERNODE_ENV.items():
        monkeypatch.setenv(name, value)
    run_distributed(2, _kernels, 1, EXAMPLES, backend=tier_backend(), timeout_s=1200,
                    hard_exit=True)
