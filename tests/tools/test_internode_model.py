"""The internode model: per-rank rows on a hand-worked case, the formula, the CLI."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_deepep.tools import internode_model as model
from megatron_deepep.transport.node_layout import compute_node_layout
from megatron_deepep.transport.topology import Topology
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT


def _tiny_routing():
    # 2 nodes x 2 ranks, one expert per rank (expert e on rank e); rank = (node, local).
    return [torch.tensor([[1, 2], [3, -1]]),   # rank 0 = (0, 0)
            torch.tensor([[0, 1]]),            # rank 1 = (0, 1)
            torch.tensor([[-1, -1]]),          # rank 2 = (1, 0)
            torch.tensor([[0, 3]])]            # rank 3 = (1, 1)


def test_rank_rows_by_hand():
    rows = model.rank_rows(_tiny_routing(), num_experts=4, num_ranks_per_node=2)
    # rank 0: tokens 0 and 1 reach node 1 -> 2 rows to rank 2; rank 3: token 0 reaches node 0 ->
    # 1 row to rank 1.
    assert rows["net_send"] == [2, 0, 0, 1]
    assert rows["net_recv"] == [0, 1, 2, 0]
    # Forwarders: rank 0 sends rank 0's token 0 to rank 1; rank 2 sends rank 0's token 1 to
    # rank 3 (token 0 stays on rank 2); rank 1 sends rank 1's and rank 3's tokens to rank 0.
    assert rows["nvl_send"] == [1, 2, 1, 0]
    assert rows["nvl_recv"] == [2, 1, 0, 1]
    assert rows["flat_net_send"] == [2, 0, 0, 1]
    assert rows["crossings"] == [2, 0, 0, 1]
    assert rows["tokens"] == [2, 1, 1, 1]


def test_phase_model_formula():
    rows = model.rank_rows(_tiny_routing(), num_experts=4, num_ranks_per_node=2)
    rates = model.Rates(network_gbps=50.0, nvlink_gbps=400.0, fixed_us=3.0)
    got = model.phase_model(rows, row_bytes=256, rates=rates)
    # Busiest rank: 2 network rows (rank 0 sends 2, rank 2 receives 2), 2 NVLink rows.
    assert got["network_bytes_max"] == 512
    assert got["nvlink_bytes_max"] == 512
    assert got["network_bytes_mean"] == 3 * 256 / 4
    assert got["nvlink_bytes_mean"] == 4 * 256 / 4
    assert got["crossings_per_token"] == pytest.approx(3 / 5)
    assert got["network_us"] == pytest.approx(512 / 50e3)
    assert got["nvlink_us"] == pytest.approx(512 / 400e3)
    assert got["time_us"] == pytest.approx(3.0 + 512 / 50e3)
    assert got["serial_time_us"] == pytest.approx(3.0 + 512 / 50e3 + 512 / 400e3)


def test_row_bytes():
    assert model.bf16_row_bytes(7168) == 14336
    assert model.fp8_row_bytes(7168) == 7168 + 56 * 4 == 7392
    assert model.fp8_row_bytes(2880) == 2880 + 23 * 4


def test_reported_times():
    got = model.reported_times(16, "dispatch", "fp8", 62e6)
    assert got["HybridEP"]["time_us"] == pytest.approx([1000.0, 1000.0])
    assert got["DeepEP"]["gbps"] == [43, 43]
    assert model.reported_times(16, "dispatch", "bf16", 1e6)["HybridEP"]["gbps"] == [77, 77]
    assert model.reported_times(64, "combine", "bf16", 50e6)["DeepEP"]["time_us"] == [1000, 1000]
    assert model.reported_times(24, "dispatch", "bf16", 1e6) == {}


def test_load_rates_from_measured():
    rates = model.load_rates(50, 450, {"nvlink_gbps": 300, "source": "H200 2x1",
                                       "combine": {"network_gbps": 40, "fixed_us": 12}})
    assert rates["dispatch"] == model.Rates(50, 300, 0.0, "H200 2x1")
    assert rates["combine"] == model.Rates(40, 300, 12.0, "H200 2x1")
    assert model.load_rates(50, 450, None)["combine"] == model.Rates(50, 450)
    with pytest.raises(ValueError, match="network_gbps=0.0"):
        model.load_rates(50, 450, {"dispatch": {"network_gbps": 0}})
    per_byte = model.load_rates(50, 450, {"network_ns_per_byte": 0.025,
                                          "combine": {"nvlink_ns_per_byte": 0.004}})
    assert per_byte["dispatch"].network_gbps == pytest.approx(40.0)
    assert per_byte["combine"].nvlink_gbps == pytest.approx(250.0)
    assert per_byte["dispatch"].nvlink_gbps == 450
    with pytest.raises(ValueError, match="network_ns_per_byte=0.0"):
        model.load_rates(50, 450, {"network_ns_per_byte": 0})


def test_accumulated_counts_match_rank_rows():
    idxs = model.route(32, 16, 4, 8, seed=2)
    topo = Topology(8, 2)
    counts = [model.source_counts(compute_node_layout(idx, 16, topo, rank=r))
              for r, idx in enumerate(idxs)]
    assert counts[0]["tokens"] == [32] and len(counts[0]["network"]) == 4
    assert model.accumulate_rank_rows(counts, 2) == model.rank_rows(idxs, 16, 2)


def test_node_limited_routing_bounds_crossings():
    idxs = model.route(64, 32, 4, 8, seed=1, num_nodes=4, group_topk=2)
    rows = model.rank_rows(idxs, 32, 2)
    assert max(rows["crossings"]) <= 64 * 2
    uniform = model.route(64, 32, 4, 8, seed=1)
    assert len(uniform) == 8 and all(i.shape == (64, 4) for i in uniform)
    # Same seed, same scores: only the node limit differs, so it cannot add crossings on average.
    assert sum(rows["crossings"]) <= sum(model.rank_rows(uniform, 32, 2)["crossings"])


def test_cli_tiny(tmp_path, capsys):
    out = tmp_path / "model.json"
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"network_gbps": 25, "source": "test"}))
    result = model.main(["--tokens", "32", "--hidden", "256", "--experts", "16", "--topk", "4",
                         "--nodes", "2", "4", "--ranks-per-node", "2", "--node-limited", "2",
                         "--seed", "3", "--json", str(out), "--measured-json", str(measured)])
    printed = capsys.readouterr().out
    assert "model" in printed and "node-limited M=2" in printed
    assert "skipped: node-limited M=2 at 2 nodes" in printed
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    cases = result["cases"]
    assert len(cases) == 3 + 6  # 2 nodes: uniform; 4 nodes: uniform and node-limited
    for case in cases:
        m = case["model"]
        assert m["network_gbps"] == 25 and m["rates_source"] == "test"
        assert m["row_bytes"] == (512 if case["wire"] == "bf16" else 256 + 2 * 4)
        assert m["network_us"] == pytest.approx(m["network_bytes_max"] / 25e3)
        assert m["nvlink_us"] == pytest.approx(m["nvlink_bytes_max"] / 450e3)
        assert m["time_us"] == pytest.approx(max(m["network_us"], m["nvlink_us"]))
        if case["routing"].startswith("node-limited"):
            assert m["crossings_per_token"] <= 2
    assert result["inputs"]["rates"]["dispatch"]["network_gbps"] == 25


def test_cli_rejects_bad_flags(capsys):
    with pytest.raises(SystemExit):
        model.main(["--nic-gbps", "0"])
    with pytest.raises(ValueError, match="--experts 10 must be a multiple of the EP size 4"):
        model.main(["--experts", "10", "--nodes", "2", "--ranks-per-node", "2", "--tokens", "4"])


def test_module_runs_as_script(tmp_path):
    out = tmp_path / "m.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_deepep.tools.internode_model", "--tokens", "16",
         "--hidden", "128", "--experts", "8", "--topk", "2", "--nodes", "2", "--ranks-per-node",
         "1",
         "--node-limited", "0", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "internode model" in proc.stdout
    assert len(json.loads(out.read_text())["cases"]) == 3


def test_several_measured_files_each_give_their_keys():
    """The proxy path's network rate and the MPS run's kernel rate come from two files; each
    key names the file it came from, and the later file wins where both have a key."""
    proxy = {"source": "NVSHMEM proxy, ucx over loopback", "dispatch": {"network_gbps": 3.0},
             "combine": {"network_gbps": 2.5}, "nvlink_gbps": 400}
    mps = {"source": "MPS on one GPU", "dispatch": {"kernel_gbps": 200.0},
           "nvlink_gbps": 300}
    rates = model.load_rates(50, 450, [proxy, mps])
    d, c = rates["dispatch"], rates["combine"]
    assert (d.network_gbps, d.nvlink_gbps, d.kernel_gbps) == (3.0, 300.0, 200.0)
    assert d.nvlink_effective_gbps == 200.0  # the kernels' ceiling is below the link
    assert dict(d.sources) == {"network_gbps": "NVSHMEM proxy, ucx over loopback",
                               "nvlink_gbps": "MPS on one GPU", "kernel_gbps": "MPS on one GPU"}
    assert d.source == "NVSHMEM proxy, ucx over loopback; MPS on one GPU"
    assert (c.network_gbps, c.kernel_gbps, c.nvlink_effective_gbps) == (2.5, 0.0, 300.0)
    # One object still works as before; a kernel ceiling above the link changes nothing.
    one = model.load_rates(50, 450, {"kernel_gbps": 900, "source": "x"})["dispatch"]
    assert one.nvlink_effective_gbps == 450 and one.source == "x"
    with pytest.raises(ValueError, match="kernel_gbps=0.0"):
        model.load_rates(50, 450, [proxy, {"kernel_gbps": 0}])


def test_kernel_ceiling_slows_the_nvlink_leg():
    rows = model.rank_rows(_tiny_routing(), num_experts=4, num_ranks_per_node=2)
    fast = model.phase_model(rows, 256, model.Rates(50.0, 400.0))
    slow = model.phase_model(rows, 256, model.Rates(50.0, 400.0, kernel_gbps=100.0))
    assert slow["nvlink_us"] == pytest.approx(fast["nvlink_us"] * 4)
    assert slow["nvlink_effective_gbps"] == 100.0 and slow["kernel_gbps"] == 100.0
    assert slow["network_us"] == fast["network_us"]


def test_cli_reads_the_proxy_and_mps_files(tmp_path, capsys):
    proxy = tmp_path / "proxy_model.json"
    mps = tmp_path / "mps_model.json"
    proxy.write_text(json.dumps({"source": "proxy path", "dispatch": {"network_gbps": 4.0},
                                 "combine": {"network_gbps": 5.0}}))
    mps.write_text(json.dumps({"source": "MPS", "dispatch": {"kernel_gbps": 100.0},
                               "combine": {"kernel_gbps": 120.0}}))
    result = model.main(["--tokens", "32", "--hidden", "256", "--experts", "16", "--topk", "4",
                         "--nodes", "2", "--ranks-per-node", "2", "--node-limited", "0",
                         "--measured-json", str(proxy), str(mps)])
    printed = capsys.readouterr().out
    assert "network_gbps: measured by proxy path" in printed
    assert "kernel_gbps: measured by MPS" in printed
    assert "kernels 100 GB/s per rank" in printed
    combine = [c for c in result["cases"] if c["phase"] == "combine"][0]["model"]
    assert combine["network_gbps"] == 5.0 and combine["nvlink_effective_gbps"] == 120.0
    assert combine["rates_source"] == "proxy path; MPS"
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        model.main(["--measured-json", str(bad), "--tokens", "4"])
