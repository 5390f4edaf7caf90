"""megatron_deepep: a Megatron-LM MoE token dispatcher on our own NVLink kernels."""

from megatron_deepep import autograd
from megatron_deepep.buffer import Buffer, get_buffer
from megatron_deepep.events import EventHandle
from megatron_deepep.handle import DispatchHandle
from megatron_deepep.layout import DispatchLayout
from megatron_deepep.transport.errors import PeerTimeoutError

__all__ = ["Buffer", "get_buffer", "EventHandle", "DispatchHandle", "DispatchLayout",
           "PeerTimeoutError", "autograd"]
__version__ = "0.1.0"
