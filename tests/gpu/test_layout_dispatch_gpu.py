"""GPU tier: the EP = 1 fused layout and expand (`ops.layout_dispatch_local`), one process.

The fused kernel must write what the layout kernel (with the EP = 1 receive layout) and
`dispatch_local` write: the layout against `layout.compute_layout`, the receive layout against
`handle.compute_recv_layout`, every row of recv_x (padding zeros included), recv_weights and
slot_rows against the two-kernel path on the same inputs, bit for bit. Cases: random, dropped
(-1), skewed (every entry on one expert) and repeated routing; 1 to 16384 tokens; top-1 to 16;
SM budgets of 132, 24 and 7 blocks; alignments 1 to 128; back-to-back epochs; a bad expert id
and a row-bound overflow reported through the error record.
"""

from __future__ import annotations

import pytest
import torch

from megatron_deepep import ops
from megatron_deepep.arena import ArenaPlan
from megatron_deepep.handle import compute_recv_layout, recv_fields
from megatron_deepep.layout import compute_layout, layout_fields
from megatron_deepep.transport.errors import ERROR_RECORD_WORDS, error_from_record
from megatron_deepep.transport.ipc import MappedHostArray
from megatron_deepep.transport.nvlink import HOST_INFO_WORDS

from tests.gpu.test_layout_gpu import FIELDS, _ids

pytestmark = pytest.mark.gpu

RECV_FIELDS = ("num_recv_tokens_per_expert", "tokens_per_expert", "expert_row_start",
               "src_expert_offset", "num_recv_tokens_per_rank")

# tokens, hidden, top-k, experts, SM budget, alignment
CASES = [(4096, 7168, 8, 256, 132, 1), (8192, 4096, 6, 64, 132, 1), (4096, 2880, 4, 128, 132, 16),
         (1, 256, 1, 1, 132, 1), (3001, 512, 16, 16, 132, 128), (777, 512, 7, 200, 24, 8),
         (16384, 256, 8, 256, 132, 1), (1000, 2048, 2, 8, 7, 1), (64, 512, 8, 256, 132, 4)]


@pytest.fixture(scope="module")
def errors():
    claim = torch.zeros(1, dtype=torch.int32, device="cuda")
    record = MappedHostArray(ERROR_RECORD_WORDS)
    host = MappedHostArray(HOST_INFO_WORDS)
    yield claim, record, ops.ErrorSink(claim.data_ptr(), record.device_ptr), host
    record.destroy()
    host.destroy()


def _arena(num_tokens, topk, num_experts):
    return ArenaPlan(layout_fields(num_tokens, topk, num_experts, 1)
                     + recv_fields(1, num_experts, max(num_tokens, 1), topk)).allocate("cuda")


def _outputs(num_rows, hidden):
    recv_x = torch.full((num_rows, hidden), 7.0, dtype=torch.bfloat16, device="cuda")
    return recv_x, torch.full((num_rows,), 7.0, device="cuda")  # not zero: padding is written


def _run_fused(x, ids, weights, num_experts, num_sms, alignment, bound, num_rows, sink, host,
               epoch):
    launch = ops.fused_layout_launch(ids.shape[0], ids.shape[1], num_experts, num_sms)
    assert launch is not None
    arena = _arena(ids.shape[0], ids.shape[1], num_experts)
    recv_x, recv_w = _outputs(num_rows, x.shape[1])
    lay = ops.layout_dispatch_local(
        recv_x, recv_w, arena, x, ids, weights, num_experts,
        ops.LocalRecv(arena, host.device_ptr, alignment, bound, epoch), launch, sink, 10**10)
    return lay, arena, recv_x, recv_w


def _run_two_kernels(x, ids, weights, num_experts, num_sms, alignment, num_rows, sink):
    arena = _arena(ids.shape[0], ids.shape[1], num_experts)
    recv_x, recv_w = _outputs(num_rows, x.shape[1])
    lay = ops.layout(ids, num_experts, 1, 0, sink, arena=arena,
                     local_recv=ops.LocalRecv(arena, 0, alignment, -1, 0))
    ops.dispatch_local(recv_x, None, recv_w, arena, x, None, ids, weights, lay, False, None,
                       num_experts, num_sms)
    return arena, recv_x, recv_w


def _assert_no_error(claim, record):
    exc = error_from_record(record.words, 1.0)
    assert exc is None and int(claim.item()) == 0, exc


