"""CPU tier: `megatron_deepep.tools.multinode_check` (and its checkout command
`python -m megatron_deepep.tools.multinode_check`) on gloo ranks with the reference transport.

The script's GPU run (the internode transport on real or virtual nodes) is the lead's; here: its
arguments and errors, the byte and GB/s arithmetic, its routing cases, one end-to-end run of the
CLI (3 spawned ranks as 3 virtual nodes, JSON read back by the internode model), and that the
check catches a transport that corrupts rows or raises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_deepep.tools import internode_model
from megatron_deepep import transport
from megatron_deepep.tools import multinode_check as mc
from tests.helpers.distributed import run_distributed
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT
COMMAND = [sys.executable, "-m", "megatron_deepep.tools.multinode_check"]


def test_every_argument_has_help():
    parser = mc.build_parser()
    missing = [a.dest for a in parser._actions if not a.help]
    assert not missing, f"arguments without help: {missing}"
    text = parser.format_help()
    for flag in ("--transport", "--num-ranks-per-node", "--spawn", "--sweep-tokens", "--json",
                 "--nics-per-node", "--print-nvshmem-size"):
        assert flag in text


@pytest.mark.parametrize("argv, message", [
    (["--cases", "uniform,bogus"], "--cases: unknown ['bogus']"),
    (["--topk", "0"], "--topk must be >= 1"),
    (["--check-hidden", "100"], "multiples of 8"),
    (["--skip-check", "--skip-sweep"], "nothing to run"),
    (["--fp8", "nope"], "--fp8 'nope'"),
    (["--fp8", "blockwise", "--sweep-hidden", "2056"], "multiples of 16"),
])
def test_bad_arguments_exit_2_naming_the_flag(argv, message, capsys):
    assert mc.main(argv) == 2
    assert message in capsys.readouterr().err


def test_no_launcher_says_how_to_launch(monkeypatch, capsys):
    # setenv first: monkeypatch then restores each variable `_launch_env` writes (a RANK left
    # behind would silence later tests' rank-0-only warnings).
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "MASTER_ADDR", "MASTER_PORT",
                "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    assert mc.main(["--device", "cpu"]) == 2
    assert "torchrun" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_LOCALID", "3")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8(x2)")
    with pytest.raises(mc.UsageError, match="export MASTER_ADDR"):
        mc._launch_env()
    monkeypatch.setenv("MASTER_ADDR", "node-a")
    mc._launch_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"],
            os.environ["LOCAL_WORLD_SIZE"]) == ("3", "16", "3", "8")


def test_nvshmem_heap_size(capsys):
    from megatron_deepep.buffer import Buffer

    hint = Buffer.size_hint(4096, 7168, 64, 8, transport="internode", num_ranks_per_node=8)
    got = mc.nvshmem_heap_bytes(4096, 7168, 64, 8, num_ranks_per_node=8)
    assert got % (512 << 20) == 0 and got >= hint + (512 << 20) and got >= 1 << 30
    assert mc.nvshmem_heap_bytes(1, 8, 2, 1, transport="reference") == 1 << 30
    with pytest.raises(mc.UsageError, match="size_hint"):
        mc.nvshmem_heap_bytes(16, 64, 2, 2, transport="no-such")
    assert mc.main(["--print-nvshmem-size", "--max-tokens", "4096", "--max-hidden", "7168",
                    "--ranks", "64", "--topk", "8", "--num-ranks-per-node", "8"]) == 0
    assert int(capsys.readouterr().out) == got


def test_nic_bytes_and_gbps():
    # 2 nodes x 4 ranks, 2 NICs per node: local ranks 0, 1 share NIC 0, 2, 3 share NIC 1.
    send = [10, 20, 30, 40, 1, 2, 3, 4]
    recv = [0, 0, 0, 50, 5, 5, 5, 5]
    # NIC 1 of node 0 sends 30 + 40 and receives 0 + 50.
    assert mc.nic_bytes(send, recv, 4, 2) == 70
    assert mc.nic_bytes(send, recv, 4, 4) == 50
    assert mc.nic_bytes(send, recv, 4, 1) == max(sum(send[:4]), sum(recv[:4]))
    rows = {"net_send": [2, 0, 0, 1], "net_recv": [0, 1, 2, 0],
            "nvl_send": [1, 2, 1, 0], "nvl_recv": [2, 1, 0, 1]}
    p = mc.sweep_point(rows, row_bytes=1000, us=2.0, num_ranks_per_node=2, nics_per_node=2)
    assert p["network_bytes_per_rank"] == 2000 and p["nvlink_bytes_per_rank"] == 2000
    assert p["gbps_per_rank"] == pytest.approx(2000 / 2e3)
    assert p["network_bytes_per_nic"] == 2000
    one_nic = mc.sweep_point(rows, 1000, 2.0, 2, 1)
    assert one_nic["network_bytes_per_nic"] == 2000  # node 0 sends 2 + 0, node 1 receives 2 + 0


def test_measured_rates_feed_the_model():
    points = [{"phase": "dispatch", "network_bytes_per_nic": 10, "us": 1.0, "gbps_per_nic": 7.0},
              {"phase": "dispatch", "network_bytes_per_nic": 90, "us": 2.0, "gbps_per_nic": 45.0},
              {"phase": "combine", "network_bytes_per_nic": 90, "us": 2.5, "gbps_per_nic": 36.0}]
    doc = mc.measured_rates(points, "two nodes")
    assert doc == {"source": "two nodes", "dispatch": {"network_gbps": 45.0},
                   "combine": {"network_gbps": 36.0}}
    rates = internode_model.load_rates(50, 450, doc)
    assert rates["dispatch"].network_gbps == 45.0 and rates["combine"].network_gbps == 36.0
    assert rates["combine"].source == "two nodes"
    assert mc.measured_rates([{"phase": "combine", "network_bytes_per_nic": 0, "us": 1.0,
                               "gbps_per_nic": 0.0}], "one node") == {"source": "one node"}


def test_routing_cases():
    shape = mc.Shape(rank=1, num_ranks=8, num_ranks_per_node=4, num_experts=32, topk=4)
    gen = torch.Generator().manual_seed(0)
    empty = mc.make_routing("empty", 64, shape, gen)
    assert empty.max() < 16 and empty.min() >= 0  # the last node's experts are never chosen
    limited = mc.make_routing("node-limited", 64, shape, gen)
    assert all(len(set((row // 16).tolist())) <= 2 for row in limited)
    dropped = mc.make_routing("dropped", 64, shape, gen)
    assert (dropped[::7] == -1).all() and (dropped == -1).any(dim=1).sum() > 9
    skewed = mc.make_routing("skewed", 256, shape, gen)
    assert (skewed < 8).sum() > (skewed >= 24).sum() * 3
    for case in mc.CASES:
        idx = mc.make_routing(case, 5, shape, gen)
        assert idx.shape == (5, 4) and idx.dtype == torch.int64
        valid = idx[idx >= 0]
        for row in idx:
            picked = row[row >= 0].tolist()
            assert len(picked) == len(set(picked)), f"{case}: duplicate expert in {row}"
        assert valid.numel() == 0 or valid.max() < 32
    assert mc.case_tokens("empty", 10, 0, 4) == 0 and mc.case_tokens("empty", 10, 1, 4) == 10
    assert [mc.case_tokens("uneven", 12, r, 4) for r in range(4)] == [3, 6, 1, 12]
    assert mc.default_num_experts(3) == 258 and mc.default_num_experts(16) == 256


def test_cli_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [*COMMAND, "--spawn", "3", "--num-ranks-per-node", "1", "--transport",
         "auto", "--device", "cpu", "--num-experts", "24", "--topk", "4",
         "--check-tokens", "12", "--check-hidden", "32", "--cases",
         "uneven,dropped,empty,node-limited", "--sweep-tokens", "16", "--sweep-hidden", "64",
         "--warmup", "0", "--iters", "1", "--seed", "7", "--fp8", "blockwise", "--json",
         str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    assert "3 ranks = 3 nodes x 1 on 1 host(s)" in text and "seed 7" in text
    for case in ("uneven", "dropped", "empty", "node-limited"):
        assert f"check {case}" in text
    assert "correctness: PASSED" in text and "GB/s/NIC" in text
    # `auto` on a CPU resolves to the reference: the record keeps both, asked and ran.
    assert "transport that ran: reference (--transport auto)" in text
    # The reference transport's times are torch's gloo all-to-all: no GB/s, saying why.
    assert "GB/s: none, the reference transport ran" in text
    sweep_rows = [line for line in text.splitlines() if line.strip().startswith("16 ")]
    assert len(sweep_rows) == 2 and all(line.split()[-3:] == ["-"] * 3 for line in sweep_rows)
    doc = json.loads(out.read_text())
    assert doc["passed"] and doc["seed"] == 7 and doc["setup"]["nodes"] == 3
    assert (doc["setup"]["transport"], doc["setup"]["transport_ran"]) == ("auto", "reference")
    assert {(p["phase"], p["wire"]) for p in doc["sweep"]} == {("dispatch", "blockwise"),
                                                                ("combine", "bf16")}
    assert all(p["network_bytes_per_rank"] > 0 and p["us"] > 0 for p in doc["sweep"])
    assert not any(k.startswith("gbps") for p in doc["sweep"] for k in p if k != "gbps_refused")
    assert "dispatch" not in doc and "combine" not in doc  # no rates for the model
    model = internode_model.main(["--tokens", "16", "--hidden", "64", "--experts", "24",
                                  "--topk", "4", "--nodes", "3", "--ranks-per-node", "1",
                                  "--node-limited", "0", "--measured-json", str(out)])
    assert not model["inputs"]["rates"]["dispatch"]["source"].startswith("multinode_check")


def test_a_kernel_transport_keeps_its_gbps_and_the_reference_loses_them():
    point = mc.sweep_point({"net_send": [4, 2], "net_recv": [1, 4], "nvl_send": [0, 0],
                            "nvl_recv": [0, 0]}, 1000, 2.0, 1, 1)
    assert point["gbps_per_nic"] == pytest.approx(4000 / 2e3)
    kept = mc.format_sweep([dict(point, tokens=8, hidden=500, phase="dispatch", wire="bf16")])
    assert "GB/s: none" not in kept and "2.00" in kept
    reason = transport.bandwidth_refusal("reference")
    for name in transport.KERNEL_TRANSPORTS:
        assert transport.bandwidth_refusal(name) is None
    refused = mc.refuse_bandwidth(dict(point, tokens=8, hidden=500, phase="dispatch",
                                       wire="bf16"), reason)
    assert "gbps_per_nic" not in refused and refused["us"] == 2.0
    table = mc.format_sweep([refused])
    assert "2.00" not in table and f"GB/s: none, {reason}" in table
    assert mc.measured_rates([refused], "x") == {"source": "x"}


class _Broken:
    """A reference Buffer whose dispatch corrupts one row on rank 1, or whose combine raises on
    every rank (a rank raising alone would leave its peers in the reference's all-to-all until
    gloo's timeout; the real transports' waits time out on their own)."""

    def __init__(self, buf, rank, mode):
        self.buf, self.rank, self.mode = buf, rank, mode

    def __getattr__(self, name):
        return getattr(self.buf, name)

    def dispatch(self, *a, **k):
        recv_x, recv_w, handle, event = self.buf.dispatch(*a, **k)
        if self.mode == "corrupt" and self.rank == 1 and recv_x.shape[0]:
            recv_x = recv_x.clone()
            recv_x[0] += 1
        return recv_x, recv_w, handle, event

    def combine(self, *a, **k):
        if self.mode == "raise":
            raise RuntimeError(f"planted failure on rank {self.rank}")
        return self.buf.combine(*a, **k)


def _check_catches(rank, world):
    import torch.distributed as dist

    module = mc
    lines = []
    for mode in ("ok", "corrupt", "raise"):
        args = module.build_parser().parse_args(
            ["--transport", "reference", "--device", "cpu", "--num-experts", str(4 * world),
             "--topk", "2", "--check-tokens", "6", "--check-hidden", "16", "--cases",
             "uniform,skewed", "--seed", "3"])
        shape = module.Shape(rank, world, 1, 4 * world, 2)
        ctx = module.Context(args, torch.device("cpu"), dist.group.WORLD, shape, 3)
        ctx.say = lines.append
        ctx.log_traceback = lambda text: None
        make = ctx.make_buffer
        ctx.make_buffer = lambda *a: _Broken(make(*a), rank, mode)
        passed = module.run_check(ctx)
        assert passed == (mode == "ok"), mode
        lines.append(f"-- {mode}")
    # A transport that cannot start here: every rank's reason, printed by rank 0, no Buffer.
    args.transport, args.num_ranks_per_node = "internode", 1
    unusable = module.Context(args, torch.device("cpu"), dist.group.WORLD, shape, 3)
    unusable.say = lines.append
    assert unusable.make_buffer(8, 16, 2) is None
    assert module.run_check(unusable) is False
    if rank == 0:
        text = "\n".join(lines)
        assert ("rank 1: Buffer(transport='internode') failed: ValueError: "
                "transport='internode' runs CUDA kernels") in text
        ok, corrupt, raised = text.split("-- ")[:3]
        assert "FAILED" not in ok and ok.count(" ok") == 2
        assert "rank 1: dispatch recv_x: 1 of" in corrupt
        assert "rank 1: raised RuntimeError: planted failure on rank 1" in raised
        assert "the remaining cases and the sweep are skipped" in raised
        assert "check skewed" not in raised


def test_check_catches_a_broken_transport():
    run_distributed(2, _check_catches)


def test_heap_is_sized_for_the_largest_buffer(monkeypatch):
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE", raising=False)
    args = mc.build_parser().parse_args(["--sweep-tokens", "512,4096", "--sweep-hidden", "7168"])
    shape = mc.Shape(rank=0, num_ranks=4, num_ranks_per_node=2, num_experts=256, topk=8)
    heap = mc._size_heap(args, shape)
    assert heap == mc.nvshmem_heap_bytes(4096, 7168, 4, 8, 2)
    assert os.environ["NVSHMEM_SYMMETRIC_SIZE"] == str(heap)
    assert mc._size_heap(args, shape) is None  # set now: kept
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE")
    one_node = mc.Shape(rank=0, num_ranks=4, num_ranks_per_node=4, num_experts=256, topk=8)
    assert mc._size_heap(args, one_node) is None and "NVSHMEM_SYMMETRIC_SIZE" not in os.environ
    args.transport = "reference"
    assert mc._size_heap(args, shape) is None


def test_reports_name_the_staging_they_timed(monkeypatch):
    """Real-node runs of full, ring and network-ring staging are told apart in the header and
    the JSON; runs without an internode transport, or with invalid knobs, report none."""
    args = mc.build_parser().parse_args([])
    shape = mc.Shape(rank=0, num_ranks=4, num_ranks_per_node=2, num_experts=256, topk=8)
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING", "full")
    assert mc._staging(args, shape) == {"name": "full", "mode": "full", "ring_slots": 0,
                                        "net_chunks": 0}
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING", "ring")
    monkeypatch.setenv("MDEEP_INTERNODE_RING_SLOTS", "64")
    assert mc._staging(args, shape)["name"] == "ring (64 slots)"
    monkeypatch.setenv("MDEEP_INTERNODE_NET_RING_CHUNKS", "8")
    assert mc._staging(args, shape) == {
        "name": "ring (64 slots) with the network ring (8 chunks per rail peer)", "mode": "ring",
        "ring_slots": 64, "net_chunks": 8}
    one_node = mc.Shape(rank=0, num_ranks=4, num_ranks_per_node=4, num_experts=256, topk=8)
    assert mc._staging(args, one_node) is None
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING", "full")  # network ring without ring staging
    assert mc._staging(args, shape) is None
    args.transport = "reference"
    monkeypatch.setenv("MDEEP_INTERNODE_NET_RING_CHUNKS", "0")
    assert mc._staging(args, shape) is None


def test_reports_name_the_staging_auto_picks(monkeypatch):
    """With `auto` the staging named is the one the sweep's Buffer picks for its shape."""
    for knob in ("STAGING", "RING_SLOTS", "NET_RING_CHUNKS", "STAGING_MAX_GB"):
        monkeypatch.delenv(f"MDEEP_INTERNODE_{knob}", raising=False)
    args = mc.build_parser().parse_args(["--sweep-tokens", "4096", "--sweep-hidden", "7168"])
    two_by_eight = mc.Shape(rank=0, num_ranks=16, num_ranks_per_node=8, num_experts=256, topk=8)
    eight_by_eight = mc.Shape(rank=0, num_ranks=64, num_ranks_per_node=8, num_experts=256,
                              topk=8)
    assert mc._staging(args, two_by_eight)["name"] == "full"
    assert mc._staging(args, eight_by_eight)["name"] == "ring (512 slots)"
    args.skip_sweep = True  # the check's Buffer: 256 tokens (768 in the uneven case)
    assert mc._staging(args, eight_by_eight)["name"] == "full"


