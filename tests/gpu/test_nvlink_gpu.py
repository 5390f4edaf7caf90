"""GPU tier: the NVLink transport against the reference, N processes sharing the GPU via IPC.

Every process drives the NVLink Buffer on the GPU and the reference Buffer on CPU copies of the
same inputs (both over one gloo group; with `MDEEP_TEST_BACKEND=nccl` one process per GPU, the
NVLink Buffer over the NCCL group and the reference over a gloo side group), and compares:
dispatch bit-exact (rows, weights, counts), combine bit-exact (same summation order and rounding
by design), backward, cached dispatch, the no-sync mode, skewed/empty/uneven routing, -1 entries,
back-to-back calls with changing shapes, calls on the Buffer's comm stream (async_finish,
previous_event), a no-sync dispatch + combine captured in a CUDA graph and replayed (eager calls
in between), bad input, and a stalled peer that must raise the timeout error instead of hanging.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_deepep import knobs
from tests.helpers import knobs as test_knobs
from megatron_deepep.autograd import combine as ag_combine
from megatron_deepep.autograd import dispatch as ag_dispatch
from megatron_deepep import buffer as buffer_module
from megatron_deepep.buffer import Buffer, get_buffer
from megatron_deepep.transport.errors import PeerTimeoutError
from tests.helpers.cases import expert_scale, make_inputs
from tests.helpers.compile_jobs import warm_up
from tests.helpers.distributed import cpu_group, run_distributed, tier_backend

pytestmark = pytest.mark.gpu

NUM_PROCS = list(test_knobs.get("TEST_PROCS"))
NUM_CALLS = test_knobs.get("TEST_CALLS")

# kind, tokens per rank, hidden, experts per rank, top-k, alignment
CASES = [
    ("random", 64, 7168, 4, 8, 1),
    ("random", 37, 2880, 3, 4, 16),
    ("dropped", 64, 2048, 4, 8, 8),  # EP = 1: the expand starts before the wait, then trimmed
    ("dropped", 50, 4096, 2, 6, 1),
    ("skewed", 40, 2048, 2, 2, 32),
    ("empty", 16, 2048, 1, 1, 1),
    ("uneven", None, 2048, 8, 16, 8),
    ("random", 0, 2048, 1, 2, 1),
]


def _init_device():
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())


def _warm(rank):
    if rank == 0:
        warm_up({c[4] for c in CASES} | {2, 8})
    dist.barrier()


def _case(rank, world, nvl, ref, seed, kind, num_tokens, hidden, per_rank, topk, align):
    if kind == "uneven":  # rank 0 sends nothing; the others send different amounts
        num_tokens = [0] + [5 + 7 * r for r in range(1, world)]
        kind = "random"
    experts = per_rank * world
    xs, idxs, ws = make_inputs(seed, world, num_tokens, hidden, experts, topk, kind)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    dev = torch.device("cuda")
    got = nvl.dispatch(x.to(dev), idx.to(dev), w.to(dev), num_experts=experts,
                       expert_alignment=align)
    exp = ref.dispatch(x, idx, w, num_experts=experts, expert_alignment=align)
    recv_x, recv_w, handle = got[0], got[1], got[2]
    assert torch.equal(recv_x.cpu(), exp[0]), f"dispatch rows differ ({kind}, H={hidden})"
    assert torch.equal(recv_w.cpu(), exp[1])
    assert handle.tokens_per_expert_list == exp[2].tokens_per_expert_list
    assert torch.equal(handle.num_recv_tokens_per_expert.cpu(),
                       exp[2].num_recv_tokens_per_expert)
    for name in ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank",
                 "token_slot_in_rank", "pos_in_expert"):
        assert torch.equal(getattr(handle.layout, name).cpu(), getattr(exp[2].layout, name)), name

    y = expert_scale(recv_x.cpu(), handle.tokens_per_expert_list)
    grad_rows = torch.rand(y.shape[0])
    for weighted in (False, True):
        out, out_w, _ = nvl.combine(y.to(dev), handle, weighted=weighted,
                                    grad_row_weights=grad_rows.to(dev))
        ref_out, ref_w, _ = ref.combine(y, exp[2], weighted=weighted, grad_row_weights=grad_rows)
        torch.testing.assert_close(out.cpu().float(), ref_out.float(), rtol=1e-2, atol=1e-2)
        assert torch.equal(out.cpu(), ref_out), "combine: same order and rounding, bit-exact"
        assert torch.equal(out_w.cpu(), ref_w)

    cached, _, _, _ = nvl.dispatch((x * 3).to(dev), handle=handle)
    assert torch.equal(cached.cpu(), ref.dispatch(x * 3, handle=exp[2])[0])

    # No host synchronization: a caller-given bound, checked on the used prefix.
    bound = world * max(max(xs_.shape[0] for xs_ in xs), 1) * topk + per_rank * align
    free = nvl.dispatch(x.to(dev), idx.to(dev), w.to(dev), num_experts=experts,
                        expert_alignment=align, num_max_recv_rows=bound)
    used = sum(exp[2].tokens_per_expert_list)
    assert free[0].shape[0] == bound and free[2].tokens_per_expert_list is None
    assert torch.equal(free[0][:used].cpu(), exp[0])
    assert torch.equal(free[2].tokens_per_expert.cpu(), exp[2].tokens_per_expert)


def _autograd(rank, world, nvl, ref, seed, exact_combine=True):
    """Forward and backward through autograd against the reference; `exact_combine`: the
    transport sums partials in the reference's order (else within bf16 rounding)."""
    xs, idxs, ws = make_inputs(seed, world, 33, 2048, 4 * world, 4, "dropped")
    results = []
    for buf, dev in ((nvl, "cuda"), (ref, "cpu")):
        x = xs[rank].to(dev).requires_grad_()
        w = ws[rank].to(dev).requires_grad_()
        recv_x, recv_w, handle = ag_dispatch(buf, x, idxs[rank].to(dev), w,
                                             num_experts=4 * world)
        y = (recv_x.float() * recv_w.unsqueeze(1) * 1.5).to(torch.bfloat16)
        out = ag_combine(buf, y, handle)
        g = torch.linspace(-1, 1, out.numel(), device=dev).view_as(out)
        (out.float() * g).sum().backward()
        results.append((out.detach().cpu(), x.grad.cpu(), w.grad.cpu()))
    (o1, gx1, gw1), (o2, gx2, gw2) = results
    if exact_combine:
        assert torch.equal(o1, o2)
    torch.testing.assert_close(o1.float(), o2.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gx1.float(), gx2.float(), rtol=1e-2, atol=1e-2)
    tolerance = 1e-4 if exact_combine else 1e-2
    torch.testing.assert_close(gw1, gw2, rtol=tolerance, atol=tolerance)


