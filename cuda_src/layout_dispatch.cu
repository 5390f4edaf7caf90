// EP = 1, bf16: the dispatch layout and the expand in one kernel, so the layout's latency (the
// ids, the counts, the wait for every block's counts) overlaps the first row loads instead of
// running before the expand. It writes every array layout_kernel and dispatch_local write, with
// the same values, and the same rows.
// Block b owns the chunk of tokens [b * chunk_tokens, ...):
//   1. its warps load their first token's first row chunk; the block marks the chunk's entries
//      in shared-memory bitmaps (common/chunk_bits.cuh) and publishes its counts;
//   2. once every block has published (all blocks are resident: at most one per SM, num_sms
//      blocks), it sums the earlier blocks' counts (its offsets) and all blocks' (the totals),
//      and scans the padded totals into the experts' row starts; block 0 writes the totals
//      and the receive layout (and publishes it to the host when asked);
//   3. it writes its chunk's pos_in_expert and slots, then copies each token's row, warp per
//      token, to row_start[e] + offset[e] + the entry's position in the chunk, and zeroes its
//      share of the padding rows.
// Workspace (layout_kernel's, per stream): state[0] the last finished epoch, state[1] the
// finished-blocks count, chunk_status[b] = 2 * epoch once block b's counts are out,
// chunk_counts[b][E + 1] the counts.
#include "common/chunk_bits.cuh"
#include "common/copy.cuh"
#include "common/local_recv.cuh"

using namespace mdeep;

constexpr int kFusedThreads = 1024;
constexpr int kFusedEntriesPerThread = 2;  // a chunk's entries: at most 2 * kFusedThreads
#ifndef MDEEP_FUSED_SUM_LOADS  // loads in flight per thread while summing the blocks' counts
#define MDEEP_FUSED_SUM_LOADS 4  // 8 spills at 64 registers (the first row chunk is live)
#endif
constexpr int kSumLoads = MDEEP_FUSED_SUM_LOADS;

