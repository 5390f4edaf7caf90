"""Every change `register_deepep_dispatcher` makes to megatron-core, and their undo.

The only module of the package that assigns attributes on Megatron's modules, classes and
objects (a CPU test checks it). Every assignment goes through `patch`, `patch_item` or `rebind`,
which record the original, so `undo_all()` (`unregister_deepep_dispatcher`) restores every one
of them, in reverse order.

What `install()` changes (megatron-core 0.16.x to 0.19.x):

* `TransformerConfig.moe_token_dispatcher_type`: its `Literal` gains "deepep" (megatron.training
  0.16+ derives the `--moe-token-dispatcher-type` choices from it), and `__post_init__` runs
  `options.check_config` and then validates a deepep config with the rules of "alltoall" (which
  allow shared-expert overlap, the EP A2A overlap and router padding);
* `MoELayer.__init__` builds a `DeepEPTokenDispatcher` for it (under an expert map with copies
  it builds S = slots per rank local experts and dispatcher slots), and `MoELayer.__init__` /
  `set_layer_number` prepare the layer's copies (`replica_experts.prepare_layer`);
* `DistributedDataParallel.__init__` refuses the distributed optimizer where copies cannot be
  served, and `finish_grad_sync` sums the copies' gradients after its own reduction;
  `SequentialMLP.sharded_state_dict` and `TEGroupedMLP.sharded_state_dict` save experts in
  logical order under a map, and the legacy `GroupedMLP` refuses to save under a map
  (`replica_experts`);
* `should_free_input` (the A2A-overlap memory policy: `models/common/utils.py` on 0.17+,
  `models/gpt/fine_grained_callables.py` on 0.16) keeps the dispatched rows alive (the experts
  save them: our dispatch postprocess is an identity); where none is found,
  `--overlap-moe-expert-parallel-comm` is refused for deepep;
* `skip_routed_expert_padding` (where it exists): experts do not pad again when
  `moe_router_padding_for_quantization` is set (the kernel pads each expert's rows);
* Megatron's step-end MoE report (`moe_utils.track_moe_metrics`,
  `MoEMetricsTracker.report`) first flushes `megatron_deepep.megatron.metrics`;
* `dist_checkpointing.save` then writes the expert plan of `--moe-mdeep-replan` into the
  checkpoint's folder (`replan`), and the expert map in force at build time (`MoELayer`'s slot
  count, the dispatcher's table) is the resumed checkpoint's plan where no explicit map is given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import sys
import typing
from typing import Dict, List

from megatron_deepep.megatron import metrics, replan, replica_experts
from megatron_deepep.megatron.dispatcher import DeepEPTokenDispatcher
from megatron_deepep.megatron.options import (
    DISPATCHER_TYPE,
    check_config,
    physical_slot_count,
    resolve_options,
)

logger = logging.getLogger(__name__)

# Type whose validation rules a deepep config borrows inside TransformerConfig.__post_init__.
_VALIDATE_AS = "alltoall"
# Branch of MoELayer.__init__'s if/elif chain that we route to our class while it runs.
_BUILD_AS = "allgather"
_BUILD_AS_CLASS = "MoEAllGatherTokenDispatcher"

_MARK = "_megatron_deepep_wrapped"
_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Patch:
    """One recorded replacement: `owner.name` (or `owner[name]` when `item`) was `original`.

    `original` is `_MISSING` when the attribute was not in the owner's own `__dict__` (a class
    attribute inherited from a base): the undo then deletes it again.
    """

    owner: object
    name: str
    original: object
    item: bool = False


_APPLIED: List[Patch] = []
# `should_free_input`: the modules whose policy was extended (empty: the overlap is refused).
_STATE: Dict[str, object] = {"should_free_input": []}


def patch(owner, name: str, new) -> None:
    """`setattr(owner, name, new)`, recorded for `undo_all`."""
    if isinstance(owner, type) and name not in owner.__dict__:
        original = _MISSING
    else:
        original = getattr(owner, name)
    _APPLIED.append(Patch(owner, name, original))
    setattr(owner, name, new)


def patch_item(mapping: dict, key: str, new) -> None:
    """`mapping[key] = new`, recorded for `undo_all`."""
    _APPLIED.append(Patch(mapping, key, mapping.get(key, _MISSING), item=True))
    mapping[key] = new


def rebind(old, new) -> None:
    """Points every loaded module's global bound to `old` at `new`, recorded for `undo_all`.

    A function replaced on its defining module must also be replaced where it was imported by
    name (`from x import f`), or those callers keep the original.
    """
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for attr, value in list(namespace.items()):
            if value is old:
                try:
                    patch(module, attr, new)
                except (AttributeError, TypeError):
                    _APPLIED.pop()


def undo_all() -> None:
    """Restores every recorded patch, newest first."""
    while _APPLIED:
        record = _APPLIED.pop()
        if record.item:
            if record.original is _MISSING:
                record.owner.pop(record.name, None)
            else:
                record.owner[record.name] = record.original
        elif record.original is _MISSING:
            delattr(record.owner, record.name)
        else:
            setattr(record.owner, record.name, record.original)
    _STATE["should_free_input"] = []


@contextlib.contextmanager
def _temporarily(owner, name: str, value):
    """`owner.name = value` for the duration of the block (single-threaded init code)."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


