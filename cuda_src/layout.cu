// Dispatch layout (local, no communication) in one pass over topk_idx. Grid: one block per chunk
// of `chunk_tokens` tokens (at least one block; a chunk has at most 2 * 512 entries).
//   1. A block marks its chunk in shared-memory bitmaps (per expert: the chunk's entries naming
//      it; per rank: the chunk's tokens with an expert there) and counts the set bits.
//   2. It publishes the counts, adds those of the earlier chunks (decoupled look-back: polls
//      512 chunks at a time back to the nearest one with its inclusive totals out, then sums
//      the counts after it, 4 counts per 16-byte load, each vector by a group of threads with
//      16 loads in flight) and publishes its own inclusive totals.
//   3. pos_in_expert and token_slot_in_rank are the earlier chunks' count plus the set bits
//      before the entry (token) in its bitmap, i.e. (n, k) and token order as layout.py defines.
//      The last chunk writes num_tokens_per_expert and num_tokens_per_rank.
// Between launches: chunk_status[c] is 2 * epoch once chunk c's counts are out and
// 2 * epoch + 1 once its inclusive totals are; state[0] holds the last finished epoch and the
// last block advances it. No zeroing per call, and a replayed CUDA graph advances it too.
// A workspace (state, chunk_status, chunk_counts) serves one stream at a time.
// At EP = 1 (`recv_tokens_per_expert` given) the last block to finish also derives
// the receive layout that notify would (nothing to exchange with one rank), so no notify runs;
// it publishes it to the host only when given `host_info` (a synchronous call that waits
// before its expand: otherwise the expand publishes, or nobody reads it).
#include "common/args.cuh"
#include "common/chunk_bits.cuh"
#include "common/local_recv.cuh"

using namespace mdeep;

constexpr int kLayoutThreads = 512;
constexpr int kEntriesPerThread = 2;  // a chunk's entries: at most 2 * kLayoutThreads
constexpr int kCountsPerThread = 5;   // experts + ranks: at most 5 * kLayoutThreads
constexpr int kSumLoads = 16;  // 16-byte loads in flight per thread summing earlier counts

template <typename IdxT, int kTopk>
__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(
    const __grid_constant__ LayoutArgs<IdxT> args) {
    const IdxT* const topk_idx = args.topk_idx;
    const int num_tokens = args.num_tokens, num_experts = args.num_experts;
    const int num_ranks = args.num_ranks, chunk_tokens = args.chunk_tokens;
    int* const num_tokens_per_expert = args.num_tokens_per_expert;
    int* const pos_in_expert = args.pos_in_expert;
    int* const num_tokens_per_rank = args.num_tokens_per_rank;
    u8* const is_token_in_rank = args.is_token_in_rank;
    int* const token_slot_in_rank = args.token_slot_in_rank;
    int* const slot_token = args.slot_token;
    u32* const state = args.state;
    u32* const chunk_status = args.chunk_status;
    int* const chunk_counts = args.chunk_counts;
    const u64 timeout_ns = args.timeout_ns;
    const int rank = args.rank;
    extern __shared__ u32 smem[];
    __shared__ int nearest_inclusive;  // the latest earlier chunk with inclusive totals, or -1
    const ErrorState err{args.error_claim, args.error_record};
    const int num_counts = num_experts + num_ranks;  // experts first, then ranks
    const int count_stride = (num_counts + 3) & ~3;  // a half row of chunk_counts: 16-byte rows
    const ChunkBits bits(smem, chunk_tokens, kTopk, num_experts, num_ranks);
    int* counts = bits.counts;  // [E + R]
    const int num_local = num_experts / num_ranks;
    const int c = blockIdx.x;
    const int first_token = c * chunk_tokens;
    const int num_entries = max(0, min(chunk_tokens, num_tokens - first_token)) * kTopk;
    const u32 epoch = ld_acquire_gpu(state) + 1u;
    const u32 published = 2u * epoch, inclusive = published + 1u;
    // The EP = 1 expand (a programmatic launch) may start now: it loads its first input rows,
    // then waits for this grid to finish before it reads anything written here.
    griddep_launch_dependents();

    // 1. The chunk's ids (all loads first), then its bitmaps and counts.
    const IdxT* chunk_idx = topk_idx + (i64)first_token * kTopk;
    IdxT ids[kEntriesPerThread];
#pragma unroll
    for (int u = 0; u < kEntriesPerThread; ++u) {
        const int j = threadIdx.x + u * kLayoutThreads;
        ids[u] = j < num_entries ? chunk_idx[j] : (IdxT)-1;
    }
    const int smem_words = bits.words(num_experts, num_ranks);
    for (int i = threadIdx.x; i < smem_words; i += kLayoutThreads) smem[i] = 0;
    if (threadIdx.x == 0) nearest_inclusive = -1;
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kEntriesPerThread; ++u) {
        const int j = threadIdx.x + u * kLayoutThreads;
        if (j < num_entries && !bits.mark<kTopk>(j, ids[u], num_experts, num_local, first_token,
                                                 err, rank)) {
            pos_in_expert[(i64)first_token * kTopk + j] = -1;
            ids[u] = -1;
        }
    }
    __syncthreads();

    // 2. Publish the counts (chunk 0's are its inclusive totals), add those of the earlier
    // chunks after the nearest one whose inclusive totals are out (all of them while the
    // earlier chunks still run), then publish this chunk's inclusive totals. All loads of the
    // sum are independent, kSumLoads in flight per thread: a round or two of L2 reads.
    int* my_counts = chunk_counts + (i64)c * 2 * count_stride;  // [2][count_stride]
    for (int i = threadIdx.x; i < num_counts; i += kLayoutThreads)
        my_counts[(c == 0 ? count_stride : 0) + i] = counts[i];
    __syncthreads();  // thread 0's release then covers the block's stores (cumulativity)
    if (threadIdx.x == 0) st_release_gpu(chunk_status + c, c == 0 ? inclusive : published);
    int own[kCountsPerThread];
