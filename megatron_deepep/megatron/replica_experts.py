"""Megatron's side of expert copies: build, gradient sum, grad norm, logical checkpoints.

An expert map with copies (`--moe-mdeep-expert-map` from `balance --redundant N`) gives each EP
rank `S = (E + N) / EP` physical slots. `patching` builds such a layer's experts and dispatcher
with S local experts and calls `prepare_layer` once it is built; from then on:

* the copies start equal (`replicas.copy_first_into_copies`), and the parameters of every copy
  but the first are marked `shared`, so Megatron's grad norm and zero count see each logical
  expert once (the norm is then the run without a map's, and so is clipping);
* after Megatron's data-parallel gradient reduction (`DistributedDataParallel.finish_grad_sync`,
  wrapped by `patching`), `sum_module_grads` sums the copies' `main_grad`s over the EP group
  (one all-reduce per layer, all layers in flight together) and writes the sum into every copy:
  every copy then applies the same update (the optimizers are elementwise), bit for bit;
* the distributed optimizer is served where the expert data-parallel group has one rank (its
  reduce-scatter then leaves the whole gradient on the rank); with more it is refused when the
  model is wrapped (`check_optimizer`): each rank keeps only a shard of a copy's reduced
  gradient, and the copies on different EP ranks are sharded at different offsets, so no one
  rank holds what the sum needs;
* under any map other than the contiguous one (copies or not), `SequentialMLP` and
  `TEGroupedMLP` checkpoints are written in logical order (`logical_sharded_state_dict`,
  `logical_grouped_sharded_state_dict`): the first copy of expert e is saved as global expert e
  of E, the other copies as replicas of it (not written, loaded from it), so a run with a map
  and a run without load each other's checkpoints, and a resume under a new map (a
  re-placement, `replan`) needs no conversion. The legacy `GroupedMLP` (one weight for all
  local experts) under a map refuses to save, and TEGroupedMLP with one GroupedTensor for all
  experts (`--moe-single-grouped-weight`) is refused at configuration (`options`).

Imports megatron-core only inside functions (this module is imported by `patching`).
"""

from __future__ import annotations

import logging
import re
from typing import List, Optional

import torch

from megatron_deepep.megatron import replan
from megatron_deepep.replicas import ReplicaLayout, copy_first_into_copies, sum_replica_grads

logger = logging.getLogger(__name__)

#: The experts module's attribute holding its `ReplicaLayout` (set by `prepare_layer`).
LAYOUT_ATTR = "_mdeep_replica_layout"


def slot_parameters(experts, num_slots: int) -> List[List[torch.nn.Parameter]]:
    """The parameters of each local expert slot, in slot order.

    `SequentialMLP` (one module per expert) and `TEGroupedMLP` (`weight<i>` / `bias<i>` per
    expert in its grouped linears).

    Raises:
        ValueError: another experts module (e.g. the legacy `GroupedMLP`, one weight for all
            local experts), naming it.
    """
    local = getattr(experts, "local_experts", None)
    if local is not None:
        return [list(m.parameters()) for m in local]
    fcs = [getattr(experts, n, None) for n in ("linear_fc1", "linear_fc2")]
    if all(fc is not None and hasattr(fc, "weight0") for fc in fcs):
        out = []
        for i in range(num_slots):
            params = []
            for fc in fcs:
                params += [p for p in (getattr(fc, f"weight{i}", None),
                                       getattr(fc, f"bias{i}", None)) if p is not None]
            out.append(params)
        return out
    raise ValueError(
        f"an expert map with copies (--moe-mdeep-expert-map) needs experts with one parameter "
        f"set per expert (SequentialMLP, TEGroupedMLP); {type(experts).__name__} keeps all "
        f"local experts in one tensor. Use --moe-grouped-gemm with TE, or the SequentialMLP")


def layer_layout(layer) -> Optional[ReplicaLayout]:
    """The `ReplicaLayout` of a deepep MoE layer under a map other than the contiguous
    placement (None otherwise)."""
    return getattr(getattr(layer, "experts", None), LAYOUT_ATTR, None)


