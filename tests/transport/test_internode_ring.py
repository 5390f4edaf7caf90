"""CPU tier: the internode transport's ring staging (`MDEEP_INTERNODE_STAGING=ring`,
docs/internode.md "Ring staging") without a GPU: the knobs and their errors, the symmetric
block's formula for both stagings, the kernel families, the ring positions both ends derive
from the real layouts, and a model of the ring protocol run on random schedules.

The model (`_Model`) replays what `cuda_src/internode/ring.cu`'s kernels do, warp by warp:
every warp is a generator that yields where the kernel would spin, and a random scheduler runs
the runnable ones (every warp of a running kernel is runnable: the kernels are co-resident).
Each rank runs its kernels in stream order. It checks that every ring position reaches its
reader with the right row, that a slot is never overwritten before it was read, and that
nothing deadlocks, over several calls (positions carry across calls) and both directions; and,
as controls, that it does deadlock when a warp does not publish before it blocks or when
forward and expand are separate kernels.
"""

from __future__ import annotations

import random
from typing import Callable, Dict, List, Tuple

import pytest
import torch

from megatron_deepep import knobs, ops
from megatron_deepep.layout import compute_layout
from megatron_deepep.transport import errors
from megatron_deepep.transport.internode import InternodeTransport, node_plan
from megatron_deepep.transport.internode_regions import (InternodeRegions, choose_staging,
                                                         describe_staging, staging_config)
from megatron_deepep.transport.recv import regrow_slots
from megatron_deepep.transport.regions import PAGE
from tests.transport.test_internode_transport import check_region_spans

GB = 1e9


# ----------------------------------------------------------------------------------- knobs

def test_staging_knobs(monkeypatch):
    monkeypatch.delenv("MDEEP_INTERNODE_STAGING", raising=False)
    monkeypatch.delenv("MDEEP_INTERNODE_RING_SLOTS", raising=False)
    assert staging_config() == ("auto", knobs.KNOBS["INTERNODE_RING_SLOTS"].default)
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING", "full")
    assert staging_config() == ("full", 0)
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING", "ring")
    assert staging_config() == ("ring", knobs.KNOBS["INTERNODE_RING_SLOTS"].default)
    monkeypatch.setenv("MDEEP_INTERNODE_RING_SLOTS", " 16 ")
    assert staging_config() == ("ring", 16)
    assert staging_config("full") == ("full", 0)  # arguments win over the knobs
    assert staging_config("ring", 3) == ("ring", 3)


# DeepSeek-V3's shape per rank (N_max 4096, H 7168, top-8) on nodes of 8: auto's pick with the
# default 4 GB and its block (full staging's in parentheses).
AUTO_PICKS = [(2, "full", 2.36, 2.36), (4, "ring (512 slots)", 1.07, 4.72),
              (16, "ring (512 slots)", 3.90, 18.89),
              (32, "ring (512 slots) with the network ring (8 chunks per rail peer)", 0.59, 37.78)]


@pytest.mark.parametrize("nodes, name, gb, full_gb", AUTO_PICKS)
def test_auto_staging_takes_the_first_that_fits(monkeypatch, nodes, name, gb, full_gb):
    for knob in ("STAGING", "RING_SLOTS", "NET_RING_CHUNKS", "STAGING_MAX_GB"):
        monkeypatch.delenv(f"MDEEP_INTERNODE_{knob}", raising=False)
    R = 8 * nodes
    choice = choose_staging(R, 8, 4096, 7168, 8)
    assert describe_staging(*choice) == name
    assert InternodeRegions(R, 8, 4096, 7168, 8, *choice).num_bytes / 1e9 == pytest.approx(
        gb, abs=0.01)
    assert InternodeRegions(R, 8, 4096, 7168, 8).num_bytes / 1e9 == pytest.approx(full_gb,
                                                                                 abs=0.01)
    assert InternodeTransport.size_hint(R, 4096, 7168, 8, 8) == InternodeRegions(
        R, 8, 4096, 7168, 8, *choice).num_bytes
    # The budget moves the switch; explicit modes and the network ring's K are kept.
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING_MAX_GB", "100")
    assert choose_staging(R, 8, 4096, 7168, 8) == ("full", 0, 0)
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING_MAX_GB", "0.001")  # nothing fits: the smallest
    assert choose_staging(R, 8, 4096, 7168, 8) == ("ring", 512, 8)
    monkeypatch.setenv("MDEEP_INTERNODE_NET_RING_CHUNKS", "2")
    assert choose_staging(R, 8, 4096, 7168, 8) == ("ring", 512, 2)
    assert choose_staging(R, 8, 4096, 7168, 8, "ring", 64, 0) == ("ring", 64, 0)
    assert choose_staging(R, 8, 4096, 7168, 8, "full", None, 0) == ("full", 0, 0)


