// The columnwise (128x1) blockwise FP8 copy of received rowwise (1x128) FP8 rows, per expert:
// the weight-gradient operand of the FP8 experts (megatron_deepep/megatron/te_experts.py), made
// from the FP8 rows in one pass (FP8 in, FP8 out).
//
// Layouts (expert e has m_e = row_offsets[e + 1] - row_offsets[e] rows from r_e = row_offsets[e];
// nb_e = ceil(m_e / 128) token blocks; B_e = nb_0 + ... + nb_{e-1}; C = scale_cols =
// round_up(H, 4)):
//   q           [num_rows, H]  e4m3, rows grouped by expert
//   scales      fp32 scale_inv of (row r, 128-column block b) at r * token_stride +
//               b * block_stride (the wire's [num_rows, nb], or TE's GEMM-ready
//               [nb, round_up(num_rows, 4)])
//   col_data    expert e at H * r_e:  [H, m_e] e4m3, the transpose of its rows
//   col_scales  expert e at C * B_e:  [nb_e, C] fp32 scale_inv, [token block, column]
// which is what TE 2.20's Float8BlockQuantizer (block_scaling_dim 1, columnwise usage, GEMM-ready
// scales) allocates and writes for each expert's [m_e, H] rows in `split_quantize`.
//
// Values: exactly those of the bf16 path (dequantize, then TE's columnwise quantization):
//   x[t, h]   = bf16(fp32(q[t, h]) * scale_inv[t, h / 128])   (fp8.cu dequantize_blockwise)
//   amax      = max |x| over the 128 tokens of one block of column h, NaN ignored; rows past
//               m_e count as 0 (TE quantize_transpose_vector_blockwise.cu clears them)
//   scale     = blockwise_scale<kPow2Scale>(amax, amax_epsilon)   (common/fp8.cuh, TE's rule)
//   col[h, t] = e4m3(fp32(x[t, h]) * scale), RN, satfinite;  scale_inv = fp32(1 / double(scale))
// Rounding to bf16 is monotone and odd, so the amax of the rounded values is the rounded amax of
// the fp32 products: the products' amax is taken in fp32 and rounded once.
//
// Work split: one CTA of 8 warps per (token block of one expert) x (128-column tile). The grid
// is num_blocks * ceil(H / 128) CTAs, token blocks of all experts in expert order, so each warp
// finds its expert from row_offsets in device memory (no host read). Warp w takes tokens
// 16 w .. 16 w + 15 of the block, lane l columns 4 l .. 4 l + 3 (4-byte loads: a warp reads one
// 128-byte row segment per load); it dequantizes into bf16 pairs in registers and keeps fp32
// column maxima; the 8 warps' maxima meet in shared memory; each lane quantizes its 4 columns x
// 16 tokens into four 16-byte runs of the transposed tile in shared memory (16-byte chunks XOR-
// swizzled, so stores and loads are free of bank conflicts); then 8 threads per column store its
// 128 bytes. Needs H % 4 == 0 (the Python side asks TE's H % 16 == 0); m_e may be anything, 0
// included: a run of 16 bytes that is partial or not 16-byte aligned is stored byte by byte.
#include "common/args.cuh"
#include "common/fp8.cuh"
#include "common/warp.cuh"