def check_one_copy_per_rank(layout: ReplicaLayout, layer_number=None,
                            origin: str = "--moe-mdeep-expert-map", fix: str = "") -> None:
    """Refuses a map that puts two copies of one expert on one EP rank.

    Such copies add no balance (the rank's load is the same), and a logical checkpoint could
    not be loaded into them: dist_checkpointing refuses two shards of one tensor at one offset
    on one rank. The planners (`placement`, `replan`) never make them; a hand-written map or a
    plan file from an older version can hold them.

    Args:
        layout: the map as this rank sees it.
        layer_number: the layer, for the message.
        origin: where the map came from (`replan.map_origin`).
        fix: what to do (`replan.map_fix`).

    Raises:
        ValueError: naming the map's origin, the layer, the rank, the expert and the fix.
    """
    s = layout.slots_per_rank
    for rank in range(layout.num_ranks):
        held = layout.physical_to_logical[rank * s:(rank + 1) * s]
        twice = sorted({e for e in held if held.count(e) > 1})
        if twice:
            raise ValueError(
                f"expert map from {origin}, layer {layer_number}: EP rank {rank} holds expert "
                f"{twice[0]} more than once (slots {list(held)}); copies of an expert go on "
                f"different ranks (a second copy on one rank adds no balance, and a checkpoint "
                f"cannot be loaded into it). {fix}".rstrip())


def prepare_layer(layer) -> Optional[ReplicaLayout]:
    """Sets up a built deepep MoE layer for its expert map (see the module docstring).

    Any map other than the contiguous placement makes the experts save in logical order; a map
    with copies also makes the copies equal (collective over the EP group) and marks every
    copy but the first `shared`. Returns the layout (None: contiguous, nothing to do).
    """
    dispatcher = layer.token_dispatcher
    p2l = dispatcher.physical_to_logical
    if p2l is None or list(p2l) == list(range(dispatcher.num_experts)):
        return None
    layout = ReplicaLayout(tuple(p2l), max(dispatcher.ep_size, 1), dispatcher.ep_rank)
    options = dispatcher.options
    check_one_copy_per_rank(
        layout, dispatcher.layer_number,
        origin=replan.map_origin(options, getattr(dispatcher, "config", None)),
        fix=replan.map_fix(options, layout.num_ranks, len(p2l), dispatcher.num_experts))
    setattr(layer.experts, LAYOUT_ATTR, layout)
    layer.experts._mdeep_ep_group = dispatcher.ep_group
    if not layout.replicated:
        return layout
    slots = slot_parameters(layer.experts, layout.slots_per_rank)
    copy_first_into_copies(layout, slots, dispatcher.ep_group)
    for i, params in enumerate(slots):
        if not layout.is_first_copy(i):
            for p in params:
                p.shared = True  # Megatron's grad norm and zero count skip it
    logger.info("megatron_deepep: layer %s holds copies of experts %s (slots %s)",
                dispatcher.layer_number, layout.replicated, layout.local_logical)
    return layout


def copy_layers(module) -> list:
    """The MoE layers of `module` whose maps have copies."""
    return [m for m in module.modules()
            if layer_layout(m) is not None and layer_layout(m).replicated]


def check_optimizer(use_distributed_optimizer: bool, expert_dp_size: int) -> None:
    """Refuses the distributed optimizer over more than one expert data-parallel rank.

    Raises:
        ValueError: naming the flags and why.
    """
    if use_distributed_optimizer and expert_dp_size > 1:
        raise ValueError(
            f"--use-distributed-optimizer with an expert map that has copies "
            f"(--moe-mdeep-expert-map) and {expert_dp_size} expert data-parallel ranks: the "
            f"distributed optimizer reduce-scatters expert gradients over those ranks, so each "
            f"keeps only a shard of a copy's gradient, at offsets that differ between the EP "
            f"ranks holding the copies; the copies' gradients cannot be summed there. Drop "
            f"--use-distributed-optimizer, use a plan without copies (balance --redundant 0), "
            f"or an expert data-parallel size of 1")