def test_auto_staging_refuses_a_bad_budget(monkeypatch):
    monkeypatch.delenv("MDEEP_INTERNODE_STAGING", raising=False)
    monkeypatch.delenv("MDEEP_INTERNODE_NET_RING_CHUNKS", raising=False)
    for bad, match in (("0", "STAGING_MAX_GB='0': expected a finite number > 0"),
                       ("lots", "STAGING_MAX_GB='lots': expected a number")):
        monkeypatch.setenv("MDEEP_INTERNODE_STAGING_MAX_GB", bad)
        with pytest.raises(ValueError, match=match):
            choose_staging(16, 8, 4096, 7168, 8)
    with pytest.raises(ValueError, match="resolved staging"):
        InternodeRegions(16, 8, 64, 2048, 8, "auto", 512)


@pytest.mark.parametrize("env, match", [
    ({"MDEEP_INTERNODE_STAGING": "rings"},
     r"MDEEP_INTERNODE_STAGING='rings': expected one of full, ring, auto; did you mean 'ring'"),
    ({"MDEEP_INTERNODE_STAGING": "ring", "MDEEP_INTERNODE_RING_SLOTS": "0"},
     r"MDEEP_INTERNODE_RING_SLOTS='0': expected an integer in \[1, 1048576\]"),
    ({"MDEEP_INTERNODE_STAGING": "ring", "MDEEP_INTERNODE_RING_SLOTS": "-4"},
     r"MDEEP_INTERNODE_RING_SLOTS='-4'"),
    ({"MDEEP_INTERNODE_STAGING": "ring", "MDEEP_INTERNODE_RING_SLOTS": "many"},
     r"MDEEP_INTERNODE_RING_SLOTS='many': expected an integer"),
    ({"MDEEP_INTERNODE_STAGING": "ring", "MDEEP_INTERNODE_RING_SLOTS": str((1 << 20) + 1)},
     r"MDEEP_INTERNODE_RING_SLOTS='1048577'"),
])
def test_bad_staging_knobs_name_the_variable(monkeypatch, env, match):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        staging_config()
    with pytest.raises(ValueError, match=match):
        InternodeTransport.size_hint(16, 512, 4096, 8)


def test_regions_refuse_slots_that_do_not_fit_the_staging():
    with pytest.raises(ValueError, match="staging='full' takes ring_slots=0"):
        InternodeRegions(16, 8, 64, 2048, 8, "full", 5)
    with pytest.raises(ValueError, match="RING_SLOTS=0"):
        InternodeRegions(16, 8, 64, 2048, 8, "ring", 0)
    with pytest.raises(ValueError, match="INTERNODE_STAGING='both'"):
        InternodeRegions(16, 8, 64, 2048, 8, "both", 5)


def _disagreeing_ranks_worker(rank, world):
    import torch.distributed as dist
    from megatron_deepep.transport.internode import _check_same_staging
    _check_same_staging(dist.group.WORLD, "ring", 512)  # everyone agrees: no error
    with pytest.raises(ValueError, match=r"rank 0: \('ring', 512, 0\), rank 1: \('full', 0, 0\)"):
        _check_same_staging(dist.group.WORLD, *(("ring", 512) if rank == 0 else ("full", 0)))


def test_ranks_that_disagree_on_the_staging_fail_at_construction():
    from tests.helpers.distributed import run_distributed
    run_distributed(2, _disagreeing_ranks_worker)