@pytest.mark.parametrize("kind", ["random", "dropped", "skewed", "repeated"])
@pytest.mark.parametrize("case", CASES, ids=[f"N{c[0]}H{c[1]}K{c[2]}E{c[3]}S{c[4]}A{c[5]}"
                                             for c in CASES])
def test_fused_matches_layout_reference_and_two_kernels(case, kind, errors):
    num_tokens, hidden, topk, num_experts, num_sms, alignment = case
    claim, record, sink, host = errors
    gen = torch.Generator().manual_seed(num_tokens * 31 + topk)
    ids = _ids(kind, num_tokens, topk, num_experts, gen)
    if ids.shape[1] < topk:  # fewer experts than top-k: pad with -1
        ids = torch.cat([ids, -torch.ones(num_tokens, topk - ids.shape[1], dtype=ids.dtype)], 1)
    ids = ids.cuda()
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16).cuda()
    weights = torch.rand(num_tokens, topk, generator=gen).cuda()
    exp_lay = compute_layout(ids.cpu(), num_experts, 1)
    exp_recv = compute_recv_layout(exp_lay.num_tokens_per_expert.view(1, -1), alignment)
    num_rows = int(exp_recv.expert_row_start[-1])
    bound = num_rows + 5  # rows past the count stay untouched
    for epoch in (3, 4):  # back to back on one workspace
        lay, arena, recv_x, recv_w = _run_fused(x, ids, weights, num_experts, num_sms,
                                                alignment, bound, bound, sink, host, epoch)
        torch.cuda.synchronize()
        _assert_no_error(claim, record)
        for name in FIELDS:
            assert torch.equal(getattr(lay, name).cpu(), getattr(exp_lay, name)), name
        used = int(exp_lay.num_tokens_per_rank[0])
        assert torch.equal(lay.slot_token[0, :used].cpu(), exp_lay.slot_token[0, :used])
        for name in RECV_FIELDS[:4]:
            assert torch.equal(arena.view(name).cpu(), getattr(exp_recv, name)), name
        assert arena.view("num_recv_tokens_per_rank").cpu().tolist() == [used]
        assert host.words[0] == epoch and host.words[1] == num_rows
        assert host.words[4:4 + num_experts].tolist() == exp_recv.tokens_per_expert.tolist()
    arena2, recv_x2, recv_w2 = _run_two_kernels(x, ids, weights, num_experts, num_sms,
                                                alignment, bound, sink)
    torch.cuda.synchronize()
    _assert_no_error(claim, record)
    assert torch.equal(recv_x, recv_x2) and torch.equal(recv_w, recv_w2)
    assert torch.equal(arena.view("slot_rows")[:used], arena2.view("slot_rows")[:used])
    # And against the rows themselves: entry (n, k) of expert e is row start[e] + pos.
    valid = exp_lay.pos_in_expert >= 0
    rows = (exp_recv.expert_row_start[ids.cpu().clamp(min=0)] + exp_lay.pos_in_expert)[valid]
    tokens = torch.arange(num_tokens).view(-1, 1).expand(-1, topk)[valid]
    assert torch.equal(recv_x[rows.cuda()], x[tokens.cuda()])
    assert torch.equal(recv_w[rows.cuda()], weights[valid.cuda()])


def test_fused_bad_expert_id_and_overflow_are_reported(errors):
    claim, record, sink, host = errors
    gen = torch.Generator().manual_seed(9)
    ids = _ids("random", 300, 4, 16, gen).cuda()
    x = torch.randn(300, 256, generator=gen).to(torch.bfloat16).cuda()
    weights = torch.rand(300, 4, generator=gen).cuda()
    try:
        bad = ids.clone()
        bad[123, 2] = 16
        _run_fused(x, bad, weights, 16, 132, 1, -1, 1200, sink, host, 1)
        torch.cuda.synchronize()
        exc = error_from_record(record.words, 1.0)
        assert isinstance(exc, ValueError) and "token 123" in str(exc), exc
        claim.zero_()
        record.words[:] = 0
        _run_fused(x, ids, weights, 16, 132, 1, 1199, 1199, sink, host, 2)
        torch.cuda.synchronize()
        exc = error_from_record(record.words, 1.0)
        assert exc is not None and "1199" in str(exc) and "1200" in str(exc), exc
    finally:
        claim.zero_()
        record.words[:] = 0
