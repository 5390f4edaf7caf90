"""Host-side mirrors of what the kernels compute, which only the tests (and `dev/`) need: the
CPU tier checks them against the device code compiled by NVRTC, then uses them to stand in for
a kernel's writes or to read its arguments back."""

from __future__ import annotations

import ctypes

from megatron_deepep.kernels.jit import Ptr


def host_word(value: int, epoch: int) -> int:
    """The 64-bit word `host_word` of host_info.cuh stores: (value << 32) | epoch (unsigned)."""
    return ((value & 0xFFFFFFFF) << 32) | (epoch & 0xFFFFFFFF)


def counts_half(epoch: int) -> int:
    """The half of `Meta.counts` notify writes and reads at `epoch` (buffer.cuh)."""
    return epoch & 1


def args_dict(args: ctypes.Structure) -> dict:
    """A filled `KernelArgs` as field name -> value (pointers as ints, 0 for null)."""
    return {name: (getattr(args, name) or 0) if ctype is Ptr else getattr(args, name)
            for name, ctype in args._fields_}
