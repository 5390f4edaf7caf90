"""CPU tier: the bench's ceiling helpers describe the layout our expand writes."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_deepep.bench import run as bench
from megatron_deepep.layout import compute_layout
from tests.helpers import load_dev_script


@pytest.mark.parametrize("num_tokens,num_experts,num_topk", [(37, 16, 4), (64, 256, 8),
                                                              (5, 3, 3), (0, 8, 2)])
def test_expert_major_rows_match_the_layout(num_tokens, num_experts, num_topk):
    g = torch.Generator().manual_seed(num_tokens * 31 + num_experts)
    topk_idx = torch.rand(num_tokens, num_experts, generator=g).topk(num_topk, dim=1).indices
    rows = bench.expert_major_rows(topk_idx)

    layout = compute_layout(topk_idx, num_experts, num_ranks=1)
    counts = layout.num_tokens_per_expert.long()
    starts = torch.cumsum(counts, 0) - counts
    expected = starts[topk_idx.flatten()] + layout.pos_in_expert.flatten().long()
    assert rows.dtype == torch.int32
    assert torch.equal(rows.long(), expected)
    assert torch.equal(torch.sort(rows).values, torch.arange(num_tokens * num_topk,
                                                              dtype=torch.int32))


def test_token_of_rows_gives_a_fan_outs_expected_output():
    topk_idx = torch.rand(37, 16, generator=torch.Generator().manual_seed(3)).topk(4).indices
    dst_rows = bench.expert_major_rows(topk_idx)
    x = torch.randn(37, 8)
    out = torch.empty(37 * 4, 8)
    out[dst_rows.long()] = x.repeat_interleave(4, dim=0)  # row of entry (n, k) <- x[n]
    assert torch.equal(out, x.index_select(0, bench.token_of_rows(dst_rows, 4)))


@pytest.mark.parametrize("text, expected", [("2x2", (2, 2)), ("3X1", (3, 1)), ("32x8", (32, 8))])
def test_nodes_parse(text, expected):
    assert bench.parse_nodes(text) == expected


@pytest.mark.parametrize("text, message", [("2", "expected MxL"), ("2x2x2", "expected MxL"),
                                           ("1x4", "2-32 nodes of 1-8 ranks"),
                                           ("2x9", "2-32 nodes of 1-8 ranks")])
def test_bad_nodes_name_the_flag(text, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--nodes", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--nodes" in err and message in err


def test_virtual_nodes_run_the_check_then_the_model(monkeypatch, tmp_path, capsys):
    """`--nodes`: multinode_check on spawned virtual nodes at the first shape (experts rounded
    up to a multiple of the ranks), then the model of DeepSeek-V3's shape at 2 x 8 and 8 x 8."""
    from megatron_deepep.tools import internode_model, multinode_check
    calls = []
    monkeypatch.setattr(multinode_check, "main", lambda argv: calls.append(argv) or 1)
    monkeypatch.setattr(internode_model, "main", lambda argv: calls.append(argv) or {})
    status = bench.run_virtual_nodes((3, 2), (512, 2048, 64, 4), 24, "blockwise_1x128,mxfp8",
                                     str(tmp_path))
    assert status == 1  # the check's status
    check, model = calls
    flags = dict(zip(check[::2], check[1::2]))
    assert flags == {"--spawn": "6", "--num-ranks-per-node": "2", "--transport": "internode",
                     "--num-experts": "66", "--topk": "4", "--check-hidden": "2048",
                     "--sweep-tokens": "512", "--sweep-hidden": "2048", "--num-sms": "24",
                     "--json": str(tmp_path / "nodes.json"), "--fp8": "blockwise_1x128"}
    assert model[model.index("--nodes") + 1:model.index("--nodes") + 3] == ["2", "8"]
    assert "--node-limited" in model
    assert "correctness, not speed" in capsys.readouterr().out


