"""Byte layout of one rank's symmetric block for the internode transport (mirrors the
`InternodeArgs` offsets of `cuda_src/common/args.cuh` and the structs of `cuda_src/internode/`).

R ranks, L ranks per node, M = R / L nodes, N_max slots, H the widest row, K the largest top-k.
Full staging (`MDEEP_INTERNODE_STAGING=full`; `auto`, the default, picks it while it fits
`MDEEP_INTERNODE_STAGING_MAX_GB`, see `choose_staging`):

    notify receive   [2][R] count rows (header + per-expert counts; two halves by epoch parity)
    notify send      [R] count rows (the source of the puts)
    signals          u64: notify [2][R], then per node: dispatch data, dispatch ack, combine
                     data, combine ack
    flags            u32 [4][8]: epoch flags written by node peers (NodeFlags)
    network send     [M][N_max] slots: a row and its record (remote nodes' chunks are put from here)
    network receive  [M][N_max] slots: what the rail peer of each node sent
    staging rows     [R][N_max] rows: what forwarders of this node wrote, by source rank
    staging metadata [R][N_max] SlotMeta records
    combine staging  [L][M][N_max] partial rows + K weights: written by this node's ranks
    combine send     [M][N_max] summed rows + weights to put back to each node's rail peer
    combine receive  [M][N_max] summed rows + weights from each node

The staging regions are the first version's fixed regions: `num_bytes` grows as R * N_max rows,
so `size_hint` reports it and the transport refuses what exceeds the heap.

Ring staging (`MDEEP_INTERNODE_STAGING=ring`, C = `MDEEP_INTERNODE_RING_SLOTS`; docs/internode.md,
"Ring staging"): the same regions, except

    ring words       u64 [4][L][C]: dispatch ready, dispatch freed, combine ready, combine freed
                     (zeroed at start with the counts; positions never repeat, so never again)
    staging rows     [L][C] rows: the ring from each forwarder of this node
    staging metadata [L][C] SlotMeta records
    combine staging  [L][C] partial rows + K weights: the ring from each rank of this node

so the block is about 4 M N_max + 2 L C slots, independent of R for the staging.

The network ring (`MDEEP_INTERNODE_NET_RING_CHUNKS` = K > 0, ring staging only; docs/internode.md,
"Network ring") bounds the four network regions too: ring staging's regions, except

    net words        u64 [4][M][K]: dispatch ready, dispatch credit, combine ready, combine credit
                     per rail peer's node and chunk slot (zeroed at start; chunk numbers never
                     repeat)
    net counters     u32 [2][M][K]: consumers done with each received chunk (local)
    rail counts      u64 signals [2][M], int [2][M][8] received, int [M][8] sent: each source's
                     tokens per rank of its rail peer's node (the forwarder's ring positions)
    network send     [M][K][32] slots (and receive, combine send, combine receive alike)

so the block is about 4 M K 32 + 2 L C slots, independent of N_max.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from megatron_deepep import knobs
from megatron_deepep.transport import regions
from megatron_deepep.transport.regions import COUNT_STRIDE, PAGE, _align

MAX_RANKS_PER_NODE = 8   # kMaxRanksPerNode
MAX_NODES = 32           # kMaxNodes
NUM_NODE_FLAGS = 4 * MAX_RANKS_PER_NODE  # struct NodeFlags
STAGING_MODES = ("auto", "full", "ring")
AUTO_NET_CHUNKS = 8       # the network ring's K when `auto` needs it and the knob says 0
MAX_RING_SLOTS = 1 << 20  # beyond any N_max x nodes a ring could need per call
RING_WORDS = 4            # ready and freed words, for dispatch and for combine
CHUNK_TOKENS = 32         # network slots per chunk (InternodeArgs.chunk_tokens)
MAX_NET_CHUNKS = 4096     # 131072 tokens per rail peer: beyond any N_max
NET_WORDS = 4             # ready and credit words, for dispatch and for combine
RAIL_COUNTS_BYTES = 2 * 8 + (2 + 1) * MAX_RANKS_PER_NODE * 4  # per node: struct RailCounts


def staging_config(staging: Optional[str] = None,
                   ring_slots: Optional[int] = None) -> Tuple[str, int]:
    """The internode staging mode and ring slots: the arguments, else the knobs
    `MDEEP_INTERNODE_STAGING` and `MDEEP_INTERNODE_RING_SLOTS` (`choose_staging` resolves
    "auto" for a shape).

    Returns:
        `(staging, ring_slots)`: "full" with 0 slots, or "ring" or "auto" with C >= 1 (the
        slots "auto" uses where it picks ring staging).

    Raises:
        ValueError: an unknown mode or a slot count outside [1, 2**20] (the message names the
            knob).
    """
    mode = staging if staging is not None else knobs.get("INTERNODE_STAGING")
    if mode not in STAGING_MODES:
        raise ValueError(f"staging / {knobs.PREFIX}INTERNODE_STAGING={mode!r}: choose one of "
                         f"{', '.join(STAGING_MODES)}")
    if mode == "full":
        return mode, 0
    slots = ring_slots if ring_slots is not None else knobs.get("INTERNODE_RING_SLOTS")
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_RING_SLOTS:
        raise ValueError(f"ring_slots / {knobs.PREFIX}INTERNODE_RING_SLOTS={slots!r}: expected an "
                         f"integer in [1, {MAX_RING_SLOTS}] (slots per ring)")
    return mode, slots


def net_ring_config(staging: str, net_chunks: Optional[int] = None) -> int:
    """The network ring's chunks per rail peer K: the argument, else the knob
    `MDEEP_INTERNODE_NET_RING_CHUNKS`; 0 is off.

    Args:
        staging: the staging mode (`staging_config`); K > 0 needs "ring" (or "auto", which
            then picks it): the network ring feeds the node's rings as its chunks land, which
            full staging's forward kernel, waiting for all of a call's rows, cannot.

    Raises:
        ValueError: K outside [0, 4096], or K > 0 with full staging (the message names the
            knobs).
    """
    chunks = net_chunks if net_chunks is not None else knobs.get("INTERNODE_NET_RING_CHUNKS")
    if (isinstance(chunks, bool) or not isinstance(chunks, int)
            or not 0 <= chunks <= MAX_NET_CHUNKS):
        raise ValueError(f"net_chunks / {knobs.PREFIX}INTERNODE_NET_RING_CHUNKS={chunks!r}: "
                         f"expected an integer in [0, {MAX_NET_CHUNKS}] (chunks of "
                         f"{CHUNK_TOKENS} tokens per rail peer; 0: off)")
    if chunks > 0 and staging == "full":
        raise ValueError(f"{knobs.PREFIX}INTERNODE_NET_RING_CHUNKS={chunks} needs "
                         f"{knobs.PREFIX}INTERNODE_STAGING=ring (got {staging!r}): the network "
                         "ring streams into the node's rings")
    return chunks


def choose_staging(num_ranks: int, ranks_per_node: int, max_tokens: int, hidden: int,
                   num_topk: int, staging: Optional[str] = None,
                   ring_slots: Optional[int] = None,
                   net_chunks: Optional[int] = None) -> Tuple[str, int, int]:
    """The staging a transport of this shape runs: the arguments, else the knobs, with "auto"
    resolved by memory. "auto" takes the first of full staging, ring staging and ring staging
    with the network ring (K = `MDEEP_INTERNODE_NET_RING_CHUNKS`, else 8) whose symmetric block
    fits `MDEEP_INTERNODE_STAGING_MAX_GB`, else the smallest; with K > 0 set it takes the
    network ring. Every rank computes the same from the same shape.

    Returns:
        `(staging, ring_slots, net_chunks)` as `InternodeRegions` takes them.

    Raises:
        ValueError: as `staging_config` and `net_ring_config`, or a budget that is not a
            positive number (the message names the knob).
    """
    mode, slots = staging_config(staging, ring_slots)
    chunks = net_ring_config(mode, net_chunks)
    if mode != "auto":
        return mode, slots, chunks
    if chunks > 0:
        return "ring", slots, chunks
    budget = knobs.get("INTERNODE_STAGING_MAX_GB")
    if not budget > 0:
        raise ValueError(f"{knobs.PREFIX}INTERNODE_STAGING_MAX_GB={budget!r}: expected a "
                         "positive number of GB (1e9 bytes)")
    choices = [("full", 0, 0), ("ring", slots, 0), ("ring", slots, AUTO_NET_CHUNKS)]
    sizes = []
    for choice in choices:
        sizes.append(InternodeRegions(num_ranks, ranks_per_node, max_tokens, hidden, num_topk,
                                      *choice).num_bytes)
        if sizes[-1] <= budget * 1e9:
            return choice
    return choices[sizes.index(min(sizes))]


def describe_staging(staging: str, ring_slots: int, net_chunks: int) -> str:
    """The staging as logs and reports name it, e.g. "full" or "ring (512 slots) with the
    network ring (8 chunks per rail peer)" (arguments as `staging_config` and
    `net_ring_config` return them)."""
    if staging != "ring":
        return staging
    ring = f"ring ({ring_slots} slots)"
    if net_chunks > 0:
        return f"{ring} with the network ring ({net_chunks} chunks per rail peer)"
    return ring


@dataclasses.dataclass(frozen=True)
class InternodeRegions:
    """Offsets and strides of the symmetric block for (R, L, N_max, H, K), full or ring staging
    (`ring_slots` C > 0 exactly for "ring"), with ring staging optionally the network ring
    (`net_chunks` > 0 chunks per rail peer)."""

    num_ranks: int
    ranks_per_node: int
    max_tokens: int
    hidden: int
    num_topk: int
    staging: str = "full"
    ring_slots: int = 0
    net_chunks: int = 0

    def __post_init__(self):
        if self.staging == "auto":
            raise ValueError("InternodeRegions takes a resolved staging (choose_staging), not "
                             "'auto'")
        if (self.staging, self.ring_slots) != staging_config(self.staging, self.ring_slots):
            raise ValueError(f"staging={self.staging!r} takes ring_slots=0, got "
                             f"{self.ring_slots}")
        net_ring_config(self.staging, self.net_chunks)

    @property
    def is_ring(self) -> bool:
        return self.staging == "ring"

    @property
    def is_net(self) -> bool:
        """The network ring is on."""
        return self.net_chunks > 0

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    @property
    def row_stride(self) -> int:
        return regions.row_stride(self.hidden)

    @property
    def record_stride(self) -> int:
        """NetRecord: token, slot per node rank (8), then K ids, positions and weights."""
        return _align(4 * (1 + MAX_RANKS_PER_NODE + 3 * self.num_topk), 16)

    @property
    def meta_stride(self) -> int:
        return regions.meta_stride(self.num_topk)

    @property
    def weight_stride(self) -> int:
        return regions.weight_stride(self.num_topk)

    def _sizes(self):
        """(region, bytes) in block order: the control words first (zeroed at start), then the
        network regions and the node's staging, each as large as the staging makes it."""
        R, L, M = self.num_ranks, self.ranks_per_node, self.num_nodes
        N, C, K = self.max_tokens, self.ring_slots, self.net_chunks
        net_slot = self.row_stride + self.record_stride
        comb_slot = self.row_stride + self.weight_stride
        per_node = K * CHUNK_TOKENS if self.is_net else N  # slots per node, network regions
        stage = L * C if self.is_ring else R * N             # NVLink staging slots
        comb_stage = L * C if self.is_ring else L * M * N     # combine staging slots
        sizes = [("notify_recv", 2 * R * COUNT_STRIDE * 4), ("notify_send", R * COUNT_STRIDE * 4),
                 ("signals", (2 * R + 4 * M) * 8), ("flags", NUM_NODE_FLAGS * 4)]
        if self.is_ring:
            sizes.append(("ring_words", RING_WORDS * L * C * 8))
        if self.is_net:
            sizes += [("net_words", NET_WORDS * M * K * 8), ("net_counters", 2 * M * K * 4),
                      ("rail_counts", M * RAIL_COUNTS_BYTES)]
        return sizes + [
            ("net_send", M * per_node * net_slot), ("net_recv", M * per_node * net_slot),
            ("stage_rows", stage * self.row_stride), ("stage_meta", stage * self.meta_stride),
            ("comb_stage", comb_stage * comb_slot),
            ("comb_send", M * per_node * comb_slot), ("comb_recv", M * per_node * comb_slot)]

    @property
    def offsets(self) -> dict:
        """Region name -> byte offset (each region page-aligned)."""
        out, at = {}, 0
        for name, size in self._sizes():
            out[name] = at
            at = _align(at + size, PAGE)
        return out

    @property
    def num_bytes(self) -> int:
        """The whole block, rounded to 2 MiB: about N_max (4 M + L M + R) (2 H + 16 K)
        bytes with full staging, the R N_max staging rows dominating at scale; about
        (4 M N_max + 2 L C) (2 H + 16 K) with ring staging; about (4 M K 32 + 2 L C)
        (2 H + 16 K) with the network ring."""
        name, size = self._sizes()[-1]
        return _align(self.offsets[name] + size, 2 << 20)

    def formula(self) -> str:
        """The block's size formula in words, for messages."""
        if self.is_net:
            return (f"about (4 M K {CHUNK_TOKENS} + 2 L C) rows, K = {self.net_chunks} network "
                    f"chunks per rail peer, C = {self.ring_slots} ring slots (ring staging with "
                    "the network ring)")
        if self.is_ring:
            return (f"about (4 M N_max + 2 L C) rows, C = {self.ring_slots} ring slots "
                    "(ring staging)")
        return "about N_max (4 M + L M + R) rows"

    def control_bytes(self) -> int:
        """Bytes before the network regions (counts, signals, flags, ring words, the network
        ring's words, counters and rail counts): zeroed at start."""
        return self.offsets["net_send"]

    def as_args(self) -> dict:
        """The `InternodeArgs` fields of the layout."""
        fields = dict(self.offsets)
        fields.update(row_stride=self.row_stride, record_stride=self.record_stride,
                      meta_stride=self.meta_stride, weight_stride=self.weight_stride,
                      max_tokens=self.max_tokens)
        if self.is_ring:
            fields["ring_slots"] = self.ring_slots
        if self.is_net:
            fields["net_chunks"] = self.net_chunks
        return fields
