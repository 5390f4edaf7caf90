"""Re-placement during training: re-plan from recorded loads every K steps, apply at a step end.

`Rebalancer` keeps the per-logical-expert token counts of the steps since the last plan (the
same numbers on every EP rank: they come from an all-reduce), and every `interval` steps asks
`balance.plan_placement` for a placement with `num_redundant` extra slots. A plan is taken when
it lowers the predicted worst-rank idle share of the current placement on the same loads by at
least `min_gain`. `apply_placement` then moves every slot's weights and optimizer state to the
new placement (`replicas.move_slots`, one all-to-all per dtype) and switches the
dispatchers' physical-to-logical tables, so the next step routes by the new map. The model does
not change: the copies of a logical expert hold the same bits (`replicas.sum_replica_grads`),
a move copies rows exactly, and checkpoints are kept in logical order.

Every rank computes the same plan (the planner is deterministic and its input is identical),
so no plan is broadcast.
"""

from __future__ import annotations

import logging
from typing import Iterable, List, Optional, Sequence

import torch

from megatron_deepep.placement import predicted_idle_share  # noqa: F401 (re-exported)
from megatron_deepep.tools import balance
from megatron_deepep.replicas import ReplicaLayout, move_slots

logger = logging.getLogger(__name__)


class Rebalancer:
    """Decides when and where to re-place one MoE layer's experts.

    Args:
        num_experts: E, the logical experts.
        num_ranks: R, the EP ranks.
        interval: re-plan every this many recorded steps (>= 1).
        num_redundant: extra slots in total for copies of hot experts (a multiple of R; the
            model's slots per rank are `(E + num_redundant) / R`).
        min_gain: take a plan only when it lowers the predicted idle share of the current
            placement (on the same loads) by at least this much.
        ranks_per_node: balance node loads too (see `balance.plan_placement`).
    """

    def __init__(self, num_experts: int, num_ranks: int, *, interval: int, num_redundant: int = 0,
                 min_gain: float = 0.01, ranks_per_node: Optional[int] = None):
        if interval < 1:
            raise ValueError(f"rebalance interval must be >= 1 step, got {interval}")
        balance.check_request(num_experts, num_ranks, num_redundant, ranks_per_node)
        self.num_experts, self.num_ranks = num_experts, num_ranks
        self.interval, self.num_redundant = interval, num_redundant
        self.min_gain, self.ranks_per_node = min_gain, ranks_per_node
        self._history: List[List[float]] = []

    @property
    def slots_per_rank(self) -> int:
        return (self.num_experts + self.num_redundant) // self.num_ranks

    def initial_map(self) -> List[int]:
        """The placement before any plan: contiguous, each rank's extra slots holding copies
        of the experts that follow its own (the next ranks', wrapping around): one copy of an
        expert per rank, as every placement needs for a checkpoint to load into it."""
        num_experts, num_ranks = self.num_experts, self.num_ranks
        e_local, extra = num_experts // num_ranks, self.num_redundant // num_ranks
        out: List[int] = []
        for r in range(num_ranks):
            own = list(range(r * e_local, (r + 1) * e_local))
            following = [(own[-1] + 1 + i) % num_experts for i in range(extra)]
            out += sorted(own + following)
        return out

    def record(self, tokens_per_logical_expert: Sequence[float]) -> None:
        """Adds one step's tokens per logical expert `[E]` (identical on every rank)."""
        if len(tokens_per_logical_expert) != self.num_experts:
            raise ValueError(f"{len(tokens_per_logical_expert)} counts for "
                             f"{self.num_experts} experts")
        self._history.append([float(v) for v in tokens_per_logical_expert])

    def maybe_plan(self, current: Sequence[int]) -> Optional[balance.Plan]:
        """A new plan when `interval` steps were recorded and it pays (else None).

        Args:
            current: the `physical_to_logical` in force.

        Returns:
            The plan to apply at this step's end, or None. The recorded steps are dropped
            either way once `interval` of them were seen.
        """
        if len(self._history) < self.interval:
            return None
        loads = balance.average_loads(self._history)
        self._history = []
        plan = balance.plan_placement(loads, self.num_ranks, self.num_redundant,
                                      self.ranks_per_node)
        now = predicted_idle_share(loads, current, self.num_ranks)
        if plan.physical_to_logical == list(current) or now - plan.idle_share < self.min_gain:
            logger.info("rebalance: kept the placement (predicted idle share %.4f, plan %.4f)",
                        now, plan.idle_share)
            return None
        logger.info("rebalance: new placement, predicted idle share %.4f -> %.4f", now,
                    plan.idle_share)
        return plan


def apply_placement(current: ReplicaLayout, physical_to_logical: Sequence[int],
                    slot_tensors: Sequence[Sequence[torch.Tensor]], group=None,
                    dispatchers: Iterable = ()) -> ReplicaLayout:
    """Moves weights and optimizer state to a new placement at a step boundary (collective).

    Args:
        current: the placement the tensors hold now.
        physical_to_logical: the new placement (same slots per rank).
        slot_tensors: per local slot, every tensor that follows the expert: parameters, their
            gradients if kept, optimizer state (views are written through).
        group: the EP group.
        dispatchers: `DeepEPTokenDispatcher`s (or anything with `set_physical_to_logical`) of
            the layer: their routing tables switch to the new map.

    Returns:
        The new layout.
    """
    new = ReplicaLayout(tuple(physical_to_logical), current.num_ranks, current.rank)
    move_slots(current, new, slot_tensors, group)
    for d in dispatchers:
        d.set_physical_to_logical(list(physical_to_logical))
    return new
