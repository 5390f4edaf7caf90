// EP = 1's receive layout, written by the layout kernel's last block (layout.cu): what notify
// writes for R ranks, with nothing to exchange for one.
#pragma once
#include "common/error.cuh"
#include "common/host_info.cuh"
#include "common/warp.cuh"

namespace mdeep {

struct LocalRecv {
    int* num_recv_tokens_per_expert;  // [E]
    int* tokens_per_expert;           // [E], padded to `alignment`
    int* expert_row_start;            // [E + 1]
    int* src_expert_offset;           // [E], all 0 (one source)
    int* num_recv_tokens_per_rank;    // [1]
    HostInfo* host_info;              // null: not published to the host
    int alignment, max_recv_rows;     // max_recv_rows < 0: no bound
    u32 host_epoch;

    __device__ int padded(int count) const {
        return (count + alignment - 1) / alignment * alignment;
    }
};

// Every thread of one block: thread e < num_experts passes expert e's final count (others 0).
// Writes the receive layout (an expert's first row is the exclusive prefix of the padded
// counts), records a row overflow, and publishes to the host when asked.
__device__ __forceinline__ void write_local_recv(const LocalRecv& out, int count,
                                                 int tokens_in_rank, int num_experts,
                                                 const ErrorState& err, int rank) {
    __shared__ int scan_smem[33];
    int num_rows;
    const int row_start = block_exclusive_scan(out.padded(count), scan_smem, &num_rows);
    const int e = threadIdx.x;
    if (e < num_experts) {
        out.num_recv_tokens_per_expert[e] = count;
        out.tokens_per_expert[e] = out.padded(count);
        out.expert_row_start[e] = row_start;
        out.src_expert_offset[e] = 0;
        if (out.host_info != nullptr)
            store_expert_rows(out.host_info, e, out.padded(count), out.host_epoch);
    }
    if (out.host_info != nullptr) __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        out.expert_row_start[num_experts] = num_rows;
        out.num_recv_tokens_per_rank[0] = tokens_in_rank;
        if (out.max_recv_rows >= 0 && num_rows > out.max_recv_rows)
            record_error(err, kErrRecvOverflow, rank, -1, kPhaseNotify, 0, out.max_recv_rows,
                         num_rows);
        if (out.host_info != nullptr) publish_host_info(out.host_info, num_rows, out.host_epoch);
    }
}

}  // namespace mdeep