def check_ddp(ddp) -> None:
    """`check_optimizer` for a Megatron `DistributedDataParallel` whose module has copies."""
    if not copy_layers(ddp.module):
        return
    group = getattr(ddp, "expt_dp_group", None)
    size = group.size() if group is not None else 1
    check_optimizer(bool(ddp.ddp_config.use_distributed_optimizer), size)


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    grad = getattr(p, "main_grad", None)
    if grad is None:
        grad = p.grad
    if grad is None:
        grad = p.grad = torch.zeros_like(p)  # a copy that saw no token: zero, not none
    return grad


def sum_module_grads(module) -> None:
    """Sums the copies' gradients of every MoE layer in `module` (after the DP reduction).

    One all-reduce per layer over its EP group, all in flight before the first wait.
    """
    pending = []
    for layer in copy_layers(module):
        layout = layer_layout(layer)
        slots = slot_parameters(layer.experts, layout.slots_per_rank)
        pending.append(sum_replica_grads(layout, [[_grad(p) for p in ps] for ps in slots],
                                         layer.experts._mdeep_ep_group, async_op=True))
    for work in pending:
        work.wait()


def refuse_checkpoint(experts) -> None:
    """Raises for an experts module without per-expert parameters saving under a map.

    Raises:
        ValueError: its checkpoint would hold the physical slots, naming the module.
    """
    if getattr(experts, LAYOUT_ATTR, None) is not None:
        raise ValueError(
            f"{type(experts).__name__} under an expert map (--moe-mdeep-expert-map): its "
            f"checkpoint would hold physical slots (experts out of logical order, copies "
            f"twice), which a run under another map or none would load into the wrong "
            f"experts. Logical checkpoints are built for SequentialMLP and TEGroupedMLP experts "
            f"(--moe-grouped-gemm with Transformer Engine), not the legacy GroupedMLP")


#: A TEGroupedMLP state-dict entry of one local expert: `...weight<i>`, `...bias<i>`,
#: `..._extra_state<i>` (expert 0's extra state has no index).
_GROUPED_ENTRY = re.compile(r"\.(weight|bias|_extra_state)(\d*)$")


def _relabel(sh, ep_axis: int, physical: int, logical: int, num_experts: int, singleton: bool,
             prefix: str) -> None:
    """Moves one sharded entry (ShardedTensor, ShardedObject or the SwiGLU
    ShardedTensorFactory) from global physical expert `physical` to logical expert `logical`."""
    if singleton:  # the expert index is in the key: `<prefix>experts.<p>.linear_fc1.weight`
        old, new = f"{prefix}experts.{physical}.", f"{prefix}experts.{logical}."
        if not sh.key.startswith(old):
            raise ValueError(f"TEGroupedMLP under an expert map: checkpoint key {sh.key} does not "
                             f"start with {old}; this megatron-core's layout is not served")
        sh.key = new + sh.key[len(old):]
        return
    build = getattr(sh, "build_fn", None)
    if build is not None:  # a factory: relabel what it builds
        def build_fn(key, data, replica_id, flattened_range):
            built = build(key, data, replica_id, flattened_range)
            parts = built.values() if isinstance(built, dict) else \
                built if isinstance(built, (list, tuple)) else [built]
            for part in parts:
                _relabel(part, ep_axis, physical, logical, num_experts, False, prefix)
            return built
        sh.build_fn = build_fn
        return
    if len(sh.global_offset) <= ep_axis or sh.global_offset[ep_axis] != physical:
        raise ValueError(f"TEGroupedMLP under an expert map: checkpoint entry {sh.key} does not "
                         f"hold expert {physical} on axis {ep_axis} ({sh.global_offset}); this "
                         f"megatron-core's layout is not served")
    sh.global_offset = (*sh.global_offset[:ep_axis], logical, *sh.global_offset[ep_axis + 1:])
    sh.global_shape = (*sh.global_shape[:ep_axis], num_experts, *sh.global_shape[ep_axis + 1:])
    if hasattr(sh, "axis_fragmentations"):
        frags = sh.axis_fragmentations
        sh.axis_fragmentations = (*frags[:ep_axis], num_experts, *frags[ep_axis + 1:])