@contextlib.contextmanager
def _dispatcher_type_as(config, alias: str):
    """Temporarily shows `alias` as the config's dispatcher type (single-threaded init code)."""
    object.__setattr__(config, "moe_token_dispatcher_type", alias)
    try:
        yield
    finally:
        object.__setattr__(config, "moe_token_dispatcher_type", DISPATCHER_TYPE)


# Megatron 0.19+ allows it for the flex backends hybridep/ncclep only; deepep reads it itself
# (sync-free dispatch), so "alltoall"'s rules must not see it.
_RANK_CAPACITY = "moe_expert_rank_capacity_factor"


@contextlib.contextmanager
def _hidden_field(config, name: str):
    """Temporarily shows the config field `name` as None (absent fields are left alone)."""
    if not hasattr(config, name):
        yield
        return
    saved = getattr(config, name)
    object.__setattr__(config, name, None)
    try:
        yield
    finally:
        object.__setattr__(config, name, saved)


def is_deepep(config) -> bool:
    return getattr(config, "moe_token_dispatcher_type", None) == DISPATCHER_TYPE


# ----------------------------------------------------------------------------------------------
def _patch_config() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    field = TransformerConfig.__dataclass_fields__["moe_token_dispatcher_type"]
    choices = typing.get_args(field.type) if typing.get_origin(field.type) is typing.Literal \
        else ()
    if DISPATCHER_TYPE not in choices:
        new_type = typing.Literal[tuple(choices) + (DISPATCHER_TYPE,)] if choices else str
        patch(field, "type", new_type)
        annotations = TransformerConfig.__dict__.get("__annotations__", {})
        if "moe_token_dispatcher_type" in annotations:
            patch_item(annotations, "moe_token_dispatcher_type", new_type)

    original = TransformerConfig.__post_init__

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        if not is_deepep(self):
            return original(self, *args, **kwargs)
        check_config(self, validated_as=_VALIDATE_AS)
        if getattr(self, "overlap_moe_expert_parallel_comm", False) \
                and not _STATE["should_free_input"]:
            raise ValueError(
                "--overlap-moe-expert-parallel-comm with --moe-token-dispatcher-type deepep: "
                "this Megatron has no should_free_input the plugin could extend, so the overlap "
                "would free rows the experts still need; use the patches/ for it")
        with _dispatcher_type_as(self, _VALIDATE_AS), _hidden_field(self, _RANK_CAPACITY):
            return original(self, *args, **kwargs)

    setattr(__post_init__, _MARK, True)
    patch(TransformerConfig, "__post_init__", __post_init__)


