// Standalone FP8 dequantize kernels (the FP8 experts' two-step path: ops.dequantize_rows, then
// TE's quantization; the quantize kernels are test-only, in bench/quantize.cu).
// Layouts and the warp's share of a row: common/fp8_standalone.cuh.
// Kernels are templates (instantiated by NVRTC name expressions); kNumWarps sets the CTA size.
#include "common/args.cuh"
#include "common/fp8_standalone.cuh"

// Blockwise 1x128: scale_inv[t, b] fp32.
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

// MXFP8 1x32: scales[t, b] u8 E8M0, one per 32 columns.
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
