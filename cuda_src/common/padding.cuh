// The alignment padding rows of an expert-major receive buffer, shared by the expands.
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

}  // namespace mdeep
