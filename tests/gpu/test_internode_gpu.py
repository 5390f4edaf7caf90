"""GPU tier: the internode transport against the reference on virtual nodes sharing one GPU.

(nodes x ranks per node) processes share the GPU (NVSHMEM's limited several-processes-per-GPU
mode, gloo as the control plane) and declare the nodes with `num_ranks_per_node`. Every process
drives the internode Buffer on the GPU and the reference Buffer on CPU copies of the same inputs
and compares: dispatch bit-exact (rows, weights, counts, row order), combine within the
fp32-accumulation tolerance (the forwarder rounds its node's sum once more than the reference) and
the routing-weight gradients exactly, the node layout against `node_layout.py`, cached dispatch,
the no-sync mode, skewed/empty/uneven routing, -1 entries, top-k 1-16, back-to-back calls with
changing shapes, calls on the Buffer's comm stream, a no-sync dispatch + combine replayed from
a CUDA graph (eager calls between replays), autograd, fp16 and fp32 rows, FP8 dispatch in every
wire format (the network carries e4m3 rows and scales), bad input, and a stalled peer that must
raise naming rank and node. With `MDEEP_TEST_BACKEND=nccl` every process has a GPU of its own
(NCCL control plane, the reference over a gloo side group, NVSHMEM's full mode): the same
virtual nodes over real GPUs, e.g. `MDEEP_TEST_NODES=2x4` on 8 GPUs.

Staging: the whole matrix runs with the node staging `MDEEP_INTERNODE_STAGING` selects (`full`
by default; `ring` with `MDEEP_INTERNODE_RING_SLOTS` slots per ring, docs/internode.md "Ring
staging"). `test_internode_small_ring` always runs ring staging with 4 slots per ring, fewer
than any ring carries per call, so every ring wraps many times per call and producers wait for
consumers in other processes (progress then comes from the GPU time-slicing the processes); it
also checks that ring staging's results equal full staging's bit for bit.

Network ring: the matrix and the graph-replay test run it when `MDEEP_INTERNODE_STAGING=ring`
and `MDEEP_INTERNODE_NET_RING_CHUNKS=K` are exported (docs/internode.md "Network ring").
`test_internode_small_net_ring` always runs it with 1 or 2 chunks of 32 tokens per rail peer
(and 4-slot node rings) on 2x1, 2x2 and 3x2 virtual nodes: every stream wraps several times a
call, so senders wait for credits from other processes' forwarders and reduces; it checks the
results against full staging bit for bit, back-to-back calls and graph replays.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from megatron_deepep import knobs
from tests.helpers import knobs as test_knobs
from megatron_deepep.buffer import Buffer
from megatron_deepep.transport.node_layout import compute_node_layout
from megatron_deepep.transport.errors import PeerTimeoutError
from megatron_deepep.transport.internode_regions import choose_staging
from megatron_deepep.transport.topology import Topology
from tests.helpers.cases import expert_scale, make_inputs
from tests.gpu import test_fp8_dispatch_gpu as fp8_gpu
from tests.gpu import test_nvlink_gpu as nvlink_gpu
from tests.helpers.distributed import cpu_group, run_distributed, tier_backend, use_rank_device

pytestmark = pytest.mark.gpu

# (nodes, ranks per node); MDEEP_TEST_NODES picks some, e.g. "2x1,2x2".
NODE_SHAPES = [tuple(int(v) for v in s.split("x")) for s in test_knobs.get("TEST_NODES").split(",")]
NUM_CALLS = test_knobs.get("TEST_CALLS")
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_SYMMETRIC_SIZE": "2G"}
# test_internode_small_ring: slots per ring (a ring carries up to nodes x tokens per rank rows
# per call) and back-to-back calls (each wrap may wait for a time slice of another process).
SMALL_RING_SLOTS = 4
SMALL_RING_CALLS = 20
# test_internode_small_net_ring: shapes, chunks per rail peer (a call of 200 tokens per rank
# puts up to 7 chunks into each stream), tokens per rank of the bit-equality check.
NET_RING_SHAPES = [(2, 1), (2, 2), (3, 2)]
NET_RING_CHUNKS = (1, 2)
NET_RING_TOKENS = 200

# kind, tokens per rank, hidden, experts per rank, top-k, alignment
CASES = [
    ("random", 64, 7168, 4, 8, 1),
    ("random", 37, 2880, 3, 4, 16),
    ("dropped", 50, 4096, 2, 6, 1),
    ("skewed", 40, 2048, 2, 2, 32),
    ("empty", 16, 2048, 1, 1, 1),
    ("uneven", None, 2048, 8, 16, 8),
    ("random", 0, 2048, 1, 2, 1),
    ("random", 100, 512, 2, 1, 1),
]


def _check_node_layout(handle, idx, experts, world, per_node, rank):
    _, _, nodes = handle.transport_state
    expected = compute_node_layout(idx, experts, Topology(world, per_node, rank))
    assert torch.equal(nodes.view("num_tokens_per_node").cpu(), expected.num_tokens_per_node)
    in_node = expected.is_token_in_node
    slots = torch.cumsum(in_node.int(), 0, dtype=torch.int32) - 1
    want = torch.where(in_node, slots, torch.full_like(slots, -1))
    assert torch.equal(nodes.view("token_slot_in_node").cpu(), want)


def _case(rank, world, per_node, inter, ref, seed, kind, num_tokens, hidden, per_rank, topk,
          align):
    if kind == "uneven":  # rank 0 sends nothing; the others send different amounts
        num_tokens = [0] + [5 + 7 * r for r in range(1, world)]
        kind = "random"
    experts = per_rank * world
    xs, idxs, ws = make_inputs(seed, world, num_tokens, hidden, experts, topk, kind)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    dev = torch.device("cuda")
    got = inter.dispatch(x.to(dev), idx.to(dev), w.to(dev), num_experts=experts,
                         expert_alignment=align)
    exp = ref.dispatch(x, idx, w, num_experts=experts, expert_alignment=align)
    recv_x, recv_w, handle = got[0], got[1], got[2]
    where = f"({kind}, H={hidden}, K={topk}, rank {rank})"
    assert torch.equal(recv_x.cpu(), exp[0]), f"dispatch rows differ {where}"
    assert torch.equal(recv_w.cpu(), exp[1]), f"dispatch weights differ {where}"
    assert handle.tokens_per_expert_list == exp[2].tokens_per_expert_list
    assert torch.equal(handle.num_recv_tokens_per_expert.cpu(),
                       exp[2].num_recv_tokens_per_expert)
    _check_node_layout(handle, idx, experts, world, per_node, rank)

    y = expert_scale(recv_x.cpu(), handle.tokens_per_expert_list)
    grad_rows = torch.rand(y.shape[0])
    for weighted in (False, True):
        out, out_w, _ = inter.combine(y.to(dev), handle, weighted=weighted,
                                      grad_row_weights=grad_rows.to(dev))
        ref_out, ref_w, _ = ref.combine(y, exp[2], weighted=weighted, grad_row_weights=grad_rows)
        scale = max(float(ref_out.float().abs().max()), 1.0) if ref_out.numel() else 1.0
        torch.testing.assert_close(out.cpu().float(), ref_out.float(), rtol=1e-2,
                                   atol=1e-2 * scale, msg=lambda m: f"combine {where}: {m}")
        assert torch.equal(out_w.cpu(), ref_w), f"combine weight gradients {where}"

    cached, _, _, _ = inter.dispatch((x * 3).to(dev), handle=handle)
    assert torch.equal(cached.cpu(), ref.dispatch(x * 3, handle=exp[2])[0]), f"cached {where}"

    # No host synchronization: a caller-given bound, checked on the used prefix.
    bound = world * max(max(xs_.shape[0] for xs_ in xs), 1) * topk + per_rank * align
    free = inter.dispatch(x.to(dev), idx.to(dev), w.to(dev), num_experts=experts,
                          expert_alignment=align, num_max_recv_rows=bound)
    used = sum(exp[2].tokens_per_expert_list)
    assert free[0].shape[0] == bound and free[2].tokens_per_expert_list is None
    assert torch.equal(free[0][:used].cpu(), exp[0]), f"no-sync rows {where}"
    assert torch.equal(free[2].tokens_per_expert.cpu(), exp[2].tokens_per_expert)


def _row_dtypes(rank, world, inter, ref, seed):
    """fp16 and fp32 rows: dispatch bit-exact (a byte copy), combine within the dtype's rounding
    (fp32 partials are never rounded; only the order of the fp32 sums differs)."""
    dev = torch.device("cuda")
    for dtype, tol in ((torch.float16, 1e-2), (torch.float32, 1e-5)):
        experts = 3 * world
        xs, idxs, ws = make_inputs(seed, world, 41, 2048, experts, 4, "dropped", dtype=dtype)
        x, idx, w = xs[rank], idxs[rank], ws[rank]
        recv_x, recv_w, handle, _ = inter.dispatch(x.to(dev), idx.to(dev), w.to(dev),
                                                   num_experts=experts)
        exp_x, exp_w, exp_handle, _ = ref.dispatch(x, idx, w, num_experts=experts)
        assert recv_x.dtype == dtype and torch.equal(recv_x.cpu(), exp_x), f"dispatch {dtype}"
        assert torch.equal(recv_w.cpu(), exp_w)
        y = (expert_scale(exp_x.float(), exp_handle.tokens_per_expert_list) * 1.37).to(dtype)
        out, _, _ = inter.combine(y.to(dev), handle, weighted=True)
        ref_out, _, _ = ref.combine(y, exp_handle, weighted=True)
        assert out.dtype == dtype
        torch.testing.assert_close(out.cpu().float(), ref_out.float(), rtol=tol, atol=tol * 10,
                                   msg=lambda m: f"combine {dtype}: {m}")


def _bad_input(rank, world, inter):
    dev = torch.device("cuda")
    x = torch.zeros(4, 2048, dtype=torch.bfloat16, device=dev)
    w = torch.ones(4, 2, device=dev)
    idx = torch.zeros(4, 2, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match="dtype"):
        inter.dispatch(x.double(), idx, w, num_experts=world)  # fp32/fp16 rows are valid
    with pytest.raises(ValueError, match="num_max_tokens_per_rank"):
        big = torch.zeros(inter.num_max_tokens_per_rank + 1, 2048, dtype=torch.bfloat16,
                          device=dev)
        inter.dispatch(big, torch.zeros(big.shape[0], 2, dtype=torch.int64, device=dev),
                       torch.ones(big.shape[0], 2, device=dev), num_experts=world)
    with pytest.raises(ValueError, match="outside"):
        inter.dispatch(x, torch.full_like(idx, 5 * world), w, num_experts=world)


def _stalled_peer(rank, world, per_node, stalled):
    """The last rank never calls dispatch: every other rank must raise naming it and its node."""
    dev = torch.device("cuda")
    if rank == world - 1:
        return
    x = torch.zeros(8, 2048, dtype=torch.bfloat16, device=dev)
    idx = torch.arange(8, device=dev).view(8, 1) % world
    node = (world - 1) // per_node
    with pytest.raises(PeerTimeoutError, match=f"peer {world - 1} is node {node}"):
        stalled.dispatch(x, idx, torch.ones(8, 1, device=dev), num_experts=world)


def _progress(rank, start, what):
    if rank == 0:
        print(f"[internode {dist.get_world_size()} ranks] {time.monotonic() - start:6.1f} s "
              f"{what}", file=sys.stderr, flush=True)


def _worker(rank, world, per_node, num_calls):
    os.environ.update(ENV)
    start = time.monotonic()
    use_rank_device(rank, gloo_device=0)
    group = dist.group.WORLD
    inter = Buffer(group, 256, 7168, 16, transport="internode", num_sms=8, timeout_s=20,
                   num_ranks_per_node=per_node)
    assert inter.transport_name == "internode"
    t = inter._transport
    assert (t.staging, t.ring_slots, t.net_chunks) == choose_staging(world, per_node, 256, 7168,
                                                                     16)
    ref = Buffer(cpu_group(), 256, 7168, 16, transport="reference")
    _progress(rank, start, f"buffers built ({inter._transport.staging_name()} staging)")
    for i, case in enumerate(CASES):
        _case(rank, world, per_node, inter, ref, 1000 * world + i, *case)
        _progress(rank, start, f"case {case} passed")
    # The forwarder rounds its node's sum once more than the reference: combine within bf16
    # rounding; integer-valued rows (the back-to-back calls) stay exact on every path.
    nvlink_gpu._autograd(rank, world, inter, ref, 7 + world, exact_combine=False)
    _progress(rank, start, "autograd passed")
    nvlink_gpu._back_to_back(rank, world, inter, num_calls)
    _progress(rank, start, f"{num_calls} back-to-back calls passed")
    nvlink_gpu._comm_stream_calls(rank, world, inter, ref, exact_combine=False)
    _progress(rank, start, "calls on the comm stream (async_finish, previous_event) passed")
    _row_dtypes(rank, world, inter, ref, 77 + world)
    _progress(rank, start, "fp16 and fp32 rows passed")
    for i, case in enumerate(fp8_gpu.CASES):  # every wire format, fused and pre-quantized
        fp8_gpu._case(rank, world, inter, ref, 500 * world + i, *case)
    _progress(rank, start, "FP8 dispatch (every format, both outputs, cached) passed")
    _bad_input(rank, world, inter)
    dist.barrier()
    stalled = Buffer(group, 64, 2048, 4, transport="internode", num_sms=4, timeout_s=3,
                     num_ranks_per_node=per_node)
    _stalled_peer(rank, world, per_node, stalled)
    _progress(rank, start, "bad input and the planted stall passed")
    dist.barrier()
    # No NVSHMEM teardown calls: limited mode forbids host collectives at teardown.


def _mode() -> str:
    """The kernel families the knobs select: "full", "ring" or "net" (the network ring), for
    the tier's largest Buffer (`auto`, the default, picks full staging for every Buffer here)."""
    staging, _, net_chunks = choose_staging(8, 4, 256, 7168, 16)
    return "net" if net_chunks > 0 else staging


