"""CPU tier: the EP > 1 bench's byte counting (against a per-token brute force) and its table.

The peer-copy kernel compiles for sm_90 in `test_kernels_compile.py` (it is in
`compile_jobs.CEILING_KERNELS`) and its argument struct in `test_kernel_args.py`; its bytes on a
GPU are checked by `tests/gpu/test_bench_peers_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_deepep.bench import peers as bench_peers
from tests.helpers.cases import make_inputs
from tests.helpers.distributed import run_distributed
from tests.helpers import REPO_ROOT

# name, ranks, tokens per rank (an int, or one per rank), experts, top-k, routing kind
ROUTINGS = [
    ("random", 4, 37, 16, 4, "random"),
    ("uneven, rank 0 has no tokens", 3, [0, 9, 41], 12, 3, "random"),
    ("skewed", 4, 30, 8, 2, "skewed"),
    ("dropped", 2, 25, 6, 5, "dropped"),
    ("one expert per rank", 5, [3, 0, 7, 1, 12], 5, 2, "random"),
    ("all dropped", 3, 6, 6, 2, "empty"),
]


def _brute_force_rows(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> list:
    """Tokens sent to each rank, one token at a time: a token goes once to every rank that owns
    at least one of its experts."""
    per_rank = num_experts // num_ranks
    rows = [0] * num_ranks
    for token in topk_idx.tolist():
        for r in {e // per_rank for e in token if e >= 0}:
            rows[r] += 1
    return rows


def _inputs(seed, num_ranks, num_tokens, num_experts, num_topk, kind):
    _, idxs, _ = make_inputs(seed, num_ranks, num_tokens, 16, num_experts, num_topk, kind)
    return idxs


@pytest.mark.parametrize("case", ROUTINGS, ids=[r[0] for r in ROUTINGS])
def test_rows_and_bytes_match_a_brute_force_count(case):
    _, num_ranks, num_tokens, num_experts, num_topk, kind = case
    hidden, fp8_row_bytes = 7168, 7168 + 56 * 4  # blockwise 1x128: 56 fp32 scales
    inputs = [_inputs(seed, num_ranks, num_tokens, num_experts, num_topk, kind)
              for seed in (3, 4, 5)]  # the bench's three rotating inputs
    matrices, brute = [], []
    for idxs in inputs:
        rows = [bench_peers.rows_per_destination(idx, num_experts, num_ranks) for idx in idxs]
        assert all(r.dtype == torch.int64 for r in rows)
        matrices.append(torch.stack(rows))
        brute.append([_brute_force_rows(idx, num_experts, num_ranks) for idx in idxs])
        assert matrices[-1].tolist() == brute[-1]
    for rank in range(num_ranks):
        sent = [sum(m[rank][d] for d in range(num_ranks) if d != rank) for m in brute]
        received = [sum(m[s][rank] for s in range(num_ranks) if s != rank) for m in brute]
        got = bench_peers.nvlink_bytes(matrices, rank, fp8_row_bytes, 2 * hidden)
        assert got == pytest.approx({
            "dispatch_send": sum(sent) / 3 * fp8_row_bytes,
            "dispatch_recv": sum(received) / 3 * fp8_row_bytes,
            "combine_send": sum(received) / 3 * 2 * hidden,
            "combine_recv": sum(sent) / 3 * 2 * hidden})
        if kind == "empty" or (isinstance(num_tokens, list) and num_tokens[rank] == 0):
            assert got["dispatch_send"] == 0 == got["combine_recv"]
    # Every byte one rank sends over NVLink another receives.
    every = [bench_peers.nvlink_bytes(matrices, r, 10, 10) for r in range(num_ranks)]
    assert sum(b["dispatch_send"] for b in every) == pytest.approx(
        sum(b["dispatch_recv"] for b in every))


def _gather_worker(rank, world, case, seed):
    _, _, num_tokens, num_experts, num_topk, kind = case
    idxs = _inputs(seed, world, num_tokens, num_experts, num_topk, kind)
    matrix = bench_peers.gather_rows_matrix(idxs[rank], num_experts)
    assert matrix.tolist() == [_brute_force_rows(idx, num_experts, world) for idx in idxs]
    reason = bench_peers.nccl_skip_reason()
    assert reason is not None and "gloo" in reason
    assert dist.get_backend() == "gloo"


@pytest.mark.parametrize("case", [ROUTINGS[1], ROUTINGS[4]], ids=["uneven", "five ranks"])
def test_rows_matrix_is_gathered_over_gloo(case):
    run_distributed(case[1], _gather_worker, case, 11, backend="gloo", timeout_s=120)


def test_peer_pattern_differs_per_source_destination_and_call():
    base = bench_peers.peer_pattern(1, 2, 1, 64, device="cpu")
    assert base.dtype == torch.uint8 and base.shape == (64,)
    for other in ((2, 1, 1), (1, 3, 1), (1, 2, 2), (0, 2, 1)):
        assert not torch.equal(base, bench_peers.peer_pattern(*other, 64, device="cpu")), other
    assert torch.equal(base, bench_peers.peer_pattern(1, 2, 1, 64, device="cpu"))


# ---------------------------------------------------------------------------------------------
# The summary and the table, from fake per-rank figures (2 ranks).

MB = 1e6
# bf16: rank 0 sends 80 MB and receives 100 MB over NVLink; rank 1 sends 100, receives 80.
BF16_BYTES = [{"dispatch_send": 80 * MB, "dispatch_recv": 100 * MB, "combine_send": 100 * MB,
               "combine_recv": 80 * MB},
              {"dispatch_send": 100 * MB, "dispatch_recv": 80 * MB, "combine_send": 80 * MB,
               "combine_recv": 100 * MB}]
FP8_BYTES = [{k: v / 2 for k, v in b.items()} for b in BF16_BYTES]


def _per_rank(with_nccl: bool):
    """Rank r: ours 24 SMs sync dispatch 250 µs (rank 1: 320), combine 280; 132 SMs: 200 µs;
    FP8 dispatch 150 µs; NCCL 300 / 330 µs; ceiling 200 µs at 24 SMs, 150 at 132."""
    out = []
    for r in range(2):
        nccl = {"bf16": {"dispatch_us": 300.0, "combine_us": 330.0},
                "blockwise_1x128": {"dispatch_us": 180.0}} if with_nccl else {}
        out.append({
            "ours": {"ours 24 SMs sync": {"dispatch": 250.0 + 70 * r, "combine": 280.0},
                     "ours 132 SMs sync": {"dispatch": 200.0, "combine": 200.0},
                     "ours 24 SMs fp8 blockwise_1x128 cached": {"dispatch": 150.0}},
            "nccl": nccl, "ceiling": {24: 200.0, 132: 150.0}})
    return out


WIRES = {"ours 24 SMs sync": "bf16", "ours 132 SMs sync": "bf16",
         "ours 24 SMs fp8 blockwise_1x128 cached": "blockwise_1x128"}
BYTES = {"bf16": BF16_BYTES, "blockwise_1x128": FP8_BYTES}
SKIPPED = "backend is gloo, not nccl: gloo cannot all-to-all CUDA tensors"


def test_summary_figures_and_targets():
    peers = bench_peers.summarize(_per_rank(True), BYTES, 50 * MB, None, WIRES)
    # The ceiling: 50 MB to 1 peer in 200 µs = 250 GB/s.
    assert peers["ceiling"]["by_sms"]["24"]["GBps_worst"] == pytest.approx(250.0)
    sync = peers["variants"]["ours 24 SMs sync"]
    # Busier direction 100 MB on both ranks: rank 0 in 250 µs = 400 GB/s, rank 1 in 320 = 312.5.
    assert sync["dispatch"]["GBps"] == pytest.approx([400.0, 312.5])
    assert sync["dispatch"]["GBps_worst"] == pytest.approx(312.5)
    assert sync["dispatch"]["us_slowest"] == 320.0
    assert sync["dispatch"]["x_nccl"] == pytest.approx(300 / 320)
    assert sync["dispatch"]["x_ceiling"] == pytest.approx(312.5 / 250)
    assert sync["dispatch"]["target_GBps_met"] is False
    assert sync["dispatch"]["target_nccl_met"] is False
    assert sync["combine"]["GBps_worst"] == pytest.approx(100 * MB / 280 / 1e3)
    assert sync["combine"]["target_GBps_met"] is True  # 357 GB/s
    assert sync["combine"]["target_nccl_met"] is True  # 330 / 280 = 1.18
    wide = peers["variants"]["ours 132 SMs sync"]
    assert wide["dispatch"]["target_GBps_met"] is None  # above 24 SMs: not judged
    assert wide["dispatch"]["target_nccl_met"] is True  # 300 / 200
    fp8 = peers["variants"]["ours 24 SMs fp8 blockwise_1x128 cached"]
    assert fp8["wire"] == "blockwise_1x128" and "combine" not in fp8
    assert fp8["dispatch"]["GBps_worst"] == pytest.approx(50 * MB / 150 / 1e3)
    assert fp8["dispatch"]["x_nccl"] == pytest.approx(180 / 150)  # against FP8 bytes
    assert peers["nccl"]["bf16"]["combine"]["us"] == [330.0, 330.0]
    assert peers["nccl"]["bf16"]["dispatch"]["GBps_worst"] == pytest.approx(100 * MB / 300 / 1e3)
    assert peers["nccl"]["blockwise_1x128"]["dispatch"]["GBps_worst"] == pytest.approx(
        50 * MB / 180 / 1e3)


def _row(peers, transport="nvlink"):
    return {"shape": [4096, 7168, 256, 8], "ep": 2, "variants": {}, "peers": peers,
            "transport": transport}


def test_table_marks_met_and_not_met():
    peers = bench_peers.summarize(_per_rank(True), BYTES, 50 * MB, None, WIRES)
    lines = bench_peers.format_table([_row(peers)])
    text = "\n".join(lines)
    assert lines[1].startswith("shape (N,H,E,K) | variant | dispatch µs | NVLink GB/s")
    (sync,) = [line for line in lines if "| ours 24 SMs sync |" in line]
    assert "| 320.0 | 312 | 0.94 | 1.25 |" in sync
    assert "dispatch: 340 GB/s NOT met, 1.1x NCCL NOT met" in sync
    assert "combine: 340 GB/s met, 1.1x NCCL met" in sync
    (wide,) = [line for line in lines if "| ours 132 SMs sync |" in line]
    assert "340 GB/s n/a (> 24 SMs), 1.1x NCCL met" in wide
    assert "NCCL all_to_all_single, same bytes" in text
    assert "bf16 dispatch 300.0 µs (333 GB/s); bf16 combine 330.0 µs (303 GB/s)" in text
    assert "blockwise_1x128 dispatch 180.0 µs (278 GB/s)" in text
    assert "peer_copy ceiling, 50.0 MB to each of 1 peers (worst rank): 24 SMs 250 GB/s" in text
    assert "bf16 dispatch send 90.0 (max 100.0) / recv 90.0 (max 100.0)" in text
    columns = len(lines[1].split(" | "))
    assert columns == 11
    assert all(len(line.split(" | ")) == columns for line in lines if "| ours " in line)


def test_table_says_why_nccl_was_skipped():
    peers = bench_peers.summarize(_per_rank(False), BYTES, 50 * MB, SKIPPED, WIRES)
    assert peers["nccl"] == {"skipped": SKIPPED}
    sync = peers["variants"]["ours 24 SMs sync"]["dispatch"]
    assert sync["x_nccl"] is None and sync["target_nccl_met"] is None
    text = "\n".join(bench_peers.format_table([_row(peers)]))
    assert f"NCCL all-to-all: skipped: {SKIPPED}" in text
    assert "1.1x NCCL skipped (no NCCL)" in text
    assert "| 320.0 | 312 | - | 1.25 |" in text


def test_a_reference_row_gets_no_nvlink_gbps():
    peers = bench_peers.summarize(_per_rank(True), BYTES, 50 * MB, None, WIRES)
    text = "\n".join(bench_peers.format_table([_row(peers, "reference")]))
    assert "NVLink GB/s: none, the reference transport ran" in text
    assert "| ours " not in text and "312" not in text
    assert "| ours 24 SMs sync |" in "\n".join(bench_peers.format_table([_row(peers)]))


def test_no_table_at_ep_1():
    assert bench_peers.format_table([{"shape": [1, 2, 3, 4], "ep": 1, "variants": {}}]) == []


# ---------------------------------------------------------------------------------------------
# `measure` end to end over gloo, the GPU parts faked on the CPU: the symmetric buffer is a
# file every rank maps (shared memory), the peer copy a torch copy into the peers' files.

class _FakeSymmetricBuffer:
    """Each rank's "buffer" is a shared file; peer_bases holds rank numbers."""

    folder = None
    mapped = {}

    def __init__(self, group, num_bytes):
        self.group, self.rank = group, dist.get_rank(group)
        world = dist.get_world_size(group)
        path = f"{self.folder}/rank{self.rank}"
        self.mine = torch.from_file(path, shared=True, size=num_bytes, dtype=torch.uint8)
        self.mine.zero_()
        dist.barrier(group=group)
        for r in range(world):
            _FakeSymmetricBuffer.mapped[r] = torch.from_file(
                f"{self.folder}/rank{r}", shared=True, size=num_bytes, dtype=torch.uint8)
        self.peer_bases = torch.arange(world, dtype=torch.int64)
        self.device = torch.device("cpu")

    def destroy(self):
        dist.barrier(group=self.group)


