"""CPU tier: the internode transport's network ring (`MDEEP_INTERNODE_NET_RING_CHUNKS`,
docs/internode.md "Network ring") without a GPU: the knob and its errors, the symmetric block's
formula, the kernel families, the timeouts' messages, the rail counts against the positions
ring staging derives, and a model of the credit protocol run on random schedules.

The model (`_NetModel`) replays what `internode_net_dispatch` and `internode_net_combine` do
on every rank of M nodes x L ranks, warp by warp, as tests/transport/test_internode_ring.py's model
does
for one node's rings: each warp is a generator that yields where the kernel would spin, puts
and signals to other ranks travel as messages the scheduler delivers at random times, and each
rank runs its kernels in stream order with no barrier between ranks (as cached dispatches
allow). It checks that every chunk reaches its receiver in its slot, that no chunk slot is
written before its previous chunk was consumed, that every row reaches its destination rank
once and every token is reduced once from every node it went to, and that nothing deadlocks,
over several calls; and, as controls, that it deadlocks when credits are never returned and
when the senders run in a kernel before the forwarders (or the sums before the reduce).
"""

from __future__ import annotations

import random
from typing import Callable, Dict, List

import pytest
import torch

from megatron_deepep import knobs, ops
from megatron_deepep.transport import errors
from megatron_deepep.transport.internode import InternodeTransport
from megatron_deepep.transport.internode_regions import (CHUNK_TOKENS, InternodeRegions,
                                                         net_ring_config)
from tests.transport.test_internode_ring import _Deadlock, _Ring, _routing, _Streams
from tests.transport.test_internode_transport import check_region_spans

GB = 1e9


# ----------------------------------------------------------------------------------- knobs

def test_net_ring_defaults_to_off(monkeypatch):
    monkeypatch.delenv("MDEEP_INTERNODE_NET_RING_CHUNKS", raising=False)
    assert net_ring_config("full") == 0 and net_ring_config("ring") == 0
    monkeypatch.setenv("MDEEP_INTERNODE_NET_RING_CHUNKS", " 3 ")
    assert net_ring_config("ring") == 3
    assert net_ring_config("ring", 0) == 0  # the argument wins over the knob
    assert net_ring_config("full", 0) == 0


@pytest.mark.parametrize("staging, value, match", [
    ("ring", "-1", r"MDEEP_INTERNODE_NET_RING_CHUNKS='-1': expected an integer in \[0, 4096\]"),
    ("ring", "4097", r"MDEEP_INTERNODE_NET_RING_CHUNKS='4097'"),
    ("ring", "two", r"MDEEP_INTERNODE_NET_RING_CHUNKS='two': expected an integer"),
    ("full", "2", r"MDEEP_INTERNODE_NET_RING_CHUNKS=2 needs MDEEP_INTERNODE_STAGING=ring"),
])
def test_bad_net_ring_knob_names_the_variable(monkeypatch, staging, value, match):
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING", staging)
    monkeypatch.setenv("MDEEP_INTERNODE_NET_RING_CHUNKS", value)
    with pytest.raises(ValueError, match=match):
        net_ring_config(staging)
    with pytest.raises(ValueError, match=match):
        InternodeTransport.size_hint(16, 512, 4096, 8)
    # The transport refuses it before it touches the group or the GPU.
    with pytest.raises(ValueError, match=match):
        InternodeTransport(None, 512, 4096, 8, num_sms=8, timeout_s=1.0)


def test_regions_refuse_a_net_ring_without_ring_staging():
    with pytest.raises(ValueError, match="needs MDEEP_INTERNODE_STAGING=ring"):
        InternodeRegions(16, 8, 64, 2048, 8, "full", 0, 2)
    with pytest.raises(ValueError, match=r"\[0, 4096\]"):
        InternodeRegions(16, 8, 64, 2048, 8, "ring", 4, -1)


def _disagreeing_ranks_worker(rank, world):
    import torch.distributed as dist
    from megatron_deepep.transport.internode import _check_same_staging
    _check_same_staging(dist.group.WORLD, "ring", 512, 4)  # everyone agrees: no error
    with pytest.raises(ValueError, match=r"NET_RING_CHUNKS .*rank 0: \('ring', 512, 4\), "
                                         r"rank 1: \('ring', 512, 0\)"):
        _check_same_staging(dist.group.WORLD, "ring", 512, 4 if rank == 0 else 0)


def test_ranks_that_disagree_on_the_net_ring_fail_at_construction():
    from tests.helpers.distributed import run_distributed
    run_distributed(2, _disagreeing_ranks_worker)


# ---------------------------------------------------------------------------------- regions

@pytest.mark.parametrize("R, L, N, H, K, C, chunks", [
    (4, 2, 64, 2048, 8, 4, 1), (16, 8, 4096, 7168, 8, 512, 8), (6, 3, 1, 16, 1, 1, 2),
    (64, 8, 4096, 7168, 16, 64, 16), (256, 8, 4096, 7168, 8, 512, 4096)])
