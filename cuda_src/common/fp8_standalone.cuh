// The standalone FP8 kernels' rows (fp8.cu's dequantize, bench/quantize.cu's quantize).
//
// Layouts (row-major, one row per token):
//   x        [num_tokens, hidden]                      bf16 (as u16 bits)
//   q        [num_tokens, hidden]                      e4m3 bytes
//   scales   [num_tokens, ceil(hidden / block)]        fp32 scale_inv (blockwise) or u8 E8M0
// One warp handles 128 consecutive elements of one token (4 per lane): one 1x128 block, or four
// 1x32 blocks. A partial last block (hidden % block != 0) covers the remaining columns only.
#pragma once
#include "common/fp8.cuh"

namespace mdeep {
namespace fp8 {

// Loads 4 bf16 starting at column `col` of `row` as fp32; columns >= hidden read as 0.
__device__ __forceinline__ void load4_bf16(const u16* row, int col, int hidden, float (&v)[4]) {
  if (col + 4 <= hidden && (hidden & 3) == 0) {
    const uint2 packed = *reinterpret_cast<const uint2*>(row + col);
    v[0] = bf16_to_f32(static_cast<u16>(packed.x & 0xFFFFu));
    v[1] = bf16_to_f32(static_cast<u16>(packed.x >> 16));
    v[2] = bf16_to_f32(static_cast<u16>(packed.y & 0xFFFFu));
    v[3] = bf16_to_f32(static_cast<u16>(packed.y >> 16));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = col + i < hidden ? bf16_to_f32(row[col + i]) : 0.0f;
  }
}

__device__ __forceinline__ void store4_e4m3(u8* row, int col, int hidden, u32 packed) {
  if (col + 4 <= hidden && (hidden & 3) == 0) {
    *reinterpret_cast<u32*>(row + col) = packed;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (col + i < hidden) row[col + i] = static_cast<u8>(packed >> (8 * i));
  }
}

__device__ __forceinline__ void load4_e4m3(const u8* row, int col, int hidden, float (&v)[4]) {
  u32 packed = 0;
  if (col + 4 <= hidden && (hidden & 3) == 0) {
    packed = *reinterpret_cast<const u32*>(row + col);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (col + i < hidden) packed |= static_cast<u32>(row[col + i]) << (8 * i);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = e4m3_to_f32(static_cast<u8>(packed >> (8 * i)));
}

__device__ __forceinline__ void store4_bf16(u16* row, int col, int hidden, const float (&v)[4]) {
  u16 b[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) b[i] = static_cast<u16>(f32_to_bf16_rn(v[i]));
  if (col + 4 <= hidden && (hidden & 3) == 0) {
    uint2 packed;
    packed.x = static_cast<u32>(b[0]) | (static_cast<u32>(b[1]) << 16);
    packed.y = static_cast<u32>(b[2]) | (static_cast<u32>(b[3]) << 16);
    *reinterpret_cast<uint2*>(row + col) = packed;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (col + i < hidden) row[col + i] = b[i];
  }
}

// The warp's (token, 128-column chunk); false when past the end.
__device__ __forceinline__ bool warp_chunk(int num_tokens, int hidden, long long& token,
                                           int& chunk) {
  const int num_chunks = (hidden + 127) / 128;
  const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  token = warp / num_chunks;
  chunk = static_cast<int>(warp % num_chunks);
  return token < num_tokens;
}

}  // namespace fp8
}  // namespace mdeep
