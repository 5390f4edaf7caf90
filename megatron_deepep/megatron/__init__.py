"""Megatron-LM integration: the `deepep` token dispatcher and its runtime registration.

    import megatron_deepep.megatron as mdm
    mdm.register_deepep_dispatcher()   # then --moe-token-dispatcher-type deepep works

Importing this package imports megatron-core; `megatron_deepep` itself does not need it.
"""

from megatron_deepep.megatron.dispatcher import (
    DISPATCHER_TYPE,
    DeepEPOptions,
    DeepEPTokenDispatcher,
    resolve_options,
    routing_map_to_topk,
)
from megatron_deepep.megatron.register import (
    check_config,
    is_registered,
    register_deepep_dispatcher,
    unregister_deepep_dispatcher,
)

__all__ = [
    "DISPATCHER_TYPE",
    "DeepEPOptions",
    "DeepEPTokenDispatcher",
    "check_config",
    "is_registered",
    "register_deepep_dispatcher",
    "resolve_options",
    "routing_map_to_topk",
    "unregister_deepep_dispatcher",
]
