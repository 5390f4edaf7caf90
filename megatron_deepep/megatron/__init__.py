"""Megatron-LM integration: the `deepep` token dispatcher and its runtime registration.

    import megatron_deepep.megatron as mdm
    mdm.register_deepep_dispatcher()   # then --moe-token-dispatcher-type deepep works
    mdm.register_deepep_dispatcher(fp8_dispatch="auto")   # FP8 dispatch (TE recipe's format)

Modules: `options` (the dispatcher's options and the one config check), `dispatcher`, `metrics`
(per-layer communication and load metrics), `patching` (every change made to megatron-core, and
its undo) and `register` (the public plugin calls and CLI flags).

Importing this package imports megatron-core; `megatron_deepep` itself does not need it.
"""

from megatron_deepep.megatron.dispatcher import DeepEPTokenDispatcher, routing_map_to_topk
from megatron_deepep.megatron.options import (
    DISPATCHER_TYPE,
    FP8_DISPATCH_CHOICES,
    TRANSPORT_CHOICES,
    DeepEPOptions,
    check_config,
    fp8_format_for_option,
    resolve_options,
)
from megatron_deepep.megatron.register import (
    add_arguments,
    apply_arguments,
    is_registered,
    register_deepep_dispatcher,
    unregister_deepep_dispatcher,
)

__all__ = [
    "DISPATCHER_TYPE",
    "FP8_DISPATCH_CHOICES",
    "TRANSPORT_CHOICES",
    "DeepEPOptions",
    "DeepEPTokenDispatcher",
    "add_arguments",
    "apply_arguments",
    "check_config",
    "fp8_format_for_option",
    "is_registered",
    "register_deepep_dispatcher",
    "resolve_options",
    "routing_map_to_topk",
    "unregister_deepep_dispatcher",
]