def _slots_per_rank(config, args, kwargs) -> "int | None":
    """The local experts a MoELayer of `config` gets under an expert map with copies (None:
    no map, or a map without copies: Megatron's E / EP)."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    options = resolve_options(config)
    if options.expert_map is None and options.replan is None:
        return None
    pg = kwargs.get("pg_collection", args[2] if len(args) > 2 else None)
    pg = pg if pg is not None else get_default_pg_collection()
    ep_size = pg.ep.size() if pg.ep is not None else 1
    count = physical_slot_count(replan.expert_map_in_force(options, ep_size))
    if count is None or count == config.num_moe_experts:
        return None
    if count % ep_size:
        raise ValueError(f"--moe-mdeep-expert-map has {count} physical slots, not a multiple of "
                         f"--expert-model-parallel-size {ep_size}")
    return count // ep_size


def _patch_moe_layer() -> None:
    from megatron.core.transformer.moe import moe_layer

    original = moe_layer.MoELayer.__init__
    slots_box = [None]

    def build_dispatcher(num_local_experts, local_expert_indices, config=None,
                         pg_collection=None, **kwargs):
        if kwargs:
            raise TypeError(f"deepep dispatcher: unexpected arguments {sorted(kwargs)} (Megatron "
                            f"before 0.15 passes model_comm_pgs: use the patches/ for it)")
        slots = slots_box[0]
        if slots is not None:  # an expert map with copies: S physical slots per rank
            first = local_expert_indices[0] // num_local_experts * slots
            num_local_experts, local_expert_indices = slots, list(range(first, first + slots))
        return DeepEPTokenDispatcher(num_local_experts, local_expert_indices, config=config,
                                     pg_collection=pg_collection)

    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        if not is_deepep(config):
            return original(self, config, *args, **kwargs)
        slots_box[0] = _slots_per_rank(config, args, kwargs)
        submodules = kwargs.get("submodules", args[0] if args else None)
        experts_spec = getattr(submodules, "experts", None)
        # The experts get S local experts too: before 0.19 MoELayer builds them through
        # moe_layer.build_module(spec, num_local_experts, ...), from 0.19 it calls
        # submodules.experts(num_local_experts, ...) itself.
        build = getattr(moe_layer, "build_module", None)

        def build_module(spec, *a, **kw):
            if slots_box[0] is not None and spec is experts_spec and a:
                a = (slots_box[0],) + a[1:]
            return build(spec, *a, **kw)

        def build_experts(num_local_experts, *a, **kw):
            return experts_spec(slots_box[0], *a, **kw)

        with contextlib.ExitStack() as stack:
            stack.callback(slots_box.__setitem__, 0, None)
            stack.enter_context(_temporarily(moe_layer, _BUILD_AS_CLASS, build_dispatcher))
            if build is not None:
                stack.enter_context(_temporarily(moe_layer, "build_module", build_module))
            elif slots_box[0] is not None and callable(experts_spec):
                stack.enter_context(_temporarily(submodules, "experts", build_experts))
            stack.enter_context(_dispatcher_type_as(config, _BUILD_AS))
            original(self, config, *args, **kwargs)
        if not isinstance(self.token_dispatcher, DeepEPTokenDispatcher):
            raise RuntimeError("megatron_deepep: MoELayer did not build the deepep dispatcher; "
                               "this Megatron version needs the patch from patches/")
        self.num_local_experts = self.token_dispatcher.num_local_experts
        self.local_expert_indices = list(self.token_dispatcher.local_expert_indices)
        self.token_dispatcher.bind_layer(self)
        if self.layer_number is not None:
            replica_experts.prepare_layer(self)

    setattr(__init__, _MARK, True)
    patch(moe_layer.MoELayer, "__init__", __init__)

    original_set = moe_layer.MoELayer.set_layer_number

    @functools.wraps(original_set)
    def set_layer_number(self, layer_number):
        original_set(self, layer_number)
        if isinstance(getattr(self, "token_dispatcher", None), DeepEPTokenDispatcher):
            self.token_dispatcher._expert_map = None  # this layer's plan from now on
            replica_experts.prepare_layer(self)

    setattr(set_layer_number, _MARK, True)
    patch(moe_layer.MoELayer, "set_layer_number", set_layer_number)


def _patch_expert_copies() -> None:
    """Copies of an expert train as one: DDP sums their gradients after its own reduction and
    refuses what it cannot serve; `SequentialMLP` and `TEGroupedMLP` save logical order; the
    legacy `GroupedMLP` under a map refuses to save (`replica_experts`)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.moe import experts

    init, finish = DistributedDataParallel.__init__, DistributedDataParallel.finish_grad_sync

    @functools.wraps(init)
    def ddp_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        replica_experts.check_ddp(self)

    @functools.wraps(finish)
    def finish_grad_sync(self, *args, **kwargs):
        result = finish(self, *args, **kwargs)
        replica_experts.sum_module_grads(self.module)
        return result

    for name, fn in (("__init__", ddp_init), ("finish_grad_sync", finish_grad_sync)):
        setattr(fn, _MARK, True)
        patch(DistributedDataParallel, name, fn)

    sequential = experts.SequentialMLP.sharded_state_dict

    @functools.wraps(sequential)
    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return replica_experts.logical_sharded_state_dict(self, sequential, prefix,
                                                          sharded_offsets, metadata)

    setattr(sharded_state_dict, _MARK, True)
    patch(experts.SequentialMLP, "sharded_state_dict", sharded_state_dict)
    grouped_te = getattr(experts, "TEGroupedMLP", None)
    if grouped_te is not None:
        te_own = grouped_te.sharded_state_dict

        @functools.wraps(te_own)
        def te_sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return replica_experts.logical_grouped_sharded_state_dict(
                self, te_own, prefix, sharded_offsets, metadata)

        setattr(te_sharded_state_dict, _MARK, True)
        patch(grouped_te, "sharded_state_dict", te_sharded_state_dict)
    legacy = getattr(experts, "GroupedMLP", None)
    if legacy is not None:
        legacy_own = legacy.sharded_state_dict

        @functools.wraps(legacy_own)
        def refusing(self, *args, **kwargs):
            replica_experts.refuse_checkpoint(self)
            return legacy_own(self, *args, **kwargs)

        setattr(refusing, _MARK, True)
        patch(legacy, "sharded_state_dict", refusing)


