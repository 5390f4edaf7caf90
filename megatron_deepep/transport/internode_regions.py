"""Byte layout of one rank's symmetric block for the internode transport (mirrors the
`InternodeArgs` offsets of `cuda_src/common/args.cuh` and the structs of `cuda_src/internode.cu`).

R ranks, L ranks per node, M = R / L nodes, N_max slots, H the widest row, K the largest top-k.

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
so `size_hint` reports it and `InternodeRegions.check_bound` refuses what exceeds the bound.
"""

from __future__ import annotations

import dataclasses

from megatron_deepep.transport import regions
from megatron_deepep.transport.regions import COUNT_STRIDE, PAGE, _align

MAX_RANKS_PER_NODE = 8   # kMaxRanksPerNode
MAX_NODES = 32           # kMaxNodes
NUM_NODE_FLAGS = 4 * MAX_RANKS_PER_NODE  # struct NodeFlags


@dataclasses.dataclass(frozen=True)
class InternodeRegions:
    """Offsets and strides of the symmetric block for (R, L, N_max, H, K)."""

    num_ranks: int
    ranks_per_node: int
    max_tokens: int
    hidden: int
    num_topk: int

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
        R, M, N = self.num_ranks, self.num_nodes, self.max_tokens
        net_slot = self.row_stride + self.record_stride
        comb_slot = self.row_stride + self.weight_stride
        return [("notify_recv", 2 * R * COUNT_STRIDE * 4), ("notify_send", R * COUNT_STRIDE * 4),
                ("signals", (2 * R + 4 * M) * 8), ("flags", NUM_NODE_FLAGS * 4),
                ("net_send", M * N * net_slot), ("net_recv", M * N * net_slot),
                ("stage_rows", R * N * self.row_stride), ("stage_meta", R * N * self.meta_stride),
                ("comb_stage", self.ranks_per_node * M * N * comb_slot),
                ("comb_send", M * N * comb_slot), ("comb_recv", M * N * comb_slot)]

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
        bytes, the R N_max staging rows dominating at scale."""
        name, size = self._sizes()[-1]
        return _align(self.offsets[name] + size, 2 << 20)

    def control_bytes(self) -> int:
        """Bytes before the network regions (counts, signals, flags): zeroed at start."""
        return self.offsets["net_send"]

    def as_args(self) -> dict:
        """The `InternodeArgs` fields of the layout."""
        fields = dict(self.offsets)
        fields.update(row_stride=self.row_stride, record_stride=self.record_stride,
                      meta_stride=self.meta_stride, weight_stride=self.weight_stride,
                      max_tokens=self.max_tokens)
        return fields
