"""Replicas of one logical expert act as one expert: summed gradients, logical checkpoints, moves.

An expert map (`DeepEPOptions.expert_map`, a `balance` plan) puts `S` physical slots on each of
R EP ranks; slot p (on rank p // S) holds logical expert `physical_to_logical[p]`, and a hot
expert may hold several slots (its copies). The dispatcher splits such an expert's tokens over
its copies, so each copy's backward sees only its share. This module keeps the copies one
expert:

* `sum_replica_grads`: before the optimizer step, the gradients of every copy are summed (one
  all-reduce over the EP group of only the replicated experts' rows, in fp32) and the same sum
  is written back into every copy. An all-reduce gives every rank the same bits, so copies that
  start equal and apply the same elementwise optimizer update stay bit-identical.
* `rows_for_slots`: a rank's slots from a tensor in logical order (each copy gets its expert's
  row), as a checkpoint in logical order loads under a map.
* `move_slots`: a new placement applied at a step boundary: every new slot receives the rows of
  its logical expert (weights, optimizer state) from that expert's first copy under the old map,
  in one all-to-all per dtype.
* `logical_to_physical_table` / `map_topk_to_physical`: the dispatcher's routing table.

Data layer: imports nothing of the package and no megatron-core (the dispatcher, the
re-placement and the demo build on it).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def logical_to_physical_table(physical_to_logical: Sequence[int], num_experts: int):
    """`(table [E, C] int64, copies [E] int64)`: the physical slots of each logical expert
    (padded with its first slot to the most copies C), and how many it has.

    Raises:
        ValueError: a logical expert has no slot or an id is out of range.
    """
    slots: List[List[int]] = [[] for _ in range(num_experts)]
    for p, e in enumerate(physical_to_logical):
        if not 0 <= e < num_experts:
            raise ValueError(f"expert map: physical slot {p} holds expert {e}, outside "
                             f"[0, {num_experts})")
        slots[e].append(p)
    missing = [e for e, s in enumerate(slots) if not s]
    if missing:
        raise ValueError(f"expert map: logical experts {missing[:8]} have no physical slot")
    width = max(len(s) for s in slots)
    table = torch.tensor([s + [s[0]] * (width - len(s)) for s in slots], dtype=torch.int64)
    copies = torch.tensor([len(s) for s in slots], dtype=torch.int64)
    return table, copies


def map_topk_to_physical(topk_idx: torch.Tensor, table: torch.Tensor,
                         copies: torch.Tensor) -> torch.Tensor:
    """Logical `topk_idx [T, K]` (-1: none) -> physical slots `[T, K]` int64 (no host sync).

    A replicated expert's tokens spread over its copies by token index (token t takes copy
    t mod copies), so each copy gets an even share.
    """
    valid = topk_idx >= 0
    logical = topk_idx.clamp(min=0).long()
    token = torch.arange(topk_idx.shape[0], device=topk_idx.device).unsqueeze(1)
    copy = token % copies.to(topk_idx.device)[logical]
    physical = table.to(topk_idx.device)[logical, copy]
    return torch.where(valid, physical, torch.full_like(physical, -1))


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """One EP rank's view of an expert map.

    Attributes:
        physical_to_logical: `[R * S]` the logical expert of each physical slot.
        num_ranks: R, the EP ranks.
        rank: this EP rank.
    """

    physical_to_logical: Tuple[int, ...]
    num_ranks: int
    rank: int

    def __post_init__(self):
        n = len(self.physical_to_logical)
        if self.num_ranks < 1 or n % self.num_ranks != 0:
            raise ValueError(f"expert map: {n} physical slots do not split over "
                             f"{self.num_ranks} EP ranks")
        if not 0 <= self.rank < self.num_ranks:
            raise ValueError(f"EP rank {self.rank} outside [0, {self.num_ranks})")
        logical_to_physical_table(self.physical_to_logical, self.num_experts)  # validates

    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int, rank: int) -> "ReplicaLayout":
        """The default placement: rank r owns experts `[r E/R, (r+1) E/R)`, no copies."""
        return cls(tuple(range(num_experts)), num_ranks, rank)

    @property
    def num_experts(self) -> int:
        return max(self.physical_to_logical) + 1

    @property
    def slots_per_rank(self) -> int:
        return len(self.physical_to_logical) // self.num_ranks

    @property
    def local_logical(self) -> List[int]:
        """The logical expert of each local slot, in slot order."""
        s = self.slots_per_rank
        return list(self.physical_to_logical[self.rank * s:(self.rank + 1) * s])

    def first_slot(self, expert: int) -> int:
        """The physical slot of `expert`'s first copy (the one checkpoints and moves read)."""
        return self.physical_to_logical.index(expert)

    def is_first_copy(self, local_slot: int) -> bool:
        """Whether local slot `local_slot` is its expert's first copy."""
        p = self.rank * self.slots_per_rank + local_slot
        return self.first_slot(self.physical_to_logical[p]) == p

    @property
    def replicated(self) -> List[int]:
        """Logical experts with more than one copy, ascending."""
        counts: Dict[int, int] = {}
        for e in self.physical_to_logical:
            counts[e] = counts.get(e, 0) + 1
        return sorted(e for e, c in counts.items() if c > 1)


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).float() for t in tensors])


