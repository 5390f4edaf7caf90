// Warp-wide row codecs of FP8 dispatch, on top of the per-value rules of common/fp8.cuh:
//   quantize_row:    bf16 row -> (e4m3 data, block scales), or -> its dequantized bf16 row;
//   copy_fp8_row:    (data, scales) -> (data, scales);
//   dequant_fp8_row: (data, scales) -> bf16 row.
// Each lane owns 8 consecutive columns (one 16-byte bf16 vector, 8 e4m3 bytes), so a 1x128
// block spans 16 lanes and a 1x32 block 4; hidden is a multiple of 16 (validated on the host).
// A staged wire row is the e4m3 data (hidden bytes) followed by the row's scales.
#pragma once
#include "common/copy.cuh"
#include "common/fp8.cuh"

namespace mdeep {
namespace fp8 {

// kFmt: the wire format (megatron_deepep/fp8/dispatch.py, WIRE_*).
constexpr int kWireBf16 = 0, kWireBlockwise = 1, kWireBlockwisePow2 = 2, kWireMxfp8 = 3;
constexpr int kRowUnroll = 8;  // 16-byte bf16 vectors in flight per lane

template <int kFmt>
struct Wire {
    static constexpr bool kMx = kFmt == kWireMxfp8;
    static constexpr int kBlock = kMx ? kMxfp8Block : kBlockwiseBlock;
    static constexpr int kScaleBytes = kMx ? 1 : 4;
    static constexpr int kBlockLanes = kBlock / 8;
};

template <int kFmt>
__device__ __forceinline__ int scale_row_bytes(int hidden) {
    return (hidden + Wire<kFmt>::kBlock - 1) / Wire<kFmt>::kBlock * Wire<kFmt>::kScaleBytes;
}

__device__ __forceinline__ void unpack_bf16x8(const int4& raw, float (&v)[8]) {
    const u32 w[4] = {(u32)raw.x, (u32)raw.y, (u32)raw.z, (u32)raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

// 8 e4m3 bytes (little-endian in `q`) times `factor`, rounded to bf16.
__device__ __forceinline__ int4 dequant_e4m3x8(const uint2& q, float factor) {
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32 word = i < 4 ? q.x : q.y;
        v[i] = __fmul_rn(e4m3_to_f32(static_cast<u8>(word >> (8 * (i & 3)))), factor);
    }
    return pack_bf16x8(v);
}

// The quantize multiplier and the stored dequantize factor (mult[u], factor[u]) of the 1x128
// block each lane's vector u belongs to, from that block's amax (amax[u], equal on the block's
// 16 lanes). A chunk of kUnroll vectors per lane holds 2 * kUnroll blocks: lane j computes block
// j's scale once (two fp32 and one fp64 division, the longest part of the quantize) and the
// lanes fetch theirs by shuffle, where each lane computed its block's scale for every u before.
// The values are blockwise_scale's and blockwise_scale_inv's either way.
template <int kFmt, int kUnroll>
__device__ __forceinline__ void blockwise_scales(const float (&amax)[kUnroll], float amax_epsilon,
                                                 int lane, float (&mult)[kUnroll],
                                                 float (&factor)[kUnroll]) {
    using W = Wire<kFmt>;
    constexpr int kBlocksPerVec = 32 / W::kBlockLanes;  // blocks in one u across the warp
    static_assert(!W::kMx && kUnroll * kBlocksPerVec <= 32, "one lane per block of the chunk");
    // Lane j takes block j: vector u = j / kBlocksPerVec, group j % kBlocksPerVec.
    float my_amax = 0.0f;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const float a = __shfl_sync(0xffffffffu, amax[u], (lane % kBlocksPerVec) * W::kBlockLanes);
        if (lane / kBlocksPerVec == u) my_amax = a;
    }
    const float my_mult = blockwise_scale<kFmt == kWireBlockwisePow2>(my_amax, amax_epsilon);
    const float my_factor = blockwise_scale_inv(my_mult);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
        const int owner = u * kBlocksPerVec + lane / W::kBlockLanes;
        mult[u] = __shfl_sync(0xffffffffu, my_mult, owner);
        factor[u] = __shfl_sync(0xffffffffu, my_factor, owner);
    }
}

// The amax of the block that this lane's 8 bf16 values (`raw`) belong to, over its lanes
// (columns past `hidden` were loaded as 0).
template <int kFmt>
__device__ __forceinline__ float block_amax(const int4& raw) {
    float v[8];
    unpack_bf16x8(raw, v);
    float lane_amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) lane_amax = amax_update(lane_amax, v[j]);
    return group_max<Wire<kFmt>::kBlockLanes>(lane_amax);
}

