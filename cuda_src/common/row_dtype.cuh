// Row element types of combine (ops.ROW_DTYPE_CODES): bf16, fp16 and fp32 rows handled as
// 16-byte words of 8 (16-bit) or 4 (fp32) elements, summed in fp32 and rounded once to the row's
// type (torch's casts, bit for bit), so fp32 rows are never rounded.
#pragma once
#include "common/types.cuh"

namespace mdeep {

constexpr int kRowBf16 = 0, kRowF16 = 1, kRowF32 = 2;

__device__ __forceinline__ float f16_to_f32(u32 bits16) {
    const unsigned short h = (unsigned short)bits16;
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Round to nearest even (overflow to inf): torch's float -> half cast, bit for bit.
__device__ __forceinline__ u32 f32_to_f16_rn(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Adds the elements of one 16-byte word `v` of kDtype rows to `acc` in fp32 (optionally times
// `scale`, unfused): acc[0..8) for 16-bit rows, acc[0..4) for fp32.
template <int kDtype, bool kScaled>
__device__ __forceinline__ void accumulate_word(float* acc, const int4& v, float scale) {
    if constexpr (kDtype == kRowBf16) {
        accumulate_bf16x8<kScaled>(acc, v, scale);
    } else if constexpr (kDtype == kRowF16) {
        const u32 words[4] = {(u32)v.x, (u32)v.y, (u32)v.z, (u32)v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float lo = f16_to_f32(words[i] & 0xffffu), hi = f16_to_f32(words[i] >> 16);
            if (kScaled) {
                lo = __fmul_rn(lo, scale);
                hi = __fmul_rn(hi, scale);
            }
            acc[2 * i] = __fadd_rn(acc[2 * i], lo);
            acc[2 * i + 1] = __fadd_rn(acc[2 * i + 1], hi);
        }
    } else {
        const float f[4] = {__int_as_float(v.x), __int_as_float(v.y), __int_as_float(v.z),
                            __int_as_float(v.w)};
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] = __fadd_rn(acc[i], kScaled ? __fmul_rn(f[i], scale)
                                                                        : f[i]);
    }
}

// One 16-byte word of kDtype rows from `acc` (rounded once; fp32 as is).
template <int kDtype>
__device__ __forceinline__ int4 pack_word(const float* acc) {
    if constexpr (kDtype == kRowBf16) {
        return pack_bf16x8(acc);
    } else if constexpr (kDtype == kRowF16) {
        u32 w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            w[i] = f32_to_f16_rn(acc[2 * i]) | (f32_to_f16_rn(acc[2 * i + 1]) << 16);
        return make_int4((int)w[0], (int)w[1], (int)w[2], (int)w[3]);
    } else {
        return make_int4(__float_as_int(acc[0]), __float_as_int(acc[1]), __float_as_int(acc[2]),
                         __float_as_int(acc[3]));
    }
}

}  // namespace mdeep