def _write_flat(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view(t.shape))
        offset += n


class _Pending:
    """An in-flight replica sum: `wait()` finishes the all-reduce and writes the sums back."""

    def __init__(self, work, buf: torch.Tensor, writes: List[Tuple[int, Sequence[torch.Tensor]]]):
        self._work, self._buf, self._writes = work, buf, writes

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        for row, tensors in self._writes:
            _write_flat(self._buf[row], tensors)
        self._writes = []


def sum_replica_grads(layout: ReplicaLayout, slot_grads: Sequence[Sequence[torch.Tensor]],
                      group=None, async_op: bool = False) -> Optional[_Pending]:
    """Sums the gradients of every copy of each replicated expert into every copy (in place).

    One all-reduce over the EP group of a `[replicated experts, P]` fp32 buffer: each rank
    adds its copies' gradients into their expert's row (zeros elsewhere), and writes the summed
    row back into each of its copies. Experts with one copy are not touched (their gradient is
    already complete). Every rank gets the same bits from the all-reduce, so every copy gets
    the same gradient.

    Args:
        layout: the map as this rank sees it.
        slot_grads: per local slot, its gradient tensors (the same shapes for every slot;
            views are fine: the sums are written through them). Empty lists for slots whose
            gradient is absent are not allowed (a copy that received no tokens has a zero
            gradient, not none).
        group: the EP group (None: the default group).
        async_op: return a handle whose `wait()` finishes the reduction (overlap it with other
            work); else finish now and return None.

    Returns:
        The handle when `async_op`, else None (also when there is nothing to reduce).

    Raises:
        ValueError: `slot_grads` does not have one entry per local slot.
    """
    if len(slot_grads) != layout.slots_per_rank:
        raise ValueError(f"slot_grads has {len(slot_grads)} entries for "
                         f"{layout.slots_per_rank} local slots")
    replicated = layout.replicated
    if not replicated:
        return _Pending(None, torch.zeros(0), []) if async_op else None
    row_of = {e: i for i, e in enumerate(replicated)}
    local = layout.local_logical
    width = sum(t.numel() for t in slot_grads[0])
    device = slot_grads[0][0].device
    buf = torch.zeros(len(replicated), width, dtype=torch.float32, device=device)
    writes = []
    for slot, e in enumerate(local):
        if e in row_of:
            buf[row_of[e]] += _flat(slot_grads[slot])
            writes.append((row_of[e], slot_grads[slot]))
    work = None
    if layout.num_ranks > 1:
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    pending = _Pending(work, buf, writes)
    if async_op:
        return pending
    pending.wait()
    return None