// One lane's 8 bf16 values (`raw`) times `mult`, as 8 e4m3 bytes (little-endian).
__device__ __forceinline__ uint2 quantize_e4m3x8(const int4& raw, float mult) {
    float v[8];
    unpack_bf16x8(raw, v);
    uint2 q;
    q.x = f32x4_to_e4m3x4(v[0] * mult, v[1] * mult, v[2] * mult, v[3] * mult);
    q.y = f32x4_to_e4m3x4(v[4] * mult, v[5] * mult, v[6] * mult, v[7] * mult);
    return q;
}

// Quantizes one lane's 8 bf16 values (`raw`, vector `i` of the row) with its block's `mult`
// and writes them to each destination: the e4m3 bytes and, from the block's first lane, the
// scale (`e8m0` for MXFP8, else `factor`); with kDequant, the dequantized bf16 values.
template <int kFmt, int kMaxDst, bool kDequant>
__device__ __forceinline__ void write_quantized_vec(const int4& raw, int i, float mult,
                                                    float factor, u8 e8m0, u8* const* dst_data,
                                                    u8* const* dst_scales, int num_dst,
                                                    int lane) {
    using W = Wire<kFmt>;
    const uint2 q = quantize_e4m3x8(raw, mult);
    if (kDequant) {
        const int4 out = dequant_e4m3x8(q, factor);
#pragma unroll
        for (int d = 0; d < kMaxDst; ++d) {
            if (d >= num_dst) break;
            st_v4(reinterpret_cast<int4*>(dst_data[d]) + i, out);
        }
        return;
    }
    const bool owns_scale = lane % W::kBlockLanes == 0;
    const int block = i * 8 / W::kBlock;
#pragma unroll
    for (int d = 0; d < kMaxDst; ++d) {
        if (d >= num_dst) break;
        reinterpret_cast<uint2*>(dst_data[d])[i] = q;
        if (owns_scale) {
            if (W::kMx) dst_scales[d][block] = e8m0;
            else reinterpret_cast<float*>(dst_scales[d])[block] = factor;
        }
    }
}

// Quantizes the bf16 row `x` (`hidden` columns). Without kDequant, writes e4m3 data to each
// dst_data[d] and the block scales to dst_scales[d]; with kDequant, writes the dequantized bf16
// row to dst_data[d] (so the result equals dequantize(quantize(x)) of formats.py). Each chunk
// of kRowUnroll vectors per lane is loaded at once; 1x128 blocks then take every block's amax
// first and their scales together (blockwise_scales), while MXFP8's e8m0 scale, a few bit
// operations, is made per vector.
template <int kFmt, int kMaxDst, bool kDequant>
__device__ __forceinline__ void quantize_row(const int4* x, int hidden, u8* const* dst_data,
                                             u8* const* dst_scales, int num_dst,
                                             float amax_epsilon, int lane) {
    const int num_vec = hidden / 8;
    for (int base = 0; base < num_vec; base += 32 * kRowUnroll) {
        int4 raw[kRowUnroll];
#pragma unroll
        for (int u = 0; u < kRowUnroll; ++u) {
            const int i = base + u * 32 + lane;
            raw[u] = i < num_vec ? ld_nc_v4(x + i) : make_int4(0, 0, 0, 0);
        }
        if constexpr (Wire<kFmt>::kMx) {
#pragma unroll
            for (int u = 0; u < kRowUnroll; ++u) {
                const int i = base + u * 32 + lane;
                const u8 e8m0 = mxfp8_scale_from_amax(block_amax<kFmt>(raw[u]));
                if (i < num_vec)
                    write_quantized_vec<kFmt, kMaxDst, kDequant>(
                        raw[u], i, e8m0_quant_multiplier(e8m0), e8m0_dequant_multiplier(e8m0),
                        e8m0, dst_data, dst_scales, num_dst, lane);
            }
        } else {
            float amax[kRowUnroll], mult[kRowUnroll], factor[kRowUnroll];
#pragma unroll
            for (int u = 0; u < kRowUnroll; ++u) amax[u] = block_amax<kFmt>(raw[u]);
            blockwise_scales<kFmt, kRowUnroll>(amax, amax_epsilon, lane, mult, factor);
#pragma unroll
            for (int u = 0; u < kRowUnroll; ++u) {
                const int i = base + u * 32 + lane;
                if (i < num_vec)
                    write_quantized_vec<kFmt, kMaxDst, kDequant>(
                        raw[u], i, mult[u], factor[u], 0, dst_data, dst_scales, num_dst, lane);
            }
        }
    }
}

