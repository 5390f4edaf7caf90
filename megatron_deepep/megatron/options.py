"""The `deepep` dispatcher's options and the one validation of a deepep config.

Imports no megatron-core: `metrics` and `register` read options without importing the
dispatcher (which imports megatron-core), so nothing here closes an import cycle.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from megatron_deepep import knobs
from megatron_deepep.fp8.dispatch import ALIASES, FLAG_NAMES, names

#: The value of `moe_token_dispatcher_type` that selects this dispatcher.
DISPATCHER_TYPE = "deepep"

#: Prefix of our TransformerConfig fields (added by the patches). It is distinct from Megatron's
#: own `moe_deepep_num_sms` / `moe_enable_deepep` (flex backend knobs).
CONFIG_PREFIX = "moe_mdeep_"

#: Values of the `transport` option.
TRANSPORT_CHOICES = knobs.TRANSPORT_NAMES

#: Values of the `fp8_dispatch` option besides the names in `megatron_deepep.fp8.FORMATS`.
FP8_DISPATCH_CHOICES = FLAG_NAMES  # one list: fp8/dispatch.py's
_FP8_ALIASES = ALIASES


@dataclasses.dataclass
class DeepEPOptions:
    """Knobs of the dispatcher.

    Each is read, highest precedence first, from the TransformerConfig field
    `moe_mdeep_<name>` (the patches add these; None means unset), the keyword arguments of
    `register_deepep_dispatcher(...)`, the environment variable `MDEEP_<NAME>` (through
    `megatron_deepep.knobs`), and this default.

    Attributes:
        transport: "auto" (the EP = 1 kernels at EP = 1, NVLink kernels within a node, the
            internode kernels when the EP group spans nodes, the pure-torch reference without
            CUDA), "local", "nvlink", "internode" or "reference".
        num_sms: SM budget of the communication kernels.
        num_max_tokens_per_rank: the most tokens one rank dispatches per call. It sizes the
            symmetric buffer and must be the same on every EP rank; None picks the next power of
            two >= the first call's token count (at least 4096), which every rank agrees on as
            long as they see the same token count (fixed sequence length and micro-batch).
        metrics: collect per-layer communication and load metrics
            (`megatron_deepep.megatron.metrics`).
        metrics_dir: where `metrics` also writes one JSON line per step (for
            `python -m megatron_deepep.tools.plot_metrics`); None writes no file.
        fp8_dispatch: FP8 on the wire (`FP8_DISPATCH_CHOICES`): "off"; "blockwise" (TE
            `Float8BlockScaling` activations: 1x128 blocks, fp32 power-of-two scales);
            "mxfp8" (TE `MXFP8BlockScaling`: 1x32 blocks, E8M0 scales); "auto" (the format of
            TE's active recipe at each dispatch, off when there is none or it has no matching
            format); or a format name of `megatron_deepep.fp8.FORMATS`. Needs hidden % 16 == 0.
            The experts get TE quantized tensors when TE's active recipe matches the format
            (see `dispatcher.fp8_handoff`), else bf16 rows dequantized on the receiver.
        rank_capacity_factor: sync-free dispatch (no host synchronization in forward or
            backward; CUDA-graph capturable): each rank receives into a fixed
            `rank_capacity_rows` (about factor x its tokens x top-k) rows. Megatron's own
            `--moe-expert-rank-capacity-factor` (0.19+) takes precedence when set. Receiving
            more rows than the bound is an error (`BufferError` naming the bound, raised by the
            layer's combine; the excess rows are never written), never a silent drop. Under
            `--moe-pad-expert-input-to-capacity` the dispatch is sync-free without it (the
            capacity bounds every expert).
        expert_map: a logical-to-physical expert placement (`megatron_deepep.tools.balance`): the
            path of `python -m megatron_deepep.tools.balance --json` output (a plan per layer
            number; a single layer "0" applies to every layer), a plan dict, or a
            `physical_to_logical` list. Physical slot p lives on EP rank p // E_local and
            holds logical expert `physical_to_logical[p]`. Under the plugin the layer is
            built with the plan's slots, its copies train as one expert and SequentialMLP
            checkpoints stay in logical order (`replica_experts`); elsewhere the expert
            weights must be permuted to match (`balance.permute_expert_weights`). None: the
            contiguous placement.
        ranks_per_node: declares nodes of this many contiguous EP ranks (virtual nodes, for
            tests and containers that share a host name); None: the ranks' hosts.
        replan: re-plan the placement at every checkpoint save and take the resumed
            checkpoint's plan at the next start (`megatron.replan`), with this many extra
            slots in total for copies of hot experts (0: none; a multiple of the EP size).
            An explicit `expert_map` wins at resume. None: off.
    """

    transport: str = "auto"
    num_sms: int = 24
    num_max_tokens_per_rank: Optional[int] = None
    metrics: bool = False
    metrics_dir: Optional[str] = None
    fp8_dispatch: str = "off"
    rank_capacity_factor: Optional[float] = None
    expert_map: Optional[object] = None
    ranks_per_node: Optional[int] = None
    replan: Optional[int] = None

    def __post_init__(self):
        check_transport_option(self.transport)
        check_fp8_dispatch_option(self.fp8_dispatch)
        if self.replan is not None:
            self.replan = check_replan_option(self.replan)
        if self.rank_capacity_factor is not None:
            self.rank_capacity_factor = check_rank_capacity_factor(self.rank_capacity_factor)


#: Megatron's field (0.19+) that selects static, sync-free shapes for the flex backends.
MEGATRON_RANK_CAPACITY_FIELD = "moe_expert_rank_capacity_factor"


def check_rank_capacity_factor(value, flag: str = "--moe-mdeep-rank-capacity-factor "
                                                  "(moe_mdeep_rank_capacity_factor / "
                                                  "MDEEP_RANK_CAPACITY_FACTOR)") -> float:
    """Raises ValueError naming the flag unless `value` is a number > 0; returns it as float."""
    try:
        factor = float(value)
    except (TypeError, ValueError):
        factor = float("nan")
    if isinstance(value, bool) or not factor > 0 or factor == float("inf"):
        raise ValueError(f"{flag} must be a finite number > 0, got {value!r}")
    return factor


def rank_capacity_factor(config, options: Optional[DeepEPOptions]) -> Optional[float]:
    """The sync-free factor in force: Megatron's `moe_expert_rank_capacity_factor` when the
    config sets it, else the `rank_capacity_factor` option (None: the dispatch sizes its output
    from the received count, one host synchronization per dispatch)."""
    value = getattr(config, MEGATRON_RANK_CAPACITY_FIELD, None)
    if value is not None:
        return check_rank_capacity_factor(value, "--moe-expert-rank-capacity-factor")
    return options.rank_capacity_factor if options is not None else None


def rank_capacity_rows(factor: float, num_tokens: int, topk: int, num_local_experts: int,
                       alignment: int = 1) -> int:
    """Rows one rank receives at most in sync-free mode (`num_max_recv_rows`).

    `ceil(factor * num_tokens * topk)` (HybridEP's budget: the rows a rank receives when every
    rank sends `num_tokens` tokens and the routing is balanced, times the factor), plus each
    local expert's alignment padding; at least 1.
    """
    budget = math.ceil(factor * num_tokens * topk)
    return max(budget + num_local_experts * (alignment - 1), 1)


REPLAN_FLAG = "--moe-mdeep-replan (moe_mdeep_replan / MDEEP_REPLAN)"


def check_replan_option(value, ep_size: Optional[int] = None,
                        num_experts: Optional[int] = None) -> int:
    """Raises ValueError naming the flag unless `value` is an int >= 0 (with `ep_size`, extra
    slots a plan can fill: `placement.check_extra_slots`); returns it."""
    from megatron_deepep import placement

    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{REPLAN_FLAG} takes the extra slots for copies of hot experts, an "
                         f"integer >= 0, got {value!r}")
    if ep_size is not None:
        try:
            placement.check_extra_slots(value, max(ep_size, 1), num_experts)
        except ValueError as exc:
            raise ValueError(f"{REPLAN_FLAG} {value} with --expert-model-parallel-size "
                             f"{ep_size}: {exc}") from None
    return value


def check_transport_option(value) -> str:
    """Raises ValueError naming the flag unless `value` is a valid `transport`."""
    if value not in TRANSPORT_CHOICES:
        raise ValueError(
            f"--moe-mdeep-transport (moe_mdeep_transport / MDEEP_TRANSPORT) must be one of "
            f"{list(TRANSPORT_CHOICES)}, got {value!r}")
    return value


def check_fp8_dispatch_option(value) -> str:
    """Raises ValueError naming the flag unless `value` is a valid `fp8_dispatch`
    (`fp8.dispatch.names()`)."""
    if value not in names():
        raise ValueError(
            f"--moe-mdeep-fp8-dispatch (moe_mdeep_fp8_dispatch / MDEEP_FP8_DISPATCH) must be one "
            f"of {list(names())}, got {value!r}")
    return value


def fp8_format_for_option(value: str, recipe=None):
    """The wire format the `fp8_dispatch` option asks for now (None: bf16 dispatch).

    Args:
        value: the option.
        recipe: for "auto": the TE recipe (default: TE's active recipe, None outside
            `fp8_autocast` or without TE).

    Returns:
        `(Fp8Format or None, reason when None)`.
    """
    from megatron_deepep.fp8 import FORMATS, te_bridge

    check_fp8_dispatch_option(value)
    if value == "off":
        return None, "fp8_dispatch is off"
    if value == "auto":
        return te_bridge.format_for_recipe(
            recipe if recipe is not None else te_bridge.active_recipe())
    return FORMATS[_FP8_ALIASES.get(value, value)], ""


_REGISTERED_OPTIONS: dict = {}

_CHECKS = {"transport": check_transport_option, "fp8_dispatch": check_fp8_dispatch_option,
           "rank_capacity_factor": check_rank_capacity_factor, "replan": check_replan_option}


def set_default_options(**kwargs) -> None:
    """Sets option defaults for dispatchers built from now on (`register_deepep_dispatcher`)."""
    names = {f.name for f in dataclasses.fields(DeepEPOptions)}
    for key in kwargs:
        if key not in names:
            raise ValueError(f"unknown megatron_deepep option {key!r}; known: {sorted(names)}")
    for key, check in _CHECKS.items():
        if kwargs.get(key) is not None:
            check(kwargs[key])
    _REGISTERED_OPTIONS.update({k: v for k, v in kwargs.items() if v is not None})


def resolve_options(config) -> DeepEPOptions:
    """Resolves `DeepEPOptions` for `config` (see `DeepEPOptions` for the precedence).

    `config` may be None (no config fields: registered defaults, then the environment).

    Raises:
        ValueError: any `MDEEP_*` variable set to a bad value, named (`knobs.check_environment`;
            also those that a config field or keyword overrides), or an option out of range.
    """
    knobs.check_environment("dispatcher")
    values = {}
    for field in dataclasses.fields(DeepEPOptions):
        value = getattr(config, CONFIG_PREFIX + field.name, None)
        if value is False:  # a bool config field can only switch a feature on
            value = None
        if value is None:
            value = _REGISTERED_OPTIONS.get(field.name)
        if value is None:
            value = knobs.get(field.name.upper())
        if value is not None:
            values[field.name] = value
    return DeepEPOptions(**values)


def option_origin(config, name: str) -> str:
    """Where the resolved option `name` came from, as errors name it (the precedence of
    `resolve_options`): the TransformerConfig field, `register_deepep_dispatcher` (which
    Megatron's parsed `--moe-mdeep-*` arguments call), or the environment variable."""
    flag = "--moe-mdeep-" + name.replace("_", "-")
    if getattr(config, CONFIG_PREFIX + name, None) not in (None, False):
        return f"{flag} (TransformerConfig field {CONFIG_PREFIX + name})"
    if _REGISTERED_OPTIONS.get(name) is not None:
        return f"{flag} (register_deepep_dispatcher({name}=...))"
    if knobs.get(name.upper()) is not None:
        return f"the environment variable MDEEP_{name.upper()}"
    return flag


def check_config(config, options: Optional[DeepEPOptions] = None, *,
                 expert_tp_size: Optional[int] = None, ep_size: Optional[int] = None,
                 validated_as: Optional[str] = None) -> None:
    """The one validation of a deepep config; every error names the flag.

    Runs in `TransformerConfig.__post_init__` (plugin: config fields only) and again when the
    dispatcher is built (resolved options and the actual process groups).

    Args:
        config: the TransformerConfig (or any object with its attributes).
        options: the resolved options; None checks the `moe_mdeep_*` config fields only.
        expert_tp_size: the expert tensor-parallel group size (default: the config's
            `expert_tensor_parallel_size`).
        ep_size: the expert-parallel group size, when known (experts must divide evenly).
        validated_as: the dispatcher type whose rules Megatron's own `__post_init__` applies
            to this config ("alltoall" under the plugin; None when Megatron knows deepep).

    Raises:
        ValueError: for settings the dispatcher does not support.
    """
    if getattr(config, "moe_enable_deepep", False):
        raise ValueError(
            "--moe-enable-deepep selects DeepEP inside Megatron's 'flex' dispatcher; it cannot be "
            "combined with --moe-token-dispatcher-type deepep (megatron_deepep). Drop it.")
    num_experts = getattr(config, "num_moe_experts", None)
    if num_experts is None:
        raise ValueError("--moe-token-dispatcher-type deepep needs --num-experts")
    if ep_size is not None and num_experts % max(ep_size, 1) != 0:
        raise ValueError(f"--num-experts {num_experts} must be a multiple of "
                         f"--expert-model-parallel-size {ep_size}")
    if options is not None:
        transport, fp8_dispatch = options.transport, options.fp8_dispatch
    else:
        transport = getattr(config, CONFIG_PREFIX + "transport", None)
        fp8_dispatch = getattr(config, CONFIG_PREFIX + "fp8_dispatch", None)
    if transport is not None:
        check_transport_option(transport)
    _check_placement(config, options, ep_size)
    _check_graph_scope(config, validated_as)
    _check_sync_free(config, options)
    etp = expert_tp_size if expert_tp_size is not None \
        else getattr(config, "expert_tensor_parallel_size", None)
    if etp is not None and etp > 1:
        _check_expert_tp(config, options, etp)
    if fp8_dispatch is not None:
        check_fp8_dispatch_option(fp8_dispatch)
        hidden = getattr(config, "hidden_size", None)
        if fp8_dispatch != "off" and hidden is not None and hidden % 16 != 0:
            raise ValueError(
                f"--moe-mdeep-fp8-dispatch {fp8_dispatch} needs --hidden-size % 16 == 0 "
                f"(hidden_size % 16 == 0: e4m3 rows are 16-byte multiples), got {hidden}")


#: Megatron's fields (newer versions) that keep all local experts' weights or biases of a
#: TEGroupedMLP in one TE GroupedTensor parameter.
SINGLE_GROUPED_FIELDS = ("moe_single_grouped_weight", "moe_single_grouped_bias")


def _check_placement(config, options: Optional[DeepEPOptions], ep_size: Optional[int]) -> None:
    """An expert map or the replan option: experts whose checkpoint can be put in logical
    order, and copies that divide over the EP ranks."""
    if options is None:
        expert_map = getattr(config, CONFIG_PREFIX + "expert_map", None)
        replan = getattr(config, CONFIG_PREFIX + "replan", None)
    else:
        expert_map, replan = options.expert_map, options.replan
    if replan is not None:
        check_replan_option(replan, ep_size, getattr(config, "num_moe_experts", None))
    if expert_map is None and replan is None:
        return
    single = [f for f in SINGLE_GROUPED_FIELDS if getattr(config, f, False)]
    if single and getattr(config, "moe_grouped_gemm", False):
        flag = "--moe-mdeep-expert-map" if expert_map is not None else REPLAN_FLAG
        raise ValueError(
            f"{flag} with --{single[0].replace('_', '-')}: TEGroupedMLP then keeps all local "
            f"experts in one GroupedTensor parameter, so neither the copies' gradient sum nor "
            f"a checkpoint in logical expert order can reach one expert's rows. Drop "
            f"--{single[0].replace('_', '-')} (one weight<i> per expert) or the placement")


#: Megatron's per-layer CUDA-graph regions that touch the MoE layer (0.16 `CudaGraphScope`,
#: 0.19 `CudaGraphModule` names).
GRAPH_MOE, GRAPH_MOE_ROUTER, GRAPH_MOE_PREPROCESS = "moe", "moe_router", "moe_preprocess"


@dataclasses.dataclass(frozen=True)
class GraphScope:
    """What Megatron captures in CUDA graphs under a config, by its own rules (0.16 to 0.19).

    Attributes:
        impl: "none", "local", "transformer_engine" or "full_iteration" (on 0.16 the local
            impl with `--cuda-graph-scope full_iteration`).
        modules: the per-layer regions by name ("attn", "mlp", "moe", "moe_router",
            "moe_preprocess", "mamba"); empty under a per-layer impl: whole layers.
        flag: the flag that set them: `--cuda-graph-modules` (0.19) or `--cuda-graph-scope`.
    """

    impl: str
    modules: frozenset
    flag: str

    @property
    def per_layer(self) -> bool:
        return self.impl in ("local", "transformer_engine")


def _scope_names(raw) -> list:
    """Megatron's scope value (None, a name, "a,b", an enum or a list of them) as names."""
    if raw is None:
        items = []
    elif isinstance(raw, (list, tuple)):
        items = list(raw)
    elif isinstance(raw, str):
        items = raw.split(",") if raw else []
    else:
        items = [raw]
    return [str(getattr(item, "name", item)) for item in items]


def graph_scope(config) -> GraphScope:
    """Megatron's CUDA-graph settings of `config` as its `__post_init__` resolves them.

    Works before and after that normalization (the plugin checks a config before Megatron's
    own rules run): the deprecated `enable_cuda_graph` / `external_cuda_graph` switches, 0.19's
    deprecated `cuda_graph_scope` (it wins over `cuda_graph_modules` when set), "a,b" strings,
    "full" (whole layers), "full_iteration" (0.19 turns it into `cuda_graph_impl
    full_iteration`; 0.16's local impl captures the iteration) and the local impl's pairing of
    moe_router with moe_preprocess (it captures both or neither).
    """
    impl = getattr(config, "cuda_graph_impl", None) or "none"
    if impl == "none" and getattr(config, "enable_cuda_graph", False):
        impl = "local"
    elif impl == "none" and getattr(config, "external_cuda_graph", False):
        impl = "transformer_engine"
    newer = hasattr(config, "cuda_graph_modules")  # 0.19+
    raw, flag = getattr(config, "cuda_graph_scope", None), "--cuda-graph-scope"
    if newer and raw is None:
        raw, flag = config.cuda_graph_modules, "--cuda-graph-modules"
    names = _scope_names(raw)
    if "full" in names:
        names = []
    if "full_iteration" in names and (impl == "local" or (newer and impl == "none")):
        impl = "full_iteration"
    names = [n for n in names if n not in ("full_iteration", "full_iteration_inference")]
    if impl == "local" and {GRAPH_MOE_ROUTER, GRAPH_MOE_PREPROCESS} & set(names):
        names += [GRAPH_MOE_ROUTER, GRAPH_MOE_PREPROCESS]
    return GraphScope(impl, frozenset(names), flag)


def graph_captures_dispatch(config) -> Optional[str]:
    """The CUDA-graph flags that capture the MoE dispatch itself (None: none do).

    A full-iteration graph; a per-layer impl with whole layers (empty modules, or "full");
    "moe" (the whole MoE layer); and, under the local impl, "attn": Megatron's local graphs
    capture a whole `TransformerLayer` (the GPT layer: attention and its MoE) when they capture
    its attention (`MoETransformerLayer`, the hybrid models' layer, does not). "moe_router"
    and "moe_preprocess" end before the dispatch: the dispatch, the experts and the combine run
    eagerly between two graphs (local) or after the graph (transformer_engine).
    """
    scope = graph_scope(config)
    if scope.impl == "none":
        return None
    if scope.impl == "full_iteration":
        return "--cuda-graph-impl full_iteration"
    if not scope.per_layer:
        return None
    if not scope.modules:
        return f"--cuda-graph-impl {scope.impl} with a whole-layer {scope.flag}"
    if GRAPH_MOE in scope.modules:
        return f"--cuda-graph-impl {scope.impl} {scope.flag} moe"
    if scope.impl == "local" and "attn" in scope.modules:
        return (f"--cuda-graph-impl local {scope.flag} attn (the local impl captures the whole "
                f"TransformerLayer, its MoE included)")
    return None


def _drop_and_pad(config) -> bool:
    return bool(getattr(config, "moe_pad_expert_input_to_capacity", False)) and getattr(
        config, "moe_expert_capacity_factor", None) is not None


def _check_graph_scope(config, validated_as: Optional[str]) -> None:
    """Megatron's own rules for graphed MoE layers, with messages that name the flags.

    Megatron refuses the same configurations in `TransformerConfig.__post_init__` with bare
    assertions; these come first. `validated_as`: the dispatcher type whose rules Megatron
    applies to this config (the plugin validates deepep as "alltoall", which adds one rule).
    """
    scope = graph_scope(config)
    if not scope.per_layer:
        return
    flag, mods = scope.flag, scope.modules
    if GRAPH_MOE in mods and GRAPH_MOE_ROUTER in mods:
        raise ValueError(f"{flag}: moe (the whole MoE layer) and moe_router (its router only) "
                         f"exclude each other")
    if GRAPH_MOE_PREPROCESS in mods and GRAPH_MOE_ROUTER not in mods:
        raise ValueError(f"{flag} moe_preprocess needs moe_router too (the preprocess graph "
                         f"continues the router's)")
    if GRAPH_MOE in mods and not _drop_and_pad(config):
        raise ValueError(
            f"{flag} moe captures the MoE layer, which Megatron allows only for drop-and-pad "
            f"layers: set --moe-pad-expert-input-to-capacity with --moe-expert-capacity-factor. "
            f"With a deepep row bound (--moe-expert-rank-capacity-factor or "
            f"--moe-mdeep-rank-capacity-factor) capture whole layers instead (empty {flag}), "
            f"or only moe_router / moe_preprocess (the dispatch then runs eagerly)")
    padding_fp8 = bool(getattr(config, "moe_router_padding_for_fp8", False))
    capacity = getattr(config, "moe_expert_capacity_factor", None)
    if validated_as == "alltoall" and GRAPH_MOE_PREPROCESS in mods and not _drop_and_pad(
            config) and (capacity is not None or padding_fp8):
        added = " (the local impl adds it to moe_router)" if scope.impl == "local" else ""
        cause = ("--moe-expert-capacity-factor" if capacity is not None
                 else "--moe-router-padding-for-fp8")
        raise ValueError(
            f"{flag} moe_preprocess{added} with {cause} and without "
            f"--moe-pad-expert-input-to-capacity: Megatron refuses it for alltoall "
            f"(its preprocess copies counts to the host), and the deepep plugin validates with "
            f"alltoall's rules. Add --moe-pad-expert-input-to-capacity, drop the capacity factor, "
            f"or capture moe_router only with --cuda-graph-impl transformer_engine")


def _check_sync_free(config, options: Optional[DeepEPOptions]) -> None:
    """A CUDA graph around the dispatch needs it sync-free: a row bound must be known."""
    megatron_factor = getattr(config, MEGATRON_RANK_CAPACITY_FIELD, None)
    if megatron_factor is not None:
        check_rank_capacity_factor(megatron_factor, "--moe-expert-rank-capacity-factor")
    captured = graph_captures_dispatch(config)
    if captured is None:
        return
    if options is None:
        options = resolve_options(config)
    if rank_capacity_factor(config, options) is None and not _drop_and_pad(config):
        raise ValueError(
            f"{captured} captures the deepep dispatch, which then must not synchronize with the "
            f"host: set --moe-expert-rank-capacity-factor (Megatron 0.19+) or "
            f"--moe-mdeep-rank-capacity-factor / MDEEP_RANK_CAPACITY_FACTOR (a per-rank row "
            f"bound), or use --moe-pad-expert-input-to-capacity with a capacity factor")


def _check_expert_tp(config, options: Optional[DeepEPOptions], etp: int) -> None:
    """Expert TP > 1 all-gathers the rows across the expert-TP group with sizes read on the host
    (`megatron.expert_tp`), so a rank capacity factor (and with it a CUDA graph around the
    dispatch) cannot combine with it; pad-to-capacity can (the same capacity segments on every
    rank)."""
    if getattr(config, "moe_pad_expert_input_to_capacity", False):
        return
    if options is None:
        options = resolve_options(config)
    refused = None
    if getattr(config, MEGATRON_RANK_CAPACITY_FIELD, None) is not None:
        refused = "--moe-expert-rank-capacity-factor"
    elif options.rank_capacity_factor is not None:
        refused = ("--moe-mdeep-rank-capacity-factor (moe_mdeep_rank_capacity_factor / "
                   "MDEEP_RANK_CAPACITY_FACTOR)")
    # A CUDA graph around the dispatch needs one of those bounds (`_check_sync_free`, which
    # runs first), so it needs no case of its own here.
    if refused is not None:
        raise ValueError(
            f"--expert-tensor-parallel-size {etp} (expert_tensor_parallel_size) with "
            f"--moe-token-dispatcher-type deepep needs the synchronous dispatch (the expert-TP "
            f"all-gather reads the row counts on the host); drop {refused}, use "
            f"--moe-pad-expert-input-to-capacity, or --expert-tensor-parallel-size 1")


EXPERT_MAP_FLAG = "--moe-mdeep-expert-map (moe_mdeep_expert_map / MDEEP_EXPERT_MAP)"


def _read_map(expert_map):
    """The `expert_map` option's plan: the JSON of its file, or itself.

    Raises:
        ValueError: a file that cannot be read or is no JSON, naming the option and the file.
    """
    import json

    if not isinstance(expert_map, str):
        return expert_map
    try:
        with open(expert_map, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise ValueError(f"{EXPERT_MAP_FLAG} = {expert_map}: cannot read that file "
                         f"({exc.strerror})") from None
    except ValueError as exc:
        raise ValueError(f"{EXPERT_MAP_FLAG} = {expert_map}: not JSON ({exc})") from None


def physical_slot_count(expert_map) -> Optional[int]:
    """The physical slots (over all EP ranks) of every layer's plan in `expert_map` (None: no
    map). A layer's experts are built before its layer number is known, so every plan must
    have the same count (plans of one `balance --redundant N` run do).

    Raises:
        ValueError: plans with different slot counts, naming the option.
    """
    if expert_map is None:
        return None
    data = _read_map(expert_map)
    plans = list(data["layers"].values()) if isinstance(data, dict) and "layers" in data \
        else [data]
    counts = {len(p.get("physical_to_logical", ())) if isinstance(p, dict) else len(p)
              for p in plans}
    if len(counts) != 1:
        raise ValueError(f"{EXPERT_MAP_FLAG}: "
                         f"its plans have different slot counts {sorted(counts)}; every layer "
                         f"needs the same (one balance run with one --redundant)")
    return counts.pop()


def physical_to_logical_for_layer(expert_map, layer_number: Optional[int]):
    """The `physical_to_logical` list the `expert_map` option gives one layer (None: none).

    Args:
        expert_map: the option (see `DeepEPOptions.expert_map`).
        layer_number: the MoE layer's `layer_number` (None: unbound, takes layer "0" or the
            only plan).

    Raises:
        ValueError: the map has no plan for this layer or is malformed (naming the option).
    """
    if expert_map is None:
        return None
    data = _read_map(expert_map)
    if isinstance(data, dict) and "layers" in data:
        layers = {str(k): v for k, v in data["layers"].items()}
        plan = layers.get(str(layer_number))
        if plan is None and len(layers) == 1:
            plan = next(iter(layers.values()))
        if plan is None:
            plan = layers.get("0")
        if plan is None:
            raise ValueError(
                f"{EXPERT_MAP_FLAG} has no plan for layer {layer_number} (layers "
                f"{sorted(layers)}) and no layer 0 for all")
        data = plan
    if isinstance(data, dict):
        data = data.get("physical_to_logical")
    if not isinstance(data, (list, tuple)) or not all(isinstance(v, int) for v in data):
        raise ValueError(f"{EXPERT_MAP_FLAG}: expected a balance plan or a physical_to_logical "
                         f"list of ints")
    return [int(v) for v in data]