def copy_first_into_copies(layout: ReplicaLayout, slot_tensors: Sequence[Sequence[torch.Tensor]],
                           group=None) -> None:
    """Makes every copy of a replicated expert hold its first copy's values (in place,
    collective; after building a model whose copies were initialized apart).

    One all-reduce over the EP group of the first copies' rows (zeros elsewhere): adding zeros
    is exact, so every copy gets the first copy's bits (in the tensors' dtype).
    """
    if len(slot_tensors) != layout.slots_per_rank:
        raise ValueError(f"slot_tensors has {len(slot_tensors)} entries for "
                         f"{layout.slots_per_rank} local slots")
    replicated = layout.replicated
    if not replicated:
        return
    row_of = {e: i for i, e in enumerate(replicated)}
    width = sum(t.numel() for t in slot_tensors[0])
    first = slot_tensors[0][0]
    buf = torch.zeros(len(replicated), width, dtype=torch.float64, device=first.device)
    writes = []
    for slot, e in enumerate(layout.local_logical):
        if e in row_of:
            if layout.is_first_copy(slot):
                buf[row_of[e]] = torch.cat([t.detach().reshape(-1).double()
                                            for t in slot_tensors[slot]])
            writes.append((row_of[e], slot_tensors[slot]))
    if layout.num_ranks > 1:
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    with torch.no_grad():
        for row, tensors in writes:
            _write_flat(buf[row], tensors)


def rows_for_slots(layout: ReplicaLayout, logical: torch.Tensor) -> torch.Tensor:
    """This rank's slots' rows `[S, ...]` from a logical-order tensor `[E, ...]` (each copy
    gets its expert's row: how a checkpoint in logical order loads under a map)."""
    if logical.shape[0] != layout.num_experts:
        raise ValueError(f"logical tensor has {logical.shape[0]} experts, the map "
                         f"{layout.num_experts}")
    index = torch.tensor(layout.local_logical, dtype=torch.long, device=logical.device)
    return logical.index_select(0, index)


def move_slots(old: ReplicaLayout, new: ReplicaLayout,
               slot_tensors: Sequence[Sequence[torch.Tensor]], group=None) -> None:
    """Applies a new placement to per-slot tensors at a step boundary (in place, collective).

    Every new slot receives the rows of its logical expert from that expert's first copy
    under `old` (weights, gradients, optimizer state alike), one `all_to_all_single` per dtype
    over the EP group.

    Args:
        old: the placement the tensors hold now.
        new: the placement to move to (same number of slots per rank and ranks).
        slot_tensors: per local slot, its tensors (same shapes and dtypes for every slot; views
            into stacked `[S, ...]` tensors are fine: rows are written through them).
        group: the EP group.

    Raises:
        ValueError: the layouts do not match in ranks, slots or experts.
    """
    if (old.num_ranks, old.slots_per_rank, old.num_experts, old.rank) != (
            new.num_ranks, new.slots_per_rank, new.num_experts, new.rank):
        raise ValueError(f"move_slots: layouts differ in (ranks, slots per rank, experts, rank): "
                         f"{(old.num_ranks, old.slots_per_rank, old.num_experts, old.rank)} vs "
                         f"{(new.num_ranks, new.slots_per_rank, new.num_experts, new.rank)}")
    if len(slot_tensors) != old.slots_per_rank:
        raise ValueError(f"slot_tensors has {len(slot_tensors)} entries for "
                         f"{old.slots_per_rank} local slots")
    s, r = old.slots_per_rank, old.num_ranks
    source = [old.first_slot(new.physical_to_logical[p]) for p in range(r * s)]
    # Rows this rank sends: to each destination rank in turn, its new slots (in order) whose
    # source slot is here. Rows it receives: its new slots, grouped by source rank.
    send_order = [(d, p) for d in range(r) for p in range(d * s, (d + 1) * s)
                  if source[p] // s == old.rank]
    send_splits = [sum(1 for d, _ in send_order if d == dst) for dst in range(r)]
    mine = range(new.rank * s, (new.rank + 1) * s)
    recv_order = sorted(mine, key=lambda p: (source[p] // s, p))
    recv_splits = [sum(1 for p in mine if source[p] // s == src) for src in range(r)]
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(slot_tensors[0]):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, columns in by_dtype.items():
        rows = [torch.cat([slot_tensors[slot][i].reshape(-1) for i in columns])
                for slot in range(s)]
        send = torch.stack([rows[source[p] - old.rank * s] for _, p in send_order]) \
            if send_order else rows[0].new_zeros(0, rows[0].numel())
        recv = send.new_empty(s, rows[0].numel())
        if r > 1:
            dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
        else:
            recv.copy_(send)
        for row, p in zip(recv, recv_order):
            _write_flat(row, [slot_tensors[p - new.rank * s][i] for i in columns])