class _FakeOps:
    """`ops.peer_copy` on the CPU (`broken`: the slot of the last peer is left alone)."""

    broken = False

    @classmethod
    def peer_copy(cls, src, peer_bases, rank, num_blocks):
        num_ranks, bytes_per_peer = src.shape
        for d in peer_bases.tolist():
            if d == rank or (cls.broken and d == num_ranks - 1):
                continue
            _FakeSymmetricBuffer.mapped[d][rank * bytes_per_peer:(rank + 1) * bytes_per_peer] \
                .copy_(src[d])


def _fake_timer(fn, setup=None, iters=30, warmup=5):
    for i in range(2):
        if setup is not None:
            setup(i)
        fn()
    return 100.0


def _measure_worker(rank, world, folder, broken):
    from megatron_deepep.fp8.dispatch import Fp8Dispatch

    _FakeSymmetricBuffer.folder = folder
    bench_peers.SymmetricBuffer = _FakeSymmetricBuffer
    bench_peers._own_bytes = lambda buffer, num_bytes: buffer.mine
    _FakeOps.broken = broken
    bench_peers.ceiling_ops = _FakeOps
    num_tokens, hidden, num_experts, num_topk = 40, 256, 3 * world, 4
    inputs = [_inputs(seed, world, num_tokens, num_experts, num_topk, "random")
              for seed in (7, 8, 9)]
    idxs = [per_rank[rank] for per_rank in inputs]
    spec = Fp8Dispatch.named("blockwise", "fp8")
    entry = {"shape": [num_tokens, hidden, num_experts, num_topk], "ep": world, "variants": {
        "ours 24 SMs sync": {"dispatch_us": 50.0 + rank, "combine_us": 60.0},
        "ours 24 SMs fp8 blockwise_1x128 sync": {"dispatch_us": 30.0, "fp8": spec.fmt.name},
        "megatron alltoall": {"dispatch_us": 500.0, "combine_us": 600.0}}}
    if broken:
        with pytest.raises(RuntimeError, match=f"{world - 1}: \\[0, 1\\]: its ceiling is not"):
            bench_peers.measure(entry, idxs, [spec], [4, 24], _fake_timer,
                                device=torch.device("cpu"))
        return
    peers = bench_peers.measure(entry, idxs, [spec], [4, 24], _fake_timer,
                                device=torch.device("cpu"))
    assert set(peers["variants"]) == {"ours 24 SMs sync", "ours 24 SMs fp8 blockwise_1x128 sync"}
    assert "gloo" in peers["nccl"]["skipped"]
    matrices = [torch.tensor([_brute_force_rows(idx, num_experts, world) for idx in per_rank])
                for per_rank in inputs]
    for r in range(world):
        assert peers["bytes"]["bf16"][r] == bench_peers.nvlink_bytes(matrices, r, 2 * hidden,
                                                                     2 * hidden)
    sync = peers["variants"]["ours 24 SMs sync"]
    assert sync["dispatch"]["us"] == [50.0 + r for r in range(world)]  # every rank's own
    busiest = max(max(b["dispatch_send"], b["dispatch_recv"]) for b in peers["bytes"]["bf16"])
    assert peers["ceiling"]["bytes_per_peer"] % 16 == 0
    assert peers["ceiling"]["bytes_per_peer"] * (world - 1) >= max(
        b["dispatch_send"] for b in peers["bytes"]["bf16"])
    assert max(sync["dispatch"]["nvlink_bytes"]) == busiest
    assert set(peers["ceiling"]["by_sms"]) == {"4", "24"}
    text = "\n".join(bench_peers.format_table([dict(entry, peers=peers)]))
    assert "NCCL all-to-all: skipped: backend is gloo" in text


@pytest.mark.parametrize("broken", [False, True], ids=["right bytes", "a slot never written"])
def test_measure_end_to_end_with_a_fake_peer_copy(tmp_path, broken):
    run_distributed(3, _measure_worker, str(tmp_path), broken, backend="gloo", timeout_s=120)


def test_the_8_gpu_command_is_the_same_in_the_docs():
    """The bench docstrings and the README give one torchrun command, with NVLS/multicast off."""
    import pathlib

    from megatron_deepep.bench import run as bench

    command = ("NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\\n"
               "    torchrun --standalone --nproc-per-node 8 -m megatron_deepep.bench")
    readme = (pathlib.Path(REPO_ROOT) / "README.md").read_text()
    assert command in readme
    for doc in (bench.__doc__, bench_peers.__doc__):
        assert command.replace("\n", "\n    ") in doc