def _back_to_back(rank, world, nvl, num_calls):
    """Changing shapes every call; integer-valued rows make every sum exact, so each call can be
    checked cheaply: out = (entries of the token) * x."""
    g = torch.Generator().manual_seed(99)
    dev = torch.device("cuda")
    for call in range(num_calls):
        n = int(torch.randint(0, 48, (1,), generator=g))
        topk = [2, 8][call % 2]
        experts = max([2, 4][call % 3 % 2] * world, topk)
        experts += (-experts) % world
        counts = torch.randint(0, 48, (world,), generator=g)
        counts[rank] = n
        x = torch.randint(-3, 4, (n, 2048), generator=g).to(torch.bfloat16).to(dev)
        idx = torch.rand(n, experts, generator=g).topk(topk, dim=1).indices
        idx[torch.rand(n, topk, generator=g) < 0.2] = -1
        w = torch.rand(n, topk, generator=g)
        recv_x, _, handle, _ = nvl.dispatch(x, idx.to(dev), w.to(dev), num_experts=experts)
        out, _, _ = nvl.combine(recv_x, handle)
        expected = x.float() * (idx >= 0).sum(1, keepdim=True).to(dev)
        assert torch.equal(out.float(), expected), f"call {call}"
    nvl.check_errors()


def _check_no_sync_call(ref, inputs, experts, recv_x, recv_w, out, exact_combine, tag):
    """A dispatch's used rows and weights bit-equal to the reference's, its weighted combine
    bit-equal (or within bf16 rounding, `exact_combine` False); returns the reference's
    dispatch. `inputs`: this rank's `(x, topk_idx, topk_weights)` on the CPU."""
    exp = ref.dispatch(*inputs, num_experts=experts)
    used = sum(exp[2].tokens_per_expert_list)
    assert torch.equal(recv_x[:used].cpu(), exp[0]), f"{tag}: dispatch rows differ"
    assert torch.equal(recv_w[:used].cpu(), exp[1]), f"{tag}: dispatch weights differ"
    ref_out, _, _ = ref.combine(exp[0], exp[2], weighted=True)
    if exact_combine:
        assert torch.equal(out.cpu(), ref_out), f"{tag}: combine differs"
    else:
        torch.testing.assert_close(out.cpu().float(), ref_out.float(), rtol=1e-2, atol=1e-2,
                                   msg=f"{tag}: combine differs")
    return exp