# ---------------------------------------------------------------------------------- regions

@pytest.mark.parametrize("R, L, N, H, K, C", [(4, 2, 64, 2048, 8, 4), (16, 8, 4096, 7168, 8, 512),
                                             (6, 3, 1, 16, 1, 1), (64, 8, 4096, 7168, 16, 64),
                                             (256, 8, 4096, 7168, 8, 512)])
def test_ring_regions_are_disjoint_page_aligned_and_bounded(R, L, N, H, K, C):
    rg = InternodeRegions(R, L, N, H, K, "ring", C)
    slot = check_region_spans(rg)
    M = R // L
    assert rg.num_bytes <= (4 * M * N + 2 * L * C) * slot + (4 << 20)
    # The staging is L rings of C slots, whatever R and N_max.
    sizes = dict(rg._sizes())
    assert sizes["stage_rows"] == L * C * rg.row_stride
    assert sizes["stage_meta"] == L * C * rg.meta_stride
    assert sizes["comb_stage"] == L * C * (rg.row_stride + rg.weight_stride)
    assert sizes["ring_words"] == 4 * L * C * 8
    # The ring words are control words: zeroed at start with the counts, before the rows.
    assert rg.offsets["ring_words"] < rg.control_bytes() == rg.offsets["net_send"]
    args = rg.as_args()
    assert set(args) <= set(ops.INTERNODE_FIELDS) and args["ring_slots"] == C
    assert "ring words" in rg.formula() or "ring slots" in rg.formula()


def test_full_regions_keep_their_layout():
    """Full staging's block is what it was before ring staging existed (the GPU-verified one):
    the same regions in the same order, no ring words."""
    rg = InternodeRegions(16, 8, 512, 4096, 8)
    assert [name for name, _ in rg._sizes()] == [
        "notify_recv", "notify_send", "signals", "flags", "net_send", "net_recv", "stage_rows",
        "stage_meta", "comb_stage", "comb_send", "comb_recv"]
    assert dict(rg._sizes())["stage_rows"] == 16 * 512 * rg.row_stride
    assert "ring_slots" not in rg.as_args() and rg.formula() == "about N_max (4 M + L M + R) rows"


@pytest.mark.parametrize("nodes, full_gb, ring_gb", [(2, 2.4, 0.59), (8, 9.4, 2.0),
                                                     (32, 37.8, 7.7)])
def test_headline_sizes(nodes, full_gb, ring_gb):
    """N_max 4096, H 7168, top-8, 8 ranks per node (docs/internode.md, "Memory (per rank)")."""
    R = 8 * nodes
    full = InternodeTransport.size_hint(R, 4096, 7168, 8, 8, staging="full")
    ring = InternodeTransport.size_hint(R, 4096, 7168, 8, 8, staging="ring", ring_slots=512)
    assert round(full / GB, 1) == full_gb
    assert round(ring / GB, 2 if ring_gb < 1 else 1) == ring_gb
    # The rings themselves: 2 L C slots, independent of R and N_max.
    small = InternodeTransport.size_hint(R, 4096, 7168, 8, 8, staging="ring", ring_slots=1)
    rg = InternodeRegions(R, 8, 4096, 7168, 8, "ring", 512)
    per_pair = 2 * rg.row_stride + rg.meta_stride + rg.weight_stride + 4 * 8  # + 4 words
    assert abs((ring - small) - 8 * 511 * per_pair) <= 6 * PAGE + (2 << 20)


def test_size_hint_follows_the_knobs(monkeypatch):
    from megatron_deepep.buffer import Buffer
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING", "full")
    full = Buffer.size_hint(4096, 7168, 64, 8, transport="internode", num_ranks_per_node=8)
    assert full == InternodeRegions(64, 8, 4096, 7168, 8).num_bytes
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING", "ring")
    monkeypatch.setenv("MDEEP_INTERNODE_RING_SLOTS", "256")
    ring = Buffer.size_hint(4096, 7168, 64, 8, transport="internode", num_ranks_per_node=8)
    assert ring == InternodeRegions(64, 8, 4096, 7168, 8, "ring", 256).num_bytes
    assert ring == InternodeTransport.size_hint(64, 4096, 7168, 8, 8)
    assert ring < full / 4