def _bench_row(transport):
    res = {"dispatch_us": 100.0, "combine_us": 120.0, "num_recv_rows": 64}
    return {"shape": [64, 1024, 8, 2], "ep": 1, "variants": {"ours 24 SMs sync": res},
            "transport": transport, "dispatch_bytes": 2e6, "floor_us": 50.0, "copy_GBps": 40.0,
            "fill_GBps": 30.0, "num_recv_rows": 64, "dispatch_write_floor_us": 10.0}


def test_the_table_names_no_gbps_for_the_reference_transport(capsys):
    bench.print_table([_bench_row("local")])
    kernels = capsys.readouterr().out
    assert "| ours 24 SMs sync | 100.0 | 20 | 0.50 | 120.0 | 17 | 0.42 |" in kernels
    assert "none" not in kernels
    bench.print_table([_bench_row("reference")])
    fallback = capsys.readouterr().out
    assert "| ours 24 SMs sync | 100.0 | - | - | 120.0 | - | - |" in fallback
    assert "GB/s and floor ratios: none, the reference transport ran" in fallback


def test_megatron_rows_are_both_alltoall_baselines(monkeypatch):
    """The bench times Megatron's alltoall with TE's fused permute and without, one labelled row
    each; where the fused one cannot run (CPU here) its row says why instead of a time."""
    calls = []

    def fake(xs, idxs, ws, num_experts, permute_fusion=False):
        calls.append(permute_fusion)
        return {"dispatch_us": 10.0, "combine_us": 20.0}

    monkeypatch.setattr(bench, "bench_megatron", fake)
    rows = bench.megatron_rows([], [], [], 8, device="cpu")
    assert list(rows) == ["megatron alltoall (fused permute)", "megatron alltoall (unfused)"]
    assert "GPU only" in rows["megatron alltoall (fused permute)"]["skipped"]
    assert rows["megatron alltoall (unfused)"] == {"dispatch_us": 10.0, "combine_us": 20.0}
    assert calls == [False]
    # On a GPU the fused row runs with moe_permute_fusion=True when TE is there.
    monkeypatch.setattr("megatron_deepep.megatron.baselines.permute_fusion_reason",
                        lambda device="cuda": "")
    rows = bench.megatron_rows([], [], [], 8)
    assert calls[1:] == [True, False]
    assert "skipped" not in rows["megatron alltoall (fused permute)"]


def test_without_te_the_fused_row_names_transformer_engine():
    from megatron_deepep.fp8 import te_bridge
    from megatron_deepep.megatron import baselines

    if te_bridge.te_available()[0]:
        pytest.skip("Transformer Engine imports here")
    reason = baselines.permute_fusion_reason("cuda")
    assert reason.startswith("moe_permute_fusion=True needs Transformer Engine")
    assert baselines.missing_fused_functions({"fused_permute": None, "fused_unpermute": 1}) == [
        "fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs"]
    assert baselines.split_run("alltoall-fused") == ("alltoall", True)
    assert baselines.split_run("deepep") == ("deepep", False)


def test_table_prints_a_skipped_baseline_with_its_reason(capsys):
    entry = {"shape": [8, 16, 4, 2], "ep": 1, "copy_GBps": 1000.0, "fill_GBps": 500.0,
             "num_recv_rows": 16, "dispatch_bytes": 768, "floor_us": 0.5,
             "dispatch_write_floor_us": 0.2,
             "variants": {"megatron alltoall (fused permute)": {"skipped": "no TE"},
                          "megatron alltoall (unfused)": {"dispatch_us": 4.0,
                                                          "combine_us": 5.0}}}
    bench.print_table([entry])
    out = capsys.readouterr().out
    assert "| megatron alltoall (fused permute) | skipped: no TE" in out
    assert "| megatron alltoall (unfused) | 4.0 |" in out