def _graph_replay(rank, world, buf, ref, num_replays=6, exact_combine=True):
    """A no-sync dispatch + combine captured in one CUDA graph, replayed on new inputs (copied
    into the captured tensors) with eager calls between replays: the protocol's epochs live on
    the device, so every replay and every eager call after it must match the reference.
    `exact_combine`: bit-equal combine (NVLink), else within bf16 rounding (internode)."""
    num_tokens, hidden, topk, per_rank = 48, 2048, 4, 2
    experts = per_rank * world
    bound = world * num_tokens * topk
    dev = torch.device("cuda")

    def inputs(seed):
        xs, idxs, ws = make_inputs(seed, world, num_tokens, hidden, experts, topk, "random")
        return xs[rank], idxs[rank], ws[rank]

    x0, idx0, w0 = inputs(500 + world)
    x_s, idx_s, w_s = x0.to(dev), idx0.to(dev), w0.to(dev)

    def step():
        recv_x, recv_w, handle, _ = buf.dispatch(x_s, idx_s, w_s, num_experts=experts,
                                                 num_max_recv_rows=bound)
        out, _, _ = buf.combine(recv_x, handle, weighted=True)
        return recv_x, recv_w, handle, out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (allocations, kernels)
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_x, recv_w, handle, out = step()

    def check(tag, seed, run):
        x, idx, w = inputs(seed)
        x_s.copy_(x)
        idx_s.copy_(idx)
        w_s.copy_(w)
        got_x, got_w, got_handle, got_out = run()
        torch.cuda.synchronize()
        exp = _check_no_sync_call(ref, (x, idx, w), experts, got_x, got_w, got_out,
                                  exact_combine, tag)
        assert torch.equal(got_handle.tokens_per_expert.cpu(), exp[2].tokens_per_expert), tag

    def replay():
        graph.replay()
        return recv_x, recv_w, handle, out

    for i in range(num_replays):
        check(f"replay {i}", 600 + 10 * i + world, replay)
        if i % 2:  # an eager call between replays advances the same device epochs
            check(f"eager after replay {i}", 700 + 10 * i + world, step)
    buf.check_errors()
    del graph


def _comm_stream_calls(rank, world, buf, ref, exact_combine=True):
    """Dispatch, cached dispatch and combine on the Buffer's comm stream (`async_finish`,
    `previous_event`), synchronous and no-sync, with the current stream busy meanwhile: every
    result read after its event equals the reference (the epochs advance on the comm stream)."""
    from megatron_deepep.events import EventHandle

    num_tokens, hidden, topk, per_rank = 40, 2048, 4, 2
    experts = per_rank * world
    dev = torch.device("cuda")
    busy = torch.randn(2048, 2048, device=dev)
    for call, bound in enumerate([None, world * num_tokens * topk, None]):
        xs, idxs, ws = make_inputs(800 + 10 * call + world, world, num_tokens, hidden, experts,
                                   topk, "random")
        x, idx, w = xs[rank], idxs[rank], ws[rank]
        x_d, idx_d, w_d = x.to(dev), idx.to(dev), w.to(dev)
        for _ in range(4):  # the current stream has queued work when the call is made
            busy = busy @ busy * 1e-3
        ready = EventHandle.capture()
        recv_x, recv_w, handle, event = buf.dispatch(
            x_d, idx_d, w_d, num_experts=experts, num_max_recv_rows=bound,
            previous_event=ready, async_finish=True)
        event.current_stream_wait()
        again, _, _, event = buf.dispatch(x_d * 2, handle=handle, async_finish=True)
        event.current_stream_wait()
        out, _, event = buf.combine(recv_x, handle, weighted=True, async_finish=True)
        event.current_stream_wait()
        tag = f"comm-stream call {call} ({'no-sync' if bound else 'sync'})"
        exp = _check_no_sync_call(ref, (x, idx, w), experts, recv_x, recv_w, out,
                                  exact_combine, tag)
        used = sum(exp[2].tokens_per_expert_list)
        assert torch.equal(again[:used].cpu(), ref.dispatch(x * 2, handle=exp[2])[0]), tag
    buf.check_errors()