# Nodes of the A2A-overlap schedule whose inputs may be freed right after their forward.
_DEEPEP_FREE_INPUT = {
    # The experts save the dispatched rows (our postprocess is an identity): keep them.
    "mlp": False,
    # Conservative, like Megatron's own deepep/hybridep backends.
    "moe_dispatch": False,
    "moe_combine": True,
}


def should_free_input_for_deepep(name: str) -> bool:
    """Whether the A2A-overlap schedule node `name` of a deepep MoE layer may free its inputs."""
    return _DEEPEP_FREE_INPUT.get(name, False)


#: Modules that define Megatron's `should_free_input` (the A2A-overlap input-freeing policy),
#: newest first: 0.17+ `models/common/utils.py` with `(name, is_moe, config, num_local_experts)`,
#: read by `TransformerLayerNode._resolve_free_input`; 0.16 `models/gpt/fine_grained_callables.py`
#: with `(name, is_moe, config)`; <= 0.15 the latter with `(name, is_moe, is_deepep)` (left alone:
#: it cannot tell a deepep config apart).
SHOULD_FREE_INPUT_MODULES = ("megatron.core.models.common.utils",
                             "megatron.core.models.gpt.fine_grained_callables")


def _patch_should_free_input() -> List[str]:
    """Wraps every `should_free_input` Megatron defines; returns the modules that had one."""
    patched = []
    seen = set()
    for path in SHOULD_FREE_INPUT_MODULES:
        try:
            module = importlib.import_module(path)
        except Exception:  # absent in this version, or needs optional packages
            logger.debug("megatron_deepep: %s not importable", path, exc_info=True)
            continue
        original = getattr(module, "should_free_input", None)
        if original is None or id(original) in seen:  # absent, or imported from the other one
            continue
        seen.add(id(original))
        params = list(inspect.signature(original).parameters)
        if params[2:3] != ["config"]:  # <= 0.15: (name, is_moe, is_deepep)
            logger.debug("megatron_deepep: %s.should_free_input%s takes no config", path,
                         tuple(params))
            continue
        patched.append(path)
        if getattr(original, _MARK, False):
            continue

        def make(original):
            @functools.wraps(original)
            def should_free_input(name, is_moe, *args, **kwargs):
                config = args[0] if args else kwargs.get("config")
                if is_moe and config is not None and not isinstance(config, bool) \
                        and is_deepep(config):
                    return should_free_input_for_deepep(name)
                return original(name, is_moe, *args, **kwargs)
            setattr(should_free_input, _MARK, True)
            return should_free_input

        rebind(original, make(original))
    if not patched:
        logger.warning("megatron_deepep: no should_free_input found in %s; "
                       "--overlap-moe-expert-parallel-comm stays refused for deepep",
                       ", ".join(SHOULD_FREE_INPUT_MODULES))
    return patched


def _patch_skip_padding() -> None:
    from megatron.core.transformer.moe import moe_utils

    original = getattr(moe_utils, "skip_routed_expert_padding", None)
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def skip_routed_expert_padding(config, *args, **kwargs):
        if is_deepep(config) and getattr(config, "moe_router_padding_for_quantization", False):
            return True
        return original(config, *args, **kwargs)

    setattr(skip_routed_expert_padding, _MARK, True)
    rebind(original, skip_routed_expert_padding)


def _patch_metrics_report() -> None:
    """Megatron's step-end MoE report flushes `metrics` first (see `metrics.wrap_*`)."""
    from megatron.core.transformer.moe import moe_utils

    original = getattr(moe_utils, "track_moe_metrics", None)
    if original is not None and not metrics.is_report_hook(original):
        rebind(original, metrics.wrap_track_moe_metrics(original))
    try:
        from megatron.core.transformer.moe import moe_logging
    except ImportError:
        return
    tracker_cls = moe_logging.MoEMetricsTracker
    if not metrics.is_report_hook(tracker_cls.report):
        patch(tracker_cls, "report", metrics.wrap_tracker_report(tracker_cls.report))


def _patch_checkpoint_save() -> None:
    """`dist_checkpointing.save` (Megatron's `save_checkpoint` calls it with the iteration
    folder on 0.16 to 0.19) writes the replan plan there after the save call (`replan`)."""
    from megatron.core.dist_checkpointing import serialization

    original = serialization.save
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def save(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        result = original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        replan.write_plan_after_save(
            str(checkpoint_dir),
            physical_optimizer=replan.physical_order_optimizer(sharded_state_dict))
        return result

    setattr(save, _MARK, True)
    rebind(original, save)


def install() -> None:
    """Applies every patch listed in the module docstring (call once; `undo_all` reverts)."""
    _patch_config()
    _patch_moe_layer()
    _patch_expert_copies()
    _STATE["should_free_input"] = _patch_should_free_input()
    _patch_skip_padding()
    _patch_metrics_report()
    _patch_checkpoint_save()
