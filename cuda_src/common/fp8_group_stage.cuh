// Quantizing a bf16 row that sits whole in a warp's shared-memory stage, one 64-column part
// per lane: the EP = 1 expand's quantize when its stages fit (ops/dispatch.py picks the stage
// size; the kernel sees it as its dynamic shared memory).
//
// stage_bf16_row copies the token's bf16 row into the stage (cp.async, 16 bytes per lane and
// copy, all in flight at once); quantize_staged_bf16_row then rewrites the stage in place into
// the layout stage_quantized_row (fp8_row.cuh) leaves: e4m3 data at [0, hidden), the row's scales
// at [hidden, ...). write_staged_row copies it out unchanged.
//
// Why a lane per part: a lane's 64 columns are two whole 1x32 blocks, or half of a 1x128 block
// whose other half is the next lane's, so a block's amax takes at most one shuffle and its
// scale is computed once. Lanes that share a block across the warp wait on shuffle latency for
// every vector; that latency, not the bytes, held the quantizing expand back. 64 columns, not
// 128, keep a lane's bf16 (8 vectors, 32 registers) in registers without spilling. The values
// are quantize_row's, so the rows stay bit-exact.
#pragma once
#include "common/fp8_row.cuh"
#include "common/ptx.cuh"

namespace mdeep {
namespace fp8 {

constexpr int kLaneCols = 64;                // columns one lane quantizes at a time
constexpr int kLaneVecs = kLaneCols / 8;     // its 16-byte bf16 vectors
constexpr int kGroupRounds = 4;              // such parts per lane per row, at most
constexpr int kGroupStageMaxHidden = 32 * kGroupRounds * kLaneCols;

// Whether a row of `hidden` columns can be quantized by groups (one stage of 2 * hidden bytes
// per warp; the caller checks that its dynamic shared memory holds them).
__device__ __forceinline__ bool group_stage_fits(int hidden) {
    return hidden <= kGroupStageMaxHidden;
}

// Starts copying the bf16 row `x` (`hidden` columns) into the warp's `stage`; the copies
// complete at quantize_staged_bf16_row. The caller __syncwarp()s first when the stage was
// being read.
__device__ __forceinline__ void stage_bf16_row(const int4* x, int hidden, u8* stage, int lane) {
    int4* const dst = reinterpret_cast<int4*>(stage);
    for (int i = lane; i < hidden / 8; i += 32) cp_async_v4(dst + i, x + i);
}

// The vector of a lane's part (0..7) that its register j holds. Rotating by lane bits 1..3
// spreads a warp's 16-byte stage reads over all eight bank quads and, with bit 0 (the part's
// parity), its 8-byte e4m3 writes over all sixteen bank pairs: no conflicts beyond the minimum.
// j / 4 selects the 1x32 block (j / 4 + lane / 8) % 2.
__device__ __forceinline__ int part_vec(int j, int lane) {
    return 4 * ((j / 4 + (lane >> 3)) & 1) + ((j + (lane >> 1)) & 3);
}

// max(|a|, |b|) per bf16 half: max.bf16x2 returns the non-NaN operand, as fmaxf does (abs.bf16x2
// becomes an operand modifier of the max, where a mask would cost an instruction).
__device__ __forceinline__ u32 bf16x2_abs_max(u32 a, u32 b) {
    u32 d;
    asm("{\n\t.reg .b32 aa, ab;\n\tabs.bf16x2 aa, %1;\n\tabs.bf16x2 ab, %2;\n\t"
        "max.bf16x2 %0, aa, ab;\n\t}"
        : "=r"(d)
        : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ u32 bf16x2_max(u32 a, u32 b) {
    u32 d;
    asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// The amax of the 32 bf16 values in raw[0..3] (NaN ignored, 0 if none is a number): the value
// amax_update folds over them from 0.
__device__ __forceinline__ float amax_of_4vecs(const int4* raw) {
    u32 m[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const int4& r = raw[t];
        m[t] = bf16x2_max(bf16x2_abs_max((u32)r.x, (u32)r.y), bf16x2_abs_max((u32)r.z, (u32)r.w));
    }
    const u32 both = bf16x2_max(bf16x2_max(m[0], m[1]), bf16x2_max(m[2], m[3]));
    return fmaxf(fmaxf(0.0f, __uint_as_float(both & 0xFFFF0000u)), __uint_as_float(both << 16));
}

// Quantizes lane's 64-column part `p` of the staged bf16 row in place and returns its scale
// word (blockwise: the block's fp32 factor, equal on lanes l and l ^ 1; MXFP8: the part's two
// e8m0 bytes). kChecked: some lanes' parts are past the row, or partly (the row's last round);
// else every lane's part is whole, and no load or store needs a bounds check.
template <int kFmt, bool kChecked>
__device__ __forceinline__ u32 quantize_part(u8* stage, int num_vec, int p, float amax_epsilon,
                                             int lane) {
    using W = Wire<kFmt>;
    const bool active = !kChecked || p * kLaneVecs < num_vec;
    const int4* const bf16_vecs = reinterpret_cast<const int4*>(stage);
    int4 raw[kLaneVecs];
#pragma unroll
    for (int j = 0; j < kLaneVecs; ++j) {
        const int v = p * kLaneVecs + part_vec(j, lane);
        raw[j] = !kChecked || v < num_vec ? bf16_vecs[v] : make_int4(0, 0, 0, 0);
    }
    __syncwarp();  // every lane holds its part before any e4m3 byte overwrites the stage
    u32 scale_word = 0;
    float mult[2];
    if constexpr (W::kMx) {
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const u8 e8m0 = mxfp8_scale_from_amax(amax_of_4vecs(raw + 4 * s));
            mult[s] = e8m0_quant_multiplier(e8m0);
            scale_word |= static_cast<u32>(e8m0) << (8 * ((s + (lane >> 3)) & 1));
        }
    } else {
        float amax = fmaxf(amax_of_4vecs(raw), amax_of_4vecs(raw + 4));
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
        const float m = blockwise_scale<kFmt == kWireBlockwisePow2>(amax, amax_epsilon);
        scale_word = __float_as_uint(blockwise_scale_inv(m));
        mult[0] = mult[1] = m;
    }
    if (!active) return scale_word;
    uint2* const out = reinterpret_cast<uint2*>(stage + (i64)p * kLaneCols);
#pragma unroll
    for (int j = 0; j < kLaneVecs; ++j) {
        const int jj = part_vec(j, lane);
        if (kChecked && p * kLaneVecs + jj >= num_vec) continue;
        float v[8];
        unpack_bf16x8(raw[j], v);
        const float k = mult[j / 4];
        out[jj] = make_uint2(f32x4_to_e4m3x4(v[0] * k, v[1] * k, v[2] * k, v[3] * k),
                             f32x4_to_e4m3x4(v[4] * k, v[5] * k, v[6] * k, v[7] * k));
    }
    return scale_word;
}

// Waits for stage_bf16_row's copies and quantizes the staged bf16 row in place. Round r gives
// lane l the 64-column part p = 32 r + l (a 1x128 block is parts 2b and 2b + 1, lanes l and
// l ^ 1: their amax meet by one shuffle); the part's e4m3 bytes land at 64 p, over bf16 that
// this or an earlier round has read (each round reads all of its parts before any lane
// writes), and the scales go in last, past `hidden`.
template <int kFmt>
__device__ __forceinline__ void quantize_staged_bf16_row(u8* stage, int hidden, float amax_epsilon,
                                                         int lane) {
    static_assert(Wire<kFmt>::kMx || Wire<kFmt>::kBlock == 2 * kLaneCols,
                  "a 1x128 block is two lanes' parts");
    const int num_vec = hidden / 8;
    const int num_parts = (hidden + kLaneCols - 1) / kLaneCols;
    u32 scale_words[kGroupRounds] = {};
    cp_async_wait_all();
    __syncwarp();
#pragma unroll
    for (int r = 0; r < kGroupRounds; ++r) {
        if (r * 32 >= num_parts) break;  // the same for every lane
        const int p = r * 32 + lane;
        if ((r + 1) * 32 * kLaneVecs <= num_vec)  // the same for every lane
            scale_words[r] = quantize_part<kFmt, false>(stage, num_vec, p, amax_epsilon, lane);
        else
            scale_words[r] = quantize_part<kFmt, true>(stage, num_vec, p, amax_epsilon, lane);
    }
    __syncwarp();  // all bf16 is read: the scales may overwrite it
#pragma unroll
    for (int r = 0; r < kGroupRounds; ++r) {
        const int p = r * 32 + lane;
        if (p >= num_parts) break;
        if (Wire<kFmt>::kMx)
            reinterpret_cast<u16*>(stage + hidden)[p] = static_cast<u16>(scale_words[r]);
        else if (p % 2 == 0)
            reinterpret_cast<u32*>(stage + hidden)[p / 2] = scale_words[r];
    }
    __syncwarp();
}

}  // namespace fp8
}  // namespace mdeep
