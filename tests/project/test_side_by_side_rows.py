"""CPU tier: the side-by-side driver's three rows (`ours`, `deepep`, `deepep+permute`): the rows
and HBM bytes each side is credited with, the tables, the permuted rows' check, and
megatron-core's own permute/unpermute of DeepEP-shaped received rows (unfused: TE and DeepEP are
absent here)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import load_dev_gpu_script


def _side_by_side():
    return load_dev_gpu_script("deepep_side_by_side")


def _routing():
    """Two ranks, 4 experts (2 per rank), top-2, 3 tokens each: hand-counted below."""
    idx0 = torch.tensor([[0, 1], [0, 2], [2, 3]])  # rank 0's tokens
    idx1 = torch.tensor([[1, 3], [3, 2], [0, -1]])  # rank 1's tokens (one dropped entry)
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    w = torch.full((3, 2), 0.5)
    return [(x, idx0, w), (x, idx1, w)]


def test_row_counts_and_the_rows_each_side_is_credited_with():
    d = _side_by_side()
    counts = d.row_counts(_routing(), 0, 4)
    # Rank 0 owns experts 0, 1: its tokens 0, 1 (3 entries) and rank 1's tokens 0, 2 (2).
    assert counts == {"token_rows": 4, "self_rows": 2, "expert_rows": 5, "tokens_out": 3}
    assert d.received_tokens(_routing(), 0, 4) == 4
    assert d.row_counts(_routing(), 1, 4) == {"token_rows": 4, "self_rows": 2,
                                               "expert_rows": 6, "tokens_out": 3}
    assert [d.own_rows(i, counts) for i in d.IMPLS] == [5, 4, 9]
    # Dispatch: deepep 4 passes per token row; ours 3 per peer row, 1 per own row, 1 per expert
    # row; the permute adds a read per token row and a write per expert row.
    assert [d.hbm_rows(i, "dispatch", counts) for i in d.IMPLS] == [3 * 2 + 2 + 5, 16,
                                                                    16 + 4 + 5]
    assert d.hbm_rows("ours", "fp8_dispatch", counts) == d.hbm_rows("ours", "dispatch", counts)
    # Combine: deepep 3 per token row + the output rows; ours the expert rows, 2 per peer row
    # and the output rows; the unpermute reads the expert rows and writes the token rows.
    assert [d.hbm_rows(i, "combine", counts) for i in d.IMPLS] == [5 + 4 + 3, 15, 15 + 5 + 4]


def _records(num_ranks=2):
    recs = []
    for r in range(num_ranks):
        counts = {"token_rows": 1000, "self_rows": 500, "expert_rows": 4000, "tokens_out": 1000}
        times = {"check_bf16": "passed", "check_fp8": "passed", "dispatch_us": 100.0 + r,
                 "cached_us": 50.0, "combine_us": 80.0, "fp8_dispatch_us": 60.0,
                 "dispatch_host_us": 30.0 + r, "cached_host_us": 5.0, "combine_host_us": 7.0,
                 "fp8_dispatch_host_us": 31.0}
        recs.append({"rank": r, "num_sms": 24, "rows": counts, "errors": {}, "error_t_s": {},
                     "ours": dict(times), "deepep": dict(times),
                     "deepep+permute": dict(times, check_bf16="passed (as sets per expert)")})
    return recs


def test_bandwidths_count_each_sides_own_rows_and_one_numerator_for_all():
    d = _side_by_side()
    size = {"num_ranks": 2, "records": _records()}
    rows = {impl: d.summarize(size, impl, 7168, concurrent=True) for impl in d.IMPLS}
    row_b = 7168 * 2
    slowest_ns = 101.0 * 1e3
    assert rows["ours"]["dispatch_gbps"] == pytest.approx(4000 * row_b / slowest_ns)
    assert rows["deepep"]["dispatch_gbps"] == pytest.approx(1000 * row_b / slowest_ns)
    assert rows["deepep+permute"]["dispatch_gbps"] == pytest.approx(5000 * row_b / slowest_ns)
    for impl in d.IMPLS:  # the same times give the same algorithm bandwidth
        assert rows[impl]["dispatch_algbw"] == pytest.approx(1000 * row_b / slowest_ns)
    hbm = d.hbm_rows("deepep", "dispatch", size["records"][0]["rows"]) * row_b
    assert rows["deepep"]["dispatch_hbm_rank"] == pytest.approx(hbm / slowest_ns)
    assert rows["deepep"]["dispatch_hbm_sum"] == pytest.approx(2 * hbm / slowest_ns)
    fp8_b = 7168 + 4 * 56
    assert rows["ours"]["fp8_dispatch_gbps"] == pytest.approx(4000 * fp8_b / 60e3)
    assert rows["ours"]["dispatch_host_us"] == 31.0  # the slowest rank's median host µs
    assert rows["deepep+permute"]["check_bf16"] == "passed (as sets per expert)"
    assert not rows["deepep+permute"]["check_failed"]
    sliced = d.summarize(size, "ours", 7168, concurrent=False)
    assert "dispatch_algbw" not in sliced and sliced["dispatch_host_us"] == 31.0

    class Args:
        concurrent, tokens, hidden, experts, topk = True, 4096, 7168, 256, 8
    table = d.format_table(list(rows.values()), Args)
    assert "| 2 | deepep+permute | 24 | passed (as sets per expert) | passed | 101 | 50 | 80 " \
           "| 60 | 710 | 896 | 616 | 31/5/7/31 |" in table
    assert "| 2 | ours | 24 | 142 | 179 |" in table  # alg dispatch / combine GB/s
    assert "note: deepep+permute fp8: megatron-core 0.19.2's flex dispatcher hands DeepEP bf16" \
           in table
    assert "note: deepep+permute fp8" not in d.format_table([rows["ours"]], Args)


def test_errors_name_the_rank_and_when():
    d = _side_by_side()
    recs = _records()
    recs[1]["errors"]["deepep"] = "check fp8: AcceleratorError: CUDA error: an illegal memory"
    recs[1]["error_t_s"]["deepep"] = 104.5
    del recs[1]["deepep"]["fp8_dispatch_us"]
    row = d.summarize({"num_ranks": 2, "records": recs}, "deepep", 7168, concurrent=True)
    assert row["errors"] == ["check fp8: AcceleratorError: CUDA error: an illegal memory "
                             "(rank 1, 104.5 s)"]
    assert row["fp8_dispatch_us"] is None and "fp8_dispatch_gbps" not in row
    assert d.cuda_fault(recs[1]["errors"]["deepep"])
    assert not d.cuda_fault("Buffer: RuntimeError: DeepEP error: CPU recv timeout")


def test_permuted_rows_are_compared_in_order_then_as_sets_per_expert():
    d = _side_by_side()
    want = torch.arange(12, dtype=torch.float32).reshape(6, 2).to(torch.bfloat16)
    want_w = torch.arange(6, dtype=torch.float32)
    per_expert = torch.tensor([2, 4])
    assert d.compare_permuted("rows", want, want_w, per_expert, want, want_w) == (
        "", "same order")
    order = torch.tensor([1, 0, 5, 3, 4, 2])  # shuffled inside each expert
    assert d.compare_permuted("rows", want[order], want_w[order], per_expert, want,
                              want_w) == ("", "as sets per expert")
    across = torch.tensor([2, 1, 0, 3, 4, 5])  # a row moved to the other expert
    problem, how = d.compare_permuted("rows", want[across], want_w[across], per_expert, want,
                                      want_w)
    assert "local expert 0: rows differ even as a set" in problem and how == ""
    weights = want_w[order].clone()
    weights[0] += 1  # a row with the wrong prob
    assert "local expert 0" in d.compare_permuted("rows", want[order], weights, per_expert,
                                                  want, want_w)[0]
    assert "experts hold 5 rows" in d.compare_permuted("rows", want, None, torch.tensor([1, 4]),
                                                       want, None)[0]


def _deepep_receive(inputs, rank, experts, shuffle):
    """DeepEP's receive on `rank`: one row per (source, token) with an expert here, grouped by
    source rank, tokens in order (what its channels give) or shuffled; local ids (-1
    elsewhere) and zeroed weights there, as DeepEP hands them to Megatron."""
    per_rank = experts // len(inputs)
    rows, ids, weights = [], [], []
    gen = torch.Generator().manual_seed(rank)
    for x, idx, w in inputs:
        tokens = torch.nonzero(((idx // per_rank) == rank).any(1)).flatten()
        if shuffle:
            tokens = tokens[torch.randperm(len(tokens), generator=gen)]
        local = torch.where((idx[tokens] // per_rank) == rank, idx[tokens] - rank * per_rank,
                            torch.full_like(idx[tokens], -1))
        rows.append(x[tokens])
        ids.append(local)
        weights.append(torch.where(local >= 0, w[tokens], torch.zeros_like(w[tokens])))
    ids = torch.cat(ids)
    per_expert = [int((ids == e).sum()) for e in range(per_rank)]
    return torch.cat(rows), ids, torch.cat(weights), per_expert


@pytest.mark.parametrize("shuffle, how", [(False, "same order"), (True, "as sets per expert")])
def test_megatrons_own_permute_of_deepeps_rows_matches_the_oracle(shuffle, how):
    """megatron-core's `_DeepepManager` helpers (unfused here: no TE) turn DeepEP-shaped rows
    into the oracle's expert-major rows, and its unpermute sums each token's expert rows."""
    pytest.importorskip("megatron.core")
    d = _side_by_side()
    num_ranks, experts, topk = 2, 8, 3
    inputs = d.make_inputs(num_ranks, 16, 256, experts, topk, seed=3)
    want = d.oracle(inputs, experts)
    manager = d.flex_manager(None, experts // num_ranks, topk, experts, 24, fused=False)
    assert manager.permute_fusion is False and manager.config.moe_router_dtype == "fp32"
    for rank in range(num_ranks):
        rows, ids, weights, per_expert = _deepep_receive(inputs, rank, experts, shuffle)
        permuted, probs, counts = d.megatron_permute(manager, rows, ids, weights, per_expert)
        assert counts.tolist() == per_expert
        assert d.compare_permuted("rows", permuted, probs, counts, want[rank][0],
                                  want[rank][1]) == ("", how)
        restored = manager.get_restored_hidden_states_by_experts(permuted)
        k_local = (ids >= 0).sum(1, keepdim=True).float()
        torch.testing.assert_close(restored.float(), rows.float() * k_local, rtol=1e-2,
                                   atol=1e-2)
    # The fp8 column's permute: e4m3 rows (as bytes) and their scales with one routing map.
    from megatron_deepep.fp8 import formats

    fmt = formats.FORMATS[d.FP8_FORMAT]
    fp8 = [fmt.quantize(x) for x, _, _ in inputs]
    want_q = d.oracle(inputs, experts, [q.view(torch.uint8) for q, _ in fp8])
    want_s = d.oracle(inputs, experts, [s for _, s in fp8])
    quantized = [(q.view(torch.uint8), s, i, w) for (q, s), (_, i, w) in zip(fp8, inputs)]
    rows, ids, weights, per_expert = _deepep_receive(
        [(q, i, w) for q, _, i, w in quantized], 0, experts, shuffle)
    scales = _deepep_receive([(s, i, w) for _, s, i, w in quantized], 0, experts, shuffle)[0]
    q_rows, s_rows, _, counts = d.permute_fp8(manager, rows, scales, ids, weights, per_expert,
                                              torch.uint8)
    assert d.compare_permuted("e4m3", q_rows, None, counts, want_q[0][0], None)[0] == ""
    assert d.compare_permuted("scales", s_rows, None, counts, want_s[0][0], None)[0] == ""


def test_arguments_sweeps_and_shares():
    d = _side_by_side()
    args = d.build_parser().parse_args(["--skip-deepep", "--num-sms", "8,16,24,48"])
    assert d.check_args(args) == ([2, 4, 8], [8, 16, 24, 48])
    for bad, words in ((["--num-sms", "8,15"], "--num-sms 15: DeepEP needs an even count"),
                       (["--num-sms", "8,x"], "expected comma-separated integers"),
                       (["--skip-ours"], "leaves nothing to run"),
                       (["--mps-percentage", "120"], "expected 1 to 100")):
        with pytest.raises(d.UsageError, match=words):
            d.check_args(d.build_parser().parse_args(["--skip-deepep"] + bad))
    assert d.sm_budget(64, 8, True, 132) == 14  # 12% of 132: 15 SMs, even: 14
    assert d.sm_budget(64, 8, True, 132, percentage=100) == 64
    assert d.sm_budget(64, 2, True, 132) == 64 and d.sm_budget(80, 2, True, 132) == 66
    assert d.mps_percentage(4) == 25 and d.mps_percentage(4, 100) == 100
    ours_only = d.build_parser().parse_args(["--skip-deepep"])
    assert d.impls_of(ours_only) == ["ours"]
    assert d.impls_of(d.build_parser().parse_args([])) == list(d.IMPLS)
    alone = d.build_parser().parse_args(["--skip-ours", "--skip-permute"])
    assert d.impls_of(alone) == ["deepep"]


def test_dry_run_names_the_rows_and_the_sweep(capsys):
    d = _side_by_side()
    assert d.main(["--skip-deepep", "--dry-run", "--ranks", "2", "--num-sms", "8,16",
                   "--concurrent", "--mps-percentage", "100", "--check-only"]) == 0
    out = capsys.readouterr().out
    assert ("R = [2] on one GPU, ours, concurrent (MPS), MPS share 100%, 4096 tokens (checked "
            "at 256, checks only), SM budget 8,16") in out
