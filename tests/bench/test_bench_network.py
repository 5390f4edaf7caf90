"""CPU tier: `python -m megatron_deepep.bench.network` explains itself and refuses a CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


def test_help_names_every_argument():
    out = subprocess.run([sys.executable, "-m", "megatron_deepep.bench.network", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for flag in ("--nodes", "--ranks-per-node", "--sizes-kib", "--rounds", "--warmup",
                 "--blocks", "--out"):
        assert flag in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU machine")
def test_without_a_gpu_it_says_what_to_run():
    done = subprocess.run([sys.executable, "-m", "megatron_deepep.bench.network"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "python -m pytest -q -rs tests" in done.stderr


def test_the_document_records_the_transport_that_ran():
    import argparse

    from megatron_deepep.bench import network as bench_network
    args = argparse.Namespace(nodes=2, ranks_per_node=1, sizes_kib=[4, 64])
    per_rank = {0: {4: 10.0, 64: 40.0}, 1: {4: 12.0, 64: 44.0}}
    doc = bench_network.summarize(per_rank, args, "a GPU")
    assert doc["transport"].startswith("internode (network leg: NVSHMEM puts")
    assert doc["fixed_us"] == 11.0 and doc["network_gbps"] == pytest.approx(64 * 1024 / 42e3)
