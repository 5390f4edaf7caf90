"""GPU tier: `python -m megatron_deepep.tools.multinode_check` on one GPU, processes sharing it.

The nvlink transport at 2 ranks (one node: the harness against a kernel transport), then the
internode transport on 2 virtual nodes x 2 ranks (skipped until the transport exists). Each run
is the script's own CLI with `--spawn`: exit status 0, every case `ok`, the sweep table and its
JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_deepep.buffer import TRANSPORTS

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMAND = [sys.executable, "-m", "megatron_deepep.tools.multinode_check"]


def _run(tmp_path, *args):
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([*COMMAND, "--check-tokens", "128", "--sweep-tokens",
                           "512,4096", "--sweep-hidden", "7168", "--warmup", "2", "--iters", "5",
                           "--json", str(out), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    assert "correctness: PASSED" in done.stdout and "FAILED" not in done.stdout, text
    doc = json.loads(out.read_text())
    assert doc["passed"] and len(doc["sweep"]) == 4, doc
    sys.stdout.write(done.stdout)  # the table, for `pytest -s`
    return doc


def test_nvlink_two_ranks(tmp_path):
    doc = _run(tmp_path, "--spawn", "2", "--transport", "nvlink")
    assert doc["setup"]["nodes"] == 1
    assert all(p["network_bytes_per_rank"] == 0 for p in doc["sweep"])


@pytest.mark.skipif("internode" not in TRANSPORTS, reason="no internode transport in this tree")
def test_internode_two_virtual_nodes(tmp_path):
    doc = _run(tmp_path, "--spawn", "4", "--num-ranks-per-node", "2", "--transport",
               "internode")
    assert doc["setup"]["nodes"] == 2 and doc["setup"]["ranks_per_node"] == 2
    assert all(p["network_bytes_per_rank"] > 0 for p in doc["sweep"])
    assert doc["dispatch"]["network_gbps"] > 0 and doc["combine"]["network_gbps"] > 0