def test_ring_node_plan_keeps_ring_base_when_it_grows():
    assert "ring_base" not in node_plan(5, 2, 8, 3).fields
    old = node_plan(5, 2, 8, 3, True).allocate("cpu")
    assert old.view("ring_base").shape == (3, 3)
    old.view("ring_base").copy_(torch.arange(9).view(3, 3))
    new = regrow_slots(old, node_plan(5, 2, 32, 3, True), ("fwd_slots",), "cpu")
    assert torch.equal(new.view("ring_base"), old.view("ring_base"))


# --------------------------------------------------------------------------------- kernels

@pytest.mark.parametrize("fp8", [None, "blockwise", "mxfp8"])
def test_ring_kernel_families(fp8):
    from megatron_deepep.fp8.dispatch import Fp8Dispatch
    spec = Fp8Dispatch.named(fp8) if fp8 else None
    family = ops.internode_ring_expressions(4, "int", spec)
    combine = ops.internode_ring_combine_expressions(4, 1)
    assert len(set(family)) == len(family) == 7 and len(set(combine)) == len(combine) == 6
    names = {expr.split("<")[0] for expr in family + combine}
    assert names == {"internode_node_layout", "internode_notify", "internode_dispatch_send",
                     "internode_combine_reduce"} | set(ops.INTERNODE_RING_KERNELS)
    assert "internode_ring_count<4>" in family
    assert "internode_ring_combine<4, true, false, 1>" in combine
    # The kernels shared with full staging are the same instantiations.
    full = set(ops.internode_expressions(4, "int", spec))
    assert {e for e in family if e.startswith("internode_dispatch_send")} <= full


def test_precompile_links_the_staging_the_knob_selects(monkeypatch):
    from megatron_deepep.tools.precompile import internode_families_for
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING", "full")
    monkeypatch.delenv("MDEEP_INTERNODE_NET_RING_CHUNKS", raising=False)
    full = internode_families_for([8], index_dtypes=("int64",))
    assert full == [("internode/full.cu", ops.internode_expressions(8, "long long", None)),
                    ("internode/full.cu", ops.internode_combine_expressions(8, 0))]
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING", "ring")
    ring = internode_families_for([8], index_dtypes=("int64",))
    assert ring == [("internode/ring.cu", ops.internode_ring_expressions(8, "long long", None)),
                    ("internode/ring.cu", ops.internode_ring_combine_expressions(8, 0))]
    assert internode_families_for([8], index_dtypes=("int64",), staging="full") == full
    net = [("internode/net_ring.cu", ops.internode_net_expressions(8, "long long", None)),
           ("internode/net_ring.cu", ops.internode_net_combine_expressions(8, 0))]
    monkeypatch.delenv("MDEEP_INTERNODE_STAGING")  # auto: whichever the group's shape picks
    assert internode_families_for([8], index_dtypes=("int64",)) == full + ring + net


def test_ring_timeouts_name_ring_words_rank_and_node():
    import numpy as np
    transport = InternodeTransport.__new__(InternodeTransport)
    transport.rank, transport.ranks_per_node = 5, 4
    words = np.zeros(errors.ERROR_RECORD_WORDS, dtype=np.int32)
    words[:5] = (1, 5, 6, 15, 0)  # rank 5 in ring forward, waiting for ring space at rank 6
    words[6:10] = np.array([130, 126], dtype=np.int64).view(np.int32)
    exc = errors.error_from_record(words, 3.0, transport.locate)
    assert isinstance(exc, errors.PeerTimeoutError)
    text = str(exc)
    assert "internode ring forward (waiting for ring space" in text
    assert "waited for ring word 130, saw 126" in text
    assert "rank 5 is node 1 local 1; peer 6 is node 1 local 2" in text
    words[3] = 19  # the rail acknowledgement carries an epoch
    assert "waited for epoch 130" in str(errors.error_from_record(words, 3.0, transport.locate))
    for phase in range(14, 20):
        assert phase in errors.PHASES