def test_net_regions_are_disjoint_page_aligned_and_bounded(R, L, N, H, K, C, chunks):
    rg = InternodeRegions(R, L, N, H, K, "ring", C, chunks)
    check_region_spans(rg)
    sizes = dict(rg._sizes())
    M, slots = R // L, chunks * CHUNK_TOKENS
    net_slot, comb_slot = rg.row_stride + rg.record_stride, rg.row_stride + rg.weight_stride
    # Every network region is K chunks per rail peer, whatever N_max.
    for name, slot in (("net_send", net_slot), ("net_recv", net_slot), ("comb_send", comb_slot),
                       ("comb_recv", comb_slot)):
        assert sizes[name] == M * slots * slot
    # The node's rings are ring staging's.
    assert sizes["stage_rows"] == L * C * rg.row_stride
    assert sizes["comb_stage"] == L * C * comb_slot
    # The chunk words, counters and rail counts are control words, zeroed at start.
    assert sizes["net_words"] == 4 * M * chunks * 8
    assert sizes["net_counters"] == 2 * M * chunks * 4
    assert sizes["rail_counts"] == M * (2 * 8 + 3 * 8 * 4)  # struct RailCounts
    for name in ("net_words", "net_counters", "rail_counts", "ring_words"):
        assert rg.offsets[name] < rg.control_bytes() == rg.offsets["net_send"]
    slot = rg.row_stride + max(rg.record_stride, rg.meta_stride, rg.weight_stride)
    assert rg.num_bytes <= (4 * M * slots + 2 * L * C) * slot + (4 << 20)
    args = rg.as_args()
    assert set(args) <= set(ops.INTERNODE_FIELDS)
    assert args["net_chunks"] == chunks and args["ring_slots"] == C
    assert f"K = {chunks} network chunks" in rg.formula()


def test_regions_without_the_net_ring_are_ring_stagings():
    """Knob off: the block is ring staging's, bit for bit (no net words, no net_chunks)."""
    ring = InternodeRegions(16, 8, 512, 4096, 8, "ring", 64)
    assert ring == InternodeRegions(16, 8, 512, 4096, 8, "ring", 64, 0)
    assert "net_words" not in ring.offsets and "net_chunks" not in ring.as_args()
    assert InternodeRegions(16, 8, 512, 4096, 8).formula() == "about N_max (4 M + L M + R) rows"


@pytest.mark.parametrize("nodes, chunks, net_gb", [(8, 8, 0.24), (8, 16, 0.36), (32, 4, 0.36),
                                                   (32, 8, 0.59), (32, 16, 1.07)])
def test_headline_sizes(nodes, chunks, net_gb):
    """N_max 4096, H 7168, top-8, 8 ranks per node, C = 512 (docs/internode.md, "Network
    ring", memory table): the network ring removes N_max from the block."""
    R = 8 * nodes
    net = InternodeTransport.size_hint(R, 4096, 7168, 8, 8, staging="ring", ring_slots=512,
                                       net_chunks=chunks)
    assert round(net / GB, 2) == net_gb
    ring = InternodeTransport.size_hint(R, 4096, 7168, 8, 8, staging="ring", ring_slots=512)
    assert net < ring / 3
    # Independent of N_max: the same block for 512 or 65536 tokens per rank.
    for max_tokens in (512, 65536):
        assert InternodeTransport.size_hint(R, max_tokens, 7168, 8, 8, staging="ring",
                                            ring_slots=512, net_chunks=chunks) == net


def test_size_hint_follows_the_knobs(monkeypatch):
    from megatron_deepep.buffer import Buffer
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING", "ring")
    monkeypatch.setenv("MDEEP_INTERNODE_RING_SLOTS", "256")
    monkeypatch.delenv("MDEEP_INTERNODE_NET_RING_CHUNKS", raising=False)
    ring = Buffer.size_hint(4096, 7168, 64, 8, transport="internode", num_ranks_per_node=8)
    assert ring == InternodeRegions(64, 8, 4096, 7168, 8, "ring", 256).num_bytes
    monkeypatch.setenv("MDEEP_INTERNODE_NET_RING_CHUNKS", "8")
    net = Buffer.size_hint(4096, 7168, 64, 8, transport="internode", num_ranks_per_node=8)
    assert net == InternodeRegions(64, 8, 4096, 7168, 8, "ring", 256, 8).num_bytes
    assert net == InternodeTransport.size_hint(64, 4096, 7168, 8, 8)
    assert net < ring / 5


# --------------------------------------------------------------------------------- kernels

@pytest.mark.parametrize("fp8", [None, "blockwise", "mxfp8"])
def test_net_kernel_families(fp8):
    from megatron_deepep.fp8.dispatch import Fp8Dispatch
    spec = Fp8Dispatch.named(fp8) if fp8 else None
    family = ops.internode_net_expressions(4, "int", spec)
    combine = ops.internode_net_combine_expressions(4, 1)
    assert len(set(family)) == len(family) == 4 and len(set(combine)) == len(combine) == 4
    names = {expr.split("<")[0] for expr in family + combine}
    assert names == {"internode_node_layout", "internode_notify"} | set(ops.INTERNODE_NET_KERNELS)
    assert family[-1].startswith("internode_net_dispatch<4, true, int, ")
    assert {e for e in family if not e.startswith("internode_net")} == {
        "internode_node_layout", "internode_notify"}
    assert "internode_net_combine<4, true, false, 1>" in combine
    assert ops.internode_families("net") == (ops.internode_net_expressions,
                                             ops.internode_net_combine_expressions)


