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
* `MoELayer.__init__` builds a `DeepEPTokenDispatcher` for it;
* `should_free_input` (the A2A-overlap memory policy: `models/common/utils.py` on 0.17+,
  `models/gpt/fine_grained_callables.py` on 0.16) keeps the dispatched rows alive (the experts
  save them: our dispatch postprocess is an identity); where none is found,
  `--overlap-moe-expert-parallel-comm` is refused for deepep;
* `skip_routed_expert_padding` (where it exists): experts do not pad again when
  `moe_router_padding_for_quantization` is set (the kernel pads each expert's rows);
* Megatron's step-end MoE report (`moe_utils.track_moe_metrics`,
  `MoEMetricsTracker.report`) first flushes `megatron_deepep.megatron.metrics`.
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

from megatron_deepep.megatron import metrics
from megatron_deepep.megatron.dispatcher import DeepEPTokenDispatcher
from megatron_deepep.megatron.options import DISPATCHER_TYPE, check_config

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


def applied() -> List[Patch]:
    """The patches in force, oldest first."""
    return list(_APPLIED)


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


def _patch_moe_layer() -> None:
    from megatron.core.transformer.moe import moe_layer

    original = moe_layer.MoELayer.__init__

    def build_dispatcher(num_local_experts, local_expert_indices, config=None,
                         pg_collection=None, **kwargs):
        if kwargs:
            raise TypeError(f"deepep dispatcher: unexpected arguments {sorted(kwargs)} (Megatron "
                            f"before 0.15 passes model_comm_pgs: use the patches/ for it)")
        return DeepEPTokenDispatcher(num_local_experts, local_expert_indices, config=config,
                                     pg_collection=pg_collection)

    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        if not is_deepep(config):
            return original(self, config, *args, **kwargs)
        with _temporarily(moe_layer, _BUILD_AS_CLASS, build_dispatcher), \
                _dispatcher_type_as(config, _BUILD_AS):
            original(self, config, *args, **kwargs)
        if not isinstance(self.token_dispatcher, DeepEPTokenDispatcher):
            raise RuntimeError("megatron_deepep: MoELayer did not build the deepep dispatcher; "
                               "this Megatron version needs the patch from patches/")
        self.token_dispatcher.bind_layer(self)

    setattr(__init__, _MARK, True)
    patch(moe_layer.MoELayer, "__init__", __init__)


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


def install() -> None:
    """Applies every patch listed in the module docstring (call once; `undo_all` reverts)."""
    _patch_config()
    _patch_moe_layer()
    _STATE["should_free_input"] = _patch_should_free_input()
    _patch_skip_padding()
    _patch_metrics_report()
