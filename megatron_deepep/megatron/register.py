"""Runtime plugin: makes `deepep` a dispatcher type of an unmodified pip megatron-core.

    import megatron_deepep.megatron as mdm
    mdm.register_deepep_dispatcher()          # before building configs / parsing arguments

After the call (megatron-core 0.16.x to 0.19.x):

* `TransformerConfig.moe_token_dispatcher_type` accepts "deepep": its `Literal` gains the value
  (megatron.training 0.16+ derives `--moe-token-dispatcher-type` choices from it, so the CLI
  accepts it when arguments are parsed after the call), and `__post_init__` validates a deepep
  config with the rules of "alltoall" (which allow shared-expert overlap, the EP A2A overlap and
  router padding), after our own checks;
* `MoELayer` builds a `DeepEPTokenDispatcher` for it;
* the A2A-overlap memory policy (`should_free_input`: `models/common/utils.py` on 0.17+,
  `models/gpt/fine_grained_callables.py` on 0.16) keeps the dispatched rows alive (the experts
  save them: our dispatch postprocess is an identity); where no such function is found,
  `--overlap-moe-expert-parallel-comm` is refused for deepep;
* on versions that have `skip_routed_expert_padding`, experts do not pad again when
  `moe_router_padding_for_quantization` is set (the kernel pads each expert's rows);
* Megatron's step-end MoE report first flushes `megatron_deepep.metrics` (when enabled).

Everything is a wrapper around the original function, idempotent, and undone by
`unregister_deepep_dispatcher()`. On Megatron-LM source trees the patches in `patches/` do the
same statically.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import sys
import typing
from typing import Dict, List, Tuple

from megatron_deepep.megatron.dispatcher import (
    CONFIG_PREFIX,
    DISPATCHER_TYPE,
    FP8_DISPATCH_CHOICES,
    DeepEPTokenDispatcher,
    check_fp8_dispatch_option,
    set_default_options,
)

logger = logging.getLogger(__name__)

# Type whose validation rules a deepep config borrows inside TransformerConfig.__post_init__.
_VALIDATE_AS = "alltoall"
# Branch of MoELayer.__init__'s if/elif chain that we route to our class while it runs.
_BUILD_AS = "allgather"
_BUILD_AS_CLASS = "MoEAllGatherTokenDispatcher"

_MARK = "_megatron_deepep_wrapped"
# (owner, attribute, original) for every replacement, for unregister.
_PATCHES: List[Tuple[object, str, object]] = []
_REBOUND: List[Tuple[object, str, object]] = []
_STATE: Dict[str, object] = {"registered": False, "should_free_input": []}


def _replace(owner, name: str, new) -> None:
    old = getattr(owner, name)
    _PATCHES.append((owner, name, old))
    setattr(owner, name, new)


def _rebind_everywhere(old, new) -> None:
    """Points every loaded module's global bound to `old` (a `from x import f`) at `new`."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace or not getattr(module, "__name__", "").startswith("megatron"):
            continue
        for attr, value in list(namespace.items()):
            if value is old:
                _REBOUND.append((module, attr, old))
                setattr(module, attr, new)


@contextlib.contextmanager
def _dispatcher_type_as(config, alias: str):
    """Temporarily shows `alias` as the config's dispatcher type (single-threaded init code)."""
    object.__setattr__(config, "moe_token_dispatcher_type", alias)
    try:
        yield
    finally:
        object.__setattr__(config, "moe_token_dispatcher_type", DISPATCHER_TYPE)


def _is_deepep(config) -> bool:
    return getattr(config, "moe_token_dispatcher_type", None) == DISPATCHER_TYPE