def _link(family) -> None:
    from megatron_deepep import ops
    from megatron_deepep.kernels import jit, nvshmem_link
    from megatron_deepep.fp8.dispatch import Fp8Dispatch
    topk, fmt, output = family
    fp8 = None if fmt is None else Fp8Dispatch(fp8_gpu.FORMATS[fmt], output)
    expressions = ops.internode_families(_mode())[0]
    nvshmem_link.link_cubin(ops.INTERNODE_SOURCES[_mode()],
                            list(expressions(topk, "long long", fp8)),
                            jit.device_arch())


def _link_combine(family) -> None:
    from megatron_deepep import ops
    from megatron_deepep.kernels import jit, nvshmem_link
    topk, row_dtype = family
    expressions = ops.internode_families(_mode())[1]
    nvshmem_link.link_cubin(ops.INTERNODE_SOURCES[_mode()], list(expressions(topk, row_dtype)),
                            jit.device_arch())


def _link_once():
    """Links every kernel family the test uses here (in parallel), so the ranks find them in the
    disk cache instead of all linking."""
    import concurrent.futures
    import multiprocessing
    families = [(k, None, None) for k in sorted({c[4] for c in CASES} | {2, 8, 4, 1})]
    families += [(case[4], fmt, output) for case in fp8_gpu.CASES
                 for fmt in fp8_gpu.FORMATS for output in ("fp8", "bf16")]
    families = sorted(set(families), key=str)
    combine = [(k, dtype) for k in sorted({c[4] for c in CASES} | {2, 8, 4, 1}
                                          | {c[4] for c in fp8_gpu.CASES}) for dtype in (0, 1, 2)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count() or 1,
                                                mp_context=context) as pool:
        list(pool.map(_link, families)) + list(pool.map(_link_combine, combine))


