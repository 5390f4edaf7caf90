"""CPU tier: the wrap-safe compare of epoch flags and NVSHMEM signals (`epoch_reached` of
`cuda_src/common/error.cuh`, which `net::signal_reached` of `cuda_src/internode/net.cuh` uses).

Epochs are 32-bit and restart at 0 after 2^32 calls; the internode signals are 64-bit words that
carry such an epoch (or a running chunk count). A host model of the compare is checked against
the kernels' function evaluated by NVRTC, and a model of one signal across the wrap shows what
the plain 64-bit `>=` did: a wait that passes before the peer arrived, and one that never ends.
"""

from __future__ import annotations

import pytest

from megatron_deepep.kernels import jit

pytest.importorskip("cuda.bindings.nvrtc")

U32 = 1 << 32


def reached(seen: int, need: int) -> bool:
    """The host model: the signed difference of the low 32 bits is >= 0."""
    diff = (seen - need) % U32
    return diff < (1 << 31)


def plain_ge(seen: int, need: int) -> bool:
    """The compare before: a 64-bit `>=` of a signal holding a 32-bit epoch."""
    return seen >= need


CASES = [(5, 5), (6, 5), (4, 5), (0, U32 - 1), (U32 - 1, 0), (1, U32 - 1), (U32 - 1, U32 - 2),
         (0x80000000, 0), (0x7FFFFFFF, 0), (U32 + 3, 2), (2, U32 + 3), (1 << 40, (1 << 40) + 1)]


def test_host_model_matches_the_kernels_compare():
    body = '#include "common/error.cuh"\n' + "\n".join(
        f'static_assert(mdeep::epoch_reached({s % U32}u, {n % U32}u) == '
        f'{str(reached(s, n)).lower()}, "epoch_reached({s}, {n})");' for s, n in CASES)
    jit.compile_code(body + "\n", "signal_compare.cu")


def test_the_check_can_fail():
    with pytest.raises(jit.CompileError, match="epoch_reached"):
        jit.compile_code('#include "common/error.cuh"\nstatic_assert(mdeep::epoch_reached(0u, '
                         '4294967295u) == false, "epoch_reached(0, 2^32 - 1)");\n',
                         "signal_compare_fail.cu")


def _waits_across_the_wrap(compare, first: int, calls: int):
    """One rail signal over `calls` calls from epoch `first`: the peer sets it to each call's
    32-bit epoch, and this rank waits for (a) this call's epoch before reading and (b) the
    previous call's epoch (the ack of the slots it reuses), once the peer is a call ahead.
    Returns the first (call, wait) the compare gets wrong."""
    for k in range(calls):
        epoch = (first + k) % U32
        previous = (epoch - 1) % U32
        signal_before = previous                # the peer has not sent this call yet
        if compare(signal_before, epoch):
            return epoch, "passed before the peer sent this call"
        signal_after = epoch                    # the peer is one call ahead of the ack wait
        if not compare(signal_after, previous):
            return epoch, "never sees the previous call's ack"
        if not compare(signal_after, epoch):
            return epoch, "never sees this call"
    return None


def test_wrap_safe_compare_holds_across_the_wrap():
    assert _waits_across_the_wrap(reached, U32 - 3, 8) is None


def test_plain_64_bit_compare_fails_at_the_wrap():
    assert _waits_across_the_wrap(plain_ge, 1, 8) is None  # fine far from the wrap
    failure = _waits_across_the_wrap(plain_ge, U32 - 3, 8)
    assert failure is not None and failure[0] == 0, failure