def _bad_input(rank, world, nvl):
    dev = torch.device("cuda")
    x = torch.zeros(4, 2048, dtype=torch.bfloat16, device=dev)
    w = torch.ones(4, 2, device=dev)
    with pytest.raises(ValueError, match="dtype"):
        nvl.dispatch(x.double(), torch.zeros(4, 2, dtype=torch.int64, device=dev), w,
                     num_experts=world)
    with pytest.raises(ValueError, match="num_max_tokens_per_rank"):
        big = torch.zeros(nvl.num_max_tokens_per_rank + 1, 2048, dtype=torch.bfloat16, device=dev)
        nvl.dispatch(big, torch.zeros(big.shape[0], 2, dtype=torch.int64, device=dev),
                     torch.ones(big.shape[0], 2, device=dev), num_experts=world)
    with pytest.raises(ValueError, match="is on cpu"):
        nvl.dispatch(x.cpu(), torch.zeros(4, 2, dtype=torch.int64), w.cpu(), num_experts=world)
    idx = torch.full((4, 2), 5 * world, dtype=torch.int64, device=dev)  # out of range
    with pytest.raises(ValueError, match="outside"):
        nvl.dispatch(x, idx, w, num_experts=world)


def _stalled_peer(rank, world, nvl):
    """The last rank never calls dispatch: every other rank must raise naming it."""
    dev = torch.device("cuda")
    if rank == world - 1:
        return
    x = torch.zeros(8, 2048, dtype=torch.bfloat16, device=dev)
    idx = torch.arange(8, device=dev).view(8, 1) % world
    with pytest.raises(PeerTimeoutError, match=f"peer {world - 1}"):
        nvl.dispatch(x, idx, torch.ones(8, 1, device=dev), num_experts=world)


def _given_layout(rank, world, nvl, ref, seed):
    """A precomputed `get_dispatch_layout` (at EP = 1 the receive layout then comes from the
    notify kernel over the local transport's private metadata), sync and no-sync."""
    experts, align = 4 * world, 8
    xs, idxs, ws = make_inputs(seed, world, 45, 2048, experts, 6, "dropped")
    dev = torch.device("cuda")
    x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)
    exp = ref.dispatch(xs[rank], idxs[rank], ws[rank], num_experts=experts,
                       expert_alignment=align)
    for bound in (None, 45 * world * 6 + experts * align):
        layout, _ = nvl.get_dispatch_layout(idx, experts)
        recv_x, recv_w, handle, _ = nvl.dispatch(x, idx, w, num_experts=experts, layout=layout,
                                                 expert_alignment=align,
                                                 num_max_recv_rows=bound)
        used = sum(exp[2].tokens_per_expert_list)
        assert torch.equal(recv_x[:used].cpu(), exp[0]) and torch.equal(recv_w[:used].cpu(),
                                                                        exp[1])
        assert torch.equal(handle.tokens_per_expert.cpu(), exp[2].tokens_per_expert)
        out, _, _ = nvl.combine(recv_x, handle)  # reads only the used rows
        assert torch.equal(out.cpu(), ref.combine(exp[0], exp[2])[0])


def _growth(rank, world, seed):
    """get_buffer grows while a micro-batch's backward is pending; that backward still runs
    (on the larger Buffer) and matches a Buffer that never grew."""
    experts = 4 * world
    xs, idxs, ws = make_inputs(seed, world, 30, 2048, experts, 4, "random")
    big_xs, big_idxs, big_ws = make_inputs(seed + 1, world, 100, 4096, experts, 4, "random")
    dev = torch.device("cuda")

    def step(buf, x, idx, w):
        x, w = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
        recv_x, recv_w, handle = ag_dispatch(buf, x, idx.to(dev), w, num_experts=experts)
        out = ag_combine(buf, (recv_x.float() * recv_w.unsqueeze(1)).to(torch.bfloat16),
                         handle)
        return out.float().sum(), x, w

    fixed = Buffer(dist.group.WORLD, 128, 4096, 4, num_sms=8, timeout_s=30)
    loss_ref, x_ref, w_ref = step(fixed, xs[rank], idxs[rank], ws[rank])
    loss_ref.backward()
    fixed.destroy()
    small = get_buffer(dist.group.WORLD, 32, 2048, 4, num_sms=8, timeout_s=30)
    expected_name = "local" if world == 1 else "nvlink"
    assert small.transport_name == expected_name
    assert (small.num_bytes == 0) == (world == 1)
    loss1, x1, w1 = step(small, xs[rank], idxs[rank], ws[rank])
    large = get_buffer(dist.group.WORLD, 128, 4096, 4, num_sms=8, timeout_s=30)
    assert large is not small
    loss2, _, _ = step(large, big_xs[rank], big_idxs[rank], big_ws[rank])
    loss2.backward()
    loss1.backward()  # through the Buffer get_buffer replaced
    assert torch.equal(x1.grad, x_ref.grad) and torch.equal(w1.grad, w_ref.grad)
    large.destroy()
    buffer_module._BUFFERS.clear()


