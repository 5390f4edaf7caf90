// One chunk of tokens' routing in shared-memory bitmaps, the first step of the layout kernel
// (layout.cu): per expert, the chunk's (n, k) entries naming it; per rank, the chunk's tokens
// with an expert there; and their counts. An entry's position among its expert's entries (a
// token's among its rank's tokens) is then a popcount.
// Chunks publish to a per-chunk status word: 2 * epoch once their counts are out, 2 * epoch + 1
// once their inclusive totals are, so epochs advance with no zeroing between launches.
#pragma once
#include "common/error.cuh"

namespace mdeep {

// Set bits of `bits[0 .. index)` (index in bits).
__device__ __forceinline__ int bits_before(const u32* bits, int index) {
    int count = __popc(bits[index >> 5] & ((1u << (index & 31)) - 1u));
    for (int w = 0; w < (index >> 5); ++w) count += __popc(bits[w]);
    return count;
}

// The lanes of a warp mark and count entries of one 32-entry word of their experts' bitmaps,
// word w of expert e at e * stride + w: an odd stride puts different experts in different banks
// (an even one put every expert in 2 of the 32: 16-way conflicts, most of the layout's time).
struct ChunkBits {
    u32* expert_bits;  // [E][expert_stride]: bit j is entry j of the chunk
    u32* rank_bits;    // [R][token_words]: bit t is token t of the chunk
    int* counts;       // [E + R]: set bits per expert, then per rank
    int expert_stride, token_words;

    // The bitmaps and counts at the start of `smem` for chunks of `chunk_tokens` tokens.
    __device__ ChunkBits(u32* smem, int chunk_tokens, int topk, int num_experts, int num_ranks)
        : expert_stride(((chunk_tokens * topk + 31) >> 5) | 1),
          token_words((chunk_tokens + 31) >> 5) {
        expert_bits = smem;
        rank_bits = expert_bits + num_experts * expert_stride;
        counts = reinterpret_cast<int*>(rank_bits + num_ranks * token_words);
    }

    // 32-bit words from `smem` up to the end of `counts` (all zeroed before marking).
    __device__ int words(int num_experts, int num_ranks) const {
        return num_experts * expert_stride + num_ranks * token_words + num_experts + num_ranks;
    }

    // Entry j's position among the chunk's entries of expert e (j names expert e).
    __device__ int entry_pos(int e, int j) const {
        return bits_before(expert_bits + e * expert_stride, j);
    }

    __device__ bool token_in_rank(int r, int t) const {
        return (rank_bits[r * token_words + (t >> 5)] >> (t & 31)) & 1u;
    }

    // Token t's position among the chunk's tokens with an expert on rank r.
    __device__ int token_pos(int r, int t) const {
        return bits_before(rank_bits + r * token_words, t);
    }

    // Marks entry j (chunk order (n, k)) naming expert `id`; false for -1 and for an id out of
    // [0, num_experts), which is recorded as the token's error. Shared-memory atomics.
    template <int kTopk, typename IdxT>
    __device__ bool mark(int j, IdxT id, int num_experts, int num_local, int first_token,
                         const ErrorState& err, int rank) const {
        if (id < 0 || id >= num_experts) {
            if (id != -1)
                record_error(err, kErrBadExpertId, rank, -1, kPhaseLayout,
                             first_token + j / kTopk, (i64)num_experts, (i64)id);
            return false;
        }
        atomicOr(&expert_bits[(int)id * expert_stride + (j >> 5)], 1u << (j & 31));
        atomicAdd(&counts[id], 1);
        const int t = j / kTopk, r = (int)id / num_local;
        const u32 bit = 1u << (t & 31);
        if (!(atomicOr(&rank_bits[r * token_words + (t >> 5)], bit) & bit))
            atomicAdd(&counts[num_experts + r], 1);  // the token's first expert on rank r
        return true;
    }
};

// Waits until chunk `p` has published this epoch's counts (`published` = 2 * epoch); true once
// its inclusive totals are out too. A chunk that never publishes is a scheduling fault:
// recorded, and the wait ends (the result is wrong, the error record says so).
__device__ __forceinline__ bool wait_chunk(const u32* status, int p, u32 published,
                                           u64 timeout_ns, const ErrorState& err, int rank) {
    const u64 start = global_timer_ns();
    for (u32 iter = 0;; ++iter) {
        const u32 seen = ld_acquire_gpu(status + p);
        if ((int)(seen - published) >= 0) return seen != published;
        if ((iter & 255u) == 255u &&
            (has_error(err) || global_timer_ns() - start > timeout_ns)) {
            if (!has_error(err))
                record_error(err, kErrTimeout, rank, rank, kPhaseLayout, p, (i64)published,
                             (i64)seen);
            return true;
        }
    }
}

}  // namespace mdeep