# ----------------------------------------------------------------------------------------------
def _patch_config() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    field = TransformerConfig.__dataclass_fields__["moe_token_dispatcher_type"]
    choices = typing.get_args(field.type) if typing.get_origin(field.type) is typing.Literal \
        else ()
    if DISPATCHER_TYPE not in choices:
        new_type = typing.Literal[tuple(choices) + (DISPATCHER_TYPE,)] if choices else str
        _PATCHES.append((field, "type", field.type))
        field.type = new_type
        annotations = TransformerConfig.__dict__.get("__annotations__", {})
        if "moe_token_dispatcher_type" in annotations:
            _PATCHES.append((annotations, None, dict(annotations)))
            annotations["moe_token_dispatcher_type"] = new_type

    original = TransformerConfig.__post_init__

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        if not _is_deepep(self):
            return original(self, *args, **kwargs)
        check_config(self)
        if getattr(self, "overlap_moe_expert_parallel_comm", False) \
                and not _STATE["should_free_input"]:
            raise ValueError(
                "--overlap-moe-expert-parallel-comm with --moe-token-dispatcher-type deepep: "
                "this Megatron has no should_free_input the plugin could extend, so the overlap "
                "would free rows the experts still need; use the patches/ for it")
        with _dispatcher_type_as(self, _VALIDATE_AS):
            return original(self, *args, **kwargs)

    setattr(__post_init__, _MARK, True)
    _replace(TransformerConfig, "__post_init__", __post_init__)


def check_config(config) -> None:
    """Our own validation of a deepep config, run before Megatron's (errors name the flag)."""
    if getattr(config, "moe_enable_deepep", False):
        raise ValueError(
            "--moe-enable-deepep selects DeepEP inside Megatron's 'flex' dispatcher; it cannot be "
            "combined with --moe-token-dispatcher-type deepep (megatron_deepep). Drop it.")
    etp = getattr(config, "expert_tensor_parallel_size", None)
    if etp is not None and etp > 1:
        raise ValueError(
            f"--moe-token-dispatcher-type deepep does not support expert tensor parallelism "
            f"(--expert-tensor-parallel-size {etp}); use --expert-tensor-parallel-size 1")
    if getattr(config, "num_moe_experts", None) is None:
        raise ValueError("--moe-token-dispatcher-type deepep needs --num-experts")
    fp8_dispatch = getattr(config, CONFIG_PREFIX + "fp8_dispatch", None)
    if fp8_dispatch is not None:
        check_fp8_dispatch_option(fp8_dispatch)
        hidden = getattr(config, "hidden_size", None)
        if fp8_dispatch != "off" and hidden is not None and hidden % 16 != 0:
            raise ValueError(f"--moe-mdeep-fp8-dispatch {fp8_dispatch} needs --hidden-size "
                             f"% 16 == 0, got {hidden}")


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
        if not _is_deepep(config):
            return original(self, config, *args, **kwargs)
        saved = getattr(moe_layer, _BUILD_AS_CLASS)
        setattr(moe_layer, _BUILD_AS_CLASS, build_dispatcher)
        try:
            with _dispatcher_type_as(config, _BUILD_AS):
                original(self, config, *args, **kwargs)
        finally:
            setattr(moe_layer, _BUILD_AS_CLASS, saved)
        if not isinstance(self.token_dispatcher, DeepEPTokenDispatcher):
            raise RuntimeError("megatron_deepep: MoELayer did not build the deepep dispatcher; "
                               "this Megatron version needs the patch from patches/")
        self.token_dispatcher.bind_layer(self)

    setattr(__init__, _MARK, True)
    _replace(moe_layer.MoELayer, "__init__", __init__)


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
                        and _is_deepep(config):
                    return should_free_input_for_deepep(name)
                return original(name, is_moe, *args, **kwargs)
            setattr(should_free_input, _MARK, True)
            return should_free_input

        _rebind_everywhere(original, make(original))
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
        if _is_deepep(config) and getattr(config, "moe_router_padding_for_quantization", False):
            return True
        return original(config, *args, **kwargs)

    setattr(skip_routed_expert_padding, _MARK, True)
    _rebind_everywhere(original, skip_routed_expert_padding)


