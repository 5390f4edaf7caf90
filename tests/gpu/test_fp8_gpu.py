"""GPU tier: the standalone FP8 kernels (`cuda_src/fp8.cu`'s dequantize, the test-only
`cuda_src/bench/quantize.cu`) bit-exact against the torch reference.

Same input classes and hidden sizes as the CPU tier. fp8 bytes, scale bits and bf16 bits must be
equal, except that a NaN only has to be a NaN (its sign bit is not part of the format).
"""

from __future__ import annotations

import pytest
import torch

from megatron_deepep import ops
from megatron_deepep.fp8 import formats as F
from megatron_deepep.ops.bench.quantize import quantize_rows
from tests.fp8.test_fp8_formats import ALL_FORMATS, FORMAT_IDS, HIDDENS, KINDS, make_input

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _assert_fp8_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    a, e = actual.view(torch.uint8).cpu(), expected.view(torch.uint8)
    a_nan, e_nan = (a & 0x7F) == 0x7F, (e & 0x7F) == 0x7F
    assert torch.equal(a_nan, e_nan), "NaN positions differ"
    diff = (a != e) & ~e_nan
    assert not bool(diff.any()), f"{int(diff.sum())} fp8 bytes differ, first at {diff.nonzero()[0]}"


def _assert_scales_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    a = actual.cpu()
    if a.dtype == torch.float32:
        a, expected = a.view(torch.int32), expected.view(torch.int32)
    diff = a != expected
    assert not bool(diff.any()), f"{int(diff.sum())} scales differ, first at {diff.nonzero()[0]}"


def _assert_bf16_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    a, e = actual.cpu(), expected
    assert torch.equal(torch.isnan(a), torch.isnan(e)), "NaN positions differ"
    finite = ~torch.isnan(e)
    diff = (a.view(torch.int16) != e.view(torch.int16)) & finite
    assert not bool(diff.any()), f"{int(diff.sum())} bf16 differ, first at {diff.nonzero()[0]}"


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_matches_reference(fmt, hidden, kind):
    x = make_input(kind, 37, hidden, seed=1)
    q_ref, s_ref = F.quantize(x, fmt)
    q, s = quantize_rows(x.cuda(), fmt)
    torch.cuda.synchronize()
    _assert_fp8_equal(q, q_ref)
    _assert_scales_equal(s, s_ref)

    # Dequantize the reference's bytes so the check does not depend on the quantize kernel.
    y = ops.dequantize_rows(q_ref.cuda(), s_ref.cuda(), fmt)
    torch.cuda.synchronize()
    _assert_bf16_equal(y, F.dequantize(q_ref, s_ref, fmt))


@pytest.mark.parametrize("fmt", [F.BLOCKWISE_1x128, F.MXFP8_1x32], ids=lambda f: f.name)
@pytest.mark.parametrize("num_tokens", [0, 1, 4097])
def test_cuda_token_counts(fmt, num_tokens):
    x = make_input("random", max(num_tokens, 4), 7168, seed=2)[:num_tokens].contiguous()
    q, s = quantize_rows(x.cuda(), fmt)
    y = ops.dequantize_rows(q, s, fmt)
    torch.cuda.synchronize()
    q_ref, s_ref = F.quantize(x, fmt)
    _assert_fp8_equal(q, q_ref)
    _assert_scales_equal(s, s_ref)
    _assert_bf16_equal(y, F.dequantize(q_ref, s_ref, fmt))


@pytest.mark.parametrize("num_warps", [1, 4])
def test_cuda_cta_sizes(num_warps):
    x = make_input("nan_inf", 9, 2880, seed=4)
    for fmt in (F.BLOCKWISE_1x128, F.MXFP8_1x32):
        q, s = quantize_rows(x.cuda(), fmt, num_warps=num_warps)
        torch.cuda.synchronize()
        q_ref, s_ref = F.quantize(x, fmt)
        _assert_fp8_equal(q, q_ref)
        _assert_scales_equal(s, s_ref)
