// Ceilings for the benchmark: what this GPU's memory system allows for the traffic our
// kernels make, measured in the same run (megatron_deepep.bench).
//   fill_kernel: write-only rate (16-byte stores, grid-stride). torch's own fill reaches ~20%
//     less on H200, so it understates the write ceiling.
//   fan_out_copy: the EP=1 expand's traffic without its bookkeeping: each of N rows read once
//     and written to `fan_out` rows given by `dst_rows` (N x fan_out, -1 skips); a row's first
//     loads are issued before its destinations are read, as the expand does.
//   fan_out_fp8_bytes: the FP8 expand's traffic without its arithmetic: each bf16 row read once
//     and written to `fan_out` rows as one byte per element (its high byte: no amax, no
//     scaling) plus `scale_int4` 16-byte words of scales per row, by the same loop shape as
//     fan_out_copy; `narrow_stores` picks 8-byte stores from coalesced loads over 16-byte
//     stores from loads with a 32-byte lane stride. At a given block count the faster is the
//     store path's floor for FP8 rows.
//   fan_in_sum: the EP=1 combine's traffic: for each of N output rows, its `fan_in` rows of
//     `src` (given by `src_rows`) summed in fp32 and written once in bf16.
//   peer_copy: at EP > 1, the NVLink traffic alone: every rank writes a slot of bytes into each
//     other rank's symmetric buffer, all ranks at once (bench_peers.py times it).
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

__global__ void __launch_bounds__(1024) fan_out_copy(const __grid_constant__ FanOutArgs args) {
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

// The high bytes of the eight bf16 in `a`, as one int2.
__device__ __forceinline__ int2 high_bytes(const int4 a) {
    return make_int2(__byte_perm(a.x, a.y, 0x7531), __byte_perm(a.z, a.w, 0x7531));
}

// Source word j of a lane's 8 in the chunk at `base` (256 source words per chunk). Wide: lane
// l holds words 2(32u + l) and 2(32u + l) + 1 for u < 4, so one 16-byte store per output word,
// from loads with a 32-byte lane stride. Narrow: word 32j + l, loads coalesced, 8-byte stores.
template <bool kNarrow>
__device__ __forceinline__ int source_word(int base, int j, int lane) {
    return kNarrow ? base + j * 32 + lane : base + 2 * ((j / 2) * 32 + lane) + (j & 1);
}

template <bool kNarrow>
__device__ __forceinline__ void fan_out_fp8_rows(const FanOutBytesArgs& args) {
    const int num_rows = args.num_rows, num_int4 = args.num_int4, fan_out = args.fan_out;
    const int scale_int4 = args.scale_int4;
    constexpr int kWords = 8;  // source words of 16 bytes in flight per lane, as fan_out_copy
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int num_warps = (gridDim.x * blockDim.x) >> 5;
    int2* const dst = reinterpret_cast<int2*>(args.dst);  // output word i: source word i's bytes
    for (int n = warp; n < num_rows; n += num_warps) {
        const int4* const row = args.src + (i64)n * num_int4;
        int4 v[kWords];
        const int my_row = lane < fan_out ? args.dst_rows[(i64)n * fan_out + lane] : -1;
        for (int base = 0; base < num_int4; base += 32 * kWords) {
#pragma unroll
            for (int j = 0; j < kWords; ++j) {
                const int i = source_word<kNarrow>(base, j, lane);
                if (i < num_int4) v[j] = ld_nc_v4(row + i);
            }
            for (int k = 0; k < fan_out; ++k) {
                const int out_row = __shfl_sync(0xffffffffu, my_row, k);
                if (out_row < 0) continue;
                int2* const out = dst + (i64)out_row * num_int4;
#pragma unroll
                for (int j = 0; j < kWords; j += kNarrow ? 1 : 2) {
                    const int i = source_word<kNarrow>(base, j, lane);
                    if (i >= num_int4) continue;
                    if (kNarrow) {
                        *reinterpret_cast<int2*>(out + i) = high_bytes(v[j]);
                    } else {
                        const int2 lo = high_bytes(v[j]), hi = high_bytes(v[j + 1]);
                        st_v4(reinterpret_cast<int4*>(out + i), make_int4(lo.x, lo.y, hi.x, hi.y));
                    }
                }
                if (base == 0 && lane < scale_int4)
                    st_v4(args.dst_scales + (i64)out_row * scale_int4 + lane, v[0]);
            }
        }
    }
}

__global__ void __launch_bounds__(1024) fan_out_fp8_bytes(
    const __grid_constant__ FanOutBytesArgs args) {
    if (args.narrow_stores)
        fan_out_fp8_rows<true>(args);
    else
        fan_out_fp8_rows<false>(args);
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

// The NVLink ceiling at EP > 1: every rank writes `num_int4_per_peer` int4 to each other rank at
// once, with nothing else (no layout, no flags, no expand). Blocks are spread over the peers,
// each rank starting at its next rank so that no peer is written by all ranks in the same order;
// with fewer blocks than peers a block serves several peers in turn. Within one peer's bytes
// the blocks that serve it stride over them together, kUnroll 16-byte loads in flight per thread
// before the stores (the HBM read latency would otherwise throttle the NVLink writes).
__global__ void __launch_bounds__(512) peer_copy(const __grid_constant__ PeerCopyArgs args) {
    const int num_ranks = args.num_ranks, rank = args.rank, num_peers = num_ranks - 1;
    const i64 num_int4 = args.num_int4_per_peer;
    constexpr int kUnroll = 4;
    if (num_peers <= 0) return;
    const int num_blocks = gridDim.x, block = blockIdx.x;
    // This block's share of a peer: part `part` of `num_parts` blocks (all of them for one peer
    // when there are at least as many blocks as peers, else the whole peer).
    const bool spread = num_blocks >= num_peers;
    for (int j = block % num_peers; j < num_peers; j += num_blocks) {
        const int peer = (rank + 1 + j) % num_ranks;
        const int num_parts = spread ? (num_blocks - j + num_peers - 1) / num_peers : 1;
        const int part = spread ? block / num_peers : 0;
        const int4* const src = args.src + (i64)peer * num_int4;
        int4* const dst = reinterpret_cast<int4*>(args.peer_bases[peer]) + (i64)rank * num_int4;
        const i64 stride = (i64)num_parts * blockDim.x;
        for (i64 base = (i64)part * blockDim.x + threadIdx.x; base < num_int4;
             base += stride * kUnroll) {
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (base + u * stride < num_int4) v[u] = ld_nc_v4(src + base + u * stride);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (base + u * stride < num_int4) st_v4(dst + base + u * stride, v[u]);
        }
    }
}
