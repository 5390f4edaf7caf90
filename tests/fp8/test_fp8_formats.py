"""CPU tier: FP8 wire formats against an independent element-wise oracle, plus NVRTC compiles.

The oracle below shares no code with `megatron_deepep.fp8.formats`: it restates TE's rules with
numpy fp32 scalar arithmetic per block, encodes e4m3 by nearest-value search in the table of all
e4m3 values (ties to the even code), and rounds to bf16 with its own bit arithmetic. Results must
agree bit for bit (fp8 bytes, scale bits, bf16 bits; NaN positions compared as NaN).
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_deepep.fp8 import formats as F
from tests.helpers import REPO_ROOT

REPO = Path(REPO_ROOT)
CUDA_SRC = REPO / "cuda_src"
HIDDENS = [2048, 2880, 4096, 7168]
KINDS = ["random", "zero_blocks", "huge", "tiny", "nan_inf"]
ALL_FORMATS = [
    F.BLOCKWISE_1x128,
    F.BLOCKWISE_1x128_FP32_SCALES,
    dataclasses.replace(F.BLOCKWISE_1x128_FP32_SCALES, name="blockwise_eps", amax_epsilon=1e-3),
    F.MXFP8_1x32,
]
FORMAT_IDS = [f.name for f in ALL_FORMATS]
BF16_MAX = float.fromhex("0x1.FEp127")


# ---- inputs --------------------------------------------------------------------------------------

def make_input(kind: str, num_tokens: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """`[num_tokens, hidden]` bf16 test data of one class."""
    g = torch.Generator().manual_seed(seed * 7919 + hidden)
    x = torch.randn(num_tokens, hidden, generator=g)
    # Per-token magnitudes spread over many binades.
    x = x * torch.exp2(torch.randint(-12, 12, (num_tokens, 1), generator=g).float())
    if kind == "zero_blocks":
        x[0] = 0
        x[1, :128] = 0
        x[2, 32:64] = 0
        x[3, -(hidden % 128 or 128):] = 0  # the (possibly partial) last block
    elif kind == "huge":
        x[0] = x[0] * 1e4
        x[1, :64] = torch.linspace(-3.3e38, 3.3e38, 64, dtype=torch.float64).float()
        x[2, ::97] = 6.0e4
        x[3] = x[3].sign() * 3.0e38
    elif kind == "tiny":
        x[0] = x[0] * 1e-39  # bf16 subnormals
        x[1, :128] = x[1, :128] * 1e-38
        x[2, :32] = torch.tensor(9.2e-41)  # smallest bf16 subnormal region
        x[3] = x[3] * 2.0 ** -130
    elif kind == "nan_inf":
        x[0, 3] = float("nan")
        x[0, 200] = float("inf")
        x[1, :128] = float("nan")  # all-NaN block
        x[2, 40] = float("-inf")
        x[2, 41] = float("nan")
        x[3, -1] = float("inf")
        x[3, 0] = float("-inf")
    elif kind != "random":
        raise ValueError(kind)
    return x.to(torch.bfloat16)


# ---- oracle --------------------------------------------------------------------------------------

def _e4m3_table():
    codes = np.arange(0x7F)  # every finite non-negative code, ascending in value
    e, m = codes >> 3, codes & 7
    values = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    return codes.astype(np.uint8), values


E4M3_CODES, E4M3_VALUES = _e4m3_table()


def oracle_e4m3(y: np.ndarray) -> np.ndarray:
    """fp32 -> e4m3 bytes: nearest value, ties to even code, saturate, NaN -> 0x7F."""
    y = y.astype(np.float64)
    a = np.abs(y)
    a_clipped = np.minimum(np.nan_to_num(a, nan=0.0), 448.0)
    hi = np.clip(np.searchsorted(E4M3_VALUES, a_clipped), 0, len(E4M3_VALUES) - 1)
    lo = np.clip(hi - 1, 0, None)
    d_lo, d_hi = a_clipped - E4M3_VALUES[lo], E4M3_VALUES[hi] - a_clipped
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (E4M3_CODES[hi] % 2 == 0))
    code = np.where(pick_hi, E4M3_CODES[hi], E4M3_CODES[lo])
    code = code | np.where(np.signbit(y), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(y), 0x7F, code).astype(np.uint8)


def oracle_e4m3_decode(code: np.ndarray) -> np.ndarray:
    mag = code & 0x7F
    values = np.where(mag == 0x7F, np.nan, E4M3_VALUES[np.minimum(mag, 0x7E)])
    return np.where(code & 0x80, -values, values).astype(np.float32)


def oracle_bf16_bits(values: np.ndarray) -> np.ndarray:
    u = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return np.where(np.isnan(values), 0x7FC0, rounded).astype(np.uint16)


def _amax(block: np.ndarray) -> np.float32:
    finite_or_inf = np.abs(block[~np.isnan(block)])
    return np.float32(finite_or_inf.max()) if finite_or_inf.size else np.float32(0.0)


def _blockwise_scale(amax: np.float32, fmt) -> float:
    if amax < np.float32(fmt.amax_epsilon):
        amax = np.float32(fmt.amax_epsilon)
    if amax == 0 or np.isinf(amax) or np.isnan(amax):
        return 1.0
    with np.errstate(over="ignore"):
        scale = np.float32(448.0) / amax
    if np.isinf(scale):
        scale = np.float32(BF16_MAX)
    if fmt.power_2_scale:
        _, exponent = math.frexp(float(scale))  # scale = m * 2^exponent, m in [0.5, 1)
        scale = np.float32(math.ldexp(1.0, exponent - 1))
    return float(scale)


def _e8m0(value: np.float32) -> int:
    if value == 0:
        return 0
    if np.isinf(value):
        return 0xFE
    mantissa, exponent = math.frexp(float(value))
    ceil_log2 = exponent - 1 if mantissa == 0.5 else exponent
    return int(min(max(ceil_log2 + 127, 0), 0xFE))


def _e8m0_quant_multiplier(e: int) -> float:
    if e == 0:
        return 1.0
    if e == 254:
        return 0.0  # TE exp2f_rcp: bit pattern (254 - 254) << 23 is +0
    return 2.0 ** (127 - e)


def oracle_quantize(x: torch.Tensor, fmt):
    """Returns (fp8 bytes uint8 [N, H], scales [N, nb] as float32 or uint8 numpy)."""
    xf = x.float().numpy()
    num_tokens, hidden = xf.shape
    bs = fmt.block_size
    nb = -(-hidden // bs)
    q = np.zeros((num_tokens, hidden), np.uint8)
    is_blockwise = fmt.scale_kind is F.ScaleKind.FP32_SCALE_INV
    scales = np.zeros((num_tokens, nb), np.float32 if is_blockwise else np.uint8)
    rcp = np.float32(1.0 / 448.0)
    for t in range(num_tokens):
        for b in range(nb):
            block = xf[t, b * bs:(b + 1) * bs]
            amax = _amax(block)
            if is_blockwise:
                scale = _blockwise_scale(amax, fmt)
                scales[t, b] = np.float32(1.0 / scale)
            else:
                e = _e8m0(amax * rcp)
                scales[t, b] = e
                scale = _e8m0_quant_multiplier(e)
            with np.errstate(invalid="ignore", over="ignore"):
                y = block.astype(np.float32) * np.float32(scale)
            q[t, b * bs:(b + 1) * bs] = oracle_e4m3(y)
    return q, scales


def oracle_dequantize(q: np.ndarray, scales: np.ndarray, fmt) -> np.ndarray:
    """Returns bf16 bits uint16 [N, H]."""
    values = oracle_e4m3_decode(q)
    bs = fmt.block_size
    if fmt.scale_kind is F.ScaleKind.FP32_SCALE_INV:
        factor = scales.astype(np.float32)
    else:
        e = scales.astype(np.int64)
        with np.errstate(over="ignore"):
            factor = np.where(e == 0, 0.0, 2.0 ** (e - 127.0)).astype(np.float32)
    factor = np.repeat(factor, bs, axis=1)[:, :q.shape[1]]
    with np.errstate(invalid="ignore", over="ignore"):
        return oracle_bf16_bits(values * factor)


# ---- checks --------------------------------------------------------------------------------------

def _same_bits(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    mismatch = np.nonzero(actual != expected)
    if mismatch[0].size:
        first = tuple(int(i[0]) for i in mismatch)
        raise AssertionError(f"{what}: {mismatch[0].size} mismatches, first at {first}: "
                             f"got {actual[first]}, want {expected[first]}")


def _scale_bits(scales: np.ndarray) -> np.ndarray:
    return scales.view(np.uint32) if scales.dtype == np.float32 else scales


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("kind", KINDS)
def test_quantize_matches_oracle(fmt, hidden, kind):
    x = make_input(kind, 5, hidden)
    q, scales = F.quantize(x, fmt)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (5, hidden)
    assert scales.dtype == fmt.scale_dtype and tuple(scales.shape) == (5, fmt.num_blocks(hidden))
    q_want, s_want = oracle_quantize(x, fmt)
    _same_bits(q.view(torch.uint8).numpy(), q_want, "fp8 bytes")
    _same_bits(_scale_bits(scales.numpy()), _scale_bits(s_want), "scales")

    y = F.dequantize(q, scales, fmt)
    assert y.dtype == torch.bfloat16 and tuple(y.shape) == (5, hidden)
    _same_bits(y.view(torch.int16).numpy().view(np.uint16), oracle_dequantize(q_want, s_want, fmt),
               "dequantized bf16")


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("hidden", HIDDENS)
def test_round_trip_error_bound(fmt, hidden):
    x = make_input("random", 8, hidden, seed=3)
    q, scales = F.quantize(x, fmt)
    y = F.dequantize(q, scales, fmt).float()
    xf = x.float()
    if fmt.scale_kind is F.ScaleKind.FP32_SCALE_INV:
        factor = scales
    else:
        factor = F.e8m0_dequant_multiplier(scales)
    factor = factor.repeat_interleave(fmt.block_size, dim=1)[:, :hidden]
    # e4m3 normals: half an ulp is 2^-4 relative; subnormals: 2^-10 absolute (times the block
    # factor); then the bf16 output rounding, 2^-9 relative.
    bound = (xf.abs() * 2.0 ** -4 + factor * 2.0 ** -10) * (1 + 2.0 ** -8) + xf.abs() * 2.0 ** -8
    assert bool(((y - xf).abs() <= bound).all())
    # No block saturates on finite data: the largest element maps to at most 448.
    assert bool((q.float().abs() <= 448).all())


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=FORMAT_IDS)
def test_nan_inf_behaviour(fmt):
    x = make_input("nan_inf", 5, 4096)
    q, scales = F.quantize(x, fmt)
    y = F.dequantize(q, scales, fmt).float()
    xf = x.float()
    assert bool(torch.isnan(y[torch.isnan(xf)]).all()), "NaN must survive the round trip"
    assert bool((q.view(torch.uint8)[torch.isnan(xf)] == 0x7F).all())
    # The all-NaN 1x128 block of token 1 does not disturb the rest of token 1.
    rest = slice(128, None)
    assert bool(torch.isfinite(y[1, rest]).all())
    inf_at = torch.isinf(xf)
    if fmt.scale_kind is F.ScaleKind.FP32_SCALE_INV:
        # inf saturates to +-448 with scale_inv 1.
        assert bool((y[inf_at].abs() == 448).all())
        assert bool((torch.sign(y[inf_at]) == torch.sign(xf[inf_at])).all())
    else:
        # An MXFP8 block with inf: scale 0xFE, the inf becomes NaN and the rest zeros.
        assert bool(torch.isnan(y[inf_at]).all())
        assert int(scales[0, 200 // 32]) == 0xFE
        block = y[0, 192:224]
        assert bool(((block == 0) | torch.isnan(block)).all())


def test_zero_block_scales():
    x = make_input("zero_blocks", 5, 4096)
    _, s = F.quantize(x, F.BLOCKWISE_1x128)
    assert bool((s[0] == 1.0).all())
    _, s = F.quantize(x, F.MXFP8_1x32)
    assert bool((s[0] == 0).all())


def test_partial_last_block():
    # 2880 = 22 * 128 + 64: the last blockwise block covers 64 columns; MXFP8 has 90 full blocks.
    assert F.BLOCKWISE_1x128.num_blocks(2880) == 23 and F.MXFP8_1x32.num_blocks(2880) == 90
    x = make_input("random", 3, 2880)
    x[:, -64:] = 0
    x[:, -64] = 7.0
    q, s = F.quantize(x, F.BLOCKWISE_1x128_FP32_SCALES)
    assert torch.equal(s[:, -1], torch.full((3,), 7.0 / 448.0, dtype=torch.float32))
    assert bool((q[:, -64].float() == 448).all())
    # The last block's amax comes from its own 64 columns only.
    x2 = x.clone()
    x2[:, -65] = 1000.0
    _, s2 = F.quantize(x2, F.BLOCKWISE_1x128_FP32_SCALES)
    assert torch.equal(s2[:, -1], s[:, -1])


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=FORMAT_IDS)
def test_no_tokens(fmt):
    q, s = F.quantize(torch.zeros(0, 2880, dtype=torch.bfloat16), fmt)
    assert tuple(q.shape) == (0, 2880) and tuple(s.shape) == (0, fmt.num_blocks(2880))
    assert tuple(F.dequantize(q, s, fmt).shape) == (0, 2880)


def test_bytes_per_token():
    bw, mx = F.BLOCKWISE_1x128, F.MXFP8_1x32
    assert bw.bytes_per_token(7168) == 7168 + 4 * 56
    assert mx.bytes_per_token(7168) == 7168 + 224
    assert bw.bytes_per_token(2880) == 2880 + 4 * 23
    assert mx.bytes_per_token(2880) == 2880 + 90
    assert abs(bw.byte_ratio(4096) - (4096 + 4 * 32) / 8192) < 1e-12
    assert abs(bw.byte_ratio(7168) - 0.515625) < 1e-12


def test_scale_helpers_edges():
    e = F.float_to_e8m0(torch.tensor([0.0, 1.0, 1.5, 2.0 ** -127, 2.0 ** -127 * 1.25,
                                      float("inf"), float("nan"), 3.0e38]))
    assert e.tolist() == [0, 127, 128, 0, 1, 0xFE, 0xFF, 0xFE]
    m = F.e8m0_quant_multiplier(torch.tensor([0, 1, 127, 253, 254], dtype=torch.uint8))
    assert m.tolist() == [1.0, 2.0 ** 126, 1.0, 2.0 ** -126, 0.0]
    s = F.blockwise_scale(torch.tensor([0.0, float("inf"), float("nan"), 448.0, 1e-45]),
                          power_2_scale=False, amax_epsilon=0.0)
    assert s.tolist() == [1.0, 1.0, 1.0, 1.0, float(np.float32(BF16_MAX))]


# ---- NVRTC compile (no GPU needed) ---------------------------------------------------------------

# (source, kernels): the product's dequantize, the tests' quantize.
KERNELS = [
    ("fp8.cu", ["dequantize_blockwise<8>", "dequantize_mxfp8<8>"]),
    ("bench/quantize.cu", ["quantize_blockwise<8, true>", "quantize_blockwise<8, false>",
                           "quantize_blockwise<4, true>", "quantize_mxfp8<8>"]),
]


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_kernels_compile(arch):
    # sm_80 exercises the software e4m3 cast (no cvt.e4m3x2 before sm_89).
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) not installed")
    from megatron_deepep.kernels.jit import compile_cubin

    for source, kernels in KERNELS:
        cubin, lowered = compile_cubin(source, kernels, arch)
        assert len(cubin) > 0
        assert set(lowered) == set(kernels)
        assert all(name.startswith("_Z") for name in lowered.values())  # templates


def test_sources_include_only_our_headers():
    for path in (CUDA_SRC / "fp8.cu", CUDA_SRC / "bench" / "quantize.cu",
                 CUDA_SRC / "common" / "fp8_standalone.cuh", CUDA_SRC / "common" / "fp8.cuh"):
        for line in path.read_text().splitlines():
            match = re.match(r'\s*#\s*include\s*([<"])([^>"]+)[>"]', line)
            if match:
                assert match.group(1) == '"', f"{path.name}: system include {line!r}"
                assert (CUDA_SRC / match.group(2)).is_file(), f"{path.name}: {line!r}"


# ---- TE bridge -----------------------------------------------------------------------------------

def _te_missing_reason() -> str:
    from megatron_deepep.fp8 import te_bridge
    ok, reason = te_bridge.te_available()
    return "" if ok else reason


class _QParams:
    def __init__(self, power_2_scale, amax_epsilon=0.0):
        self.power_2_scale, self.amax_epsilon = power_2_scale, amax_epsilon


class _Format:
    def __init__(self, name):
        self.name = name


class Float8BlockScaling:  # duck-typed stand-in: format_for_recipe reads fields by name
    def __init__(self, power_2_scale=True, x_dim=1, fp8_format="E4M3"):
        self.fp8_format = _Format(fp8_format)
        self.fp8_quant_fwd_inp = _QParams(power_2_scale)
        self.x_block_scaling_dim = x_dim


class MXFP8BlockScaling:
    def __init__(self, fp8_format="E4M3"):
        self.fp8_format = _Format(fp8_format)


def test_format_for_recipe():
    from megatron_deepep.fp8 import te_bridge
    fmt, _ = te_bridge.format_for_recipe(Float8BlockScaling())
    assert fmt == F.BLOCKWISE_1x128
    fmt, _ = te_bridge.format_for_recipe(Float8BlockScaling(power_2_scale=False))
    assert fmt == F.BLOCKWISE_1x128_FP32_SCALES
    assert te_bridge.format_for_recipe(MXFP8BlockScaling("HYBRID"))[0] == F.MXFP8_1x32
    fmt, reason = te_bridge.format_for_recipe(Float8BlockScaling(x_dim=2))
    assert fmt is None and "x_block_scaling_dim" in reason
    fmt, reason = te_bridge.format_for_recipe(None)
    assert fmt is None and reason


def test_te_bridge_without_te():
    reason = _te_missing_reason()
    if not reason:
        pytest.skip("transformer_engine is installed; this checks the TE-absent path")
    from megatron_deepep.fp8 import te_bridge
    q, s = F.quantize(make_input("random", 2, 256), F.BLOCKWISE_1x128)
    with pytest.raises(te_bridge.TEUnavailableError, match="transformer_engine"):
        te_bridge.to_te_tensor(q, s, F.BLOCKWISE_1x128)
    assert te_bridge.active_recipe() is None
    assert te_bridge.recipe_matches(F.MXFP8_1x32, MXFP8BlockScaling())[0] is False


@pytest.mark.parametrize("fmt", [F.BLOCKWISE_1x128, F.BLOCKWISE_1x128_FP32_SCALES, F.MXFP8_1x32],
                         ids=lambda f: f.name)
def test_te_tensor_dequantizes_like_reference(fmt):
    reason = _te_missing_reason()
    if reason:
        pytest.skip(f"TE bridge needs Transformer Engine: {reason}")
    if not torch.cuda.is_available():
        pytest.skip("TE quantized tensors need a CUDA device")
    if fmt is F.MXFP8_1x32 and torch.cuda.get_device_capability()[0] < 10:
        pytest.skip("TE's MXFP8 dequantize kernel needs sm_100+")
    from megatron_deepep.fp8 import te_bridge
    x = make_input("random", 64 if fmt is F.MXFP8_1x32 else 13, 2048)
    q, s = F.quantize(x, fmt)
    tensor = te_bridge.to_te_tensor(q.cuda(), s.cuda(), fmt, check_gemm_shape=False)
    got = tensor.dequantize(dtype=torch.bfloat16).cpu()
    assert torch.equal(got.view(torch.int16), F.dequantize(q, s, fmt).view(torch.int16))