// Bytes of one warp's quantize stage (stage_quantized_row): the e4m3 data, then the scales
// from the next 16-byte boundary. megatron_deepep/ops/dispatch.py computes the same.
template <int kFmt>
__device__ __forceinline__ int stage_stride(int hidden) {
    return hidden + (scale_row_bytes<kFmt>(hidden) + 15) / 16 * 16;
}

// Quantizes the bf16 row `x` into the warp's shared-memory `stage` (e4m3 data, then scales at
// stage + hidden): the same values quantize_row writes, so the rows stay bit-exact.
template <int kFmt>
__device__ __forceinline__ void stage_quantized_row(const int4* x, int hidden, u8* stage,
                                                    float amax_epsilon, int lane) {
    u8* const data[1] = {stage};
    u8* const scales[1] = {stage + hidden};
    quantize_row<kFmt, 1, false>(x, hidden, data, scales, 1, amax_epsilon, lane);
}

// Writes a row's staged scales (`src_scales`, scale_row_bytes of them, in shared memory) to the
// rows `rows` (-1: none) of `recv_scales`: 4-byte words where every row's scales start 4-byte
// aligned, else bytes.
template <int kFmt, int kTopk>
__device__ __forceinline__ void write_staged_scales(const u8* src_scales, int hidden,
                                                    u8* recv_scales, const int (&rows)[kTopk],
                                                    int lane) {
    const int scale_bytes = scale_row_bytes<kFmt>(hidden);
    if (scale_bytes % 4 == 0) {
        for (int i = lane; i < scale_bytes / 4; i += 32) {
            const u32 w = reinterpret_cast<const u32*>(src_scales)[i];
#pragma unroll
            for (int k = 0; k < kTopk; ++k)
                if (rows[k] >= 0)
                    reinterpret_cast<u32*>(recv_scales + (i64)rows[k] * scale_bytes)[i] = w;
        }
    } else {
        for (int i = lane; i < scale_bytes; i += 32) {
            const u8 b = src_scales[i];
#pragma unroll
            for (int k = 0; k < kTopk; ++k)
                if (rows[k] >= 0) recv_scales[(i64)rows[k] * scale_bytes + i] = b;
        }
    }
}

// Writes a staged quantized row (stage_quantized_row) to the rows of `recv_x` and
// `recv_scales` that lanes 0..kTopk-1 name in `row_lane` (-1: none): 16-byte words for the
// data, 4-byte words (or bytes) for the scales. Row addresses come by shuffle, so no pointer
// array lives in local memory. The caller __syncwarp()s between staging and this call.
template <int kFmt, int kTopk>
__device__ __forceinline__ void write_staged_row(const u8* stage, int hidden, u8* recv_x,
                                                 u8* recv_scales, int row_lane, int lane) {
    int rows[kTopk];
#pragma unroll
    for (int k = 0; k < kTopk; ++k) rows[k] = __shfl_sync(0xffffffffu, row_lane, k);
    const int4* words = reinterpret_cast<const int4*>(stage);
    const int num_int4 = hidden / 16;
    for (int base = 0; base < num_int4; base += 32 * kCopyUnroll) {
        int4 v[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
            const int i = base + u * 32 + lane;
            if (i < num_int4) v[u] = words[i];
        }
#pragma unroll
        for (int k = 0; k < kTopk; ++k) {
            if (rows[k] < 0) continue;
            int4* dst = reinterpret_cast<int4*>(recv_x + (i64)rows[k] * hidden);
#pragma unroll
            for (int u = 0; u < kCopyUnroll; ++u) {
                const int i = base + u * 32 + lane;
                if (i < num_int4) st_v4(dst + i, v[u]);
            }
        }
    }
    write_staged_scales<kFmt, kTopk>(stage + hidden, hidden, recv_scales, rows, lane);
}

