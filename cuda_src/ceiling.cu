// Ceilings for the benchmark: what this GPU's memory system allows for the traffic our
// kernels make, measured in the same run (megatron_deepep.bench).
//   fill_kernel: write-only rate (16-byte stores, grid-stride). torch's own fill reaches ~20%
//     less on H200, so it understates the write ceiling.
//   fan_out_copy: the EP=1 expand's traffic without its bookkeeping: each of N rows read once
//     and written to `fan_out` rows given by `dst_rows` (N x fan_out, -1 skips); a row's first
//     loads are issued before its destinations are read, as the expand does.
//   fan_in_sum: the EP=1 combine's traffic: for each of N output rows, its `fan_in` rows of
//     `src` (given by `src_rows`) summed in fp32 and written once in bf16.
#include "common/args.cuh"
#include "common/ptx.cuh"
#include "common/types.cuh"

using namespace mdeep;

__global__ void __launch_bounds__(256) fill_kernel(const __grid_constant__ FillArgs args) {
    int4* const dst = args.dst;
    const i64 num_int4 = args.num_int4;
    const int4 value = make_int4(0, 0, 0, 0);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < num_int4;
         i += (i64)gridDim.x * blockDim.x)
        st_v4(dst + i, value);
}

__global__ void __launch_bounds__(512) fan_out_copy(const __grid_constant__ FanOutArgs args) {
    const int4* const src = args.src;
    const int* const dst_rows = args.dst_rows;
    int4* const dst = args.dst;
    const int num_rows = args.num_rows, num_int4 = args.num_int4, fan_out = args.fan_out;
    constexpr int kUnroll = 8;
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int num_warps = (gridDim.x * blockDim.x) >> 5;
    for (int n = warp; n < num_rows; n += num_warps) {
        // The row's first chunk is loaded before its destinations (as dispatch_local does).
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int i = u * 32 + lane;
            if (i < num_int4) v[u] = ld_nc_v4(src + (i64)n * num_int4 + i);
        }
        const int my_row = lane < fan_out ? dst_rows[(i64)n * fan_out + lane] : -1;
        for (int base = 0; base < num_int4; base += 32 * kUnroll) {
            if (base > 0) {
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const int i = base + u * 32 + lane;
                    if (i < num_int4) v[u] = ld_nc_v4(src + (i64)n * num_int4 + i);
                }
            }
            for (int k = 0; k < fan_out; ++k) {
                const int row = __shfl_sync(0xffffffffu, my_row, k);
                if (row < 0) continue;
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const int i = base + u * 32 + lane;
                    if (i < num_int4) st_v4(dst + (i64)row * num_int4 + i, v[u]);
                }
            }
        }
    }
}

__global__ void __launch_bounds__(512) fan_in_sum(const __grid_constant__ FanInArgs args) {
    const int4* const src = args.src;
    const int* const src_rows = args.src_rows;
    int4* const dst = args.dst;
    const int num_rows = args.num_rows, num_int4 = args.num_int4;
    constexpr int kFanIn = 8;  // the bench's first shape; rows beyond `src_rows` are -1
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int num_warps = (gridDim.x * blockDim.x) >> 5;
    for (int n = warp; n < num_rows; n += num_warps) {
        int rows[kFanIn];
#pragma unroll
        for (int k = 0; k < kFanIn; ++k) rows[k] = src_rows[(i64)n * kFanIn + k];
        for (int i = lane; i < num_int4; i += 32) {
            int4 v[kFanIn];
#pragma unroll
            for (int k = 0; k < kFanIn; ++k)
                if (rows[k] >= 0) v[k] = ld_nc_v4(src + (i64)rows[k] * num_int4 + i);
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int k = 0; k < kFanIn; ++k)
                if (rows[k] >= 0) accumulate_bf16x8<false>(acc, v[k], 1.f);
            st_v4(dst + (i64)n * num_int4 + i, pack_bf16x8(acc));
        }
    }
}