# ------------------------------------------------------------------------- the ring streams

def _routing(seed: int, num_ranks: int, num_tokens: int, experts_per_rank: int, topk: int):
    """Per source rank: its `topk_idx` and `compute_layout` (the layout the kernels write)."""
    g = torch.Generator().manual_seed(seed)
    num_experts = experts_per_rank * num_ranks
    out = []
    for r in range(num_ranks):
        n = int(torch.randint(0, num_tokens + 1, (1,), generator=g))
        idx = torch.rand(n, num_experts, generator=g).topk(min(topk, num_experts), 1).indices
        idx[torch.rand(idx.shape, generator=g) < 0.25] = -1
        out.append(compute_layout(idx, num_experts, num_ranks))
    return out


class _Streams:
    """What each end of every ring of node `node` derives for one call, from the layouts alone:
    the forwarder's records, its ring_base (internode_ring_count) and the positions it gives
    them, and the destination's view (prefixes of its notify counts)."""

    def __init__(self, layouts, num_nodes: int, per_node: int, node: int):
        self.M, self.L, self.node = num_nodes, per_node, node
        M, L = num_nodes, per_node
        # records[u][n]: slot_in_rank rows ([L] ints) of what source (n, u) sends node `node`.
        self.records: List[List[List[List[int]]]] = []
        for u in range(L):
            per_source = []
            for n in range(M):
                lay = layouts[n * L + u]
                cols = lay.token_slot_in_rank[:, node * L:(node + 1) * L]
                in_node = (cols >= 0).any(dim=1)
                per_source.append(cols[in_node].tolist())
            self.records.append(per_source)
        # ring_base[u][t][n]: the forwarder's prefix of its per-(t, n) counts.
        self.ring_base = [[[0] * (M + 1) for _ in range(L)] for _ in range(L)]
        for u in range(L):
            for t in range(L):
                for n in range(M):
                    count = sum(rec[t] >= 0 for rec in self.records[u][n])
                    self.ring_base[u][t][n + 1] = self.ring_base[u][t][n] + count
        # start[t][u][n]: the destination's prefix of num_recv_tokens_per_rank[(n, u)].
        self.start = [[[0] * (M + 1) for _ in range(L)] for _ in range(L)]
        for t in range(L):
            for u in range(L):
                for n in range(M):
                    sent = int(layouts[n * L + u].num_tokens_per_rank[node * L + t])
                    self.start[t][u][n + 1] = self.start[t][u][n] + sent

    def producer_positions(self, u: int, t: int) -> List[Tuple[int, Tuple[int, int]]]:
        """(position, (source node, slot on t)) of ring u -> t in record order."""
        out = []
        for n in range(self.M):
            for rec in self.records[u][n]:
                if rec[t] >= 0:
                    out.append((self.ring_base[u][t][n] + rec[t], (n, rec[t])))
        return out

    def consumer_item(self, t: int, u: int, q: int) -> Tuple[int, int]:
        """(source node, slot) the destination t expects at position q of ring u -> t."""
        start = self.start[t][u]
        n = max(m for m in range(self.M) if start[m] <= q and start[m] < start[m + 1])
        return n, q - start[n]


@pytest.mark.parametrize("nodes, per_node", [(2, 1), (2, 2), (3, 2), (2, 4), (4, 3)])
def test_both_ends_of_every_ring_agree_on_positions(nodes, per_node):
    """The forwarder's positions (ring_base + slot_in_rank) are 0 .. total-1, increasing along
    its records, and each is the (source node, slot) the destination expects there: the
    density and order the kernels rely on, on the layouts the kernels compute."""
    layouts = _routing(11 + nodes * per_node, nodes * per_node, 40, 2, 4)
    for node in range(nodes):
        streams = _Streams(layouts, nodes, per_node, node)
        for u in range(per_node):
            for t in range(per_node):
                items = streams.producer_positions(u, t)
                positions = [pos for pos, _ in items]
                assert positions == list(range(len(items)))
                assert len(items) == streams.start[t][u][nodes]
                for pos, item in items:
                    assert streams.consumer_item(t, u, pos) == item


