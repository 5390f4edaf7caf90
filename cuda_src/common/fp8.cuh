// FP8 wire formats of Transformer Engine's recipes, as device functions.
//
// Two formats, both e4m3 data quantized per token along the hidden dimension:
//   blockwise 1x128 (TE Float8BlockScaling, x_block_scaling_dim=1): fp32 scale_inv per block;
//   MXFP8 1x32 (TE MXFP8BlockScaling): E8M0 (biased exponent, uint8) scale per block.
// Every function here reproduces, bit for bit, the torch reference in
// megatron_deepep/fp8/formats.py; that file names the TE source of each rule.
//
// Header-only and free of system includes, so NVRTC compiles it with only -I<repo>/cuda_src;
// bf16 <-> fp32 come from common/types.cuh (mdeep::bf16_to_f32, mdeep::f32_to_bf16_rn).
// NaN rule shared by both formats: a block's amax ignores NaN (fmaxf semantics, as TE), so a
// NaN element is stored as the e4m3 NaN and does not disturb its block's scale.
#pragma once

#include "common/types.cuh"

namespace mdeep {
namespace fp8 {

constexpr float kE4M3Max = 448.0f;
// TE's value_for_inf for bf16 input (TypeExtrema<bf16>::max): the largest finite bf16.
constexpr float kBf16Max = 0x1.FEp127f;
// TE's Quantized_Limits<fp8e4m3>::max_norm_rcp: 1/448 rounded once to fp32.
constexpr float kE4M3MaxRcp = (float)(1.0 / 448.0);
constexpr int kBlockwiseBlock = 128;
constexpr int kMxfp8Block = 32;

// ---- fp32 classification (bit tests: exact whatever the math flags) -------------------------

__device__ __forceinline__ bool is_nan(float value) {
  return (__float_as_uint(value) & 0x7FFFFFFFu) > 0x7F800000u;
}

__device__ __forceinline__ bool is_inf(float value) {
  return (__float_as_uint(value) & 0x7FFFFFFFu) == 0x7F800000u;
}

// ---- e4m3 ---------------------------------------------------------------------------------------

// Software fp32 -> e4m3 (round to nearest even, saturate to +-448, NaN -> 0x7F): the fallback
// for GPUs without the cvt instruction, with the same results as the PTX path.
__device__ __forceinline__ u8 f32_to_e4m3_soft(float value) {
  const u32 bits = __float_as_uint(value);
  const u8 sign = static_cast<u8>((bits >> 24) & 0x80u);
  const u32 abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return 0x7F;
  if (abs_bits >= 0x43E00000u) return sign | 0x7E;  // >= 448 (and inf) saturates
  if (abs_bits < 0x3C800000u) {
    // Below 2^-6: subnormal e4m3, a multiple of 2^-9. Exact: x * 2^9 in fp32, then rint.
    const float scaled = __uint_as_float(abs_bits) * 512.0f;
    return sign | static_cast<u8>(__float2uint_rn(scaled));
  }
  // Normal: keep 3 mantissa bits, round to nearest even on the 20 dropped bits.
  const u32 rounded = abs_bits + 0x7FFFFu + ((abs_bits >> 20) & 1u);
  const u32 exponent = (rounded >> 23) - 120u;  // rebias 127 -> 7
  const u32 code = (exponent << 3) | ((rounded >> 20) & 7u);
  return sign | static_cast<u8>(code > 0x7Eu ? 0x7Eu : code);
}

// Two fp32 -> two e4m3 bytes (low byte from `lo`), RN + satfinite.
__device__ __forceinline__ u16 f32x2_to_e4m3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
  u16 packed;
  // The first source goes to the upper byte.
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  return packed;
#else
  return static_cast<u16>(f32_to_e4m3_soft(lo)) |
         static_cast<u16>(static_cast<u16>(f32_to_e4m3_soft(hi)) << 8);
#endif
}

// Four fp32 -> four e4m3 bytes packed little-endian (element 0 in the lowest byte).
__device__ __forceinline__ u32 f32x4_to_e4m3x4(float v0, float v1, float v2, float v3) {
  return static_cast<u32>(f32x2_to_e4m3x2(v0, v1)) |
         (static_cast<u32>(f32x2_to_e4m3x2(v2, v3)) << 16);
}

// e4m3 -> fp32, exact (NaN codes 0x7F/0xFF give a quiet NaN).
__device__ __forceinline__ float e4m3_to_f32(u8 code) {
  const u32 sign = static_cast<u32>(code & 0x80u) << 24;
  const u32 exponent = (code >> 3) & 0xFu;
  const u32 mantissa = code & 7u;
  if (exponent == 0xFu && mantissa == 7u) return __uint_as_float(sign | 0x7FC00000u);
  if (exponent == 0u) {
    // Subnormal: mantissa * 2^-9.
    return __uint_as_float(sign | __float_as_uint(static_cast<float>(mantissa) * 0.001953125f));
  }
  return __uint_as_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// ---- amax ---------------------------------------------------------------------------------------

// |x| folded into a running amax. fmaxf returns the non-NaN operand, so NaN never wins (as in
// TE's kernels); the running value starts at 0.
__device__ __forceinline__ float amax_update(float amax, float value) {
  return fmaxf(amax, fabsf(value));
}

// Max over aligned groups of kGroupLanes lanes of a warp (all 32 lanes must call it). With
// 4 elements per lane, kGroupLanes = 32 gives a 1x128 block and 8 gives a 1x32 block.
template <int kGroupLanes>
__device__ __forceinline__ float group_max(float value) {
  static_assert(kGroupLanes >= 1 && kGroupLanes <= 32 && (kGroupLanes & (kGroupLanes - 1)) == 0,
                "group must be a power of two within a warp");
#pragma unroll
  for (int offset = kGroupLanes / 2; offset > 0; offset /= 2)
    value = fmaxf(value, __shfl_xor_sync(0xFFFFFFFFu, value, offset));
  return value;
}

__device__ __forceinline__ float block128_amax(float lane_amax) { return group_max<32>(lane_amax); }
__device__ __forceinline__ float block32_amax(float lane_amax) { return group_max<8>(lane_amax); }

// ---- blockwise scale (TE compute_scale_from_amax) -----------------------------------------------

// Quantization multiplier for a block: 448 / max(amax, eps); 1 when amax is 0, inf or NaN; the
// bf16 max when the quotient overflows; optionally truncated to a power of two.
template <bool kPow2Scale>
__device__ __forceinline__ float blockwise_scale(float amax, float amax_epsilon) {
  if (amax < amax_epsilon) amax = amax_epsilon;  // NaN compares false and stays NaN
  if (is_inf(amax) || amax == 0.0f || is_nan(amax)) return 1.0f;
  float scale = __fdiv_rn(kE4M3Max, amax);
  if (is_inf(scale)) scale = kBf16Max;
  if (kPow2Scale) scale = __uint_as_float(__float_as_uint(scale) & 0xFF800000u);
  return scale;
}

// The stored dequantization factor: 1 / scale in double, rounded to fp32 (TE writes
// `CType scale_inv = 1.0 / scale`, a double division).
__device__ __forceinline__ float blockwise_scale_inv(float scale) {
  return static_cast<float>(1.0 / static_cast<double>(scale));
}

// ---- E8M0 (TE ptx::float_to_e8m0 / exp2f_rcp / exp2f) -----------------------------------------

// E8M0 biased exponent of a non-negative fp32, rounded up (toward +inf), saturating at 0xFE.
__device__ __forceinline__ u8 float_to_e8m0(float value) {
  if (is_nan(value)) return 0xFF;
  if (is_inf(value)) return 0xFE;
  if (value == 0.0f) return 0x00;
  const u32 bits = __float_as_uint(value);
  u32 exponent = (bits >> 23) & 0xFFu;
  const u32 mantissa = bits & 0x7FFFFFu;
  if (mantissa > 0u && exponent != 0xFEu && !(exponent == 0u && mantissa <= 0x400000u))
    ++exponent;
  return static_cast<u8>(exponent);
}

// A block's E8M0 scale from its amax: e8m0(amax * fp32(1/448)).
__device__ __forceinline__ u8 mxfp8_scale_from_amax(float amax) {
  return float_to_e8m0(amax * kE4M3MaxRcp);
}

// Multiplier used to quantize: 2^(127 - e), except 1 for e == 0 (TE exp2f_rcp; e == 254 gives 0).
__device__ __forceinline__ float e8m0_quant_multiplier(u8 biased_exponent) {
  if (biased_exponent == 0) return 1.0f;
  return __uint_as_float(static_cast<u32>(254 - static_cast<int>(biased_exponent)) << 23);
}

// Multiplier used to dequantize: the float with exponent field e (TE exp2f): 0 for e == 0,
// inf for e == 255.
__device__ __forceinline__ float e8m0_dequant_multiplier(u8 biased_exponent) {
  return __uint_as_float(static_cast<u32>(biased_exponent) << 23);
}

}  // namespace fp8
}  // namespace mdeep