def test_precompile_links_the_net_ring_when_the_knob_asks(monkeypatch):
    from megatron_deepep.tools.precompile import internode_families_for
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING", "ring")
    monkeypatch.delenv("MDEEP_INTERNODE_NET_RING_CHUNKS", raising=False)
    ring = [("internode/ring.cu", ops.internode_ring_expressions(8, "long long", None)),
            ("internode/ring.cu", ops.internode_ring_combine_expressions(8, 0))]
    assert internode_families_for([8], index_dtypes=("int64",)) == ring
    monkeypatch.setenv("MDEEP_INTERNODE_NET_RING_CHUNKS", "2")
    assert internode_families_for([8], index_dtypes=("int64",)) == [
        ("internode/net_ring.cu", ops.internode_net_expressions(8, "long long", None)),
        ("internode/net_ring.cu", ops.internode_net_combine_expressions(8, 0))]
    assert internode_families_for([8], index_dtypes=("int64",), net_chunks=0) == ring


@pytest.mark.parametrize("L, blocks", [(1, 1), (5, 1), (6, 2), (8, 2)])
def test_net_kernels_get_a_warp_for_every_role(L, blocks):
    assert ops.net_ring_min_blocks(L) == blocks
    assert blocks * ops.INTERNODE_THREADS // 32 >= ops.NET_ROLE_GROUPS_PER_RANK * L


def test_role_groups_and_phases_mirror_the_kernels():
    import re
    from megatron_deepep.kernels import nvshmem_link
    # Notify (every staging's, with the rail counts) and the network ring's own kernels.
    source = "".join((nvshmem_link.cuda_src_dir() / "internode" / name).read_text()
                     for name in ("common.cuh", "net_ring.cu"))
    groups = re.search(r"kNetGroupsPerRank = (\d+);", source)
    assert groups and int(groups.group(1)) == ops.NET_ROLE_GROUPS_PER_RANK
    for name, phase in (("kPhaseInNetNotify", 20), ("kPhaseInNetSend", 21),
                        ("kPhaseInNetForward", 22), ("kPhaseInNetCombineSend", 23),
                        ("kPhaseInNetReduce", 24)):
        assert re.search(rf"{name} = {phase}\b", source), name
        assert phase in errors.PHASES
    assert errors.NET_RING_PHASES == (21, 22, 23, 24)


def test_net_timeouts_name_chunk_words_rank_peer_and_node():
    import numpy as np
    transport = InternodeTransport.__new__(InternodeTransport)
    transport.rank, transport.ranks_per_node = 5, 4
    words = np.zeros(errors.ERROR_RECORD_WORDS, dtype=np.int32)
    words[:5] = (1, 5, 1, 21, 0)  # rank 5 (node 1) waiting for a credit from rail peer 1
    words[6:10] = np.array([7, 3], dtype=np.int64).view(np.int32)
    text = str(errors.error_from_record(words, 3.0, transport.locate))
    assert "internode network ring send (waiting for a credit" in text
    assert "waited for chunk word 7, saw 3" in text
    assert "rank 5 is node 1 local 1; peer 1 is node 0 local 1" in text
    for phase, what in ((22, "forward"), (23, "combine send"), (24, "reduce")):
        words[3] = phase
        text = str(errors.error_from_record(words, 3.0, transport.locate))
        assert f"network ring {what}" in text and "chunk word" in text
    words[3] = 20  # the rail counts carry the notify epoch
    text = str(errors.error_from_record(words, 3.0, transport.locate))
    assert "rail peer's per-rank token counts" in text and "waited for epoch 7" in text


@pytest.mark.parametrize("nodes, per_node", [(2, 1), (2, 2), (3, 2), (4, 3)])
def test_rail_counts_give_ring_stagings_positions(nodes, per_node):
    """Notify's rail counts (each source's num_tokens_per_rank for its rail peer's node, summed
    over source nodes) are exactly ring_base as internode_ring_count counts it from the landed
    rows: the forwarder can place rows before they arrive."""
    layouts = _routing(5 + nodes, nodes * per_node, 40, 2, 4)
    for node in range(nodes):
        streams = _Streams(layouts, nodes, per_node, node)
        for u in range(per_node):
            for t in range(per_node):
                base = [0]
                for n in range(nodes):
                    sent = int(layouts[n * per_node + u].num_tokens_per_rank[node * per_node + t])
                    base.append(base[-1] + sent)
                assert base == streams.ring_base[u][t]


# ---------------------------------------------------------------------- the protocol model

