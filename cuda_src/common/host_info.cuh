// The receive layout's summary for the host, in mapped pinned memory (mirrored by
// megatron_deepep/transport/nvlink.py): written by notify, or by the layout kernel at EP = 1.
// The host polls `epoch`; the other words are written and fenced before it.
#pragma once
#include "common/ptx.cuh"

namespace mdeep {

struct HostInfo {
    int epoch;
    int num_recv_rows;
    int pad[2];
    int tokens_per_expert[kMaxLocalExperts];
};

// Thread 0: publishes the row count, then the epoch the host waits for (the per-expert sizes
// were stored and fenced by the caller's threads before).
__device__ __forceinline__ void publish_host_info(HostInfo* host_info, int num_rows, u32 epoch) {
    st_volatile(&host_info->num_recv_rows, num_rows);
    __threadfence_system();
    st_volatile(&host_info->epoch, (int)epoch);
    __threadfence_system();
}

// One warp: copies the padded rows per local expert and the row count (the last row start) to
// the host, then publishes `epoch` (EP = 1 expand launched before the host's wait).
__device__ __forceinline__ void warp_publish_host_info(HostInfo* host_info,
                                                       const int* tokens_per_expert,
                                                       const int* expert_row_start,
                                                       int num_local, u32 epoch, int lane) {
    for (int e = lane; e < num_local; e += 32)
        host_info->tokens_per_expert[e] = tokens_per_expert[e];
    __threadfence_system();
    __syncwarp();
    if (lane == 0) publish_host_info(host_info, expert_row_start[num_local], epoch);
}

}  // namespace mdeep
