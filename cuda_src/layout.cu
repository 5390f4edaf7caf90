// Dispatch layout (local, no communication).
// Grid: ceil(E / kTargetsPerBlock) expert blocks, then one rank block.
//   expert block b: experts [8 b, 8 b + 8). Scans the tokens in order: pos_in_expert[n][k] for
//                   entries naming one of its experts, and num_tokens_per_expert.
//   rank block:     every rank r at once: is_token_in_rank[n][r], token_slot_in_rank[n][r],
//                   slot_token[r][slot] and num_tokens_per_rank[r]; it also marks -1 entries
//                   (pos -1) and checks the range of every id.
// Each thread loads the ids of kTokensPerThread consecutive tokens once into registers (as int32
// target numbers), and one block scan serves all 8 targets of a block, so a pass costs one
// barrier round whatever E is and topk_idx is re-read E / 8 times instead of E.
#include "common/error.cuh"
#include "common/warp.cuh"

using namespace mdeep;

constexpr int kLayoutThreads = 512;
constexpr int kTargetsPerBlock = 8;
constexpr int kEntriesPerPass = 8192;  // ids staged in shared memory per pass

template <int kTopk>
struct LayoutShape {
    static constexpr int kTokensPerThread = kEntriesPerPass / kLayoutThreads / kTopk;
    static_assert(kTokensPerThread >= 1, "top-k up to 16");
};

template <typename IdxT, int kTopk>
__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(
    const IdxT* topk_idx, int num_tokens, int num_experts, int num_ranks,
    int* num_tokens_per_expert, int* pos_in_expert, int* num_tokens_per_rank,
    u8* is_token_in_rank, int* token_slot_in_rank, int* slot_token, int* error_claim,
    ErrorRecord* error_record, int rank) {
    constexpr int G = kTargetsPerBlock, T = LayoutShape<kTopk>::kTokensPerThread;
    // target_s[i]: entry i's target number in [0, G) for this block, or -1; pos_s: its position.
    // Staging both makes every global read and write of the ids coalesced.
    __shared__ signed char target_s[kEntriesPerPass];
    __shared__ int pos_s[kEntriesPerPass];
    __shared__ int scan_smem[G][33];
    __shared__ int bad_s;
    const ErrorState err{error_claim, error_record};
    const int num_local = num_experts / num_ranks;
    const int num_expert_blocks = (num_experts + G - 1) / G;
    const bool is_expert_block = blockIdx.x < num_expert_blocks;
    const int first = is_expert_block ? blockIdx.x * G : 0;
    const int num_targets = is_expert_block ? min(G, num_experts - first) : num_ranks;
    if (threadIdx.x == 0) bad_s = 0;
    int base[G];
#pragma unroll
    for (int j = 0; j < G; ++j) base[j] = 0;
    for (int chunk = 0; chunk < num_tokens; chunk += blockDim.x * T) {
        const int chunk_entries = min(kEntriesPerPass, (num_tokens - chunk) * kTopk);
        const IdxT* ids = topk_idx + (i64)chunk * kTopk;
        __syncthreads();  // the previous pass is done with the staged arrays (and bad_s is 0)
        for (int i = threadIdx.x; i < chunk_entries; i += blockDim.x) {
            const i64 id = (i64)ids[i];
            const bool valid = id >= 0 && id < num_experts;
            if (id < -1 || id >= num_experts) bad_s = 1;
            const int g = !valid ? -1 : is_expert_block ? (int)id - first : (int)id / num_local;
            target_s[i] = g >= 0 && g < num_targets ? (signed char)g : (signed char)-1;
        }
        __syncthreads();
        const int first_entry = threadIdx.x * T * kTopk;  // this thread's consecutive tokens
        const int n0 = chunk + threadIdx.x * T;
        int count[G];
#pragma unroll
        for (int j = 0; j < G; ++j) count[j] = 0;
#pragma unroll
        for (int t = 0; t < T; ++t) {
            if (n0 + t >= num_tokens) break;
#pragma unroll
            for (int j = 0; j < G; ++j) {
                int hit = 0;
#pragma unroll
                for (int k = 0; k < kTopk; ++k) hit += target_s[first_entry + t * kTopk + k] == j;
                count[j] += is_expert_block ? hit : hit > 0;
            }
        }
        int offset[G], total[G];
        block_exclusive_scan_n<G>(count, scan_smem, offset, total);
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const int n = n0 + t;
            if (n >= num_tokens) break;
            const int e0 = first_entry + t * kTopk;
            if (is_expert_block) {
#pragma unroll
                for (int k = 0; k < kTopk; ++k) {
                    const int g = target_s[e0 + k];
                    int pos = 0;
#pragma unroll
                    for (int j = 0; j < G; ++j)
                        if (g == j) pos = base[j] + offset[j]++;
                    pos_s[e0 + k] = pos;
                }
                continue;
            }
            if (bad_s) {  // rare: report the exact id
#pragma unroll
                for (int k = 0; k < kTopk; ++k) {
                    const i64 id = (i64)topk_idx[(i64)n * kTopk + k];
                    if (id < -1 || id >= num_experts)
                        record_error(err, kErrBadExpertId, rank, -1, kPhaseLayout, n,
                                     (i64)num_experts, id);
                }
            }
#pragma unroll
            for (int j = 0; j < G; ++j) {
                if (j >= num_ranks) break;
                bool hit = false;
#pragma unroll
                for (int k = 0; k < kTopk; ++k) hit |= target_s[e0 + k] == j;
                const int slot = base[j] + offset[j];
                is_token_in_rank[(i64)n * num_ranks + j] = hit ? 1 : 0;
                token_slot_in_rank[(i64)n * num_ranks + j] = hit ? slot : -1;
                if (hit) slot_token[(i64)j * num_tokens + slot] = n;
                offset[j] += hit;
            }
        }
        __syncthreads();
        // Coalesced write-out: expert blocks their entries' positions, the rank block -1 for
        // entries naming no expert.
        int* pos_out = pos_in_expert + (i64)chunk * kTopk;
        for (int i = threadIdx.x; i < chunk_entries; i += blockDim.x) {
            const bool mine = target_s[i] >= 0;
            if (is_expert_block && mine) pos_out[i] = pos_s[i];
            if (!is_expert_block && !mine) pos_out[i] = -1;
        }
#pragma unroll
        for (int j = 0; j < G; ++j) base[j] += total[j];
    }
    if (threadIdx.x == 0) {
#pragma unroll
        for (int j = 0; j < G; ++j) {
            if (j >= num_targets) break;
            if (is_expert_block) num_tokens_per_expert[first + j] = base[j];
            else num_tokens_per_rank[j] = base[j];
        }
    }
}
