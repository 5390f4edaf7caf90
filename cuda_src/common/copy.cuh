// Warp-wide row copies: one source row to several destinations, many bytes in flight per lane.
#pragma once
#include "common/ptx.cuh"

namespace mdeep {

// 16 B x 8 in flight per lane: enough bytes to cover latency.
constexpr int kCopyUnroll = 8;

// One lane's share of a chunk of kCopyUnroll x 32 words starting at `base`: word
// base + u * 32 + lane for u < kCopyUnroll. kStagedSrc: the source was written by a peer during
// this kernel (read through L2), else it is read-only input (non-coherent path).
template <bool kStagedSrc>
__device__ __forceinline__ void load_chunk(const int4* src, int base, int num_int4, int lane,
                                           int4 (&v)[kCopyUnroll]) {
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i < num_int4) v[u] = kStagedSrc ? ld_cg_v4(src + i) : ld_nc_v4(src + i);
    }
}

template <int kMaxDst>
__device__ __forceinline__ void store_chunk(int4* const* dst, int num_dst, int base,
                                            int num_int4, int lane,
                                            const int4 (&v)[kCopyUnroll]) {
#pragma unroll
    for (int d = 0; d < kMaxDst; ++d) {
        if (d >= num_dst) break;
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
            const int i = base + u * 32 + lane;
            if (i < num_int4) st_v4(dst[d] + i, v[u]);
        }
    }
}

// Copies one row of `num_int4` 16-byte words from `src` to up to kMaxDst destinations; the
// whole warp takes part.
template <int kMaxDst, bool kStagedSrc>
__device__ __forceinline__ void warp_copy_row(const int4* src, int4* const* dst, int num_dst,
                                              int num_int4, int lane) {
    for (int base = 0; base < num_int4; base += 32 * kCopyUnroll) {
        int4 v[kCopyUnroll];
        load_chunk<kStagedSrc>(src, base, num_int4, lane, v);
        store_chunk<kMaxDst>(dst, num_dst, base, num_int4, lane, v);
    }
}

// Copies one read-only row to the rows of `out` (of `row_bytes` each) that lanes 0..kMaxDst-1
// name in `row_lane` (-1: none), taken by shuffle per chunk, so no destination array lives in
// local memory. The caller already loaded the first chunk `v` (issued before the token's
// bookkeeping loads, so their latencies overlap), and words 32 * kCopyUnroll .. stage_end - 1
// of the row into the warp's `stage` (word i at stage[i - 32 * kCopyUnroll], each by the lane
// that reads it here; stage_end <= 32 * kCopyUnroll: none).
template <int kMaxDst>
__device__ __forceinline__ void warp_copy_row_to_lane_rows(const int4* src, int4 (&v)[kCopyUnroll],
                                                           u8* out, i64 row_bytes, int row_lane,
                                                           int num_int4, int lane,
                                                           const int4* stage = nullptr,
                                                           int stage_end = 0) {
    constexpr int kChunk = 32 * kCopyUnroll;
    for (int base = 0;;) {
#pragma unroll
        for (int k = 0; k < kMaxDst; ++k) {
            const int row = __shfl_sync(0xffffffffu, row_lane, k);
            if (row < 0) continue;
            int4* dst = reinterpret_cast<int4*>(out + row * row_bytes);
#pragma unroll
            for (int u = 0; u < kCopyUnroll; ++u) {
                const int i = base + u * 32 + lane;
                if (i < num_int4) st_v4(dst + i, v[u]);
            }
        }
        base += kChunk;
        if (base >= num_int4) break;
        if (base < stage_end) {
#pragma unroll
            for (int u = 0; u < kCopyUnroll; ++u) {
                const int i = base + u * 32 + lane;
                if (i < num_int4) v[u] = i < stage_end ? stage[i - kChunk] : ld_nc_v4(src + i);
            }
        } else {
            load_chunk<false>(src, base, num_int4, lane, v);
        }
    }
}

// Issues (cp.async) the copy of words 32 * kCopyUnroll .. stage_end - 1 of a read-only row
// into the warp's `stage`, in the layout warp_copy_row_to_lane_rows reads; each lane waits for
// its own copies (cp_async_wait_all) before that read.
__device__ __forceinline__ void warp_stage_row(const int4* src, int4* stage, int stage_end,
                                               int lane) {
    constexpr int kChunk = 32 * kCopyUnroll;
    for (int i = kChunk + lane; i < stage_end; i += 32) cp_async_v4(stage + (i - kChunk), src + i);
}

// Zeroes `num_int4` 16-byte words at `dst` with the whole warp.
__device__ __forceinline__ void warp_zero_row(int4* dst, int num_int4, int lane) {
    const int4 zero = make_int4(0, 0, 0, 0);
    for (int i = lane; i < num_int4; i += 32) dst[i] = zero;
}

}  // namespace mdeep