def test_fp8_rows_carry_the_bare_fan_out_ratio_of_their_sm_budget(capsys):
    """At EP = 1 the table prints the store path's floor per SM budget (bf16 rows against
    FP8-sized rows on the bare fan-out kernel) and each FP8 row carries its budget's ratio."""
    entry = _bench_row("local")
    entry["variants"]["ours 24 SMs fp8 blockwise_1x128 sync"] = {
        "dispatch_us": 62.0, "num_recv_rows": 64, "fp8": "blockwise_1x128"}
    entry["fp8_blockwise_1x128"] = {"dispatch_bytes": 1.1e6, "floor_us": 27.5,
                                    "wire_byte_ratio": 0.516}
    entry["sm_fan_out"] = {"24": {"bf16_us": 90.0, "fp8_bytes_us": 54.0, "bf16_us_512": 95.0,
                                  "bf16_us_1024": 90.0, "fp8_bytes_us_512": 54.0,
                                  "fp8_bytes_us_1024": 56.0},
                           "132": {"bf16_us": 40.0, "fp8_bytes_us": 30.0}}
    bench.print_table([entry])
    out = capsys.readouterr().out
    assert "[wire bytes x0.516, time x0.62 of bf16; bare fan-out x0.60]" in out
    assert ("bare fan-out at 24 SMs (one block per SM, 512 / 1024 threads): bf16 rows 95.0 / "
            "90.0 µs, FP8-sized rows 54.0 / 56.0 µs (best x0.60)") in out
    assert "bare fan-out at 132 SMs" in out and "- / - µs" in out and "(best x0.75)" in out


@contextlib.contextmanager
def _harness_buffer(monkeypatch):
    """A Buffer on dev/host_path_cpu.py's local transport with CUDA faked, and its inputs:
    (buf, x, idx, w, num_experts). Every sync call finds its receive layout published (the
    epoch is the one it waits for: the mailbox is refilled before each read)."""
    harness = load_dev_script("host_path_cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    counter = harness.CudaCallCounter()
    num_tokens, hidden, num_experts, num_topk = 64, 256, 16, 4
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    idx = torch.rand(num_tokens, num_experts, generator=g).topk(num_topk, dim=1).indices
    w = torch.rand(num_tokens, num_topk, generator=g)
    with harness.fake_gpu(counter):
        buf = harness.make_buffer(counter, num_tokens, hidden, num_topk)
        status = buf._transport.status
        status.wait_num_rows = lambda epoch: num_tokens * num_topk
        status.tokens_per_expert = lambda num_local: [num_tokens * num_topk // num_local] * (
            num_local)
        yield buf, x, idx, w, num_experts


def test_kernel_profile_tables_each_format_and_mode(monkeypatch):
    """`--profile`: one kernel table for bf16 dispatch + combine, then one each for the no-sync
    and the cached FP8 dispatch (the CPU harness's local transport, kernels faked)."""
    from megatron_deepep.fp8.dispatch import Fp8Dispatch
    with _harness_buffer(monkeypatch) as (buf, x, idx, w, num_experts):
        text = bench.profile_kernels(buf, x, idx, w, num_experts,
                                     fp8=Fp8Dispatch.named("blockwise"), calls=2)
    for label in ("dispatch+combine nosync bf16", "dispatch nosync fp8 blockwise_1x128",
                  "dispatch cached fp8 blockwise_1x128"):
        assert f"kernels of 2 calls, {label}:" in text
    assert text.count("Self CPU time total") == 3  # a profiler table under each


def test_host_profile_reports_each_dispatch_mode(monkeypatch):
    """`--profile-host`: the sync, no-sync and cached dispatch each get their µs/call and
    cProfile lines (run here on the CPU harness's local transport, kernels faked)."""
    from megatron_deepep.fp8.dispatch import Fp8Dispatch
    with _harness_buffer(monkeypatch) as (buf, x, idx, w, num_experts):
        for fp8 in (None, Fp8Dispatch.named("blockwise")):
            text = bench.profile_host(buf, x, idx, w, num_experts, calls=3, fp8=fp8)
            label = "bf16" if fp8 is None else "fp8 blockwise_1x128"
            for mode in bench.HOST_PROFILE_MODES:
                assert f"host profile, dispatch {mode} {label}: " in text
            assert text.count("µs/call (host)") == 3 and "tottime" in text
