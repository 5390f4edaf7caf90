"""GPU tier: the bench's EP > 1 pieces on processes sharing one GPU (gloo control plane, IPC).

The GPU time-slices between the processes, so the figures mean nothing here; what is checked is
that the peer-copy ceiling writes the right bytes (and raises when it does not), that the bench's
EP > 1 path runs end to end (its NCCL column skipped, saying why) with bytes equal to a count of
every rank's routing, and that the EP = 1 bench still runs as a command. Run alone:
`python -m pytest -q -m gpu tests/gpu/test_bench_peers_gpu.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from megatron_deepep.ops.bench import ceiling as ceiling_ops
from megatron_deepep.bench import peers as bench_peers
from megatron_deepep.bench import run as bench
from tests.helpers.compile_jobs import warm_up
from tests.helpers.distributed import free_port, run_distributed

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _init_device():
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())


def _peer_copy_worker(rank, world):
    _init_device()
    # 1, 2 and 24 blocks: fewer blocks than peers (a block serves several), one per peer, many
    # per peer with uneven shares; 1 MiB + 48 bytes: a tail shorter than one unrolled stride.
    budgets = [1, 2, 24]
    us = bench_peers.peer_copy_ceiling((1 << 20) + 48, budgets, bench.time_cuda)
    assert sorted(us) == budgets and all(t > 0 for t in us.values()), us


def _broken_peer_copy_worker(rank, world):
    """A copy that writes nothing: every rank must raise, naming the ceiling."""
    _init_device()
    ceiling_ops.peer_copy = lambda *args, **kwargs: None  # this process only (spawned)
    with pytest.raises(RuntimeError, match="peer_copy .* wrote wrong bytes.*not valid"):
        bench_peers.peer_copy_ceiling(4096, [4], bench.time_cuda)


@pytest.mark.parametrize("num_procs", [2, 3])
def test_peer_copy_writes_every_peer_slot(num_procs):
    run_distributed(num_procs, _peer_copy_worker, backend="gloo", timeout_s=300)


def test_a_wrong_peer_copy_is_not_a_ceiling():
    run_distributed(2, _broken_peer_copy_worker, backend="gloo", timeout_s=300)


SHAPE = (256, 1024, 8, 4)  # tokens per rank, hidden, experts, top-k


def _bench_worker(rank, world, out_dir):
    _init_device()
    if rank == 0:  # one compile per kernel, not one per process
        warm_up({SHAPE[3]})
    dist.barrier()
    rows = bench.run([SHAPE], [4, 24], out_dir, with_megatron=False, fp8_names="blockwise")
    peers = rows[0]["peers"]
    assert "gloo" in peers["nccl"]["skipped"]
    # The bench's routing, rebuilt for every rank (make_routing's seeds): the bytes it reports
    # are the count of tokens each rank sends to each other rank, once per destination rank.
    num_tokens, hidden, num_experts, num_topk = SHAPE
    per_rank = num_experts // world
    sends = [[0] * world for _ in range(3)]
    receives = [[0] * world for _ in range(3)]
    for i in range(3):
        for src in range(world):
            idx, _ = bench.make_routing(num_tokens, num_experts, num_topk, 17 + i + 100 * src)
            for token in idx.tolist():
                for dst in {e // per_rank for e in token} - {src}:
                    sends[i][src] += 1
                    receives[i][dst] += 1
    for r in range(world):
        expected_send = sum(s[r] for s in sends) / 3 * 2 * hidden
        expected_recv = sum(s[r] for s in receives) / 3 * 2 * hidden
        got = peers["bytes"]["bf16"][r]
        assert got["dispatch_send"] == pytest.approx(expected_send)
        assert got["dispatch_recv"] == pytest.approx(expected_recv)
        assert got["combine_send"] == pytest.approx(expected_recv)
    for key, v in peers["variants"].items():
        assert v["dispatch"]["GBps_worst"] > 0 and v["dispatch"]["x_ceiling"] > 0, key
        assert v["dispatch"]["x_nccl"] is None, key
    assert {v["wire"] for v in peers["variants"].values()} == {"bf16", "blockwise_1x128"}
    assert set(peers["ceiling"]["by_sms"]) == {"4", "24"}
    text = "\n".join(bench_peers.format_table(rows))
    assert "NCCL all-to-all: skipped: backend is gloo" in text
    assert "| ours 24 SMs sync |" in text and "peer_copy ceiling" in text


def test_bench_ep2_path_on_processes_sharing_the_gpu(tmp_path):
    run_distributed(2, _bench_worker, str(tmp_path), backend="gloo", timeout_s=900)
    assert (tmp_path / "bench.json").exists()


def test_bench_ep1_command_still_runs(tmp_path):
    env = dict(os.environ, MASTER_PORT=str(free_port()))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-m", "megatron_deepep.bench", "--shapes", "1024,1024,16,4",
         "--no-megatron", "--fp8", "", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "shape (N,H,E,K) | EP | variant" in done.stdout
    assert "| ours 24 SMs sync |" in done.stdout
    assert "NVLink, EP" not in done.stdout  # the EP > 1 table only at EP > 1
    assert (tmp_path / "bench.json").exists()
