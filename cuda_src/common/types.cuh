// Fixed-width types and bf16 <-> fp32 conversions without any system header (NVRTC-only build).
#pragma once

namespace mdeep {

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

constexpr int kWarpSize = 32;
constexpr int kMaxRanks = 8;
constexpr int kMaxLocalExperts = 256;

__device__ __forceinline__ float bf16_to_f32(u32 bits16) { return __uint_as_float(bits16 << 16); }

// Round to nearest even, NaN -> 0x7fc0: the same rule as torch's float -> bfloat16 cast, so a
// kernel's rounding equals the reference's bit for bit.
__device__ __forceinline__ u32 f32_to_bf16_rn(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}

// Adds the 8 bf16 values of `v` to `acc[0..8)` in fp32 (optionally times `scale`, unfused).
template <bool kScaled>
__device__ __forceinline__ void accumulate_bf16x8(float* acc, const int4& v, float scale) {
    const u32 words[4] = {(u32)v.x, (u32)v.y, (u32)v.z, (u32)v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float lo = __uint_as_float(words[i] << 16);
        float hi = __uint_as_float(words[i] & 0xffff0000u);
        if (kScaled) {
            lo = __fmul_rn(lo, scale);
            hi = __fmul_rn(hi, scale);
        }
        acc[2 * i] = __fadd_rn(acc[2 * i], lo);
        acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], hi);
    }
}

__device__ __forceinline__ int4 pack_bf16x8(const float* acc) {
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        w[i] = f32_to_bf16_rn(acc[2 * i]) | (f32_to_bf16_rn(acc[2 * i + 1]) << 16);
    return make_int4((int)w[0], (int)w[1], (int)w[2], (int)w[3]);
}

}  // namespace mdeep