def _worker(rank, world, num_calls):
    _init_device()
    _warm(rank)
    group = dist.group.WORLD
    nvl = Buffer(group, 256, 7168, 16, transport="nvlink", num_sms=8, timeout_s=30)
    ref = Buffer(cpu_group(), 256, 7168, 16, transport="reference")
    for i, case in enumerate(CASES):
        _case(rank, world, nvl, ref, 1000 * world + i, *case)
    _autograd(rank, world, nvl, ref, 7 + world)
    _given_layout(rank, world, nvl, ref, 31 + world)
    _back_to_back(rank, world, nvl, num_calls)
    _comm_stream_calls(rank, world, nvl, ref)
    nvl.destroy()
    dist.barrier()
    bad = Buffer(group, 64, 2048, 4, transport="nvlink", num_sms=4, timeout_s=30)
    _bad_input(rank, world, bad)
    bad.destroy()
    _growth(rank, world, 51 + world)
    if world > 1:
        stalled = Buffer(group, 64, 2048, 4, transport="nvlink", num_sms=4, timeout_s=3)
        _stalled_peer(rank, world, stalled)
        dist.barrier()
        stalled.destroy()


@pytest.mark.parametrize("num_procs", NUM_PROCS)
def test_nvlink_matches_reference(num_procs):
    run_distributed(num_procs, _worker, NUM_CALLS, backend=tier_backend(), timeout_s=1500)


def _graph_worker(rank, world):
    _init_device()
    _warm(rank)
    group = dist.group.WORLD
    nvl = Buffer(group, 64, 2048, 4, transport="nvlink", num_sms=8, timeout_s=30)
    ref = Buffer(cpu_group(), 64, 2048, 4, transport="reference")
    _graph_replay(rank, world, nvl, ref)
    dist.barrier()
    nvl.destroy()


@pytest.mark.parametrize("num_procs", NUM_PROCS)
def test_nvlink_graph_replay(num_procs):
    """At 1 process the EP = 1 kernels: the call order's events recorded inside the capture."""
    run_distributed(num_procs, _graph_worker, backend=tier_backend(), timeout_s=300)


def _calls_after_overflow_worker(rank, world):
    """No-sync dispatches queued back to back after one overflowed its row bound (the host sees
    the error only at a later call): every rank must end with a clear error from the Buffer and
    a healthy CUDA context, never an illegal address from a kernel that read the receive layout
    a notify gave up on (the EP = 2 bench once crashed that way: its bound, tokens x top-k,
    is too small when a rank receives more rows than it sends)."""
    _init_device()
    _warm(rank)
    experts, topk, num_tokens = 4 * world, 4, 256
    xs, idxs, ws = make_inputs(71 + world, world, num_tokens, 1024, experts, topk, "random")
    dev = torch.device("cuda")
    x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)
    buf = Buffer(dist.group.WORLD, num_tokens, 1024, topk, transport="nvlink", num_sms=4,
                 timeout_s=3)
    raised = None
    for _ in range(6):
        try:
            buf.dispatch(x, idx, w, num_experts=experts, num_max_recv_rows=1)
        except (ValueError, RuntimeError) as exc:
            raised = exc
            break
    torch.cuda.synchronize()  # a kernel fault would surface here (sticky CUDA error)
    if raised is None:  # every call was queued before the first error reached the host
        with pytest.raises((ValueError, RuntimeError)) as info:
            buf.dispatch(x, idx, w, num_experts=experts, num_max_recv_rows=1)
        raised = info.value
    assert "CUDA error" not in str(raised) and "illegal" not in str(raised), raised
    assert "num_max_recv_rows=1 is too small" in str(raised) or isinstance(
        raised, PeerTimeoutError) or "failed earlier" in str(raised), raised
    dist.barrier()
    buf.destroy()


@pytest.mark.parametrize("num_procs", [n for n in NUM_PROCS if n > 1])
def test_nvlink_calls_after_an_overflow_raise_cleanly(num_procs):
    run_distributed(num_procs, _calls_after_overflow_worker, backend=tier_backend(), timeout_s=300)
