"""Re-placement inside Megatron's own training: re-plan at checkpoint save, apply at resume.

Under `--moe-mdeep-replan N` (`MDEEP_REPLAN`, N extra slots in total for copies of hot experts,
0 for none):

* every deepep dispatcher adds the tokens its local slots received in training forwards into
  a device counter (`record`, no host synchronization);
* at each checkpoint save (`patching` wraps `dist_checkpointing.save`, which Megatron's
  `save_checkpoint` calls with the iteration folder on 0.16 to 0.19), after the save call,
  every rank folds its counters into per-logical-expert loads (`[E]` per layer, copies added
  back to their expert), one `all_gather_object` over the default group brings them to rank 0,
  and rank 0 writes `PLAN_FILE` into the iteration folder: per layer the
  `placement.plan_placement` plan for the current EP size with N extra slots, the loads it was
  made from, and the idle share it predicts for the placement in force and for itself (a plan
  that gains less than `MIN_GAIN` keeps the placement in force; every layer has one slot
  count, `plan_layers`). The counters then restart;
* at the next start the dispatcher takes the plan of the checkpoint it resumes from as its
  expert map (`expert_map_in_force`: `--load`'s `latest_checkpointed_iteration.txt`, or the
  folder `set_resume_dir` names), logs once what it took, and the logical checkpoint
  (`replica_experts`) loads into the new physical placement: weights and optimizer state
  follow dist_checkpointing's logical keys. An explicit `--moe-mdeep-expert-map` wins.

Why not move experts mid-run: Megatron's loop and its (distributed) optimizer own the
parameters and their state; moving them at a step boundary would reach inside the optimizer's
buffers and shards. A resume reuses dist_checkpointing's resharding, and long runs restart
regularly anyway.

Imports megatron-core only inside functions (`patching` and the dispatcher import this).
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_deepep import placement
from megatron_deepep.megatron.options import DeepEPOptions, option_origin, resolve_options

logger = logging.getLogger(__name__)

#: The plan file in a checkpoint's iteration folder.
PLAN_FILE = "mdeep_expert_plan.json"
#: Megatron's tracker file of the newest checkpoint in a `--save` / `--load` directory.
TRACKER_FILE = "latest_checkpointed_iteration.txt"
#: A new plan must lower the predicted idle share of the placement in force by this much.
MIN_GAIN = 0.01
#: The option as errors name it.
FLAG = "--moe-mdeep-replan (moe_mdeep_replan / MDEEP_REPLAN)"

_COUNTERS: Dict[int, "_Counter"] = {}  # id(dispatcher) -> its counter
_STATE: Dict[str, object] = {"resume_dir": None, "plan": None, "plan_path": None,
                             "logged": False}


class _Counter:
    """Tokens per local slot of one dispatcher since the last plan (int64, its device)."""

    def __init__(self, dispatcher, counts: torch.Tensor):
        self.dispatcher = weakref.ref(dispatcher)
        self.tokens_per_slot = torch.zeros_like(counts, dtype=torch.int64)


def record(dispatcher, tokens_per_local_slot: torch.Tensor) -> None:
    """Adds one training dispatch's tokens per local slot `[S]` (any int dtype and device; no
    host synchronization). Evaluation passes (grad off) are not counted."""
    if not torch.is_grad_enabled():
        return
    counter = _COUNTERS.get(id(dispatcher))
    if counter is None or counter.dispatcher() is not dispatcher:
        counter = _COUNTERS[id(dispatcher)] = _Counter(dispatcher, tokens_per_local_slot)
    counter.tokens_per_slot += tokens_per_local_slot.to(counter.tokens_per_slot.device,
                                                        torch.int64)


def reset() -> None:
    """Forgets the counters and the plan read at resume (tests; a new model in one process)."""
    _COUNTERS.clear()
    _STATE.update(resume_dir=None, plan=None, plan_path=None, logged=False)


def set_resume_dir(path: Optional[str]) -> None:
    """Where `expert_map_in_force` looks for the plan: a `--load`-style directory (with
    Megatron's tracker file) or one checkpoint iteration folder. Under megatron.training the
    default is its `--load`; custom loops and tests call this before building the model."""
    _STATE.update(resume_dir=path, plan=None, plan_path=None, logged=False)


def _megatron_load_dir() -> Optional[str]:
    try:
        from megatron.training.global_vars import get_args
        return getattr(get_args(), "load", None)
    except Exception:  # no megatron.training here, or its arguments are not parsed yet
        return None


def plan_path_for_resume(directory: Optional[str]) -> Optional[str]:
    """The plan file of the checkpoint a run resumes from in `directory` (None: nothing to
    resume, a fresh start).

    `directory` is an iteration folder holding `PLAN_FILE`, or a `--load` directory: its
    tracker names the iteration (`iter_0000100`, or `release`).

    Raises:
        ValueError: the resumed checkpoint has no plan (naming the option and the path).
    """
    if not directory or not os.path.isdir(directory):
        return None
    if os.path.isfile(os.path.join(directory, PLAN_FILE)):
        return os.path.join(directory, PLAN_FILE)
    tracker = os.path.join(directory, TRACKER_FILE)
    if not os.path.isfile(tracker):
        return None
    with open(tracker, encoding="utf-8") as f:
        text = f.read().strip()
    folder = "release" if text == "release" else f"iter_{int(text):07d}"
    path = os.path.join(directory, folder, PLAN_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"{FLAG}: the checkpoint this run resumes from ({os.path.join(directory, folder)}) "
            f"has no {PLAN_FILE} (saved without the option?). Give this resume its placement "
            f"with --moe-mdeep-expert-map (an explicit map wins; the contiguous one is the list "
            f"0 .. E-1), or resume from a checkpoint saved with {FLAG}")
    return path


def read_plan(path: str) -> dict:
    """A plan file as `{"layers": {layer: plan dict}, ...}` after checking it.

    Raises:
        ValueError: unreadable JSON, no layers, or a layer without a `physical_to_logical`
            list of ints or its `num_ranks` (naming the option and the file).
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{FLAG}: cannot read the plan {path}: {exc}") from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"{FLAG}: the plan {path} has no layers (expected {{\"layers\": "
                         f"{{\"<layer number>\": {{\"physical_to_logical\": [...]}}}}}})")
    for name, plan in layers.items():
        p2l = plan.get("physical_to_logical") if isinstance(plan, dict) else None
        if not isinstance(p2l, list) or not p2l or not all(isinstance(v, int) for v in p2l) \
                or not isinstance(plan.get("num_ranks"), int) or plan["num_ranks"] < 1:
            raise ValueError(f"{FLAG}: layer {name} of the plan {path} needs a "
                             f"physical_to_logical list of ints and its num_ranks")
        if sorted(set(p2l)) != list(range(max(p2l) + 1)) or len(p2l) % plan["num_ranks"]:
            raise ValueError(f"{FLAG}: layer {name} of the plan {path}: its {len(p2l)} slots "
                             f"must hold every expert 0 .. {max(p2l)} and split over its "
                             f"{plan['num_ranks']} EP ranks")
    return data


def map_origin(options: DeepEPOptions, config=None) -> str:
    """Where the expert map in force comes from, as errors name it: the option (its flag,
    config field or environment variable, and its file), or the re-plan file with its path."""
    if options.expert_map is not None:
        where = option_origin(config, "expert_map")
        if isinstance(options.expert_map, str):
            where += f" = {options.expert_map}"
        return where
    if options.replan is not None and _STATE["plan_path"]:
        return f"the re-plan file {_STATE['plan_path']} (written at checkpoint save by {FLAG})"
    return "the contiguous placement"


def map_fix(options: DeepEPOptions, num_ranks: int, num_slots: int, num_experts: int) -> str:
    """What to do about an expert map that cannot be loaded, for the map's origin."""
    extra = num_slots - num_experts
    if options.expert_map is None and options.replan is not None and _STATE["plan_path"]:
        path = _STATE["plan_path"]
        return (f"Re-plan that file with this version's planner, which puts copies on "
                f"different ranks: python -m megatron_deepep.tools.balance --loads {path} "
                f"--ranks {num_ranks} --redundant {extra} --json {path}; or give this resume "
                f"--moe-mdeep-expert-map (an explicit map wins)")
    return (f"Plan the map with python -m megatron_deepep.tools.balance --ranks {num_ranks} "
            f"--redundant {extra} (it puts copies on different ranks), or move the copy to a "
            f"rank that does not hold the expert")


def expert_map_in_force(options: DeepEPOptions, ep_size: Optional[int] = None):
    """The expert map a layer takes: the explicit `expert_map` option when given, else under
    the replan option the plan of the resumed checkpoint (None: the contiguous placement).

    Args:
        options: the resolved options.
        ep_size: the EP group size, when known: a plan made for another EP size is refused.

    Raises:
        ValueError: a missing or malformed plan, or one for another EP size (naming the option).
    """
    if options.expert_map is not None or options.replan is None:
        return options.expert_map
    if _STATE["plan_path"] is None:
        directory = _STATE["resume_dir"] or _megatron_load_dir()
        path = plan_path_for_resume(directory)
        _STATE["plan_path"] = path or ""
        _STATE["plan"] = read_plan(path) if path else None
        if path is None:
            logger.info("megatron_deepep: %s: no checkpoint to resume from in %s; contiguous "
                        "placement until the first plan", FLAG, directory)
    plan = _STATE["plan"]
    if plan is None:
        return None
    if ep_size is not None:
        ranks = {p["num_ranks"] for p in plan["layers"].values()}
        if ranks != {max(ep_size, 1)}:
            raise ValueError(
                f"{FLAG}: the plan {_STATE['plan_path']} is for {sorted(ranks)} EP ranks, this "
                f"run has --expert-model-parallel-size {ep_size}; give the placement with "
                f"--moe-mdeep-expert-map (e.g. python -m megatron_deepep.tools.balance --loads "
                f"on its loads with --ranks {ep_size})")
    if not _STATE["logged"] and (not dist.is_initialized() or dist.get_rank() == 0):
        _STATE["logged"] = True
        logger.info("megatron_deepep: expert placement from %s: %s", _STATE["plan_path"],
                    "; ".join(f"layer {k}: predicted idle share {v.get('idle_share_before', 0):.3f}"
                              f" -> {v.get('idle_share', 0):.3f}"
                              for k, v in sorted(plan["layers"].items(),
                                                 key=lambda kv: int(kv[0]))))
    return plan


# ----------------------------------------------------------------------------------------------
def _local_loads() -> Dict[str, dict]:
    """This rank's recorded loads per layer: `{layer: {loads [E], num_ranks, map}}`."""
    out: Dict[str, dict] = {}
    for key, counter in list(_COUNTERS.items()):
        d = counter.dispatcher()
        if d is None:
            del _COUNTERS[key]
            continue
        num_ranks, s = max(d.ep_size, 1), d.num_local_experts
        p2l = d.physical_to_logical or list(range(num_ranks * s))
        counts = counter.tokens_per_slot.cpu().double()
        loads = torch.zeros(d.num_experts, dtype=torch.float64)
        loads.index_add_(0, torch.tensor(p2l[d.ep_rank * s:(d.ep_rank + 1) * s]), counts)
        out[str(d.layer_number)] = {"loads": loads.tolist(), "num_ranks": num_ranks,
                                    "physical_to_logical": list(p2l)}
        counter.tokens_per_slot.zero_()
    return out


def plan_layer(loads: List[float], current: List[int], num_ranks: int,
               num_redundant: int, keep: bool = False, min_gain: float = MIN_GAIN) -> dict:
    """One layer's entry of the plan file: the planner's plan for `loads [E]`, or the
    placement in force (`current`) when the plan lowers its predicted idle share by less than
    `min_gain` or `keep` is set. `planned_idle_share` records the plan's prediction either way.

    Raises:
        ValueError: an impossible request (`placement.check_request`: extra slots not a
            non-negative multiple of the ranks, or more than `E * (R - 1)`), naming the option
            and the numbers.
    """
    try:
        placement.check_request(len(loads), num_ranks, num_redundant)
    except ValueError as exc:
        raise ValueError(f"{FLAG} {num_redundant}: {exc}") from None
    t = torch.tensor(loads, dtype=torch.float64)
    before = placement.predicted_idle_share(t, current, num_ranks) if t.sum() > 0 else 0.0
    plan = placement.plan_placement(t, num_ranks, num_redundant).to_dict()
    planned = plan["idle_share"]
    keep = keep or before - planned < min_gain  # all-zero loads: 0 - 0
    if keep:
        plan["physical_to_logical"] = list(current)
        plan["idle_share"] = before
        plan["slots_per_rank"] = len(current) // num_ranks
        plan["logical_to_physical"] = [[p for p, x in enumerate(current) if x == e]
                                       for e in range(len(loads))]
        plan["rank_load"] = _rank_loads(t, current, num_ranks)
    plan.update(loads=list(loads), idle_share_before=before, kept=keep,
                planned_idle_share=planned, previous_physical_to_logical=list(current),
                num_redundant=num_redundant)
    return plan


def _rank_loads(loads: torch.Tensor, physical_to_logical: List[int],
                num_ranks: int) -> List[float]:
    copies = [physical_to_logical.count(e) for e in range(loads.numel())]
    s = len(physical_to_logical) // num_ranks
    return [sum(loads[e].item() / copies[e] for e in physical_to_logical[r * s:(r + 1) * s])
            for r in range(num_ranks)]


def plan_layers(merged: Dict[str, dict], num_redundant: int, keep: bool = False) -> dict:
    """Every layer's entry (`plan_layer`), with one slot count for all layers.

    Megatron builds a layer's experts before it knows the layer's number, so every layer of a
    plan file must have the same slot count. When the slot count in force differs from
    `E + num_redundant` (the first plan after a fresh start, or a new N) and some layers keep
    their placement while others take a plan, the count changes only where no layer loses by
    it: then the kept layers take their plans too (each predicts no worse than the placement
    in force); otherwise the layers that took a plan re-plan within the slot count in force.

    Args:
        merged: per layer `{loads [E], num_ranks, physical_to_logical}` (the placement in force).
        num_redundant: the extra slots asked for.
        keep: every layer keeps its placement.
    """
    layers = {k: plan_layer(v["loads"], v["physical_to_logical"], v["num_ranks"],
                            num_redundant, keep=keep)
              for k, v in sorted(merged.items(), key=lambda kv: int(kv[0]))}
    if len({len(v["physical_to_logical"]) for v in layers.values()}) == 1:
        return layers
    if all(v["planned_idle_share"] <= v["idle_share_before"] for v in layers.values()):
        logger.info("megatron_deepep: %s: the slot count changes, so layers %s take their plans "
                    "although they gain less than %s", FLAG,
                    [k for k, v in layers.items() if v["kept"]], MIN_GAIN)
        return {k: plan_layer(merged[k]["loads"], merged[k]["physical_to_logical"],
                              merged[k]["num_ranks"], num_redundant, min_gain=0.0)
                if v["kept"] else v for k, v in layers.items()}
    for k, v in layers.items():
        if not v["kept"]:
            m = merged[k]
            in_force = len(m["physical_to_logical"]) - len(m["loads"])
            layers[k] = plan_layer(m["loads"], m["physical_to_logical"], m["num_ranks"],
                                   in_force)
    logger.info("megatron_deepep: %s: a layer's plan with %d extra slots predicts worse than its "
                "placement in force, so every layer keeps the slot count in force", FLAG,
                num_redundant)
    return layers


#: Megatron's distributed-optimizer checkpoint formats that save state per parameter in model
#: space (keys from the model's sharded state dict: logical under a map); the others save each
#: data-parallel rank's flat buffers, in the physical order of the run that saved them.
MODEL_SPACE_OPTIMIZER_FORMATS = ("fully_sharded_model_space", "fully_reshardable")


def physical_order_optimizer(state_dict, depth: int = 4) -> Optional[str]:
    """The distributed optimizer's checkpoint format in `state_dict` when it is not in model
    space (`param_state_sharding_type`, e.g. "dp_reshardable"), else None."""
    if not isinstance(state_dict, dict) or depth < 0:
        return None
    kind = state_dict.get("param_state_sharding_type")
    if isinstance(kind, str) and kind not in MODEL_SPACE_OPTIMIZER_FORMATS:
        return kind
    for value in state_dict.values():
        found = physical_order_optimizer(value, depth - 1)
        if found:
            return found
    return None


def _replan_slots(options: DeepEPOptions) -> Optional[int]:
    if options.replan is not None:
        return options.replan
    for counter in _COUNTERS.values():  # set through a config field only
        d = counter.dispatcher()
        if d is not None and d.options.replan is not None:
            return d.options.replan
    return None


def write_plan_after_save(checkpoint_dir: str, options: Optional[DeepEPOptions] = None,
                          physical_optimizer: Optional[str] = None) -> None:
    """Plans from the loads recorded since the last plan and writes `PLAN_FILE` into
    `checkpoint_dir` (rank 0). Collective over the default group when it is initialized.

    Args:
        checkpoint_dir: the iteration folder just saved.
        options: the options (default: the registered ones).
        physical_optimizer: the optimizer checkpoint's format when it is saved in physical
            order (`physical_order_optimizer`): every layer then keeps the placement in force,
            since that state would not follow a new placement.
    """
    num_redundant = _replan_slots(options if options is not None else resolve_options(None))
    if num_redundant is None:
        return
    mine = _local_loads()
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts: List[Optional[dict]] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    else:
        parts = [mine]
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    merged: Dict[str, dict] = {}
    for part in parts:
        for layer, entry in (part or {}).items():
            if layer in merged:
                merged[layer]["loads"] = [a + b for a, b in zip(merged[layer]["loads"],
                                                                entry["loads"])]
            else:
                merged[layer] = dict(entry)
    if not merged:
        logger.warning("megatron_deepep: %s: no deepep layer recorded loads; %s not written",
                       FLAG, os.path.join(checkpoint_dir, PLAN_FILE))
        return
    if physical_optimizer:
        logger.warning(
            "megatron_deepep: %s: the optimizer state is saved in physical order "
            "(distrib_optim_sharding_type %s), so the plan keeps the placement in force; save "
            "it in model space (--dist-ckpt-optim-fully-reshardable) for re-placement",
            FLAG, physical_optimizer)
    layers = plan_layers(merged, num_redundant, keep=bool(physical_optimizer))
    path = os.path.join(checkpoint_dir, PLAN_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"format": 1, "num_redundant": num_redundant, "layers": layers}, f)
    os.replace(path + ".tmp", path)
    logger.info("megatron_deepep: wrote %s: %s", path, "; ".join(
        f"layer {k}: predicted idle share {v['idle_share_before']:.3f} -> {v['idle_share']:.3f}"
        f"{' (kept)' if v['kept'] else ''}" for k, v in layers.items()))
