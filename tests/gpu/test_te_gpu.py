"""GPU tier with Transformer Engine: `fp8.te_bridge` against real TE (2.20.2 on the H200).

Blockwise 1x128 end to end (TE's quantizer, dequantize and `te.Linear` on bridged tensors) at the
shapes where GEMM-ready and compact scale layouts coincide (N == ceil(H / 128), N % 4 == 0:
N=4 H=512, N=56 H=7168) and elsewhere; MXFP8 for layout and fallback only on Hopper (TE's MXFP8
kernels need sm_100). Run by dev/gpu/gpu_te.sh; skipped without TE or a GPU.
"""

from __future__ import annotations

import pytest
import torch

from megatron_deepep.fp8 import formats as F
from megatron_deepep.fp8 import te_bridge
from tests.gpu.marks import TE_GPU

pytestmark = TE_GPU

COINCIDING = [(4, 512), (56, 7168)]
OTHER = [(13, 2048), (64, 2880), (256, 7168)]


def _rows(n, h, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, generator=g) * torch.logspace(-3, 3, h)).to(torch.bfloat16)


def _te():
    import transformer_engine.pytorch as te

    return te


def _autocast(recipe):
    te = _te()
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def _blockwise_supported():
    ok = _te().is_fp8_block_scaling_available()
    return ok[0] if isinstance(ok, tuple) else bool(ok)


def test_te_version_is_read():
    import transformer_engine

    assert te_bridge.te_version() == te_bridge.parse_version(transformer_engine.__version__)
    assert te_bridge.te_version() >= (1, 0, 0)


@pytest.mark.parametrize("fmt", [F.BLOCKWISE_1x128, F.BLOCKWISE_1x128_FP32_SCALES],
                         ids=lambda f: f.name)
@pytest.mark.parametrize("n,h", COINCIDING + OTHER)
def test_te_quantizer_makes_the_wire_bytes(fmt, n, h):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    x = _rows(n, h)
    quantizer = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False,
                                     force_pow_2_scales=fmt.power_2_scale, block_scaling_dim=1)
    t = quantizer(x.cuda())
    q, s = F.quantize(x, fmt)
    back_q, back_s = te_bridge.from_te_tensor(t)
    assert torch.equal(back_q.view(torch.uint8).cpu(), q.view(torch.uint8))
    assert torch.equal(back_s.cpu(), s)


@pytest.mark.parametrize("n,h", COINCIDING + OTHER)
def test_bridge_dequantizes_like_the_wire(n, h):
    """Fails with the shape-based layout choice at N=4 H=512 and N=56 H=7168."""
    q, s = F.quantize(_rows(n, h, 1), F.BLOCKWISE_1x128)
    t = te_bridge.to_te_tensor(q.cuda(), s.cuda(), F.BLOCKWISE_1x128, check_gemm_shape=False)
    got = t.dequantize(dtype=torch.bfloat16).cpu()
    want = F.dequantize(q, s, F.BLOCKWISE_1x128)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("n,h,out", [(56, 7168, 512), (64, 2048, 1024), (256, 7168, 2048),
                                     (16, 1536, 256)])
def test_linear_on_bridged_rows_equals_te_quantizing_itself(n, h, out):
    if not _blockwise_supported():
        pytest.skip("TE: FP8 block scaling unavailable on this GPU")
    from transformer_engine.common.recipe import Float8BlockScaling

    te = _te()
    torch.manual_seed(0)
    lin = te.Linear(h, out, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = _rows(n, h, 2)
    q, s = F.quantize(x, F.BLOCKWISE_1x128)
    with torch.no_grad(), _autocast(Float8BlockScaling()):
        y_te = lin(x.cuda())
        y_wire = lin(te_bridge.to_te_tensor(q.cuda(), s.cuda(), F.BLOCKWISE_1x128))
    assert torch.equal(y_te, y_wire), (y_te.float() - y_wire.float()).abs().max().item()


def test_shape_rule_is_checked_before_the_handoff():
    from megatron_deepep import autograd

    q, s = F.quantize(_rows(13, 2048), F.BLOCKWISE_1x128)
    with pytest.raises(te_bridge.TEUnavailableError, match=r"rows % 8 == 0"):
        te_bridge.to_te_tensor(q.cuda(), s.cuda(), F.BLOCKWISE_1x128)
    rows = autograd._wrap_for_te((q.cuda(), s.cuda()), F.BLOCKWISE_1x128)
    assert type(rows) is torch.Tensor and rows.dtype == torch.bfloat16  # dequantized instead
    assert torch.equal(rows.cpu().view(torch.int16),
                       F.dequantize(q, s, F.BLOCKWISE_1x128).view(torch.int16))


@pytest.mark.parametrize("n", [56, 13, 100])
def test_mxfp8_falls_back_where_te_cannot_take_the_rows(n):
    """TE's MXFP8 quantizer raises RuntimeError for N % 32 != 0; the bridge must fall back."""
    from megatron_deepep import autograd

    q, s = F.quantize(_rows(n, 2048), F.MXFP8_1x32)
    for check in (True, False):
        with pytest.raises(te_bridge.TEUnavailableError, match=r"rows % (8|32) == 0"):
            te_bridge.to_te_tensor(q.cuda(), s.cuda(), F.MXFP8_1x32, check_gemm_shape=check)
    rows = autograd._wrap_for_te((q.cuda(), s.cuda()), F.MXFP8_1x32)
    assert type(rows) is torch.Tensor and rows.dtype == torch.bfloat16
    assert torch.equal(rows.cpu().view(torch.int16),
                       F.dequantize(q, s, F.MXFP8_1x32).view(torch.int16))


@pytest.mark.parametrize("n,h", [(64, 2048), (32, 2880), (128, 7168)])
def test_mxfp8_layout(n, h):
    """Layout only on Hopper: the scales sit unswizzled at `[round_up(N,128), round_up(H/32,4)]`."""
    q, s = F.quantize(_rows(n, h, 4), F.MXFP8_1x32)
    t = te_bridge.to_te_tensor(q.cuda(), s.cuda(), F.MXFP8_1x32)
    sinv = t._rowwise_scale_inv
    assert tuple(sinv.shape) == te_bridge.mxfp8_scale_shape(n, h)
    assert torch.equal(sinv[:n, :s.shape[1]].cpu(), s)
    assert int(sinv[n:].sum()) == 0 and int(sinv[:, s.shape[1]:].sum()) == 0
    assert torch.equal(t._rowwise_data.cpu(), q.view(torch.uint8))
    if torch.cuda.get_device_capability()[0] >= 10:
        got = t.dequantize(dtype=torch.bfloat16).cpu()
        assert torch.equal(got.view(torch.int16),
                           F.dequantize(q, s, F.MXFP8_1x32).view(torch.int16))


@pytest.mark.parametrize("splits", [[16, 0, 48, 32], [128], [0, 0, 16]])
def test_split_rowwise_matches_te_per_expert(splits):
    """Each expert's tensor equals TE quantizing that expert's rows itself."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    h = 2880
    x = _rows(sum(splits), h, 5)
    q, s = F.quantize(x, F.BLOCKWISE_1x128)
    parts = te_bridge.split_rowwise(q.cuda(), s.cuda(), splits)
    quantizer = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False,
                                     block_scaling_dim=1)
    start = 0
    for m, part in zip(splits, parts):
        assert tuple(part._rowwise_data.shape) == (m, h)
        if m:
            ref = quantizer(x[start:start + m].cuda())
            assert torch.equal(part._rowwise_data, ref._rowwise_data)
            assert torch.equal(part._rowwise_scale_inv, ref._rowwise_scale_inv)
        start += m
