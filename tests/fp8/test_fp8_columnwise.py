"""CPU tier: the columnwise (128x1) copy of rowwise FP8 rows (`fp8.columnwise`), the reference
`cuda_src/fp8_columnwise.cu` must equal bit for bit (tests/gpu/test_fp8_columnwise_gpu.py).

Hand-computed small cases (pow-2 and fp32 scales, a partial block, a zero block, a NaN, a padded
expert, an empty expert, the bf16 rounding of the dequantized rows), and a cross-check on random
rows: TE's 128x1 columnwise blocks of X are its 1x128 rowwise blocks of X^T, so the reference
must equal `formats.quantize` (bit-exact with TE's rowwise quantizer) of the transpose.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_deepep.fp8 import columnwise as C
from megatron_deepep.fp8 import formats as F

H = 128
SPLITS = [16, 0, 144, 16]  # the last: 6 real rows and 10 padding rows (zero bytes)


def _e4m3(value: float) -> int:
    return int(F.to_e4m3(torch.tensor([value])).view(torch.uint8))


def _rows():
    """Rowwise FP8 rows (bytes from exact values) and their 1x128 scale_inv, by hand."""
    values = torch.zeros(sum(SPLITS), H)
    row_scales = torch.ones(sum(SPLITS), 1)
    values[0:16, 0] = torch.arange(1, 17, dtype=torch.float32)  # expert 0, column 0: 1..16
    values[0:16, 2] = 2.0  # column 2: 2.0 and one NaN
    values[3, 2] = float("nan")
    # Expert 2 (rows 16..159): block 0 = rows 16..143, block 1 = rows 144..159.
    values[16 + 5, 0] = 2.0
    values[16 + 130, 0] = 0.125
    row_scales[16 + 130] = 4.0  # dequantizes to 0.5
    values[16 + 7, 3] = 1.125
    row_scales[16 + 7] = 1.0 + 2.0 ** -10  # the product 1.12610 rounds to bf16 1.125
    # Expert 3 (rows 160..175): rows 166.. are padding with scale 0.
    values[160 + 2, 0] = -3.0
    row_scales[166:] = 0.0
    return F.to_e4m3(values), row_scales


def test_hand_computed_pow2_scales():
    x_fp8, scales = _rows()
    parts = C.reference(x_fp8, scales, SPLITS, power_2_scale=True)
    assert [tuple(d.shape) for d, _ in parts] == [(H, 16), (H, 0), (H, 144), (H, 16)]
    assert [tuple(s.shape) for _, s in parts] == [(1, H), (0, H), (2, H), (1, H)]
    assert all(d.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 for d, s in parts)
    (d0, s0), _, (d2, s2), (d3, s3) = [(d.view(torch.uint8), s) for d, s in parts]
    # Expert 0, column 0: amax 16 -> 448 / 16 = 28 -> 16 (pow 2); data 16 v.
    assert d0[0].tolist() == [_e4m3(16.0 * v) for v in range(1, 17)]
    assert s0[0, 0] == 1.0 / 16
    # Column 1, an all-zero block: scale 1, data 0.
    assert s0[0, 1] == 1.0 and not d0[1].any()
    # Column 2: the NaN does not enter the amax (2 -> 224 -> 128) and stays NaN (0x7F).
    assert s0[0, 2] == 1.0 / 128
    assert d0[2].tolist() == [0x7F if t == 3 else _e4m3(256.0) for t in range(16)]
    assert (s0[0, 3:] == 1.0).all() and not d0[3:].any()
    # Expert 2, column 0: block 0 holds 2.0 (scale 128), the partial block 1 holds 0.5 (scale
    # 512): both store 256.
    assert s2[0, 0] == 1.0 / 128 and s2[1, 0] == 1.0 / 512
    assert d2[0, 5] == _e4m3(256.0) and d2[0, 130] == _e4m3(256.0)
    assert int(torch.count_nonzero(d2[0])) == 2
    # Column 3: the dequantized 1.125 (bf16) -> 448 / 1.125 -> 256; 1.125 * 256 = 288.
    assert s2[0, 3] == 1.0 / 256 and d2[3, 7] == _e4m3(288.0) and s2[1, 3] == 1.0
    # Expert 3 (padded): only the real row counts: amax 3 -> 149.3 -> 128; -3 * 128 = -384.
    assert s3[0, 0] == 1.0 / 128
    assert d3[0].tolist() == [_e4m3(-384.0) if t == 2 else 0 for t in range(16)]


def test_hand_computed_fp32_scales_see_the_bf16_rows():
    x_fp8, scales = _rows()
    (d0, s0), _, (d2, s2), _ = C.reference(x_fp8, scales, SPLITS, power_2_scale=False)
    # Expert 0, column 0: scale 448 / 16 = 28 exactly; 16 * 28 = 448, 3 * 28 = 84 -> 80 (RNE).
    assert s0[0, 0] == torch.tensor(1.0 / 28, dtype=torch.float64).float()
    assert d0.view(torch.uint8)[0, 15] == _e4m3(448.0) and d0.view(torch.uint8)[0, 2] == \
        _e4m3(80.0)
    # Expert 2, column 3: the scale comes from the bf16 value 1.125, not the fp32 product.
    def scale_inv(amax):
        scale = torch.tensor(448.0) / torch.tensor(amax, dtype=torch.float32)
        return (1.0 / scale.double()).float()

    product = torch.tensor(1.125) * torch.tensor(1.0 + 2.0 ** -10)
    assert s2[0, 3] == scale_inv(1.125) and s2[0, 3] != scale_inv(float(product))


def test_epsilon_floors_the_amax():
    x_fp8, scales = _rows()
    (_, s0), *_ = C.reference(x_fp8, scales, SPLITS, power_2_scale=True, amax_epsilon=64.0)
    assert s0[0, 0] == 1.0 / 4  # amax 16 -> 64: 448 / 64 = 7 -> 4
    assert s0[0, 1] == 1.0 / 4  # the zero block too (the floor applies before the zero test)


@pytest.mark.parametrize("power_2_scale,amax_epsilon", [(True, 0.0), (False, 0.0),
                                                        (False, 1e-3)])
@pytest.mark.parametrize("splits,hidden", [([128, 16, 0, 272], 256), ([48, 0, 0], 7168 // 4),
                                           ([0], 64), ([384, 32], 2880)])
def test_columnwise_is_rowwise_of_the_transpose(splits, hidden, power_2_scale, amax_epsilon):
    gen = torch.Generator().manual_seed(sum(splits) + hidden)
    x = torch.randn(sum(splits), hidden, generator=gen) * torch.rand(sum(splits), 1,
                                                                      generator=gen) * 30
    x_fp8, scales = F.quantize(x.bfloat16(), F.BLOCKWISE_1x128)
    parts = C.reference(x_fp8, scales, splits, power_2_scale=power_2_scale,
                        amax_epsilon=amax_epsilon)
    x_bf16 = F.dequantize(x_fp8, scales, F.BLOCKWISE_1x128)
    fmt = dataclasses.replace(F.BLOCKWISE_1x128, power_2_scale=power_2_scale,
                              amax_epsilon=amax_epsilon)
    rows, _ = C.layout(splits)
    for (data, scale_inv), r0, r1 in zip(parts, rows[:-1], rows[1:]):
        want_data, want_scales = F.quantize(x_bf16[r0:r1].t().contiguous(), fmt)
        assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8))
        assert torch.equal(scale_inv[:, :hidden], want_scales.t())
        assert not scale_inv[:, hidden:].any()


def test_layout_and_pack():
    splits = [16, 0, 144, 16]
    rows, blocks = C.layout(splits)
    assert rows == [0, 16, 16, 160, 176] and blocks == [0, 1, 1, 3, 4]
    assert C.scale_columns(4096) == 4096 and C.scale_columns(4098) == 4100
    x_fp8, scales = _rows()
    parts = C.reference(x_fp8, scales, splits)
    data, scale_inv = C.pack(parts, H)
    assert data.shape == (H * 176,) and scale_inv.shape == (4, H)
    for (d, s), r0, r1, b0, b1 in zip(parts, rows[:-1], rows[1:], blocks[:-1], blocks[1:]):
        assert torch.equal(data[H * r0:H * r1].view(H, r1 - r0), d.view(torch.uint8))
        assert torch.equal(scale_inv[b0:b1], s)
    offsets = C.device_offsets(rows, "cpu")
    assert offsets.dtype == torch.int32 and offsets.tolist() == rows


def test_reference_checks_the_splits():
    x_fp8, scales = _rows()
    with pytest.raises(ValueError, match="splits sum to 175"):
        C.reference(x_fp8, scales, [16, 0, 143, 16])