template <int kTopk, typename IdxT>
__global__ void __launch_bounds__(kFusedThreads, 1) layout_dispatch_local(
    const int4* x, int hidden_int4, const IdxT* topk_idx, const float* topk_weights,
    int num_tokens, int num_experts, int chunk_tokens, u8* recv_x, float* recv_weights,
    int max_rows, int* num_tokens_per_expert, int* pos_in_expert, int* num_tokens_per_rank,
    u8* is_token_in_rank, int* token_slot_in_rank, int* slot_token, int* slot_rows,
    int* recv_tokens_per_expert, int* recv_padded, int* recv_row_start, int* recv_src_offset,
    int* recv_tokens_per_rank, HostInfo* host_info, int alignment, int max_recv_rows,
    u32 host_epoch, u32* state, u32* chunk_status, int* chunk_counts, u64 timeout_ns,
    int* error_claim, ErrorRecord* error_record) {
    static_assert(kTopk <= 32, "one lane per top-k entry");
    extern __shared__ u32 smem[];
    const ErrorState err{error_claim, error_record};
    const LocalRecv recv{recv_tokens_per_expert, recv_padded,   recv_row_start,
                         recv_src_offset,        recv_tokens_per_rank, host_info,
                         alignment,              max_recv_rows, host_epoch};
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int b = blockIdx.x, num_blocks = gridDim.x;
    const int num_counts = num_experts + 1;  // experts, then the one rank
    const int first_token = b * chunk_tokens;
    const int block_tokens = max(0, min(chunk_tokens, num_tokens - first_token));
    const int num_entries = block_tokens * kTopk;
    const ChunkBits bits(smem, chunk_tokens, kTopk, num_experts, 1);
    int* offset = bits.counts + num_counts;       // [E + 1]: the earlier blocks' counts
    int* total = offset + num_counts;             // [E + 1]: every block's
    int* row_start = total + num_counts;          // [E + 1]
    int* entry_row = row_start + num_counts;      // [chunk entries]: an entry's row, or -1
    const i64 row_bytes = (i64)hidden_int4 * 16;
    const u32 epoch = ld_acquire_gpu(state) + 1u;

    // 0. Warp w's first token row chunk stays in flight through the layout work.
    int4 first[kCopyUnroll];
    if (warp < block_tokens)
        load_chunk<false>(x + (i64)(first_token + warp) * hidden_int4, 0, hidden_int4, lane,
                          first);

    // 1. The chunk's ids, bitmaps and counts.
    const IdxT* chunk_idx = topk_idx + (i64)first_token * kTopk;
    IdxT ids[kFusedEntriesPerThread];
#pragma unroll
    for (int u = 0; u < kFusedEntriesPerThread; ++u) {
        const int j = threadIdx.x + u * kFusedThreads;
        ids[u] = j < num_entries ? chunk_idx[j] : (IdxT)-1;
    }
    const int zero_words = bits.words(num_experts, 1) + 2 * num_counts;  // through total[]
    for (int i = threadIdx.x; i < zero_words; i += kFusedThreads) smem[i] = 0;
    __syncthreads();
    bool valid[kFusedEntriesPerThread];
#pragma unroll
    for (int u = 0; u < kFusedEntriesPerThread; ++u) {
        const int j = threadIdx.x + u * kFusedThreads;
        valid[u] = j < num_entries &&
                   bits.mark<kTopk>(j, ids[u], num_experts, num_experts, first_token, err, 0);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < num_counts; i += kFusedThreads)
        chunk_counts[(i64)b * num_counts + i] = bits.counts[i];
    __syncthreads();  // thread 0's release then covers the block's stores (cumulativity)
    const u32 published = 2u * epoch;
    if (threadIdx.x == 0) st_release_gpu(chunk_status + b, published);

    // 2. Every block's counts: the offsets (blocks before b) and the totals.
    if (warp == 0) {
        for (int p = lane; p < num_blocks; p += 32)
            wait_chunk(chunk_status, p, published, timeout_ns, err, 0);
        __syncwarp();
    }
    __syncthreads();
    const int num_items = num_blocks * num_counts;  // item q: count q % E+1 of block q / E+1
    for (int q0 = threadIdx.x; q0 < num_items; q0 += kFusedThreads * kSumLoads) {
        int value[kSumLoads];
#pragma unroll
        for (int u = 0; u < kSumLoads; ++u) {
            const int q = q0 + u * kFusedThreads;
            value[u] = q < num_items ? __ldcg(chunk_counts + q) : 0;
        }
#pragma unroll
        for (int u = 0; u < kSumLoads; ++u) {
            const int q = q0 + u * kFusedThreads;
            if (value[u] == 0) continue;
            const int p = q / num_counts, i = q - p * num_counts;
            atomicAdd(&total[i], value[u]);
            if (p < b) atomicAdd(&offset[i], value[u]);
        }
    }
    __syncthreads();
    const int e = threadIdx.x;
    const int count = e < num_experts ? total[e] : 0;
    int num_rows;
    const int start = local_row_start(recv, count, &num_rows);
    if (e < num_experts) row_start[e] = start;
    if (e == 0) row_start[num_experts] = num_rows;
    if (b == 0) {
        if (e < num_experts) num_tokens_per_expert[e] = count;
        if (e == 0) num_tokens_per_rank[0] = total[num_experts];
        write_local_recv(recv, count, start, num_rows, total[num_experts], num_experts, err, 0);
    }
    __syncthreads();

    // 3. The chunk's layout entries, then its rows.
#pragma unroll
    for (int u = 0; u < kFusedEntriesPerThread; ++u) {
        const int j = threadIdx.x + u * kFusedThreads;
        if (j >= num_entries) continue;
        const int id = valid[u] ? (int)ids[u] : -1;
        const int pos = valid[u] ? offset[id] + bits.entry_pos(id, j) : -1;
        pos_in_expert[(i64)first_token * kTopk + j] = pos;
        const int row = valid[u] ? row_start[id] + pos : -1;
        entry_row[j] = row < max_rows ? row : -1;  // overflow: recorded by block 0
    }
    for (int t = threadIdx.x; t < block_tokens; t += kFusedThreads) {
        const int n = first_token + t;
        const bool in_rank = bits.token_in_rank(0, t);
        const int slot = in_rank ? offset[num_experts] + bits.token_pos(0, t) : -1;
        is_token_in_rank[n] = in_rank ? 1 : 0;
        token_slot_in_rank[n] = slot;
        if (in_rank) slot_token[slot] = n;
    }
    __syncthreads();
    for (int t = warp; t < block_tokens; t += kFusedThreads / 32) {
        const int n = first_token + t;
        const int4* src = x + (i64)n * hidden_int4;
        if (t != warp) load_chunk<false>(src, 0, hidden_int4, lane, first);
        if (!bits.token_in_rank(0, t)) continue;  // no valid entry: no rows, no slot
        const int slot = offset[num_experts] + bits.token_pos(0, t);
        int row_lane = -1;  // lane k: the row of entry k
        if (lane < kTopk) {
            row_lane = entry_row[t * kTopk + lane];
            slot_rows[(i64)slot * kTopk + lane] = row_lane;
            if (row_lane >= 0) recv_weights[row_lane] = topk_weights[(i64)n * kTopk + lane];
        }
        warp_copy_row_to_lane_rows<kTopk>(src, first, recv_x, row_bytes, row_lane, hidden_int4,
                                          lane);
    }
    // Padding rows: expert e's from row_start[e] + total[e] on, one warp of the grid each.
    for (int p = b * (kFusedThreads / 32) + warp; p < num_experts;
         p += num_blocks * (kFusedThreads / 32)) {
        const int last = min(row_start[p + 1], max_rows);
        for (int row = row_start[p] + total[p]; row < last; ++row) {
            warp_zero_row(reinterpret_cast<int4*>(recv_x + row * row_bytes), hidden_int4, lane);
            if (lane == 0) recv_weights[row] = 0.f;
        }
    }

    // The last block to finish (every block has read this epoch's counts) advances the epoch.
    __shared__ bool is_last_done;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        is_last_done = atomicAdd(state + 1, 1u) == num_blocks - 1;
        if (is_last_done) {
            state[1] = 0;
            st_release_gpu(state, epoch);
        }
    }
}