# ---------------------------------------------------------------------- the protocol model

class _Deadlock(AssertionError):
    pass


class _Ring:
    """One ring: C slots, their ready (consumer side) and freed (producer side) words."""

    def __init__(self, slots: int):
        self.slots = slots
        self.data: List[object] = [None] * slots
        self.ready = [0] * slots
        self.freed = [0] * slots
        self.read = set()  # positions read so far

    def publish(self, word: str, pos: int) -> None:
        words = self.ready if word == "ready" else self.freed
        assert words[pos % self.slots] <= pos + 1, "a ring word went backwards"
        words[pos % self.slots] = pos + 1


class _Model:
    """The ring kernels of one node's L ranks on random schedules (see the module docstring).

    Args:
        per_node: L.
        slots: C.
        warps: warps per role group (the kernels' `per_group`).
        seed: of the scheduler.
        publish_before_wait: the rule of `ring::warp_wait_word`; False for a control.
        fused: forward and expand (combine send and sums) in one kernel each, as built; False:
            four kernels in stream order (a control).
        chunk: tokens per network chunk (the forwarder's sums go by chunk).
    """

    def __init__(self, per_node: int, slots: int, warps: int, seed: int,
                 publish_before_wait: bool = True, fused: bool = True, chunk: int = 3):
        self.L, self.C, self.P, self.chunk = per_node, slots, warps, chunk
        self.publish_before_wait, self.fused = publish_before_wait, fused
        self.rng = random.Random(seed)
        pairs = [(a, b) for a in range(per_node) for b in range(per_node)]
        self.disp = {pair: _Ring(slots) for pair in pairs}  # (forwarder u, destination t)
        self.comb = {pair: _Ring(slots) for pair in pairs}  # (expert rank t, forwarder u)
        # ring_seen: (what, this rank, the other end) -> positions of earlier calls.
        self.seen = {(what, a, b): 0 for what in ("disp_sent", "disp_recv", "comb_sent",
                                                 "comb_recv") for a, b in pairs}

    # -- warps: generators that yield a wait predicate (or None at a scheduling point)
    def _flush(self, pending: list) -> None:
        for ring, word, pos in pending:
            ring.publish(word, pos)
        pending.clear()

    def _wait(self, pending: list, ready: Callable[[], bool]):
        if not ready():
            if self.publish_before_wait:
                self._flush(pending)
            yield ready

    def _add(self, pending: list, ring: _Ring, word: str, pos: int) -> None:
        pending.append((ring, word, pos))
        if len(pending) == 32:
            self._flush(pending)

    def _produce(self, ring: _Ring, items: list, first: int):
        """A producer warp: (position in the call, payload) items in order."""
        pending = []
        for pos, payload in items:
            pos += first
            need = max(pos + 1 - ring.slots, 0)
            yield from self._wait(pending, lambda c=pos % ring.slots: ring.freed[c] >= need)
            if pos >= ring.slots:
                assert pos - ring.slots in ring.read, "a slot was overwritten before its read"
            ring.data[pos % ring.slots] = (pos, payload)
            yield None
            self._add(pending, ring, "ready", pos)
        self._flush(pending)

    def _consume(self, ring: _Ring, items: list, first: int, got: list):
        """An expanding warp: (position in the call, expected payload) items in order."""
        pending = []
        for pos, expected in items:
            pos += first
            yield from self._wait(pending, lambda c=pos % ring.slots: ring.ready[c] >= pos + 1)
            assert ring.data[pos % ring.slots] == (pos, expected), "wrong row in the slot"
            ring.read.add(pos)
            got.append(expected)
            yield None
            self._add(pending, ring, "freed", pos)
        self._flush(pending)

    def _sum(self, u: int, tokens: list, got: list):
        """A forwarder's summing warp: tokens in order, each one partial per (t, position)."""
        first = {t: self.seen[("comb_recv", u, t)] for t in range(self.L)}
        pending = []
        for token, entries in tokens:
            for t, pos, expected in entries:
                ring, pos = self.comb[(t, u)], pos + first[t]
                yield from self._wait(pending,
                                      lambda r=ring, c=pos % ring.slots: r.ready[c] >= pos + 1)
                assert ring.data[pos % ring.slots] == (pos, expected), "wrong partial"
                ring.read.add(pos)
            got.append(token)
            yield None
            for t, pos, _ in entries:
                self._add(pending, self.comb[(t, u)], "freed", pos + first[t])
        self._flush(pending)

    # -- one call's kernels
    def _strided(self, batches: List[list], num_warps: int) -> List[list]:
        """Batch b to warp b mod num_warps, each warp's batches in order."""
        out: List[list] = [[] for _ in range(num_warps)]
        for b, batch in enumerate(batches):
            out[b % num_warps].extend(batch)
        return out

    def _call(self, streams: _Streams, results: dict) -> Dict[int, List[list]]:
        """Per rank, the call's kernels in stream order, each a list of warp factories."""
        L, M, P = self.L, streams.M, self.P
        roles = {what: {r: [] for r in range(L)} for what in ("dp", "dc", "cp", "cc")}
        for u in range(L):
            # The forwarder's records in (source node, slot) order: producers take batches of
            # 32 records, keep those going to their t.
            records = [(n, rec) for n in range(M) for rec in streams.records[u][n]]
            for t in range(L):
                batches = [[(streams.ring_base[u][t][n] + rec[t], (n, rec[t]))
                            for n, rec in records[b:b + 32] if rec[t] >= 0]
                           for b in range(0, len(records), 32)]
                for part in self._strided(batches, P):
                    roles["dp"][u].append(lambda p=part, u=u, t=t: self._produce(
                        self.disp[(u, t)], p, self.seen[("disp_sent", u, t)]))
                total = streams.start[t][u][M]
                expect = [[(q, streams.consumer_item(t, u, q))] for q in range(total)]
                got = results.setdefault(("disp", u, t), [])
                for part in self._strided(expect, P):
                    roles["dc"][t].append(lambda p=part, u=u, t=t, g=got: self._consume(
                        self.disp[(u, t)], p, self.seen[("disp_recv", t, u)], g))
                # Combine ring t -> u: t's partials of the same tokens, in the same order.
                partials = [[(q, (u,) + item) for (q, item) in one] for one in expect]
                for part in self._strided(partials, P):
                    roles["cp"][t].append(lambda p=part, u=u, t=t: self._produce(
                        self.comb[(t, u)], p, self.seen[("comb_sent", t, u)]))
            # The forwarder's sums: whole chunks of one source node, strided over P L warps.
            chunks = []
            for n in range(M):
                tokens = [((n, j), [(t, streams.ring_base[u][t][n] + rec[t], (u, n, rec[t]))
                                    for t in range(L) if rec[t] >= 0])
                          for j, rec in enumerate(streams.records[u][n])]
                chunks += [tokens[c:c + self.chunk] for c in range(0, len(tokens), self.chunk)]
            got = results.setdefault(("comb", u), [])
            for part in self._strided(chunks, P * L):
                roles["cc"][u].append(lambda p=part, u=u, g=got: self._sum(u, p, g))
        if self.fused:
            return {r: [roles["dp"][r] + roles["dc"][r], roles["cp"][r] + roles["cc"][r]]
                    for r in range(L)}
        return {r: [roles[what][r] for what in ("dp", "dc", "cp", "cc")] for r in range(L)}

    def _advance(self, rank: int, done: _Streams) -> None:
        """A rank's ring_seen after its kernels of the call `done` (their last blocks)."""
        for t in range(self.L):
            self.seen[("disp_sent", rank, t)] += done.ring_base[rank][t][done.M]
            self.seen[("disp_recv", rank, t)] += done.start[rank][t][done.M]
            self.seen[("comb_sent", rank, t)] += done.start[rank][t][done.M]
            self.seen[("comb_recv", rank, t)] += done.ring_base[rank][t][done.M]

    def run(self, calls: List[_Streams], max_steps: int = 3_000_000) -> dict:
        """Every rank runs its kernels of every call in stream order, with no barrier between
        ranks (as cached dispatches allow); returns what the readers got, by ring.

        Raises:
            _Deadlock: no warp can run and some have not ended.
        """
        L, results = self.L, {}
        queue = {r: [] for r in range(L)}  # per rank: (call, last kernel of it?, factories)
        for streams in calls:
            per_rank = self._call(streams, results)
            for r in range(L):
                kernels = per_rank[r]
                queue[r] += [(streams, k == len(kernels) - 1, f) for k, f in enumerate(kernels)]
        running = {r: [] for r in range(L)}
        ending = {r: None for r in range(L)}  # the call whose last kernel runs
        for _ in range(max_steps):
            for r in range(L):  # stream order: a rank's next kernel once its last one ended
                if not running[r]:
                    if ending[r] is not None:
                        self._advance(r, ending[r])
                        ending[r] = None
                    if queue[r]:
                        streams, last, factories = queue[r].pop(0)
                        ending[r] = streams if last else None
                        running[r] = [[f(), None] for f in factories]
            live = [(r, w) for r in range(L) for w in running[r]]
            if not live:
                if not any(queue.values()):
                    return results
                continue
            runnable = [(r, w) for r, w in live if w[1] is None or w[1]()]
            if not runnable:
                raise _Deadlock(f"no warp can run ({len(live)} waiting)")
            r, w = self.rng.choice(runnable)
            try:
                w[1] = next(w[0])
            except StopIteration:
                running[r].remove(w)
        raise AssertionError("the model did not finish")


