// Notify: each rank writes its per-expert counts and call parameters into every peer's metadata
// region (the half of Meta::counts of the epoch's parity), releases a flag carrying the call's
// epoch, waits for all peers' flags, then derives its receive layout (per-source offsets
// inside each local expert, padded segment sizes and the total row count) and publishes it to
// the host through mapped pinned memory. One block.
#include "common/args.cuh"
#include "common/protocol.cuh"

using namespace mdeep;

constexpr int kNotifyThreads = 256;  // ops.NOTIFY_THREADS: one thread per local expert
static_assert(kNotifyThreads == kMaxLocalExperts, "step 3 gives each expert a thread");

__global__ void __launch_bounds__(kNotifyThreads) notify_kernel(
    const __grid_constant__ NotifyArgs args) {
    const u64* const peer_bases = args.peer_bases;
    const int rank = args.rank, num_ranks = args.num_ranks;
    const u32 epoch = *args.epoch_word;
    const int* const num_tokens_per_rank = args.num_tokens_per_rank;
    const int* const num_tokens_per_expert = args.num_tokens_per_expert;
    const int num_local = args.num_local, hidden = args.hidden, num_topk = args.num_topk;
    const int alignment = args.alignment, max_recv_rows = args.max_recv_rows;
    int* const num_recv_tokens_per_rank = args.num_recv_tokens_per_rank;
    int* const num_recv_tokens_per_expert = args.num_recv_tokens_per_expert;
    int* const tokens_per_expert = args.tokens_per_expert;
    int* const expert_row_start = args.expert_row_start;
    int* const src_expert_offset = args.src_expert_offset;
    HostInfo* const host_info = args.host_info;
    const u64 timeout_ns = args.timeout_ns;
    const ErrorState err{args.error_claim, args.error_record};
    const int row_len = 8 + num_local;
    const int half = counts_half(epoch);
    // 1. My row into every rank's Meta.counts[half][rank].
    for (int i = threadIdx.x; i < num_ranks * row_len; i += blockDim.x) {
        const int dst = i / row_len, col = i % row_len;
        int value;
        switch (col) {
            case kHdrTokens: value = num_tokens_per_rank[dst]; break;
            case kHdrHidden: value = hidden; break;
            case kHdrTopk: value = num_topk; break;
            case kHdrExperts: value = num_local * num_ranks; break;
            case kHdrAlign: value = alignment; break;
            default: value = col >= 8 ? num_tokens_per_expert[dst * num_local + col - 8] : 0;
        }
        meta_of(peer_bases[dst])->counts[half][rank][col] = value;
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x < num_ranks)
        st_release_sys(&meta_of(peer_bases[threadIdx.x])->notify_flag[rank], epoch);
    // 2. Everyone's row into mine.
    Meta* mine = meta_of(peer_bases[rank]);
    if (!block_wait_peers(mine->notify_flag, epoch, num_ranks, rank, true, timeout_ns, err,
                          kPhaseNotify, /*give_up_on_error=*/false))
        return;
    volatile int(*counts)[kCountStride] = mine->counts[half];
    if (threadIdx.x < num_ranks) {
        const int s = threadIdx.x;
        const int mine_hdr[5] = {0, hidden, num_topk, num_local * num_ranks, alignment};
        for (int f = kHdrHidden; f <= kHdrAlign; ++f)
            if (counts[s][f] != mine_hdr[f])
                record_error(err, kErrRankMismatch, rank, s, kPhaseNotify, f, mine_hdr[f],
                             counts[s][f]);
        num_recv_tokens_per_rank[s] = counts[s][kHdrTokens];
    }
    // 3. Receive layout: offsets per (source, expert), padded segments, their prefix sum (one
    //    thread per local expert; a serial prefix over 256 experts cost microseconds).
    __shared__ int scan_smem[33];
    const int e = threadIdx.x;
    int padded = 0;
    if (e < num_local) {
        int running = 0;
        for (int s = 0; s < num_ranks; ++s) {
            src_expert_offset[s * num_local + e] = running;
            running += counts[s][8 + e];
        }
        num_recv_tokens_per_expert[e] = running;
        padded = (running + alignment - 1) / alignment * alignment;
        tokens_per_expert[e] = padded;
        if (host_info != nullptr) store_expert_rows(host_info, e, padded, args.host_epoch);
    }
    if (host_info != nullptr) __threadfence_system();  // null: no host wait reads it
    int num_rows;
    const int row_start = block_exclusive_scan(padded, scan_smem, &num_rows);
    if (e < num_local) expert_row_start[e] = row_start;
    if (threadIdx.x == 0) {
        expert_row_start[num_local] = num_rows;
        if (max_recv_rows >= 0 && num_rows > max_recv_rows)
            record_error(err, kErrRecvOverflow, rank, -1, kPhaseNotify, 0, max_recv_rows,
                         num_rows);
        if (host_info != nullptr) publish_host_info(host_info, num_rows, args.host_epoch);
    }
}
