"""CPU tier: the evidence scripts of `dev/gpu/` parse, name their pieces in a dry run, refuse a
missing folder with one line, and the side-by-side driver's pieces (DeepEP's rows in the
oracle's order, the table, the model's input) work without a GPU."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import load_dev_gpu_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_DIR = os.path.join(ROOT, "dev", "gpu")
SCRIPTS = ("evidence.sh", "evidence_lib.sh", "deepep.sh", "mps.sh", "proxy.sh")


def _side_by_side():
    return load_dev_gpu_script("deepep_side_by_side")


def _run(tmp_path, script, *args, **env):
    full = dict(os.environ, TMPDIR=str(tmp_path), EV_OUT=str(tmp_path / "ev_out"),
                **{k: str(v) for k, v in env.items()})
    full.pop("OUT", None)
    done = subprocess.run(["bash", os.path.join(GPU_DIR, script), *args], cwd=str(tmp_path),
                          env=full, capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture
def folders(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "libucx_cu13-1.22.0-py3-none-any.whl").write_bytes(b"")
    src = tmp_path / "DeepEP-v1.2.1.tar.gz"
    src.write_bytes(b"")
    return str(wheels), str(src)


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse(script):
    done = subprocess.run(["bash", "-n", os.path.join(GPU_DIR, script)], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_evidence_dry_run_names_every_piece_and_record(tmp_path, folders):
    rc, out = _run(tmp_path, "evidence.sh", *folders, DRY_RUN=1)
    assert rc == 0, out
    for piece in ("precompile", "bench EP=1", "bench layer", "main job", "build", "own-test",
                  "side", "side by side, concurrent", "nvlink tier N=8",
                  "internode tier 2x4", "sweep 2x2", "internode tier 2x1 via ucx",
                  "sweep 2x2 via ucx", "internode model"):
        assert f"piece '{piece}'" in out, piece
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    for topic in ("baselines", "main_job", "deepep", "mps", "proxy", "model"):
        # A record is named after the card that ran it (`ev_card`): "dry" in a dry run.
        assert f"record benchmarks/dry_{date}_{topic}.md" in out, topic
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=12 MDEEP_TEST_PROCS=8" in out
    assert "NVSHMEM_DISABLE_P2P=1 NVSHMEM_REMOTE_TRANSPORT=ucx" in out
    assert "alltoall-fused,alltoall,deepep-sync,deepep-syncfree" in out
    # The summary table is printed last; a dry run writes no record.
    assert out.rstrip().splitlines()[-1].startswith("| internode model")
    assert not (tmp_path / "benchmarks").exists()


def test_evidence_runs_only_the_named_pieces(tmp_path, folders):
    rc, out = _run(tmp_path, "evidence.sh", *folders, DRY_RUN=1, PIECES="mps-sweep proxy-tier")
    assert rc == 0, out
    assert "piece 'sweep 2x4'" in out and "piece 'internode tier 2x2 via ucx'" in out
    for other in ("bench EP=1", "'build'", "nvlink tier", "sweep 2x1 via ucx", "internode model"):
        assert other not in out, other


@pytest.mark.parametrize("script, args, message", [
    ("evidence.sh", ["{missing}", "{src}"], "evidence: WHEELS_DIR '{missing}' is not a folder"),
    ("evidence.sh", ["{wheels}", "{missing}"],
     "evidence: DEEPEP_SRC '{missing}' is not a folder or a tarball"),
    ("deepep.sh", ["{missing}"], "deepep: DEEPEP_SRC '{missing}' is not a folder or a tarball"),
    ("mps.sh", ["{missing}"],
     "mps: DEEPEP '{missing}' is not a built folder, a source folder or a .tar.gz"),
    ("proxy.sh", ["{missing}"], "proxy: WHEELS_DIR '{missing}' is not a folder"),
    ("proxy.sh", ["{empty}"], "proxy: no libucx*.whl in {empty} (pip download libucx-cu13 "
                              "for Python 3.12 there)"),
])
def test_missing_folders_are_refused_in_one_line(tmp_path, folders, script, args, message):
    names = {"missing": str(tmp_path / "nope"), "wheels": folders[0], "src": folders[1],
             "empty": str(tmp_path)}
    rc, out = _run(tmp_path, script, *[a.format(**names) for a in args])
    assert rc == 2
    assert out.strip() == message.format(**names), out


@pytest.mark.parametrize("script, args", [("evidence.sh", ["{wheels}", "{src}"]),
                                          ("deepep.sh", ["{src}"]), ("mps.sh", []),
                                          ("proxy.sh", ["{wheels}"])])
def test_unknown_pieces_are_refused_before_anything_runs(tmp_path, folders, script, args):
    names = {"wheels": folders[0], "src": folders[1]}
    rc, out = _run(tmp_path, script, *[a.format(**names) for a in args], PIECES="nonsense",
                   DRY_RUN=1)
    assert rc == 2 and "unknown piece 'nonsense'" in out, out
    assert "dry run: piece" not in out


def test_scripts_keep_multicast_off_and_stop_the_mps_daemon():
    lib = open(os.path.join(GPU_DIR, "evidence_lib.sh"), encoding="utf-8").read()
    assert "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1" \
        in lib
    assert "trap ev_stop_mps EXIT INT TERM" in lib and "echo quit | nvidia-cuda-mps-control" in lib
    assert 'mktemp -d "${TMPDIR:-/tmp}/mps_pipe.XXXXXX"' in lib
    for script in SCRIPTS[2:] + ("evidence.sh",):
        text = open(os.path.join(GPU_DIR, script), encoding="utf-8").read()
        assert "source \"$(dirname \"${BASH_SOURCE[0]}\")/evidence_lib.sh\"" in text, script


# ---- the side-by-side driver -------------------------------------------------------------------
def test_side_by_side_refuses_bad_arguments_in_one_line(tmp_path, capsys):
    d = _side_by_side()
    assert d.main(["--deepep", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"deepep_side_by_side: --deepep {tmp_path / 'nope'}: no such folder")
    assert d.main(["--deepep", str(tmp_path)]) == 2
    assert "no deep_ep_cpp*.so in it" in capsys.readouterr().err
    assert d.main(["--skip-deepep", "--ranks", "3"]) == 2
    assert "2, 4 or 8" in capsys.readouterr().err
    assert d.main(["--skip-deepep", "--model-json", "x.json"]) == 2
    assert "needs --concurrent" in capsys.readouterr().err
    assert d.main(["--skip-deepep", "--dry-run"]) == 0
    assert "R = [2, 4, 8] on one GPU, ours, time-sliced" in capsys.readouterr().out
    assert d.main(["--dry-run", "--deepep", str(tmp_path), "--skip-deepep"]) == 0
    assert "ours, time-sliced" in capsys.readouterr().out


def _deepep_receive(inputs, rank, experts):
    """What DeepEP's intranode dispatch hands rank `rank`: one row per (source, token) with an
    expert here, grouped by source rank in any order, local ids (-1 elsewhere), zeroed
    weights, and a handle with the rank prefix matrix and source indices."""
    num_ranks, per_rank = len(inputs), experts // len(inputs)
    rows, src_idx, counts, ids, weights = [], [], [], [], []
    gen = torch.Generator().manual_seed(rank)
    for x, idx, w in inputs:
        tokens = torch.nonzero(((idx // per_rank) == rank).any(1)).flatten()
        tokens = tokens[torch.randperm(len(tokens), generator=gen)]
        local = torch.where((idx[tokens] // per_rank) == rank, idx[tokens] - rank * per_rank,
                            torch.full_like(idx[tokens], -1))
        rows.append(x[tokens])
        src_idx.append(tokens)
        counts.append(len(tokens))
        ids.append(local)
        weights.append(torch.where(local >= 0, w[tokens], torch.zeros_like(w[tokens])))
    prefix = torch.zeros(num_ranks, num_ranks, dtype=torch.int32)
    prefix[:, rank] = torch.tensor(counts).cumsum(0)
    handle = (prefix, None, None, torch.cat(src_idx), None, None)
    return torch.cat(rows), torch.cat(ids), torch.cat(weights), handle


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_deepep_rows_in_the_oracles_order(num_ranks):
    from tests.helpers.oracle import oracle_combine

    d = _side_by_side()
    experts, tokens = 4 * num_ranks, 12
    inputs = d.make_inputs(num_ranks, tokens, 256, experts, 3, seed=5)
    want = d.oracle(inputs, experts)
    for rank in range(num_ranks):
        rows, ids, weights, handle = _deepep_receive(inputs, rank, experts)
        got, got_w, ids_ok = d.deepep_expert_major(rows, ids, weights, handle, inputs, rank,
                                                   experts)
        assert d.compare("rows", got, want[rank][0]) == ""
        assert d.compare("weights", got_w, want[rank][1]) == ""
        assert ids_ok
        assert d.received_tokens(inputs, rank, experts) == rows.shape[0]
        wrong = ids.clone()
        wrong[ids >= 0] = (wrong[ids >= 0] + 1) % (experts // num_ranks)
        assert not d.deepep_expert_major(rows, wrong, weights, handle, inputs, rank, experts)[2]
    # DeepEP's combine returns, per token, its row times the ranks it reached: the oracle's
    # combine of one row per rank gives exactly that.
    ys = [d.one_row_per_rank(o[0], o[3]) for o in want]
    combined = oracle_combine(ys, [o[3] for o in want], [tokens] * num_ranks)
    per_rank = experts // num_ranks
    for (x, idx, _), out in zip(inputs, combined):
        reached = torch.stack([((idx // per_rank) == r).any(1) for r in range(num_ranks)], 1)
        assert torch.equal(out, (x.float() * reached.sum(1, keepdim=True)).to(torch.bfloat16))
    assert "2 values differ" in d.compare("x", torch.tensor([1.0, 2.0, 3.0]),
                                           torch.tensor([1.0, 0.0, 0.0]))


def test_table_gbps_only_when_concurrent_and_the_model_input():
    d = _side_by_side()
    rows = {"token_rows": 1000, "self_rows": 125, "expert_rows": 1000, "tokens_out": 1000}
    recs = [{"rank": r, "num_sms": 14, "received_tokens": 1000, "rows": rows, "errors": {},
             "ours": {"check_bf16": "passed", "check_fp8": "passed", "dispatch_us": 100.0 + r,
                      "cached_us": 50.0, "combine_us": 80.0, "fp8_dispatch_us": 60.0},
             "deepep": {}} for r in range(8)]
    recs[3]["errors"]["deepep"] = "Buffer: RuntimeError: exact words"
    size = {"num_ranks": 8, "records": recs}
    ours = d.summarize(size, "ours", 7168, concurrent=True)
    assert ours["dispatch_us"] == 107.0  # the slowest rank
    assert ours["dispatch_gbps"] == pytest.approx(1000 * 14336 / (107.0 * 1e3))
    assert ours["dispatch_algbw"] == pytest.approx(ours["dispatch_gbps"])
    assert ours["fp8_dispatch_gbps"] == pytest.approx(1000 * (7168 + 224) / 60e3)
    theirs = d.summarize(size, "deepep", 7168, concurrent=True)
    assert theirs["check_bf16"] == "not run" and not theirs["check_failed"]
    assert theirs["errors"] == ["Buffer: RuntimeError: exact words (rank 3, ? s)"]
    sliced = d.summarize(size, "ours", 7168, concurrent=False)
    assert "dispatch_gbps" not in sliced

    class Args:
        concurrent, tokens, hidden, experts, topk = True, 4096, 7168, 256, 8
    table = d.format_table([ours, theirs], Args)
    # Ours is credited with the rows it writes (here the received tokens: no expert rows given).
    assert "| 8 | ours | 14 | passed | passed | 107 | 50 | 80 | 60 | 134 |" in table
    assert "error R=8 SMs=14 deepep: Buffer: RuntimeError: exact words (rank 3, ? s)" in table
    model = d.model_inputs([ours, theirs], Args)
    assert model["dispatch"]["kernel_gbps"] == pytest.approx(ours["dispatch_algbw"])
    assert "EP 8, 14 SMs per rank (12% share)" in model["source"]
    assert d.sm_budget(24, 8, True, 132) == 14 and d.sm_budget(24, 2, True, 132) == 24
    assert d.sm_budget(24, 8, False, 132) == 24


def test_side_by_side_runs_ours_on_the_cpu(tmp_path):
    """`--cpu`: two processes, ours on the reference transport, checked against the oracle."""
    out = tmp_path / "side.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, os.path.join(GPU_DIR, "deepep_side_by_side.py"), "--cpu",
         "--skip-deepep", "--ranks", "2", "--tokens", "32", "--hidden", "128", "--experts", "8",
         "--topk", "2", "--check-tokens", "16", "--iters", "2", "--warmup", "1", "--json",
         str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["impl"], r["check_bf16"], r["check_fp8"]) for r in rows] == [
        ("ours", "passed", "passed")]
    assert rows[0]["dispatch_us"] > 0 and "dispatch_gbps" not in rows[0]
    assert "| 2 | ours | 24 | passed | passed |" in done.stdout


def test_mps_dry_run_builds_installs_and_plans_the_fault_runs(tmp_path, folders):
    """The one-call plan: DeepEP built from its tarball first, the wheels, the three-row side
    by side, the SM sweep, then DeepEP alone under MPS (launch blocking, 100% share), with
    compute-sanitizer, and time-sliced once the daemon is stopped; each limit and their sum."""
    rc, out = _run(tmp_path, "mps.sh", folders[1], DRY_RUN=1,
                   PIECES="build wheels side sweep-sms faults", WHEELS_DIR=folders[0])
    assert rc == 0, out
    pieces = [line.split("'")[1] for line in out.splitlines()
              if line.startswith("dry run: piece")]
    assert pieces[:5] == ["deepep build", "precompile", "side by side, concurrent",
                          "SM sweep at R=2", "faults: DeepEP build, fast debug"]
    assert "DEEPEP_NVSHMEM=0 bash" in out and "DEEPEP_FAST_DEBUG=1 bash" in out
    assert "pip install 1 wheels of" in out
    assert "--ranks 2,4,8 --num-sms 24 --concurrent --timeout-s 150" in out
    assert "--ranks 2 --num-sms 8,16,24,48 --concurrent" in out
    assert "env CUDA_LAUNCH_BLOCKING=1 python3 dev/gpu/deepep_side_by_side.py" in out
    assert "--skip-ours --check-only --timeout-s 250 --ranks 8 --num-sms 14 --concurrent " \
           "--mps-percentage 100" in out
    stopped = out.index("MPS daemon stopped for the time-sliced runs")
    assert out.index("piece 'faults: R=8 14 SMs, time-sliced'") > stopped
    assert out.index("compute-sanitizer --tool memcheck") < stopped
    assert "limits so far 120 s of 570" in out and "the pieces' limits add up to" in out
    rc, out = _run(tmp_path, "mps.sh", DRY_RUN=1, PIECES="build")
    assert rc == 2 and "the build piece needs DeepEP's source" in out