def test_heap_covers_a_smaller_buffer_on_full_staging(monkeypatch):
    """With `auto`, the sweep's large Buffer may pick ring staging while the check's smaller one
    keeps full staging with a larger block: the heap covers the larger block."""
    for knob in ("STAGING", "RING_SLOTS", "NET_RING_CHUNKS"):
        monkeypatch.delenv(f"MDEEP_INTERNODE_{knob}", raising=False)
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE", raising=False)
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING_MAX_GB", "2")
    args = mc.build_parser().parse_args(["--check-tokens", "1024", "--check-hidden", "7168",
                                         "--cases", "uniform", "--sweep-tokens", "4096",
                                         "--sweep-hidden", "7168"])
    shape = mc.Shape(rank=0, num_ranks=64, num_ranks_per_node=8, num_experts=256, topk=8)
    check = mc.nvshmem_heap_bytes(1024, 7168, 64, 8, 8)  # full staging, 2.36 GB > 2: ring
    sweep = mc.nvshmem_heap_bytes(4096, 7168, 64, 8, 8)
    assert mc._size_heap(args, shape) == max(check, sweep)
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING_MAX_GB", "3")  # now the check keeps full
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE")
    check = mc.nvshmem_heap_bytes(1024, 7168, 64, 8, 8)
    assert check > mc.nvshmem_heap_bytes(4096, 7168, 64, 8, 8)
    assert mc._size_heap(args, shape) == check
