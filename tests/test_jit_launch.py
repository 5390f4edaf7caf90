"""CPU tier: kernel arguments are packed into 8-byte slots exactly as cuLaunchKernel reads them."""

from __future__ import annotations

import ctypes
import struct

import numpy as np
import pytest

from megatron_deepep import jit


def test_packer_slots_and_parameter_array():
    args = [np.uint64(0x1122334455667788), np.int32(-5), np.uint32(7), np.float32(1.5)]
    signature = jit._signature_of(args)
    params = signature.params(args)
    buffer = signature._local.buffer
    raw = buffer.raw[:32]
    assert struct.unpack_from("<Q", raw, 0)[0] == 0x1122334455667788
    assert struct.unpack_from("<i", raw, 8)[0] == -5
    assert struct.unpack_from("<I", raw, 16)[0] == 7
    assert struct.unpack_from("<f", raw, 24)[0] == 1.5
    base = ctypes.addressof(buffer)
    assert [params[i] for i in range(4)] == [base + 8 * i for i in range(4)]
    assert jit._signature_of(args) is signature  # one signature per argument types


def test_packer_rejects_untyped_arguments():
    with pytest.raises(TypeError, match="numpy scalars"):
        jit._signature_of([np.int32(1), 3])
