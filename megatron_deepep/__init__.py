"""megatron_deepep: a Megatron-LM MoE token dispatcher on our own run-time compiled kernels.

Expert-parallel dispatch and combine over NVLink inside a node and NVSHMEM between nodes, on
CUDA kernels compiled at run time (NVRTC, nvJitLink), with a pure-torch reference transport
(the tests' oracle, and the fallback without CUDA). `Buffer` / `get_buffer` are the API,
`autograd` wraps them for training, `megatron_deepep.megatron` plugs them into Megatron-LM as
`--moe-token-dispatcher-type deepep`. Design: docs/design.md.
"""

from megatron_deepep import autograd
from megatron_deepep.buffer import Buffer, get_buffer
from megatron_deepep.events import EventHandle
from megatron_deepep.fp8.dispatch import Fp8Dispatch
from megatron_deepep.handle import DispatchHandle
from megatron_deepep.layout import DispatchLayout
from megatron_deepep.transport.errors import PeerTimeoutError

__all__ = ["Buffer", "get_buffer", "EventHandle", "DispatchHandle", "DispatchLayout",
           "Fp8Dispatch", "PeerTimeoutError", "autograd"]
__version__ = "0.1.0"
