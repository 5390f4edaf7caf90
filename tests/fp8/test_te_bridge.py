"""`fp8.te_bridge` without Transformer Engine: layouts by TE version, shape rules, fallbacks.

TE is mocked where a test needs it: a fake quantizer allocates the buffers the way the given TE
version does (`Float8BlockQuantizer.get_scale_shape`, `MXFP8Quantizer::create_tensor`), and
`_te_rowwise_dequantize` transcribes TE 2.20's `_dequantize_vectorwise` (rowwise), so the
layouts are checked at the shapes where they coincide (N == ceil(H / 128), N % 4 == 0).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_deepep.fp8 import formats as F
from megatron_deepep.fp8 import te_bridge as B

# (N, H) where GEMM-ready [ceil(H/128), round_up(N, 4)] == compact [N, ceil(H/128)].
COINCIDING = [(4, 512), (56, 7168)]
OTHER = [(13, 2048), (64, 2880)]


def _rows(n, h, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, generator=g) * torch.logspace(-3, 3, h)).to(torch.bfloat16)


def _te_rowwise_dequantize(q_u8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """TE 2.20 `Float8BlockwiseQTensorStorage._dequantize_vectorwise`, rowwise, 2-D input."""
    q_m, q_k = q_u8.shape
    q = q_u8
    if q_k % 128:
        q = torch.nn.functional.pad(q, (0, 128 - q_k % 128))
    tiled_dim, untiled_dim = scale_inv.shape
    q_tiled = q.reshape(q_m, tiled_dim, 128)
    if untiled_dim > q_m:
        scale_inv = scale_inv[:, :q_m].contiguous()
    dq_scale = scale_inv.transpose(-2, -1).contiguous().reshape(q_m, tiled_dim, 1)
    out = q_tiled.view(torch.float8_e4m3fn).float() * dq_scale
    return out.reshape(q_m, -1)[:, :q_k].to(torch.bfloat16)


def test_parse_version():
    assert B.parse_version("2.20.2") == (2, 20, 2)
    assert B.parse_version("2.5.0.dev0+abc123") == (2, 5, 0)
    assert B.parse_version("2.12") == (2, 12, 0)
    assert B.parse_version("") == (0, 0, 0)


class _Quantizer:
    def __init__(self, all_gather_usage=False):
        self.all_gather_usage = all_gather_usage


@pytest.mark.parametrize("version,flag,layout", [
    ((2, 20, 2), False, B.GEMM_READY),
    ((2, 20, 2), True, B.GEMM_READY),    # the flag is gone from 2.12 on
    ((2, 12, 0), True, B.GEMM_READY),
    ((2, 11, 0), True, B.COMPACT),
    ((2, 5, 0), True, B.COMPACT),
    ((2, 8, 1), False, B.GEMM_READY),
    ((2, 4, 0), True, B.GEMM_READY),     # before the flag existed
])
def test_layout_is_chosen_by_version(version, flag, layout):
    assert B.blockwise_scale_layout(version, _Quantizer(flag)) == layout
    assert B.blockwise_scale_layout(version, None) == B.GEMM_READY


@pytest.mark.parametrize("n,h", COINCIDING + OTHER)
def test_gemm_ready_scales_dequantize_like_the_wire(n, h):
    q, s = F.quantize(_rows(n, h, 1), F.BLOCKWISE_1x128)
    buffer = B.to_te_scales(s, B.GEMM_READY)
    assert tuple(buffer.shape) == (math.ceil(h / 128), 4 * math.ceil(n / 4))
    got = _te_rowwise_dequantize(q.view(torch.uint8), buffer)
    assert torch.equal(got.view(torch.int16),
                       F.dequantize(q, s, F.BLOCKWISE_1x128).view(torch.int16))
    assert torch.equal(B.from_te_scales(buffer, B.GEMM_READY, n), s)
    assert torch.equal(B.from_te_scales(B.to_te_scales(s, B.COMPACT), B.COMPACT, n), s)


@pytest.mark.parametrize("n,h", COINCIDING)
def test_coinciding_shapes_need_the_transpose(n, h):
    """What the old shape-based choice did at these shapes: untransposed scales, wrong values."""
    q, s = F.quantize(_rows(n, h, 1), F.BLOCKWISE_1x128)
    assert B.blockwise_scale_shape(B.GEMM_READY, n, h) == B.blockwise_scale_shape(B.COMPACT, n, h)
    wrong = _te_rowwise_dequantize(q.view(torch.uint8), s.clone())
    assert not torch.equal(wrong, F.dequantize(q, s, F.BLOCKWISE_1x128))


def test_gemm_shape_rules():
    assert B.gemm_shape_reason(F.BLOCKWISE_1x128, 16, 7168) == ""
    assert B.gemm_shape_reason(F.BLOCKWISE_1x128, 0, 2880) == ""
    reason = B.gemm_shape_reason(F.BLOCKWISE_1x128, 13, 2048)
    assert "rows % 8" in reason and "rows=13" in reason and "assert_dim_for_fp8_exec" in reason
    assert "hidden % 16" in B.gemm_shape_reason(F.BLOCKWISE_1x128, 16, 136)
    reason = B.gemm_shape_reason(F.MXFP8_1x32, 56, 7168)
    assert "rows % 32" in reason and "MXFP8" in reason
    assert B.gemm_shape_reason(F.MXFP8_1x32, 64, 2880) == ""
    assert "hidden % 32" in B.gemm_shape_reason(F.MXFP8_1x32, 64, 2064)


# ---- to_te_tensor against a fake TE --------------------------------------------------------------

_TE_LAYOUT = B.blockwise_scale_layout  # what the fake TE allocates, even when a test patches B


class _FakeTensor:
    pass


class _FakeQuantizer:
    """Allocates rowwise buffers as TE `version` does; MXFP8 raises like quantizer.cpp."""

    def __init__(self, version, mxfp8=False, all_gather_usage=False):
        self.version, self.mxfp8, self.all_gather_usage = version, mxfp8, all_gather_usage

    def make_empty(self, shape, dtype, device):
        n, h = shape
        t = _FakeTensor()
        t._rowwise_data = torch.empty(n, h, dtype=torch.uint8)
        if self.mxfp8:
            if n % 32 or h % 32:
                raise RuntimeError("quantizer.cpp:1514 in function create_tensor: MXFP8 ...")
            t._rowwise_scale_inv = torch.full(B.mxfp8_scale_shape(n, h), 7, dtype=torch.uint8)
        else:
            layout = _TE_LAYOUT(self.version, self)
            t._rowwise_scale_inv = torch.full(B.blockwise_scale_shape(layout, n, h), float("nan"))
        t._quantizer = self
        return t


@pytest.fixture
def fake_te(monkeypatch):
    state = {"version": (2, 20, 2), "quantizer": None}
    monkeypatch.setattr(B, "te_available", lambda: (True, ""))
    monkeypatch.setattr(B, "te_version", lambda: state["version"])

    def rowwise_quantizer(fmt, quantizer):
        if quantizer is None:
            quantizer = state["quantizer"] or _FakeQuantizer(
                state["version"], mxfp8=fmt.scale_kind is F.ScaleKind.E8M0)
        return quantizer

    monkeypatch.setattr(B, "_rowwise_quantizer", rowwise_quantizer)
    return state


@pytest.mark.parametrize("n,h", COINCIDING + OTHER[:1] + [(16, 2880)])
def test_to_te_tensor_gemm_ready_on_te_2_20(fake_te, n, h):
    q, s = F.quantize(_rows(n, h, 2), F.BLOCKWISE_1x128)
    t = B.to_te_tensor(q, s, F.BLOCKWISE_1x128, check_gemm_shape=False)
    got = _te_rowwise_dequantize(t._rowwise_data, t._rowwise_scale_inv)
    assert torch.equal(got.view(torch.int16),
                       F.dequantize(q, s, F.BLOCKWISE_1x128).view(torch.int16))
    back_q, back_s = B.from_te_tensor(t)
    assert torch.equal(back_q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(back_s, s)


@pytest.mark.parametrize("n,h", COINCIDING)
def test_to_te_tensor_compact_on_te_2_8_all_gather(fake_te, n, h):
    fake_te["version"] = (2, 8, 0)
    fake_te["quantizer"] = _FakeQuantizer((2, 8, 0), all_gather_usage=True)
    q, s = F.quantize(_rows(n, h, 3), F.BLOCKWISE_1x128)
    t = B.to_te_tensor(q, s, F.BLOCKWISE_1x128, check_gemm_shape=False)
    assert torch.equal(t._rowwise_scale_inv, s)
    assert torch.equal(B.from_te_tensor(t)[1], s)


def test_to_te_tensor_refuses_an_unknown_layout(fake_te, monkeypatch):
    q, s = F.quantize(_rows(24, 2048), F.BLOCKWISE_1x128)
    # A TE that allocates something else than the version's layout: raise, do not guess.
    monkeypatch.setattr(B, "te_version", lambda: (2, 8, 0))
    fake_te["quantizer"] = _FakeQuantizer((2, 8, 0), all_gather_usage=False)
    monkeypatch.setattr(B, "blockwise_scale_layout", lambda version, quantizer: B.COMPACT)
    with pytest.raises(B.TEUnavailableError, match="scale buffer"):
        B.to_te_tensor(q, s, F.BLOCKWISE_1x128)


def test_to_te_tensor_checks_te_shape_rules(fake_te, monkeypatch):
    q, s = F.quantize(_rows(13, 2048), F.BLOCKWISE_1x128)
    with pytest.raises(B.TEUnavailableError, match="rows % 8"):
        B.to_te_tensor(q, s, F.BLOCKWISE_1x128)
    q, s = F.quantize(_rows(12, 2056), F.BLOCKWISE_1x128)
    with pytest.raises(B.TEUnavailableError, match="hidden % 16"):
        B.to_te_tensor(q, s, F.BLOCKWISE_1x128)


@pytest.mark.parametrize("n", [56, 13, 4])
def test_mxfp8_rows_not_multiple_of_32_fall_back(fake_te, n):
    q, s = F.quantize(_rows(n, 2048), F.MXFP8_1x32)
    for check in (True, False):
        with pytest.raises(B.TEUnavailableError, match=r"rows % (8|32) == 0"):
            B.to_te_tensor(q, s, F.MXFP8_1x32, check_gemm_shape=check)


def test_te_runtime_error_becomes_unavailable(fake_te, monkeypatch):
    # A TE rule this module does not check: TE's RuntimeError becomes TEUnavailableError.
    monkeypatch.setattr(B, "_mxfp8_shape_reason", lambda fmt, n, h: "")
    q, s = F.quantize(_rows(56, 2048), F.MXFP8_1x32)
    with pytest.raises(B.TEUnavailableError, match="TE refused"):
        B.to_te_tensor(q, s, F.MXFP8_1x32, check_gemm_shape=False)


def test_mxfp8_layout(fake_te):
    q, s = F.quantize(_rows(64, 2880), F.MXFP8_1x32)
    t = B.to_te_tensor(q, s, F.MXFP8_1x32)
    assert tuple(t._rowwise_scale_inv.shape) == (128, 92)
    assert torch.equal(t._rowwise_scale_inv[:64, :90], s)
    assert int(t._rowwise_scale_inv[64:].abs().sum()) == 0
    assert int(t._rowwise_scale_inv[:, 90:].sum()) == 0


# ---- per-expert split ----------------------------------------------------------------------------

@pytest.mark.parametrize("splits", [[4, 0, 13, 16], [0], [32], [1, 2, 3, 5, 8, 0, 0, 7]])
def test_pack_split_scales(splits):
    n, h = sum(splits), 2880
    _, s = F.quantize(_rows(n, h, 4), F.BLOCKWISE_1x128)
    packed = B.pack_split_scales(s, splits)
    rows, _ = B.split_offsets(splits)
    assert len(packed) == len(splits)
    for r0, r1, buf in zip(rows[:-1], rows[1:], packed):
        assert buf.is_contiguous()
        assert torch.equal(buf, B.to_te_scales(s[r0:r1], B.GEMM_READY))


def test_split_offsets():
    assert B.split_offsets([4, 0, 13, 16]) == ([0, 4, 4, 17, 33], [0, 4, 4, 20, 36])


# ---- handoff -------------------------------------------------------------------------------------

class _QParams:
    power_2_scale, amax_epsilon = True, 0.0


class _Fmt:
    name = "E4M3"


class Float8BlockScaling:
    fp8_format, fp8_quant_fwd_inp, x_block_scaling_dim = _Fmt(), _QParams(), 1

    def __init__(self, backward_override=None):
        self.backward_override = backward_override


class MXFP8BlockScaling:
    fp8_format, backward_override = _Fmt(), None


def test_handoff_reason(fake_te):
    recipe = Float8BlockScaling()
    assert B.handoff_reason(F.BLOCKWISE_1x128, False, recipe) == (True, "")
    ok, why = B.handoff_reason(F.BLOCKWISE_1x128, True, recipe)
    assert not ok and "columnwise" in why and "te_experts" in why
    assert B.handoff_reason(F.BLOCKWISE_1x128, True, recipe,
                            experts_make_columnwise=True) == (True, "")
    assert B.handoff_reason(F.BLOCKWISE_1x128, True, Float8BlockScaling("dequantized"))[0]
    ok, why = B.handoff_reason(F.BLOCKWISE_1x128, False, recipe, num_rows=12, hidden=7168)
    assert not ok and "rows % 8" in why
    ok, why = B.handoff_reason(F.MXFP8_1x32, True, MXFP8BlockScaling(),
                               experts_make_columnwise=True)
    assert not ok  # the experts make a blockwise columnwise copy only
    ok, why = B.handoff_reason(F.MXFP8_1x32, False, MXFP8BlockScaling(), num_rows=48,
                               hidden=7168)
    assert not ok and "rows % 32" in why


def test_without_te_everything_says_why():
    if B.te_available()[0]:
        pytest.skip("transformer_engine is installed; this checks the TE-absent path")
    assert B.te_version() == (0, 0, 0)
    assert not B.handoff_reason(F.BLOCKWISE_1x128, False, Float8BlockScaling())[0]
    with pytest.raises(B.TEUnavailableError):
        B.split_rowwise(torch.zeros(0, 128, dtype=torch.uint8), torch.zeros(0, 1), [0])
    assert B.is_wire_tensor(torch.zeros(1)) is False
    assert "transformer_engine" in B.columnwise_reason(torch.zeros(16, 128, dtype=torch.uint8))
    with pytest.raises(B.TEUnavailableError):
        B.columnwise_tensors(torch.zeros(0, dtype=torch.uint8), torch.zeros(0, 128), [0], 128)


def test_columnwise_reason_names_what_the_kernel_needs(monkeypatch):
    monkeypatch.setattr(B, "te_available", lambda: (True, ""))
    assert "cpu" in B.columnwise_reason(torch.zeros(16, 128, dtype=torch.uint8))
