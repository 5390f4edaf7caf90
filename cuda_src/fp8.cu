// Standalone FP8 quantize / dequantize kernels (tests, and callers that pre-quantize).
//
// Layouts (row-major, one row per token):
//   x        [num_tokens, hidden]                      bf16 (as u16 bits)
//   q        [num_tokens, hidden]                      e4m3 bytes
//   scales   [num_tokens, ceil(hidden / block)]        fp32 scale_inv (blockwise) or u8 E8M0
// One warp handles 128 consecutive elements of one token (4 per lane): one 1x128 block, or four
// 1x32 blocks. A partial last block (hidden % block != 0) covers the remaining columns only.
// Kernels are templates (instantiated by NVRTC name expressions); kNumWarps sets the CTA size.
#include "common/args.cuh"
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

// Blockwise 1x128: scale_inv[t, b] fp32. kPow2Scale: truncate the scale to a power of two.
template <int kNumWarps, bool kPow2Scale>
__global__ void __launch_bounds__(kNumWarps * 32)
    quantize_blockwise(const __grid_constant__ mdeep::QuantizeArgs<float> args) {
  using namespace mdeep;
  using namespace mdeep::fp8;
  const unsigned short* const x = args.x;
  unsigned char* const q = args.q;
  float* const scale_inv = args.scales;
  const int num_tokens = args.num_tokens, hidden = args.hidden;
  const float amax_epsilon = args.amax_epsilon;
  long long token;
  int chunk;
  // Whole warps exit together, so the shuffles below always see 32 lanes.
  if (!warp_chunk(num_tokens, hidden, token, chunk)) return;
  const int lane = threadIdx.x % 32;
  const int col = chunk * kBlockwiseBlock + lane * 4;
  float v[4];
  load4_bf16(x + token * hidden, col, hidden, v);
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) amax = amax_update(amax, v[i]);
  amax = block128_amax(amax);
  const float scale = blockwise_scale<kPow2Scale>(amax, amax_epsilon);
  const u32 packed = f32x4_to_e4m3x4(v[0] * scale, v[1] * scale, v[2] * scale, v[3] * scale);
  store4_e4m3(q + token * hidden, col, hidden, packed);
  if (lane == 0) {
    const int num_blocks = (hidden + kBlockwiseBlock - 1) / kBlockwiseBlock;
    scale_inv[token * num_blocks + chunk] = blockwise_scale_inv(scale);
  }
}

template <int kNumWarps>
__global__ void __launch_bounds__(kNumWarps * 32)
    dequantize_blockwise(const __grid_constant__ mdeep::DequantizeArgs<float> args) {
  using namespace mdeep;
  using namespace mdeep::fp8;
  const unsigned char* const q = args.q;
  const float* const scale_inv = args.scales;
  unsigned short* const out = args.out;
  const int num_tokens = args.num_tokens, hidden = args.hidden;
  long long token;
  int chunk;
  if (!warp_chunk(num_tokens, hidden, token, chunk)) return;
  const int lane = threadIdx.x % 32;
  const int col = chunk * kBlockwiseBlock + lane * 4;
  const int num_blocks = (hidden + kBlockwiseBlock - 1) / kBlockwiseBlock;
  const float s = scale_inv[token * num_blocks + chunk];
  float v[4];
  load4_e4m3(q + token * hidden, col, hidden, v);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] *= s;
  store4_bf16(out + token * hidden, col, hidden, v);
}

// MXFP8 1x32: scales[t, b] u8 E8M0. Each group of 8 lanes owns one 1x32 block.
template <int kNumWarps>
__global__ void __launch_bounds__(kNumWarps * 32)
    quantize_mxfp8(const __grid_constant__ mdeep::QuantizeArgs<mdeep::u8> args) {
  using namespace mdeep;
  using namespace mdeep::fp8;
  const unsigned short* const x = args.x;
  unsigned char* const q = args.q;
  unsigned char* const scales = args.scales;
  const int num_tokens = args.num_tokens, hidden = args.hidden;
  long long token;
  int chunk;
  if (!warp_chunk(num_tokens, hidden, token, chunk)) return;
  const int lane = threadIdx.x % 32;
  const int col = chunk * 128 + lane * 4;
  float v[4];
  load4_bf16(x + token * hidden, col, hidden, v);
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) amax = amax_update(amax, v[i]);
  amax = block32_amax(amax);
  const u8 e = mxfp8_scale_from_amax(amax);
  const float m = e8m0_quant_multiplier(e);
  const u32 packed = f32x4_to_e4m3x4(v[0] * m, v[1] * m, v[2] * m, v[3] * m);
  store4_e4m3(q + token * hidden, col, hidden, packed);
  const int block = chunk * 4 + lane / 8;
  const int num_blocks = (hidden + kMxfp8Block - 1) / kMxfp8Block;
  if (lane % 8 == 0 && block < num_blocks) scales[token * num_blocks + block] = e;
}

template <int kNumWarps>
__global__ void __launch_bounds__(kNumWarps * 32)
    dequantize_mxfp8(const __grid_constant__ mdeep::DequantizeArgs<mdeep::u8> args) {
  using namespace mdeep;
  using namespace mdeep::fp8;
  const unsigned char* const q = args.q;
  const unsigned char* const scales = args.scales;
  unsigned short* const out = args.out;
  const int num_tokens = args.num_tokens, hidden = args.hidden;
  long long token;
  int chunk;
  if (!warp_chunk(num_tokens, hidden, token, chunk)) return;
  const int lane = threadIdx.x % 32;
  const int col = chunk * 128 + lane * 4;
  if (col >= hidden) return;
  const int num_blocks = (hidden + kMxfp8Block - 1) / kMxfp8Block;
  const float m = e8m0_dequant_multiplier(scales[token * num_blocks + col / kMxfp8Block]);
  float v[4];
  load4_e4m3(q + token * hidden, col, hidden, v);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] *= m;
  store4_bf16(out + token * hidden, col, hidden, v);
}