// Bytes of one warp's scale stage (quantize_row_to_lane_rows): a row's scales, whole 16-byte
// words. megatron_deepep/ops/dispatch.py computes the same.
template <int kFmt>
__device__ __forceinline__ int scale_stage_stride(int hidden) {
    return (scale_row_bytes<kFmt>(hidden) + 15) / 16 * 16;
}

// Quantizes the bf16 row `x` in registers and writes it to the rows of `recv_x` that lanes
// 0..kTopk-1 name in `row_lane` (-1: none): each chunk's e4m3 vectors straight from the lanes
// (8-byte stores, coalesced), its scales into the warp's `scale_stage` (shared memory), written
// to every row at the end. The same bytes as stage_quantized_row then write_staged_row, with no
// row-sized stage: the shared-memory traffic is the scales', not the row's twice. Its chunk loop
// repeats quantize_row's: one helper for both, taking a lambda per vector, made ptxas spill
// (28-52 bytes) in dispatch_local.
template <int kFmt, int kTopk>
__device__ __forceinline__ void quantize_row_to_lane_rows(const int4* x, int hidden, u8* recv_x,
                                                          u8* recv_scales, int row_lane,
                                                          u8* scale_stage, float amax_epsilon,
                                                          int lane) {
    using W = Wire<kFmt>;
    int rows[kTopk];
#pragma unroll
    for (int k = 0; k < kTopk; ++k) rows[k] = __shfl_sync(0xffffffffu, row_lane, k);
    const int num_vec = hidden / 8;
    const bool owns_scale = lane % W::kBlockLanes == 0;
    for (int base = 0; base < num_vec; base += 32 * kRowUnroll) {
        int4 raw[kRowUnroll];
#pragma unroll
        for (int u = 0; u < kRowUnroll; ++u) {
            const int i = base + u * 32 + lane;
            raw[u] = i < num_vec ? ld_nc_v4(x + i) : make_int4(0, 0, 0, 0);
        }
        uint2 q[kRowUnroll];
        if constexpr (W::kMx) {
#pragma unroll
            for (int u = 0; u < kRowUnroll; ++u) {
                const int i = base + u * 32 + lane;
                const u8 e8m0 = mxfp8_scale_from_amax(block_amax<kFmt>(raw[u]));
                q[u] = quantize_e4m3x8(raw[u], e8m0_quant_multiplier(e8m0));
                if (owns_scale && i < num_vec) scale_stage[i * 8 / W::kBlock] = e8m0;
            }
        } else {
            float amax[kRowUnroll], mult[kRowUnroll], factor[kRowUnroll];
#pragma unroll
            for (int u = 0; u < kRowUnroll; ++u) amax[u] = block_amax<kFmt>(raw[u]);
            blockwise_scales<kFmt, kRowUnroll>(amax, amax_epsilon, lane, mult, factor);
#pragma unroll
            for (int u = 0; u < kRowUnroll; ++u) {
                const int i = base + u * 32 + lane;
                q[u] = quantize_e4m3x8(raw[u], mult[u]);
                if (owns_scale && i < num_vec)
                    reinterpret_cast<float*>(scale_stage)[i * 8 / W::kBlock] = factor[u];
            }
        }
#pragma unroll
        for (int k = 0; k < kTopk; ++k) {
            if (rows[k] < 0) continue;
            uint2* const dst = reinterpret_cast<uint2*>(recv_x + (i64)rows[k] * hidden);
#pragma unroll
            for (int u = 0; u < kRowUnroll; ++u) {
                const int i = base + u * 32 + lane;
                if (i < num_vec) dst[i] = q[u];
            }
        }
    }
    __syncwarp();  // the scale stage is complete before any lane reads another lane's scales
    write_staged_scales<kFmt, kTopk>(scale_stage, hidden, recv_scales, rows, lane);
    __syncwarp();  // every lane has read the stage before the next row writes it
}