@pytest.mark.parametrize("shape", NODE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_internode_matches_reference(shape, monkeypatch, require_nvshmem):
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    _link_once()
    print(f"linked in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    num_nodes, per_node = shape
    run_distributed(num_nodes * per_node, _worker, per_node, NUM_CALLS, backend=tier_backend(),
                    timeout_s=1200, hard_exit=True)


def _graph_worker(rank, world, per_node):
    nvlink_gpu._init_device()
    group = dist.group.WORLD
    inter = Buffer(group, 64, 2048, 4, transport="internode", num_sms=8, timeout_s=20,
                   num_ranks_per_node=per_node)
    ref = Buffer(cpu_group(), 64, 2048, 4, transport="reference")
    nvlink_gpu._graph_replay(rank, world, inter, ref, exact_combine=False)
    dist.barrier()


@pytest.mark.parametrize("shape", NODE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_internode_graph_replay(shape, monkeypatch, require_nvshmem):
    """A no-sync dispatch + combine captured in a CUDA graph replays on new inputs, with eager
    calls between replays (the epochs live on the device)."""
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    _link((4, None, None))  # once here, not in every rank
    _link_combine((4, 0))
    num_nodes, per_node = shape
    run_distributed(num_nodes * per_node, _graph_worker, per_node, backend=tier_backend(),
                    timeout_s=300, hard_exit=True)


def _same_results(rank, world, full, ring, seed, num_tokens=40, what="ring staging"):
    """Ring staging (and the network ring) moves the same bytes and sums the node's partials
    and the nodes' rows in the same order as full staging: dispatch and combine (weighted, with
    routing-weight gradients) bit-equal."""
    dev = torch.device("cuda")
    experts = 2 * world
    xs, idxs, ws = make_inputs(seed, world, num_tokens, 2048, experts, 8, "random")
    got = []
    for buf in (full, ring):
        recv_x, recv_w, handle, _ = buf.dispatch(xs[rank].to(dev), idxs[rank].to(dev),
                                                 ws[rank].to(dev), num_experts=experts)
        y = expert_scale(recv_x.cpu(), handle.tokens_per_expert_list).to(dev)
        grad = torch.linspace(0, 1, y.shape[0], device=dev)
        out, out_w, _ = buf.combine(y, handle, weighted=True, grad_row_weights=grad)
        got.append((recv_x.cpu(), recv_w.cpu(), out.cpu(), out_w.cpu()))
    for name, a, b in zip(("rows", "weights", "combine", "weight gradients"), *got):
        assert torch.equal(a, b), f"{what}'s {name} differ from full staging's"


def _small_ring_checks(rank, world, per_node, inter, graphs, ref, seed, num_calls, start):
    """The small-ring tests' checks: three cases against the reference and back-to-back calls
    on `inter` (H 7168, top-16 room), graph replays with eager calls between on `graphs`."""
    for i in (0, 2, 5):  # top-8 at H 7168; dropped entries; uneven ranks at top-16
        _case(rank, world, per_node, inter, ref, seed + i, *CASES[i])
        _progress(rank, start, f"case {CASES[i]} passed")
    nvlink_gpu._back_to_back(rank, world, inter, num_calls)
    _progress(rank, start, f"{num_calls} back-to-back calls passed")
    nvlink_gpu._graph_replay(rank, world, graphs, ref, exact_combine=False)
    _progress(rank, start, "graph replays passed")


def _small_ring_worker(rank, world, per_node, num_calls):
    os.environ.update(ENV)
    start = time.monotonic()
    use_rank_device(rank, gloo_device=0)
    group = dist.group.WORLD
    os.environ["MDEEP_INTERNODE_STAGING"] = "full"
    full = Buffer(group, 64, 2048, 8, transport="internode", num_sms=8, timeout_s=60,
                  num_ranks_per_node=per_node)
    # `auto` under a 1 MB budget: nothing fits, so the smallest, ring staging at this N_max.
    os.environ.update(MDEEP_INTERNODE_STAGING="auto", MDEEP_INTERNODE_STAGING_MAX_GB="0.001")
    inter = Buffer(group, 256, 7168, 16, transport="internode", num_sms=8, timeout_s=60,
                   num_ranks_per_node=per_node)
    assert inter._transport.staging_name() == f"ring ({SMALL_RING_SLOTS} slots)"
    os.environ["MDEEP_INTERNODE_STAGING"] = "ring"
    ring = Buffer(group, 64, 2048, 8, transport="internode", num_sms=8, timeout_s=60,
                  num_ranks_per_node=per_node)
    ref = Buffer(cpu_group(), 256, 7168, 16, transport="reference")
    _progress(rank, start, f"buffers built (ring staging, {SMALL_RING_SLOTS} slots per ring)")
    _same_results(rank, world, full, ring, 41 + world)
    _progress(rank, start, "ring staging equals full staging bit for bit")
    _small_ring_checks(rank, world, per_node, inter, ring, ref, 3000 * world, num_calls, start)
    dist.barrier()


def _link_small_rings(monkeypatch, stagings) -> None:
    """Links the small-ring tests' kernels here, once: top-8 (the bit-equality Buffers) for each
    (staging, network chunks), then the cases' top-k for the last one, whose knobs stay set."""
    start = time.monotonic()
    for staging, net_chunks in stagings:
        monkeypatch.setenv("MDEEP_INTERNODE_STAGING", staging)
        monkeypatch.setenv("MDEEP_INTERNODE_NET_RING_CHUNKS", str(net_chunks))
        _link((8, None, None))
        _link_combine((8, 0))
    for k in sorted({CASES[i][4] for i in (0, 2, 5)} | {2, 4}):  # + back-to-back, graphs
        _link((k, None, None))
        _link_combine((k, 0))
    print(f"linked in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)


@pytest.mark.parametrize("shape", NODE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_internode_small_ring(shape, monkeypatch, require_nvshmem):
    """Ring staging with 4 slots per ring: cases, back-to-back calls and graph replays against
    the reference, and against full staging bit for bit."""
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MDEEP_INTERNODE_RING_SLOTS", str(SMALL_RING_SLOTS))
    _link_small_rings(monkeypatch, [("full", 0), ("ring", 0)])  # ring staging alone
    num_nodes, per_node = shape
    run_distributed(num_nodes * per_node, _small_ring_worker, per_node, SMALL_RING_CALLS,
                    backend=tier_backend(), timeout_s=1200, hard_exit=True)


def _small_net_ring_worker(rank, world, per_node, num_calls, chunks):
    os.environ.update(ENV)
    start = time.monotonic()
    use_rank_device(rank, gloo_device=0)
    group = dist.group.WORLD
    os.environ["MDEEP_INTERNODE_STAGING"] = "full"
    os.environ["MDEEP_INTERNODE_NET_RING_CHUNKS"] = "0"
    full = Buffer(group, 256, 2048, 8, transport="internode", num_sms=8, timeout_s=60,
                  num_ranks_per_node=per_node)
    os.environ["MDEEP_INTERNODE_STAGING"] = "ring"
    os.environ["MDEEP_INTERNODE_NET_RING_CHUNKS"] = str(chunks)
    inter = Buffer(group, 256, 7168, 16, transport="internode", num_sms=8, timeout_s=60,
                   num_ranks_per_node=per_node)
    assert (inter._transport.ring_slots, inter._transport.net_chunks) == (SMALL_RING_SLOTS,
                                                                          chunks)
    net = Buffer(group, 256, 2048, 8, transport="internode", num_sms=8, timeout_s=60,
                 num_ranks_per_node=per_node)
    ref = Buffer(cpu_group(), 256, 7168, 16, transport="reference")
    _progress(rank, start, f"buffers built (network ring, {chunks} chunks per rail peer)")
    _same_results(rank, world, full, net, 51 + world, num_tokens=NET_RING_TOKENS,
                  what="the network ring")
    _progress(rank, start, "the network ring equals full staging bit for bit")
    _small_ring_checks(rank, world, per_node, inter, net, ref, 4000 * world, num_calls, start)
    _same_results(rank, world, full, net, 61 + world, num_tokens=NET_RING_TOKENS,
                  what="the network ring after graph replays")
    dist.barrier()


@pytest.mark.parametrize("chunks", NET_RING_CHUNKS, ids=lambda k: f"{k}chunk")
@pytest.mark.parametrize("shape", NET_RING_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_internode_small_net_ring(shape, chunks, monkeypatch, require_nvshmem):
    """The network ring with 1-2 chunks per rail peer and 4-slot node rings: against full
    staging bit for bit (before and after graph replays), cases against the reference,
    back-to-back calls, graph replays with eager calls between them."""
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MDEEP_INTERNODE_RING_SLOTS", str(SMALL_RING_SLOTS))
    _link_small_rings(monkeypatch, [("full", 0), ("ring", chunks)])
    num_nodes, per_node = shape
    run_distributed(num_nodes * per_node, _small_net_ring_worker, per_node, SMALL_RING_CALLS,
                    chunks, backend=tier_backend(), timeout_s=1200, hard_exit=True)


def test_bench_on_virtual_nodes(tmp_path, require_nvshmem):
    """`python -m megatron_deepep.bench --nodes 2x1`: the internode check and sweep on virtual
    nodes (a small shape), then the model of DeepSeek-V3's shape on real nodes."""
    import subprocess
    env = dict(os.environ, **{k: v for k, v in ENV.items() if k != "NVSHMEM_SYMMETRIC_SIZE"})
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NVSHMEM_SYMMETRIC_SIZE"):
        env.pop(name, None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-m", "megatron_deepep.bench", "--nodes", "2x1", "--shapes",
         "256,2048,16,4", "--num-sms", "8", "--fp8", "blockwise", "--out", str(tmp_path)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "internode transport on 2 x 1 virtual nodes" in out
    assert "correctness: PASSED" in out and "internode staging: full" in out
    assert " 64   8x8   uniform " in out  # the model's DeepSeek-V3 rows
    assert (tmp_path / "nodes.json").exists()


def _unset_heap_worker(rank, world, per_node):
    from megatron_deepep.transport.nvshmem_heap import heap_bytes_for
    os.environ.update({k: v for k, v in ENV.items() if k != "NVSHMEM_SYMMETRIC_SIZE"})
    os.environ.pop("NVSHMEM_SYMMETRIC_SIZE", None)
    os.environ["MDEEP_INTERNODE_STAGING"] = "full"
    use_rank_device(rank, gloo_device=0)
    inter = Buffer(dist.group.WORLD, 8192, 7168, 8, transport="internode", num_sms=8,
                   timeout_s=60, num_ranks_per_node=per_node)
    block = inter._transport.num_bytes
    assert block > 1 << 30, block  # more than NVSHMEM's default heap
    assert os.environ["NVSHMEM_SYMMETRIC_SIZE"] == str(heap_bytes_for(block))
    ref = Buffer(cpu_group(), 8192, 7168, 8, transport="reference")
    _case(rank, world, per_node, inter, ref, 7000 + world, *CASES[0])
    dist.barrier()


def test_heap_is_sized_when_the_variable_is_unset(monkeypatch, require_nvshmem):
    """Without NVSHMEM_SYMMETRIC_SIZE the transport sets it for its block (here 1.4 GB, above
    NVSHMEM's 1 GiB default) before NVSHMEM starts, and the Buffer works."""
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING", "full")
    _link((8, None, None))
    _link_combine((8, 0))
    run_distributed(2, _unset_heap_worker, 1, backend=tier_backend(), timeout_s=600,
                    hard_exit=True)