def _calls(nodes: int, per_node: int, seeds, tokens: int = 24, topk: int = 4):
    return [_Streams(_routing(seed, nodes * per_node, tokens, 2, topk), nodes, per_node, 0)
            for seed in seeds]


@pytest.mark.parametrize("nodes, per_node, slots, warps", [
    (2, 1, 1, 1), (2, 1, 2, 3), (2, 2, 1, 2), (2, 2, 3, 1), (3, 2, 2, 2), (2, 3, 4, 2),
    (2, 4, 2, 1), (3, 3, 5, 3), (2, 2, 512, 2)])
def test_ring_protocol_model_completes_and_delivers_every_row(nodes, per_node, slots, warps):
    """Three calls back to back, ranks free to run a call ahead of their node peers, rings far
    smaller than what they carry: every dispatch row reaches its destination in position order
    with the right (source node, slot), every partial reaches the forwarder's sum, no slot is
    overwritten before it is read, nothing deadlocks, on several random schedules."""
    calls = _calls(nodes, per_node, (1, 2, 3))
    for seed in range(4):
        model = _Model(per_node, slots, warps, seed)
        results = model.run(calls)
        for u in range(per_node):
            for t in range(per_node):
                want = [streams.consumer_item(t, u, q) for streams in calls
                        for q in range(streams.start[t][u][nodes])]
                assert sorted(results[("disp", u, t)]) == sorted(want)
            want_tokens = sum(len(streams.records[u][n]) for streams in calls
                              for n in range(nodes))
            assert len(results[("comb", u)]) == want_tokens
        # Every ring wrapped (C smaller than its rows) where the rows allowed it.
        if slots < 4:
            assert any(pos >= slots for ring in model.disp.values() for pos in ring.read)


def test_ring_protocol_model_deadlocks_without_publishing_before_a_wait():
    """Control: a warp that sits on its unpublished ready words while it waits for space that
    only the reader of those rows can free never finishes."""
    calls = _calls(2, 1, (5,), tokens=40)
    with pytest.raises(_Deadlock):
        _Model(1, 1, 1, 0, publish_before_wait=False).run(calls)


@pytest.mark.parametrize("per_node", [1, 2])
def test_ring_protocol_model_deadlocks_with_separate_kernels(per_node):
    """Control (docs/internode.md, "Deadlock", 1): forward and expand as separate kernels in
    stream order deadlock once a ring carries more than C rows in one call."""
    calls = _calls(2, per_node, (7,), tokens=40)
    with pytest.raises(_Deadlock):
        _Model(per_node, 2, 1, 0, fused=False).run(calls)
