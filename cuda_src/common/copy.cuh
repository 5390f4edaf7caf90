// Warp-wide row copies: one source row to several destinations, many bytes in flight per lane.
#pragma once
#include "common/ptx.cuh"

namespace mdeep {

#ifndef MDEEP_COPY_UNROLL
#define MDEEP_COPY_UNROLL 8
#endif
// 16 B x 8 in flight per lane: enough bytes to cover latency (a tuning knob, see jit.py).
constexpr int kCopyUnroll = MDEEP_COPY_UNROLL;

// Copies one row of `num_int4` 16-byte words from `src` to up to kMaxDst destinations; the
// whole warp takes part. kStagedSrc: the source was written by a peer during this kernel (read
// through L2), else it is read-only input (non-coherent path).
template <int kMaxDst, bool kStagedSrc>
__device__ __forceinline__ void warp_copy_row(const int4* src, int4* const* dst, int num_dst,
                                              int num_int4, int lane) {
    for (int base = 0; base < num_int4; base += 32 * kCopyUnroll) {
        int4 v[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
            const int i = base + u * 32 + lane;
            if (i < num_int4) v[u] = kStagedSrc ? ld_cg_v4(src + i) : ld_nc_v4(src + i);
        }
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
}

// Zeroes `num_int4` 16-byte words at `dst` with the whole warp.
__device__ __forceinline__ void warp_zero_row(int4* dst, int num_int4, int lane) {
    const int4 zero = make_int4(0, 0, 0, 0);
    for (int i = lane; i < num_int4; i += 32) dst[i] = zero;
}

}  // namespace mdeep
