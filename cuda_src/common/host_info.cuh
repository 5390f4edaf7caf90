// The receive layout's summary for the host, in mapped pinned memory (mirrored by
// megatron_deepep/transport/status.py): written by notify, or by the layout kernel at EP = 1.
//
// Every word the host reads is one aligned 64-bit store carrying its value and the epoch it
// belongs to (`host_word`): the host polls `rows` for its epoch and takes the row count from the
// same load, and accepts a per-expert size only when its word carries that epoch too. So no host
// load needs to be ordered after another one: a host whose loads may reorder (Arm: GH200,
// GB200) reads a consistent layout without an acquire fence, which Python cannot issue.
// Aligned 64-bit loads and stores are single-copy atomic on x86-64, AArch64 and the GPU.
#pragma once
#include "common/ptx.cuh"

namespace mdeep {

struct HostInfo {
    u64 rows;                                 // host_word(num_recv_rows, epoch), stored last
    u64 tokens_per_expert[kMaxLocalExperts];  // host_word(padded rows of local expert e, epoch)
};

// (value << 32) | epoch: one word the host reads in a single load (status.py's unpack).
__host__ __device__ constexpr u64 host_word(int value, u32 epoch) {
    return ((u64)(u32)value << 32) | (u64)epoch;
}

__device__ __forceinline__ void st_volatile_u64(u64* p, u64 v) {
    *reinterpret_cast<volatile u64*>(p) = v;
}

// Stores local expert e's padded rows for the host (before `publish_host_info` of `epoch`).
__device__ __forceinline__ void store_expert_rows(HostInfo* host_info, int e, int rows,
                                                  u32 epoch) {
    st_volatile_u64(&host_info->tokens_per_expert[e], host_word(rows, epoch));
}

// Thread 0: publishes the row count with the epoch the host waits for (the per-expert sizes
// were stored and fenced by the caller's threads before).
__device__ __forceinline__ void publish_host_info(HostInfo* host_info, int num_rows, u32 epoch) {
    st_volatile_u64(&host_info->rows, host_word(num_rows, epoch));
    __threadfence_system();
}

// One warp: copies the padded rows per local expert and the row count (the last row start) to
// the host, then publishes `epoch` (EP = 1 expand launched before the host's wait).
__device__ __forceinline__ void warp_publish_host_info(HostInfo* host_info,
                                                       const int* tokens_per_expert,
                                                       const int* expert_row_start,
                                                       int num_local, u32 epoch, int lane) {
    for (int e = lane; e < num_local; e += 32)
        store_expert_rows(host_info, e, tokens_per_expert[e], epoch);
    __threadfence_system();
    __syncwarp();
    if (lane == 0) publish_host_info(host_info, expert_row_start[num_local], epoch);
}

}  // namespace mdeep
