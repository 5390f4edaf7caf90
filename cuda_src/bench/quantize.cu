// Standalone FP8 quantize kernels, for the tests only (ops.bench.quantize.quantize_rows: the GPU
// version of fp8.formats.quantize, checked bit for bit against it); the transport quantizes
// inside its dispatch kernels (common/fp8_row.cuh). Layouts and the warp's share of a row:
// common/fp8_standalone.cuh. Kernels are templates (instantiated by NVRTC name expressions);
// kNumWarps sets the CTA size.
#include "common/args.cuh"
#include "common/fp8_standalone.cuh"

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