// Copies a row's scales (`hidden` columns' worth) to each destination.
template <int kFmt, int kMaxDst, bool kStagedSrc>
__device__ __forceinline__ void copy_scales(const u8* src, int hidden, u8* const* dst,
                                            int num_dst, int lane) {
    const int num_blocks = (hidden + Wire<kFmt>::kBlock - 1) / Wire<kFmt>::kBlock;
    for (int b = lane; b < num_blocks; b += 32) {
        if (Wire<kFmt>::kMx) {
            const u8 e = kStagedSrc ? __ldcg(src + b) : __ldg(src + b);
#pragma unroll
            for (int d = 0; d < kMaxDst; ++d)
                if (d < num_dst) dst[d][b] = e;
        } else {
            const float* s = reinterpret_cast<const float*>(src);
            const float f = kStagedSrc ? __ldcg(s + b) : __ldg(s + b);
#pragma unroll
            for (int d = 0; d < kMaxDst; ++d)
                if (d < num_dst) reinterpret_cast<float*>(dst[d])[b] = f;
        }
    }
}

// Copies e4m3 data (`hidden` bytes, a multiple of 16) and its scales to each destination.
template <int kFmt, int kMaxDst, bool kStagedSrc>
__device__ __forceinline__ void copy_fp8_row(const u8* src_data, const u8* src_scales, int hidden,
                                             u8* const* dst_data, u8* const* dst_scales,
                                             int num_dst, int lane) {
    warp_copy_row<kMaxDst, kStagedSrc>(reinterpret_cast<const int4*>(src_data),
                                       reinterpret_cast<int4* const*>(dst_data), num_dst,
                                       hidden / 16, lane);
    copy_scales<kFmt, kMaxDst, kStagedSrc>(src_scales, hidden, dst_scales, num_dst, lane);
}

// Dequantizes (e4m3 data, scales) into the bf16 row of each destination.
template <int kFmt, int kMaxDst, bool kStagedSrc>
__device__ __forceinline__ void dequant_fp8_row(const u8* src_data, const u8* src_scales,
                                                int hidden, int4* const* dst, int num_dst,
                                                int lane) {
    using W = Wire<kFmt>;
    const int num_vec = hidden / 8;
    const uint2* data = reinterpret_cast<const uint2*>(src_data);
    for (int base = 0; base < num_vec; base += 32 * kRowUnroll) {
        uint2 q[kRowUnroll];
        float factor[kRowUnroll];
#pragma unroll
        for (int u = 0; u < kRowUnroll; ++u) {
            const int i = base + u * 32 + lane;
            if (i >= num_vec) continue;
            const int block = i * 8 / W::kBlock;
            q[u] = kStagedSrc ? __ldcg(data + i) : __ldg(data + i);
            if (W::kMx) {
                const u8 e = kStagedSrc ? __ldcg(src_scales + block) : __ldg(src_scales + block);
                factor[u] = e8m0_dequant_multiplier(e);
            } else {
                const float* s = reinterpret_cast<const float*>(src_scales) + block;
                factor[u] = kStagedSrc ? __ldcg(s) : __ldg(s);
            }
        }
#pragma unroll
        for (int u = 0; u < kRowUnroll; ++u) {
            const int i = base + u * 32 + lane;
            if (i >= num_vec) continue;
            const int4 out = dequant_e4m3x8(q[u], factor[u]);
#pragma unroll
            for (int d = 0; d < kMaxDst; ++d)
                if (d < num_dst) st_v4(dst[d] + i, out);
        }
    }
}

}  // namespace fp8
}  // namespace mdeep