def _num_chunks(count: int, chunk: int) -> int:
    return -(-count // chunk)


class _NetStream:
    """One network stream (sender -> receiver) of K chunk slots: the chunks in the receiver's
    slots with their ready words, the sender's credit words, the receiver's consumer counters,
    and the chunks consumed so far (for the overwrite check)."""

    def __init__(self, chunks: int):
        self.K = chunks
        self.data: List[object] = [None] * chunks
        self.ready = [0] * chunks
        self.credit = [0] * chunks
        self.count = [0] * chunks
        self.consumed = set()
        self.sent = 0  # chunks written so far (to see the slots wrap)

    def set_word(self, words: List[int], g: int) -> None:
        assert words[g % self.K] <= g + 1, "a chunk word went backwards"
        words[g % self.K] = g + 1


class _Call:
    """One call's routing, as the kernels see it: per node the _Streams of its rings, per
    (source, node) the source's tokens to that node in node-slot order."""

    def __init__(self, layouts, nodes: int, per_node: int):
        self.M, self.L = nodes, per_node
        self.streams = [_Streams(layouts, nodes, per_node, m) for m in range(nodes)]
        self.num_tokens = [lay.token_slot_in_rank.shape[0] for lay in layouts]
        self.node_tokens: Dict[tuple, List[int]] = {}
        for s, lay in enumerate(layouts):
            cols = lay.token_slot_in_rank
            for m in range(nodes):
                in_node = (cols[:, m * per_node:(m + 1) * per_node] >= 0).any(dim=1)
                self.node_tokens[(s, m)] = torch.nonzero(in_node).flatten().tolist()


class _NetModel:
    """The network ring's kernels on every rank of M nodes x L ranks (module docstring).

    Args:
        nodes, per_node: M, L.
        chunks: K, chunk slots per stream.
        ring_slots: C of the node's rings.
        warps: warps per role group (the kernels' `per_group`).
        seed: of the scheduler.
        chunk: tokens per network chunk (32 in the kernels).
        split: the directions whose roles run as two kernels in stream order instead of one
            (a control): "dispatch" (senders, then forward + expand), "combine" (partials +
            sums, then reduce); () as built.
        credits: False: receivers never return credits (a control).
    """

    def __init__(self, nodes: int, per_node: int, chunks: int, ring_slots: int, warps: int,
                 seed: int, chunk: int = 3, split: tuple = (), credits: bool = True):
        self.M, self.L, self.K, self.P, self.chunk = nodes, per_node, chunks, warps, chunk
        self.split, self.credits = split, credits
        self.rng = random.Random(seed)
        R = nodes * per_node
        self.R = R
        rail = [(a, m * per_node + a % per_node) for a in range(R) for m in range(nodes)]
        self.disp = {(a, b): _NetStream(chunks) for a, b in rail}  # source -> rail peer
        self.comb = {(b, a): _NetStream(chunks) for a, b in rail}  # forwarder -> source
        pairs = [(m, u, t) for m in range(nodes) for u in range(per_node)
                 for t in range(per_node)]
        self.nvl_disp = {key: _Ring(ring_slots) for key in pairs}  # (node, forwarder, dest)
        self.nvl_comb = {key: _Ring(ring_slots) for key in pairs}  # (node, expert rank, fwd)
        self.sent: Dict[tuple, int] = {}   # (dir, rank, node): chunks sent so far
        self.seen: Dict[tuple, int] = {}   # (dir, rank, node): chunks received so far
        self.pos: Dict[tuple, int] = {}    # (what, rank, local peer): ring positions so far
        self.flights: List[Callable[[], None]] = []  # puts and signals on the network

    # -- helpers
    def _rank(self, node: int, local: int) -> int:
        return node * self.L + local

    def _wait(self, pending: list, ready: Callable[[], bool]):
        if not ready():
            self._flush(pending)  # ring::warp_wait_word / netring::warp_wait publish first
            yield ready

    def _flush(self, pending: list) -> None:
        for ring, word, pos in pending:
            ring.publish(word, pos)
        pending.clear()

    def _add(self, pending: list, ring: _Ring, word: str, pos: int) -> None:
        pending.append((ring, word, pos))
        if len(pending) == 32:
            self._flush(pending)

    def _send(self, local: bool, action: Callable[[], None]) -> None:
        """A put or signal: at once to this rank's own memory, else a message in flight."""
        if local:
            action()
        else:
            self.flights.append(action)

    def _consumed(self, stream: _NetStream, g: int, consumers: int, local: bool) -> None:
        """One consumer done with chunk g; the last one returns the credit."""
        slot = g % stream.K
        stream.count[slot] += 1
        if stream.count[slot] < consumers:
            return
        stream.count[slot] = 0
        stream.consumed.add(g)
        if self.credits:
            self._send(local, lambda: stream.set_word(stream.credit, g))

    def _strided(self, items: list, index: int, count: int) -> list:
        return items[index::count]

    # -- warps
    def _sender(self, call: _Call, a: int, member: int, members: int):
        """Chunk-major (c, m) items strided over the senders, as net_send_chunks."""
        M, L, C = self.M, self.L, self.chunk
        n_a = a // L
        counts = [len(call.node_tokens[(a, m)]) for m in range(M)]
        items = [(c, m) for c in range(max([_num_chunks(x, C) for x in counts] + [0]))
                 for m in range(M) if c * C < counts[m]]
        base = {m: self.sent[("disp", a, m)] for m in range(M)}
        for c, m in self._strided(items, member, members):
            b = self._rank(m, a % L)
            stream, g = self.disp[(a, b)], base[m] + c
            need = max(g + 1 - self.K, 0)
            yield from self._wait([], lambda s=stream, g=g, n=need: s.credit[g % s.K] >= n)
            assert g < self.K or g - self.K in stream.consumed, \
                "a chunk slot was written before its previous chunk was consumed"
            rows = list(range(c * C, min(counts[m], c * C + C)))
            payload = (g, n_a, rows)
            stream.sent = max(stream.sent, g + 1)
            self._send(m == n_a, lambda s=stream, g=g, p=payload: (
                s.data.__setitem__(g % s.K, p), s.set_word(s.ready, g)))
            yield None

    def _forwarder(self, call: _Call, b: int, t: int, index: int):
        """Ring me -> t fed by whole received chunks in (source node, chunk) order."""
        M, L, C = self.M, self.L, self.chunk
        m, u = divmod(b, L)
        st = call.streams[m]
        items = [(n, c) for n in range(M) for c in range(_num_chunks(len(st.records[u][n]), C))]
        first_pos = self.pos[("disp_sent", b, t)]
        ring = self.nvl_disp[(m, u, t)]
        pending = []
        for n, c in self._strided(items, index, self.P):
            a = self._rank(n, u)
            stream, g = self.disp[(a, b)], self.seen[("disp", b, n)] + c
            yield from self._wait(pending, lambda s=stream, g=g: s.ready[g % s.K] >= g + 1)
            rows = list(range(c * C, min(len(st.records[u][n]), c * C + C)))
            assert stream.data[g % stream.K] == (g, n, rows), "wrong chunk in the slot"
            for j in rows:
                rec = st.records[u][n][j]
                if rec[t] < 0:
                    continue
                pos = first_pos + st.ring_base[u][t][n] + rec[t]
                need = max(pos + 1 - ring.slots, 0)
                yield from self._wait(pending, lambda p=pos, n=need: ring.freed[p % ring.slots]
                                      >= n)
                if pos >= ring.slots:
                    assert pos - ring.slots in ring.read, "a ring slot was overwritten unread"
                ring.data[pos % ring.slots] = (pos, (n, rec[t]))
                yield None
                self._add(pending, ring, "ready", pos)
            self._consumed(stream, g, L, n == m)
            yield None
        self._flush(pending)

    def _expander(self, call: _Call, d: int, u: int, index: int, got: list):
        m, t = divmod(d, self.L)
        st = call.streams[m]
        first = self.pos[("disp_recv", d, u)]
        ring = self.nvl_disp[(m, u, t)]
        pending = []
        for q in self._strided(list(range(st.start[t][u][self.M])), index, self.P):
            pos, expected = first + q, st.consumer_item(t, u, q)
            yield from self._wait(pending, lambda p=pos: ring.ready[p % ring.slots] >= p + 1)
            assert ring.data[pos % ring.slots] == (pos, expected), "wrong row in the ring slot"
            ring.read.add(pos)
            got.append((m, u) + expected)
            yield None
            self._add(pending, ring, "freed", pos)
        self._flush(pending)

    def _partials(self, call: _Call, d: int, u: int, index: int):
        m, t = divmod(d, self.L)
        st = call.streams[m]
        first = self.pos[("comb_sent", d, u)]
        ring = self.nvl_comb[(m, t, u)]
        pending = []
        for q in self._strided(list(range(st.start[t][u][self.M])), index, self.P):
            pos = first + q
            need = max(pos + 1 - ring.slots, 0)
            yield from self._wait(pending, lambda p=pos, n=need: ring.freed[p % ring.slots] >= n)
            if pos >= ring.slots:
                assert pos - ring.slots in ring.read, "a ring slot was overwritten unread"
            ring.data[pos % ring.slots] = (pos, (u,) + st.consumer_item(t, u, q))
            yield None
            self._add(pending, ring, "ready", pos)
        self._flush(pending)

    def _sums(self, call: _Call, f: int, member: int, members: int):
        """Whole chunks in (source node, chunk) order, each once its credit came back."""
        M, L, C = self.M, self.L, self.chunk
        m, u = divmod(f, L)
        st = call.streams[m]
        items = [(n, c) for n in range(M) for c in range(_num_chunks(len(st.records[u][n]), C))]
        first = {t: self.pos[("comb_recv", f, t)] for t in range(L)}
        base = {n: self.sent[("comb", f, n)] for n in range(M)}
        pending = []
        for n, c in self._strided(items, member, members):
            s = self._rank(n, u)
            stream, g = self.comb[(f, s)], base[n] + c
            need = max(g + 1 - self.K, 0)
            yield from self._wait(pending, lambda st_=stream, g=g, k=need:
                                  st_.credit[g % st_.K] >= k)
            assert g < self.K or g - self.K in stream.consumed, \
                "a chunk slot was written before its previous chunk was consumed"
            rows = list(range(c * C, min(len(st.records[u][n]), c * C + C)))
            for j in rows:
                rec = st.records[u][n][j]
                reads = []
                for t in range(L):
                    if rec[t] < 0:
                        continue
                    ring = self.nvl_comb[(m, t, u)]
                    pos = first[t] + st.ring_base[u][t][n] + rec[t]
                    yield from self._wait(pending, lambda r=ring, p=pos:
                                          r.ready[p % r.slots] >= p + 1)
                    assert ring.data[pos % ring.slots] == (pos, (u, n, rec[t])), "wrong partial"
                    ring.read.add(pos)
                    reads.append((ring, pos))
                yield None
                for ring, pos in reads:
                    self._add(pending, ring, "freed", pos)
            stream.sent = max(stream.sent, g + 1)
            self._send(n == m, lambda s_=stream, g=g, p=(g, m, rows): (
                s_.data.__setitem__(g % s_.K, p), s_.set_word(s_.ready, g)))
            yield None
        self._flush(pending)

    def _reducer(self, call: _Call, s: int, member: int, members: int, got: list):
        """Tokens in order; each waits for its rows from every node it went to."""
        M, L, C = self.M, self.L, self.chunk
        slot_of = [{tok: j for j, tok in enumerate(call.node_tokens[(s, n)])} for n in range(M)]
        base = {n: self.seen[("comb", s, n)] for n in range(M)}
        for i in self._strided(list(range(call.num_tokens[s])), member, members):
            rows = []
            for n in range(M):
                if i not in slot_of[n]:
                    continue
                j = slot_of[n][i]
                stream = self.comb[(self._rank(n, s % L), s)]
                g = base[n] + j // C
                yield from self._wait([], lambda st_=stream, g=g: st_.ready[g % st_.K] >= g + 1)
                g_seen, node, chunk_rows = stream.data[g % stream.K]
                assert (g_seen, node) == (g, n) and j in chunk_rows, "wrong chunk in the slot"
                rows.append((n, stream, g, len(chunk_rows)))
            got.append((s, i, tuple(n for n, *_ in rows)))
            yield None
            for n, stream, g, num_rows in rows:
                self._consumed(stream, g, num_rows, n == s // L)

    # -- kernels and their ends
    def _kernels(self, call: _Call, r: int, results: dict):
        """Rank r's kernels of one call in stream order: (roles, warp factories)."""
        L, P = self.L, self.P
        team = P * L  # warps of L groups working together (senders, sums, reducers)
        send = [lambda k=k: self._sender(call, r, k, team) for k in range(team)]
        fwd = [lambda t=t, k=k: self._forwarder(call, r, t, k)
               for t in range(L) for k in range(P)]
        got = results.setdefault("rows", [])
        expand = [lambda u=u, k=k: self._expander(call, r, u, k, got)
                  for u in range(L) for k in range(P)]
        partials = [lambda u=u, k=k: self._partials(call, r, u, k)
                    for u in range(L) for k in range(P)]
        sums = [lambda k=k: self._sums(call, r, k, team) for k in range(team)]
        reduced = results.setdefault("reduced", [])
        reduce = [lambda k=k: self._reducer(call, r, k, team, reduced) for k in range(team)]
        dispatch = ([(("send",), send), (("fwd", "expand"), fwd + expand)]
                    if "dispatch" in self.split
                    else [(("send", "fwd", "expand"), send + fwd + expand)])
        combine = ([(("partials", "sums"), partials + sums), (("reduce",), reduce)]
                   if "combine" in self.split
                   else [(("partials", "sums", "reduce"), partials + sums + reduce)])
        return dispatch + combine

    def _advance(self, call: _Call, r: int, roles) -> None:
        """What the last block of rank r's kernel advances (its roles' chunk and ring totals)."""
        M, L, C = self.M, self.L, self.chunk
        m, u = divmod(r, L)
        st = call.streams[m]
        for n in range(M):
            to_node = _num_chunks(len(call.node_tokens[(r, n)]), C)
            from_node = _num_chunks(len(st.records[u][n]), C)
            if "send" in roles:
                self.sent[("disp", r, n)] += to_node
            if "fwd" in roles:
                self.seen[("disp", r, n)] += from_node
            if "sums" in roles:
                self.sent[("comb", r, n)] += from_node
            if "reduce" in roles:
                self.seen[("comb", r, n)] += to_node
        for t in range(L):
            if "fwd" in roles:
                self.pos[("disp_sent", r, t)] += st.ring_base[u][t][M]
            if "expand" in roles:
                self.pos[("disp_recv", r, t)] += st.start[u][t][M]
            if "partials" in roles:
                self.pos[("comb_sent", r, t)] += st.start[u][t][M]
            if "sums" in roles:
                self.pos[("comb_recv", r, t)] += st.ring_base[u][t][M]

    def run(self, calls: List[_Call], max_steps: int = 5_000_000) -> dict:
        """Every rank runs its kernels of every call in stream order; returns what the readers
        got ("rows": (node, forwarder, source node, slot) per expanded row; "reduced":
        (source, token, nodes) per reduced token).

        Raises:
            _Deadlock: no warp can run, no message is in flight, and some have not ended.
        """
        R, results = self.R, {}
        for key in ("disp", "comb"):
            for r in range(R):
                for n in range(self.M):
                    self.sent[(key, r, n)] = self.seen[(key, r, n)] = 0
        for what in ("disp_sent", "disp_recv", "comb_sent", "comb_recv"):
            for r in range(R):
                for t in range(self.L):
                    self.pos[(what, r, t)] = 0
        queue = {r: [(call, roles, f) for call in calls
                     for roles, f in self._kernels(call, r, results)] for r in range(R)}
        running: Dict[int, list] = {r: [] for r in range(R)}
        ending: Dict[int, object] = {r: None for r in range(R)}
        for _ in range(max_steps):
            for r in range(R):  # stream order: a rank's next kernel once its last one ended
                if not running[r]:
                    if ending[r] is not None:
                        self._advance(*ending[r])
                        ending[r] = None
                    if queue[r]:
                        call, roles, factories = queue[r].pop(0)
                        ending[r] = (call, r, roles)
                        running[r] = [[f(), None] for f in factories]
            live = [(r, w) for r in range(R) for w in running[r]]
            if not live and not any(queue.values()) and not self.flights:
                return results
            runnable = [(r, w) for r, w in live if w[1] is None or w[1]()]
            choices = len(runnable) + len(self.flights)
            if choices == 0:
                if live:
                    raise _Deadlock(f"no warp can run ({len(live)} waiting), nothing in flight")
                continue
            pick = self.rng.randrange(choices)
            if pick >= len(runnable):
                self.flights.pop(pick - len(runnable))()
                continue
            r, w = runnable[pick]
            try:
                w[1] = next(w[0])
            except StopIteration:
                running[r].remove(w)
        raise AssertionError("the model did not finish")


def _net_calls(nodes: int, per_node: int, seeds, tokens: int = 24, topk: int = 4):
    return [_Call(_routing(seed, nodes * per_node, tokens, 2, topk), nodes, per_node)
            for seed in seeds]


def _expected(calls: List[_Call], nodes: int, per_node: int):
    rows, reduced = [], []
    for call in calls:
        for m in range(nodes):
            st = call.streams[m]
            for t in range(per_node):
                for u in range(per_node):
                    rows += [(m, u) + st.consumer_item(t, u, q)
                             for q in range(st.start[t][u][nodes])]
        for s in range(nodes * per_node):
            for i in range(call.num_tokens[s]):
                went = tuple(n for n in range(nodes) if i in call.node_tokens[(s, n)])
                reduced.append((s, i, went))
    return sorted(rows), sorted(reduced)


@pytest.mark.parametrize("nodes, per_node, chunks, ring_slots, warps", [
    (2, 1, 1, 1, 1), (2, 1, 2, 2, 2), (2, 2, 1, 2, 1), (2, 2, 2, 1, 2), (3, 1, 1, 3, 2),
    (3, 2, 1, 2, 1), (3, 2, 3, 4, 2), (2, 3, 2, 2, 1), (4, 2, 1, 1, 1), (2, 2, 64, 512, 2)])
def test_net_protocol_model_completes_and_delivers_every_row_once(nodes, per_node, chunks,
                                                                  ring_slots, warps):
    """Three calls back to back, ranks free to run ahead of their peers, streams of many more
    chunks than slots, messages delivered at random times: every chunk arrives in its slot,
    no slot is overwritten before its chunk was consumed, every row reaches its destination
    once, every token is reduced once from exactly the nodes it went to, and nothing
    deadlocks, on several schedules."""
    calls = _net_calls(nodes, per_node, (1, 2, 3))
    want_rows, want_reduced = _expected(calls, nodes, per_node)
    for seed in range(3):
        model = _NetModel(nodes, per_node, chunks, ring_slots, warps, seed)
        results = model.run(calls)
        assert sorted(results["rows"]) == want_rows
        assert sorted(results["reduced"]) == want_reduced
        if chunks < 3:  # the streams wrapped: credits were needed
            assert any(stream.sent > chunks for stream in model.disp.values())
            assert any(stream.sent > chunks for stream in model.comb.values())


def test_net_protocol_model_deadlocks_without_credits():
    """Control: a receiver that never returns credits stops every stream after K chunks."""
    calls = _net_calls(2, 1, (5,), tokens=40)
    with pytest.raises(_Deadlock):
        _NetModel(2, 1, 2, 4, 1, 0, credits=False).run(calls)


@pytest.mark.parametrize("per_node", [1, 2])
def test_net_protocol_model_deadlocks_with_separate_kernels(per_node):
    """Control (docs/internode.md, "Network ring", deadlock 1): senders in a kernel before the
    forwarders deadlock once a stream carries more than K chunks in one call (a rank's own
    stream alone does: its credits come from its own forwarder, queued behind its sender)."""
    calls = _net_calls(2, per_node, (7,), tokens=40)
    with pytest.raises(_Deadlock):
        _NetModel(2, per_node, 1, 4, 1, 0, split=("dispatch",)).run(calls)


def test_net_protocol_model_sums_before_reduce_deadlock():
    """Control: with the dispatch fused as built, combine's sums in a kernel before the reduce
    deadlock the same way (a forwarder waits for credits that only the reduce returns, queued
    behind the forwarder's own sums on its rail peer, and on itself for its own node)."""
    calls = _net_calls(2, 1, (9,), tokens=40)
    with pytest.raises(_Deadlock):
        _NetModel(2, 1, 1, 4, 1, 0, split=("combine",)).run(calls)


# ------------------------------------------------------------- the transport's kernel order

class _FakeStatus:
    host_info_ptr = 0

    def check_errors(self):
        pass

    def wait_num_rows(self, epoch):
        return 48

    def tokens_per_expert(self, num_local):
        return [0] * num_local


class _FakeEpochs:
    dispatch, notify, combine = 0x10, 0x20, 0x30

    def advance_dispatch(self):
        pass

    advance_cached_dispatch = advance_combine = advance_dispatch


class _FakeLayout:
    num_tokens = 6

    def address(self, name):
        return 0x1000


def _fake_transport(monkeypatch, staging: str, ring_slots: int, net_chunks: int):
    """An InternodeTransport with CPU stand-ins for the device state, its kernels recorded."""
    t = InternodeTransport.__new__(InternodeTransport)
    t.staging, t.ring_slots, t.net_chunks = staging, ring_slots, net_chunks
    t.is_ring, t.is_net = staging == "ring", net_chunks > 0
    t.rank, t.num_ranks, t.ranks_per_node, t.num_nodes = 1, 4, 2, 2
    t.regions = InternodeRegions(4, 2, 64, 256, 2, staging, ring_slots, net_chunks)
    t.device = torch.device("cpu")
    t.num_sms, t.ring_blocks, t.net_blocks, t.timeout_ns = 8, 8, 8, 10 ** 9
    t.status, t.epochs, t.host_epoch = _FakeStatus(), _FakeEpochs(), 0
    t.block = torch.zeros(t.regions.control_bytes() + 16, dtype=torch.uint8)
    t.pe_of_rank = torch.arange(4, dtype=torch.int32)
    t.workspace = torch.zeros(16, dtype=torch.int32)
    t.chunks_seen = torch.zeros(4, dtype=torch.int64)
    t.ring_seen = torch.zeros(32, dtype=torch.int64)
    t.net_sent = torch.zeros(4, dtype=torch.int64)

    class _Errors:
        claim = record = 0x40
    t.status.errors = _Errors()
    t._static = t._static_fields()
    launched = []

    def recorder(name):
        def launch(*args, **kwargs):
            fields = next(a for a in list(args) + list(kwargs.values()) if isinstance(a, dict))
            launched.append((name, args, kwargs, dict(fields)))
        return launch

    kernels = ["internode_node_layout", "internode_notify", "internode_dispatch_send",
               "internode_forward", "internode_dispatch_recv", "internode_combine_send",
               "internode_combine_forward", "internode_combine_reduce", "internode_ring_count",
               "internode_ring_dispatch", "internode_ring_combine", "internode_net_dispatch",
               "internode_net_combine"]
    for name in kernels:
        monkeypatch.setattr(ops, name, recorder(name))
    monkeypatch.setattr(ops, "dispatch_layout", lambda *a, **k: _FakeLayout())
    return t, launched


@pytest.mark.parametrize("staging, slots, chunks, dispatch, cached, combine", [
    ("full", 0, 0, ["node_layout", "notify", "dispatch_send", "forward", "dispatch_recv"],
     ["dispatch_send", "forward", "dispatch_recv"],
     ["combine_send", "combine_forward", "combine_reduce"]),
    ("ring", 4, 0, ["node_layout", "notify", "dispatch_send", "ring_count", "ring_dispatch"],
     ["dispatch_send", "ring_count", "ring_dispatch"], ["ring_combine", "combine_reduce"]),
    ("ring", 4, 2, ["node_layout", "notify", "net_dispatch"], ["net_dispatch"],
     ["net_combine"]),
])
@pytest.mark.parametrize("sync", [True, False])
def test_transport_launches_the_kernels_of_its_mode(monkeypatch, staging, slots, chunks,
                                                    dispatch, cached, combine, sync):
    """Knob off, the kernel sequences of full and ring staging are unchanged; with the network
    ring, dispatch is node layout -> notify -> one kernel, combine one kernel, and every launch
    carries the network ring's fields."""
    t, launched = _fake_transport(monkeypatch, staging, slots, chunks)
    x = torch.zeros(6, 256, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 5]] * 6)
    w = torch.ones(6, 2)
    _, _, handle = t.dispatch(x, idx, w, 8, num_max_recv_rows=None if sync else 96)
    names = [name.replace("internode_", "") for name, *_ in launched]
    assert names == dispatch
    launched.clear()
    t.cached_dispatch(x, handle)
    assert [name.replace("internode_", "") for name, *_ in launched] == cached
    launched.clear()
    t.combine(torch.zeros(48, 256, dtype=torch.bfloat16), handle, weighted=True)
    assert [name.replace("internode_", "") for name, *_ in launched] == combine
    if chunks == 0:
        return
    fields = launched[0][3]
    assert fields["net_chunks"] == chunks and fields["ring_slots"] == slots
    assert fields["net_sent"] == t.net_sent.data_ptr() and fields["ring_base"] != 0
    for name in ("net_words", "net_counters", "rail_counts", "net_send", "comb_recv"):
        assert fields[name] == t.regions.offsets[name]
    assert launched[0][1][-2] == t.net_blocks  # the grid