def logical_grouped_sharded_state_dict(experts, original, prefix: str = "", sharded_offsets=(),
                                       metadata=None):
    """A `TEGroupedMLP`'s sharded state dict in logical expert order (see the module
    docstring): its own `sharded_state_dict` (physical: local gemm i is global expert
    `rank * S + i` of `R * S`), with every per-expert entry (`weight<i>`, `bias<i>`,
    `_extra_state<i>` of linear_fc1 / linear_fc2, the SwiGLU factory of a gated fc1 included)
    moved to logical expert `physical_to_logical[rank * S + i]` of E, and every copy but the
    first made a replica that is not written (loaded from the first copy's data).

    Args:
        experts: the TEGroupedMLP.
        original: its class's own `sharded_state_dict`.
        prefix, sharded_offsets, metadata: as Megatron passes them.

    Raises:
        ValueError: an entry that is not one expert's (or not where the layout puts it),
            naming it.
    """
    state = original(experts, prefix, sharded_offsets, metadata)
    layout = getattr(experts, LAYOUT_ATTR, None)
    if layout is None:
        return state
    import torch.distributed as dist

    singleton = (metadata or {}).get("singleton_local_shards", False)
    world = dist.get_world_size() if dist.is_initialized() else 1
    base = layout.rank * layout.slots_per_rank
    for key, sh in state.items():
        match = _GROUPED_ENTRY.search(key)
        local = int(match.group(2) or 0) if match else -1
        if not 0 <= local < layout.slots_per_rank:
            raise ValueError(f"TEGroupedMLP under an expert map: its checkpoint entry {key} is "
                             f"not one of its {layout.slots_per_rank} local experts' "
                             f"weight<i> / bias<i> / _extra_state<i>")
        physical = base + local
        logical = layout.physical_to_logical[physical]
        copy_index = layout.physical_to_logical[:physical].count(logical)
        _relabel(sh, len(sharded_offsets), physical, logical, layout.num_experts, singleton,
                 prefix)
        rid = sh.replica_id
        # The first copy keeps its replica id; the others are replicas that never write.
        sh.replica_id = (*rid[:2], rid[2] + copy_index * world)
    return state


def logical_sharded_state_dict(experts, original, prefix: str = "", sharded_offsets=(),
                               metadata=None):
    """A `SequentialMLP`'s sharded state dict in logical expert order (see the module docstring).

    Args:
        experts: the SequentialMLP.
        original: its class's own `sharded_state_dict` (used where it has no copies).
        prefix, sharded_offsets, metadata: as Megatron passes them.
    """
    layout = getattr(experts, LAYOUT_ATTR, None)
    if layout is None:
        return original(experts, prefix, sharded_offsets, metadata)
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding

    singleton = (metadata or {}).get("singleton_local_shards", False)
    dp_rank, dp_size = experts.dp_group.rank(), experts.dp_group.size()
    out = {}
    for local, expert in enumerate(experts.local_experts):
        e = layout.local_logical[local]
        copy_index = layout.physical_to_logical[:layout.rank * layout.slots_per_rank
                                                + local].count(e)
        local_prefix = f"{prefix}local_experts.{local}."
        if singleton:
            sharded_prefix, offsets = f"{prefix}experts.{e}.", sharded_offsets
        else:
            sharded_prefix = f"{prefix}experts."
            offsets = (*sharded_offsets, (len(sharded_offsets), e, layout.num_experts))
        state = expert.sharded_state_dict(local_prefix, offsets, metadata)
        replace_prefix_for_sharding(state, local_prefix, sharded_prefix)
        for sh in state.values():
            rid = sh.replica_id
            # The first copy is the main replica along DP rank 0; the others never write.
            sh.replica_id = (*rid[:2], dp_rank + copy_index * dp_size)
        out.update(state)
    return out
