// Rows of an expert-major receive buffer (recv_x, recv_scales), shared by the expands: the
// destinations of one token, the alignment padding rows.
#pragma once
#include "common/copy.cuh"

namespace mdeep {

// Zeroes local expert e's alignment padding rows of recv_x (and their scales and weights) with
// the whole warp: rows [start + received, next start), clipped to max_rows.
template <bool kFp8Out, bool kCached>
__device__ __forceinline__ void zero_padding_rows(int e, u8* recv_x, u8* recv_scales,
                                                  float* recv_weights, i64 row_bytes,
                                                  int scale_bytes, int max_rows,
                                                  const int* num_recv_tokens_per_expert,
                                                  const int* expert_row_start, int lane) {
    const int first = expert_row_start[e] + num_recv_tokens_per_expert[e];
    const int last = min(expert_row_start[e + 1], max_rows);
    for (int row = first; row < last; ++row) {
        warp_zero_row(reinterpret_cast<int4*>(recv_x + row * row_bytes), (int)(row_bytes / 16),
                      lane);
        if (kFp8Out)
            for (int b = lane; b < scale_bytes; b += 32)
                recv_scales[(i64)row * scale_bytes + b] = 0;
        if (!kCached && lane == 0) recv_weights[row] = 0.f;
    }
}

// Lane k of the warp holds `row_lane`, the row of the token's entry k (-1: none): gathers the
// token's destination rows (and scale rows) in k order into dst / dst_scales; returns how many.
template <int kTopk>
__device__ __forceinline__ int lane_rows_to_dsts(int row_lane, u8* recv_x, i64 row_bytes,
                                                 u8* recv_scales, int scale_bytes, u8** dst,
                                                 u8** dst_scales) {
    int num_dst = 0;
#pragma unroll
    for (int k = 0; k < kTopk; ++k) {
        const int row = __shfl_sync(0xffffffffu, row_lane, k);
        if (row < 0) continue;
        dst[num_dst] = recv_x + row * row_bytes;
        dst_scales[num_dst++] = recv_scales + (i64)row * scale_bytes;
    }
    return num_dst;
}

}  // namespace mdeep
