"""Megatron-LM integration: the `deepep` token dispatcher and its runtime registration.

    import megatron_deepep.megatron as mdm
    mdm.register_deepep_dispatcher()   # then --moe-token-dispatcher-type deepep works
    mdm.register_deepep_dispatcher(fp8_dispatch="auto")   # FP8 dispatch (TE recipe's format)

Importing this package imports megatron-core; `megatron_deepep` itself does not need it.
"""

from megatron_deepep.megatron.dispatcher import (
    DISPATCHER_TYPE,
    FP8_DISPATCH_CHOICES,
    DeepEPOptions,
    DeepEPTokenDispatcher,
    fp8_format_for_option,
    resolve_options,
    routing_map_to_topk,
)
from megatron_deepep.megatron.register import (
    add_arguments,
    apply_arguments,
    check_config,
    is_registered,
    register_deepep_dispatcher,
    unregister_deepep_dispatcher,
)

__all__ = [
    "DISPATCHER_TYPE",
    "FP8_DISPATCH_CHOICES",
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