namespace mdeep {
namespace fp8 {

constexpr int kColumnTile = 128;   // columns per CTA: one 1x128 block of the rowwise scales
constexpr int kTokenBlock = 128;   // tokens per columnwise scale
constexpr int kColumnwiseWarps = 8;
constexpr int kTokensPerWarp = kTokenBlock / kColumnwiseWarps;
constexpr int kChunks = kTokenBlock / 16;  // 16-byte runs of one column in a token block
static_assert(kTokensPerWarp == 16, "a lane's run of one column is one 16-byte store");

// Where a CTA's token block lies.
struct TokenBlock {
  int expert;       // -1: past the last expert's blocks
  int row_start;    // the expert's first row in q
  int num_rows;     // the expert's rows (m_e)
  int first_token;  // the block's first token within the expert
};

// The `block`-th token block of all experts, in expert order. Every lane of the calling warp
// gets the same answer; row offsets outside [0, num_rows] are clamped.
__device__ __forceinline__ TokenBlock find_token_block(const int* row_offsets, int num_experts,
                                                       int num_rows, int block) {
  const int lane = threadIdx.x % kWarpSize;
  TokenBlock found = {-1, 0, 0, 0};
  int blocks_before = 0;  // token blocks of the experts before this group of 32
  for (int first = 0; first < num_experts; first += kWarpSize) {
    const int expert = first + lane;
    int start = 0, rows = 0;
    if (expert < num_experts) {
      start = min(max(row_offsets[expert], 0), num_rows);
      rows = max(min(row_offsets[expert + 1], num_rows) - start, 0);
    }
    const int blocks = (rows + kTokenBlock - 1) / kTokenBlock;
    const int inclusive = warp_inclusive_scan(blocks);
    const int begin = blocks_before + inclusive - blocks;
    const u32 holder = __ballot_sync(0xFFFFFFFFu, block >= begin && block < begin + blocks);
    if (holder != 0) {
      const int src = __ffs(holder) - 1;
      found.expert = first + src;
      found.row_start = __shfl_sync(0xFFFFFFFFu, start, src);
      found.num_rows = __shfl_sync(0xFFFFFFFFu, rows, src);
      found.first_token = (block - __shfl_sync(0xFFFFFFFFu, begin, src)) * kTokenBlock;
      return found;
    }
    blocks_before += __shfl_sync(0xFFFFFFFFu, inclusive, kWarpSize - 1);
  }
  return found;
}

// Two e4m3 bytes (the low byte first) -> two fp32, exact (e4m3 is a subset of fp16).
__device__ __forceinline__ void e4m3x2_to_f32x2(u32 pair, float& lo, float& hi) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 890)
  u32 halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(static_cast<u16>(pair & 0xFFFFu)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(static_cast<u16>(halves & 0xFFFFu)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(static_cast<u16>(halves >> 16)));
#else
  lo = e4m3_to_f32(static_cast<u8>(pair & 0xFFu));
  hi = e4m3_to_f32(static_cast<u8>((pair >> 8) & 0xFFu));
#endif
}

// Two fp32 -> bf16x2 (`lo` in the low half), each rounded to nearest even; NaN stays NaN.
__device__ __forceinline__ u32 f32x2_to_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 800)
  u32 packed;
  // The first source goes to the upper half.
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
  return packed;
#else
  return f32_to_bf16_rn(lo) | (f32_to_bf16_rn(hi) << 16);
#endif
}

// One bf16 half of a bf16x2 word as fp32 (exact).
template <int kHalf>
__device__ __forceinline__ float bf16x2_half(u32 packed) {
  return __uint_as_float(kHalf == 0 ? packed << 16 : packed & 0xFFFF0000u);
}

}  // namespace fp8
}  // namespace mdeep

