"""GPU tier: the layout kernel (`ops.dispatch_layout`) against `layout.compute_layout`, one process.

The layout kernel works in chunks of tokens that find their offsets from the earlier chunks'
published counts (cuda_src/layout.cu). The NVLink tests send at most 64 tokens per rank, one
chunk; these cases cross many chunks: up to 16387 tokens, top-k 1 to 16, 8 to 2048 experts, 1
to 8 ranks, int32 and int64 ids, -1 entries, every entry on one expert, repeated experts in a
token, no tokens, many calls in a row on one workspace (its epoch), on two streams, and in a
replayed CUDA graph.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from megatron_deepep import ops
from megatron_deepep.layout import compute_layout
from megatron_deepep.transport.errors import ERROR_RECORD_WORDS, error_from_record
from megatron_deepep.transport.ipc import MappedHostArray

pytestmark = pytest.mark.gpu

FIELDS = ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank",
          "token_slot_in_rank", "pos_in_expert")

# tokens, top-k, experts, ranks
SHAPES = [(4096, 8, 256, 1), (8192, 6, 64, 1), (4096, 4, 128, 1), (16387, 16, 2048, 8),
          (5000, 1, 8, 8), (3001, 2, 24, 3), (777, 7, 1280, 5), (1, 3, 16, 2), (0, 8, 64, 4),
          (2049, 16, 16, 1), (1025, 1, 2048, 8)]


@pytest.fixture(scope="module")
def errors():
    claim = torch.zeros(1, dtype=torch.int32, device="cuda")
    record = MappedHostArray(ERROR_RECORD_WORDS)
    yield claim, record, ops.ErrorSink(claim.data_ptr(), record.device_ptr)
    record.destroy()


def _ids(kind, num_tokens, topk, num_experts, gen):
    if kind == "skewed":  # every entry on expert 0: one long run of bits
        return torch.zeros(num_tokens, topk, dtype=torch.int64)
    if kind == "repeated":  # experts repeat inside tokens
        return torch.randint(0, max(1, num_experts // 8), (num_tokens, topk), generator=gen)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    ids = scores.topk(min(topk, num_experts), dim=1).indices
    if kind == "dropped":  # about a third of the entries are -1
        ids[torch.rand(ids.shape, generator=gen) < 0.33] = -1
    return ids


def _check(topk_idx, num_experts, num_ranks, sink, claim, record, chunk_tokens=None):
    got = ops.dispatch_layout(topk_idx, num_experts, num_ranks, 0, sink, chunk_tokens=chunk_tokens)
    torch.cuda.synchronize()
    exc = error_from_record(record.words, 1.0)
    assert exc is None and int(claim.item()) == 0, exc
    exp = compute_layout(topk_idx.cpu(), num_experts, num_ranks)
    for name in FIELDS:
        assert torch.equal(getattr(got, name).cpu(), getattr(exp, name)), name
    used = exp.num_tokens_per_rank.tolist()
    for r in range(num_ranks):
        assert torch.equal(got.slot_token[r, :used[r]].cpu(), exp.slot_token[r, :used[r]])


@pytest.mark.parametrize("kind", ["random", "dropped", "skewed", "repeated"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"N{s[0]}K{s[1]}E{s[2]}R{s[3]}" for s in SHAPES])
def test_layout_kernel_matches_compute_layout(shape, kind, errors):
    num_tokens, topk, num_experts, num_ranks = shape
    claim, record, sink = errors
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, kind)).encode()))
    ids = _ids(kind, num_tokens, topk, num_experts, gen)
    for dtype in (torch.int64, torch.int32):
        _check(ids.to(dtype).cuda(), num_experts, num_ranks, sink, claim, record)


@pytest.mark.parametrize("chunk_tokens", [1, 3, 16, 33])
@pytest.mark.parametrize("shape", [(4096, 8, 256, 1), (3001, 2, 24, 3), (2049, 16, 16, 8)],
                         ids=["N4096K8E256R1", "N3001K2E24R3", "N2049K16E16R8"])
def test_layout_kernel_with_small_chunks(shape, chunk_tokens, errors):
    """Thousands of blocks: look-back walks over many 32-chunk windows before an inclusive."""
    num_tokens, topk, num_experts, num_ranks = shape
    claim, record, sink = errors
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, chunk_tokens)).encode()))
    for kind in ("random", "dropped"):
        ids = _ids(kind, num_tokens, topk, num_experts, gen).cuda()
        _check(ids, num_experts, num_ranks, sink, claim, record, chunk_tokens)


def test_layout_back_to_back_two_streams_and_a_graph(errors):
    claim, record, sink = errors
    gen = torch.Generator().manual_seed(7)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for call in range(200):  # the workspace's epoch advances every call
        num_tokens = int(torch.randint(0, 6000, (1,), generator=gen))
        ids = _ids("random", num_tokens, 8, 256, gen).cuda()
        if call % 2:
            with torch.cuda.stream(side):
                _check(ids, 256, 2 ** (call % 4), sink, claim, record)
        else:
            _check(ids, 256, 2 ** (call % 4), sink, claim, record)
    # A captured layout replays with fresh ids each time: the epoch lives on the device.
    ids = _ids("random", 4096, 8, 256, gen).cuda()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ops.dispatch_layout(ids, 256, 2, 0, sink)  # the workspace exists before capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            lay = ops.dispatch_layout(ids, 256, 2, 0, sink)
    for _ in range(3):
        ids.copy_(_ids("random", 4096, 8, 256, gen).cuda())
        graph.replay()
        torch.cuda.synchronize()
        exp = compute_layout(ids.cpu(), 256, 2)
        for name in FIELDS:
            assert torch.equal(getattr(lay, name).cpu(), getattr(exp, name)), name
    assert error_from_record(record.words, 1.0) is None


def test_layout_bad_expert_id_is_reported(errors):
    claim, record, sink = errors
    ids = _ids("random", 3000, 4, 64, torch.Generator().manual_seed(3)).cuda()
    ids[2500, 1] = 64
    ops.dispatch_layout(ids, 64, 2, 0, sink)
    torch.cuda.synchronize()
    exc = error_from_record(record.words, 1.0)
    assert isinstance(exc, ValueError) and "token 2500" in str(exc) and "64" in str(exc)
    claim.zero_()
    record.words[:] = 0


@pytest.mark.parametrize("num_tokens,topk,num_experts,alignment,bound", [
    (4096, 8, 256, 1, -1), (3001, 6, 64, 16, -1), (777, 4, 128, 128, -1), (0, 2, 8, 8, -1),
    (2049, 16, 16, 1, 2049 * 16)])
def test_layout_writes_the_ep1_receive_layout(errors, num_tokens, topk, num_experts, alignment,
                                              bound):
    """EP = 1: the layout kernel's last block writes what notify would (compute_recv_layout)
    and publishes the row count and padded sizes to the host, with the given epoch."""
    from megatron_deepep.arena import ArenaPlan
    from megatron_deepep.handle import compute_recv_layout, recv_fields
    from megatron_deepep.layout import layout_fields
    from megatron_deepep.transport.status import HOST_INFO_WORDS

    claim, record, sink = errors
    gen = torch.Generator().manual_seed(num_tokens + alignment)
    ids = _ids("dropped", num_tokens, topk, num_experts, gen).cuda()
    arena = ArenaPlan(layout_fields(num_tokens, topk, num_experts, 1)
                      + recv_fields(1, num_experts, max(num_tokens, 1), topk)).allocate("cuda")
    host = MappedHostArray(HOST_INFO_WORDS)
    try:
        for epoch in (5, 6):  # a second call on the same workspace publishes its own epoch
            local = ops.LocalRecv(arena, host.device_ptr, alignment, bound, epoch)
            lay = ops.dispatch_layout(ids, num_experts, 1, 0, sink, arena=arena, local_recv=local)
            torch.cuda.synchronize()
            assert error_from_record(record.words, 1.0) is None and int(claim.item()) == 0
            exp_lay = compute_layout(ids.cpu(), num_experts, 1)
            exp = compute_recv_layout(exp_lay.num_tokens_per_expert.view(1, -1), alignment)
            for name in ("num_recv_tokens_per_expert", "tokens_per_expert", "expert_row_start",
                         "src_expert_offset"):
                assert torch.equal(arena.view(name).cpu(), getattr(exp, name)), name
            assert arena.view("num_recv_tokens_per_rank").cpu().tolist() == \
                exp_lay.num_tokens_per_rank.tolist()
            assert torch.equal(lay.pos_in_expert.cpu(), exp_lay.pos_in_expert)
            num_rows = int(exp.expert_row_start[-1])
            # 64-bit words (value << 32) | epoch, little endian: epoch first, then the value.
            assert host.words[0] == epoch and host.words[1] == num_rows
            per_expert = host.words[2:2 + 2 * num_experts]
            assert per_expert[0::2].tolist() == [epoch] * num_experts
            assert per_expert[1::2].tolist() == exp.tokens_per_expert.tolist()
    finally:
        host.destroy()


def test_layout_ep1_row_bound_overflow_is_reported(errors):
    claim, record, sink = errors
    from megatron_deepep.arena import ArenaPlan
    from megatron_deepep.handle import recv_fields
    from megatron_deepep.layout import layout_fields
    from megatron_deepep.transport.status import HOST_INFO_WORDS

    ids = _ids("random", 100, 4, 16, torch.Generator().manual_seed(4)).cuda()
    arena = ArenaPlan(layout_fields(100, 4, 16, 1) + recv_fields(1, 16, 100, 4)).allocate("cuda")
    host = MappedHostArray(HOST_INFO_WORDS)
    try:
        ops.dispatch_layout(ids, 16, 1, 0, sink, arena=arena,
                   local_recv=ops.LocalRecv(arena, host.device_ptr, 1, 399, 1))
        torch.cuda.synchronize()
        exc = error_from_record(record.words, 1.0)
        assert exc is not None and "399" in str(exc) and "400" in str(exc), exc
    finally:
        claim.zero_()
        record.words[:] = 0
        host.destroy()