# ----------------------------------------------------------------------------------------------
def register_deepep_dispatcher(**options) -> None:
    """Makes `moe_token_dispatcher_type="deepep"` work in this process (idempotent).

    Call it before TransformerConfigs are built and before megatron.training parses arguments.

    Args:
        **options: defaults for `DeepEPOptions` (`transport`, `num_sms`,
            `num_max_tokens_per_rank`, `metrics`, `metrics_dir`, `fp8_dispatch`); config fields
            `moe_mdeep_<name>` (patched Megatron) override them, and they override `MDEEP_<NAME>`
            environment variables.
    """
    set_default_options(**options)
    if _STATE["registered"]:
        return
    _patch_config()
    _patch_moe_layer()
    _STATE["should_free_input"] = _patch_should_free_input()
    _patch_skip_padding()
    from megatron_deepep import metrics
    metrics.install_megatron_hooks()
    _STATE["registered"] = True
    logger.info("megatron_deepep: moe_token_dispatcher_type='deepep' registered")


def is_registered() -> bool:
    return bool(_STATE["registered"])


def unregister_deepep_dispatcher() -> None:
    """Restores every function and annotation `register_deepep_dispatcher` replaced."""
    while _REBOUND:
        module, attr, old = _REBOUND.pop()
        setattr(module, attr, old)
    while _PATCHES:
        owner, name, old = _PATCHES.pop()
        if name is None:  # an annotations dict
            owner.clear()
            owner.update(old)
        else:
            setattr(owner, name, old)
    _STATE["registered"] = False
    _STATE["should_free_input"] = []


# ----------------------------------------------------------------------------------------------
#: Our command-line flags (`megatron.training`'s `extra_args_provider`), one per DeepEPOptions
#: field: `--moe-mdeep-<name>`, named apart from Megatron's own flags (`--moe-deepep-num-sms`,
#: `--moe-enable-deepep`, `--fp8-format`, `--fp8-recipe` ...).
ARGUMENTS = [
    ("--moe-mdeep-transport", dict(type=str, default=None,
                                   choices=["auto", "nvlink", "reference"],
                                   help="megatron_deepep transport")),
    ("--moe-mdeep-num-sms", dict(type=int, default=None, help="SMs of the comm kernels")),
    ("--moe-mdeep-num-max-tokens-per-rank", dict(
        type=int, default=None, help="most tokens one rank dispatches (same on every rank)")),
    ("--moe-mdeep-metrics", dict(action="store_true", default=None,
                                 help="megatron_deepep per-layer comm/load metrics")),
    ("--moe-mdeep-metrics-dir", dict(type=str, default=None,
                                     help="also write metrics as JSON lines here")),
    ("--moe-mdeep-fp8-dispatch", dict(
        type=str, default=None, choices=list(FP8_DISPATCH_CHOICES),
        help="FP8 token dispatch: blockwise (TE Float8BlockScaling, 1x128), mxfp8 (TE "
             "MXFP8BlockScaling, 1x32), auto (the active TE recipe's format) or off")),
]


def add_arguments(parser):
    """Adds the `--moe-mdeep-*` flags that `parser` lacks (a patched Megatron defines them as
    config fields); usable as `pretrain(..., extra_args_provider=add_arguments)`."""
    group = parser.add_argument_group(title="megatron_deepep")
    for flag, kwargs in ARGUMENTS:
        if flag not in parser._option_string_actions:
            group.add_argument(flag, **kwargs)
    return parser


def apply_arguments(args) -> None:
    """Makes parsed `--moe-mdeep-*` values the option defaults (`register_deepep_dispatcher`)."""
    options = {}
    for flag, _ in ARGUMENTS:
        name = flag[len("--moe-mdeep-"):].replace("-", "_")
        value = getattr(args, CONFIG_PREFIX + name, None)
        if value is False:  # store_true left unset
            value = None
        options[name] = value
    register_deepep_dispatcher(**options)