// kPow2Scale: the input quantizer's `force_pow_2_scales` (TE Float8BlockScaling's default).
template <bool kPow2Scale>
__global__ void __launch_bounds__(mdeep::fp8::kColumnwiseWarps * 32)
    columnwise_from_rowwise(const __grid_constant__ mdeep::ColumnwiseArgs args) {
  using namespace mdeep;
  using namespace mdeep::fp8;
  __shared__ float4 column_amax[kColumnwiseWarps][kWarpSize];  // [warp][lane]: 4 columns each
  __shared__ uint4 tile_t[kColumnTile][kChunks];  // [column][16-token run], runs swizzled
  const int hidden = args.hidden;
  const int num_tiles = (hidden + kColumnTile - 1) / kColumnTile;
  const int block = static_cast<int>(blockIdx.x / num_tiles);
  const int tile = static_cast<int>(blockIdx.x % num_tiles);
  if (block >= args.num_blocks) return;  // the whole CTA
  const TokenBlock where = find_token_block(args.row_offsets, args.num_experts, args.num_rows,
                                            block);
  if (where.expert < 0) return;  // the whole CTA: every warp found the same
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;

  // 1. Load 16 tokens x 4 columns, dequantize to bf16 (kept in pairs), fp32 column maxima.
  const int column = tile * kColumnTile + 4 * lane;  // this lane's first column
  const bool column_in = column < hidden;            // hidden % 4 == 0: all four or none
  const int token0 = where.first_token + warp * kTokensPerWarp;  // within the expert
  const i64 row0 = static_cast<i64>(where.row_start) + token0;
  float row_scale = 0.0f;  // lane i < 16: scale_inv of token token0 + i (0 past the end)
  if (lane < kTokensPerWarp && token0 + lane < where.num_rows)
    row_scale = args.scales[(row0 + lane) * args.token_stride + tile * args.block_stride];
  u32 words[kTokensPerWarp];  // 4 e4m3 bytes of one token, column order
#pragma unroll
  for (int i = 0; i < kTokensPerWarp; ++i) {
    words[i] = 0;
    if (column_in && token0 + i < where.num_rows)
      words[i] = __ldg(reinterpret_cast<const u32*>(args.q + (row0 + i) * hidden + column));
  }
  u32 values[kTokensPerWarp][2];  // bf16 pairs: [i][0] columns 0 and 1, [i][1] columns 2 and 3
  float amax[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < kTokensPerWarp; ++i) {
    const float s = __shfl_sync(0xFFFFFFFFu, row_scale, i);
    float v[4];
    e4m3x2_to_f32x2(words[i], v[0], v[1]);
    e4m3x2_to_f32x2(words[i] >> 16, v[2], v[3]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[j] = __fmul_rn(v[j], s);
      amax[j] = amax_update(amax[j], v[j]);
    }
    values[i][0] = f32x2_to_bf16x2(v[0], v[1]);
    values[i][1] = f32x2_to_bf16x2(v[2], v[3]);
  }
  column_amax[warp][lane] = make_float4(amax[0], amax[1], amax[2], amax[3]);
  __syncthreads();

  // 2. The block's amax and scale per column; warp 0 writes the scale_inv row of its tile.
  float4 block_amax = column_amax[0][lane];
#pragma unroll
  for (int w = 1; w < kColumnwiseWarps; ++w) {
    const float4 other = column_amax[w][lane];
    block_amax = make_float4(fmaxf(block_amax.x, other.x), fmaxf(block_amax.y, other.y),
                             fmaxf(block_amax.z, other.z), fmaxf(block_amax.w, other.w));
  }
  const float amax_f32[4] = {block_amax.x, block_amax.y, block_amax.z, block_amax.w};
  float scale[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    // The amax of the bf16 values: the fp32 amax rounded once.
    scale[j] = blockwise_scale<kPow2Scale>(bf16_to_f32(f32_to_bf16_rn(amax_f32[j])),
                                           args.amax_epsilon);
  }
  if (warp == 0 && column_in) {
    *reinterpret_cast<float4*>(args.col_scales + static_cast<i64>(block) * args.scale_cols +
                               column) =
        make_float4(blockwise_scale_inv(scale[0]), blockwise_scale_inv(scale[1]),
                    blockwise_scale_inv(scale[2]), blockwise_scale_inv(scale[3]));
  }

  // 3. Quantize: this lane's 16 tokens of column j are one 16-byte run of tile_t row 4 lane + j,
  //    stored at chunk warp ^ (lane % 8) (8 lanes of a quarter warp hit 8 distinct chunks).
  const int chunk = warp ^ (lane & 7);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    u32 packed[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float t[4];
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const u32 pair = values[4 * k + n][j / 2];
        t[n] = __fmul_rn(j % 2 == 0 ? bf16x2_half<0>(pair) : bf16x2_half<1>(pair), scale[j]);
      }
      packed[k] = f32x4_to_e4m3x4(t[0], t[1], t[2], t[3]);
    }
    tile_t[4 * lane + j][chunk] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
  __syncthreads();

  // 4. Store: 8 threads per column, 16 tokens each (128 contiguous bytes of col_data).
  u8* const expert_data = args.col_data + static_cast<i64>(hidden) * where.row_start;
#pragma unroll
  for (int pass = 0; pass < kColumnTile * kChunks / (kColumnwiseWarps * kWarpSize); ++pass) {
    const int r = threadIdx.x / kChunks + pass * (kColumnwiseWarps * kWarpSize / kChunks);
    const int c = threadIdx.x % kChunks;
    const int h = tile * kColumnTile + r;
    const int t = where.first_token + 16 * c;
    const int count = min(16, where.num_rows - t);
    if (h >= hidden || count <= 0) continue;
    const uint4 run = tile_t[r][c ^ ((r >> 2) & 7)];
    u8* const dst = expert_data + static_cast<i64>(h) * where.num_rows + t;
    if (count == 16 && (reinterpret_cast<u64>(dst) & 15u) == 0) {
      *reinterpret_cast<uint4*>(dst) = run;
    } else {
      const u32 bytes[4] = {run.x, run.y, run.z, run.w};
      for (int b = 0; b < count; ++b) dst[b] = static_cast<u8>(bytes[b / 4] >> (8 * (b % 4)));
    }
  }
}