#pragma unroll
    for (int v = 0; v < kCountsPerThread; ++v) {
        const int i = threadIdx.x + v * kLayoutThreads;
        own[v] = i < num_counts ? counts[i] : 0;
    }
    // Windows of one chunk per thread, back from c - 1, until one holds inclusive totals.
    for (int end = c; end > 0; end -= kLayoutThreads) {
        const int p = end - 1 - (int)threadIdx.x;
        if (p >= 0 && wait_chunk(chunk_status, p, published, timeout_ns, err, rank))
            atomicMax(&nearest_inclusive, p);
        __syncthreads();  // the window's counts are out (and own[] is read)
        const bool found = nearest_inclusive >= 0;
        __syncthreads();  // everyone read it before the next window's atomics
        if (found) break;
    }
    const int first = max(nearest_inclusive, 0);
    const bool has_inclusive = nearest_inclusive >= 0;
    // Counts 4v .. 4v + 3 (one 16-byte vector) are summed by `groups` threads (every groups-th
    // chunk each, kSumLoads loads in flight), consecutive threads on consecutive vectors; one
    // shared atomic per thread and count.
    const int num_vecs = count_stride >> 2;
    const int span = min(num_vecs, kLayoutThreads), groups = kLayoutThreads / span;
    const int g = threadIdx.x / span;
    const int4* vec_counts = reinterpret_cast<const int4*>(chunk_counts);
    for (int v = threadIdx.x - g * span; g < groups && v < num_vecs; v += span) {
        int4 sum = make_int4(0, 0, 0, 0);
        for (int p0 = first + g; p0 < c; p0 += groups * kSumLoads) {
            int4 value[kSumLoads];
#pragma unroll
            for (int u = 0; u < kSumLoads; ++u) {
                const int p = p0 + u * groups;
                const int half = p == first && has_inclusive ? num_vecs : 0;
                value[u] = p < c ? __ldcg(vec_counts + (i64)p * 2 * num_vecs + half + v)
                                 : make_int4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < kSumLoads; ++u) {
                sum.x += value[u].x;
                sum.y += value[u].y;
                sum.z += value[u].z;
                sum.w += value[u].w;
            }
        }
        // The row's padding words are never written: whatever they hold is skipped.
        const int sums[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
        for (int w = 0; w < 4; ++w)
            if (4 * v + w < num_counts && sums[w] != 0) atomicAdd(&counts[4 * v + w], sums[w]);
    }
    __syncthreads();
    const bool is_last = c == (int)gridDim.x - 1;
#pragma unroll
    for (int v = 0; v < kCountsPerThread; ++v) {
        const int i = threadIdx.x + v * kLayoutThreads;
        if (i >= num_counts) continue;
        const int total = counts[i];  // this chunk's and every earlier one's
        if (c > 0) my_counts[count_stride + i] = total;
        if (is_last) {
            if (i < num_experts) num_tokens_per_expert[i] = total;
            else num_tokens_per_rank[i - num_experts] = total;
        }
        counts[i] = total - own[v];  // from here on: the offset of this chunk's first bit
    }
    __syncthreads();
    if (threadIdx.x == 0 && c > 0) st_release_gpu(chunk_status + c, inclusive);

    // 3. Positions: earlier chunks' count plus the bits before this one.
#pragma unroll
    for (int u = 0; u < kEntriesPerThread; ++u) {
        const int j = threadIdx.x + u * kLayoutThreads;
        if (j >= num_entries || ids[u] < 0) continue;
        const int e = (int)ids[u];
        pos_in_expert[(i64)first_token * kTopk + j] = counts[e] + bits.entry_pos(e, j);
    }
    for (int t = threadIdx.x; t * kTopk < num_entries; t += kLayoutThreads) {
        const int n = first_token + t;
        for (int r = 0; r < num_ranks; ++r) {
            const bool in_rank = bits.token_in_rank(r, t);
            const int slot = in_rank ? counts[num_experts + r] + bits.token_pos(r, t) : -1;
            is_token_in_rank[(i64)n * num_ranks + r] = in_rank ? 1 : 0;
            token_slot_in_rank[(i64)n * num_ranks + r] = slot;
            if (in_rank) slot_token[(i64)r * num_tokens + slot] = n;
        }
    }
    // The last block to finish (every block's writes and error records are out) advances the
    // epoch, after the EP = 1 receive layout when asked.
    __shared__ bool is_last_done;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        is_last_done = atomicAdd(state + 1, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!is_last_done) return;
    if (args.recv_tokens_per_expert != nullptr) {
        const LocalRecv out{args.recv_tokens_per_expert, args.recv_padded,
                            args.recv_row_start,         args.recv_src_offset,
                            args.recv_tokens_per_rank,   args.host_info,
                            args.alignment,              args.max_recv_rows,
                            args.host_epoch};
        // Written by other blocks: read past L1.
        const int count = threadIdx.x < num_experts ? __ldcg(num_tokens_per_expert + threadIdx.x)
                                                    : 0;
        write_local_recv(out, count, __ldcg(num_tokens_per_rank), num_experts, err, rank);
    }
    if (threadIdx.x == 0) {
        state[1] = 0;
        st_release_gpu(state, epoch);
    }
}
