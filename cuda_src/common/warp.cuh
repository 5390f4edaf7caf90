// Warp and block helpers: scans, the last-block-done pattern.
#pragma once
#include "common/ptx.cuh"

namespace mdeep {

__device__ __forceinline__ int warp_inclusive_scan(int v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int n = __shfl_up_sync(0xffffffffu, v, d);
        if (lane >= d) v += n;
    }
    return v;
}

// Exclusive scan over the block; `total` receives the block sum. `smem` holds >= 33 ints.
__device__ __forceinline__ int block_exclusive_scan(int v, int* smem, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int num_warps = (blockDim.x + 31) >> 5;
    const int inc = warp_inclusive_scan(v);
    if (lane == 31) smem[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int w = lane < num_warps ? smem[lane] : 0;
        const int winc = warp_inclusive_scan(w);
        if (lane < num_warps) smem[lane] = winc - w;
        if (lane == 31) smem[32] = winc;
    }
    __syncthreads();
    const int result = smem[warp] + inc - v;
    *total = smem[32];
    __syncthreads();
    return result;
}

// Call from every thread at the end of a kernel: returns true in thread 0 of the last block to
// finish. Every thread's earlier writes (peers' memory included) are fenced before the count.
__device__ __forceinline__ bool last_block_done(u32* counter) {
    __shared__ bool is_last;
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 done = atomicAdd(counter, 1u);
        is_last = done == gridDim.x - 1;
        if (is_last) {
            *counter = 0;  // ready for the next launch; stream order keeps launches apart
            __threadfence_system();
        }
    }
    __syncthreads();
    return is_last && threadIdx.x == 0;
}

}  // namespace mdeep
