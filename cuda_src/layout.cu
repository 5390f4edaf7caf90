// Dispatch layout (local, no communication).
// Grid: ceil(E / kTargetsPerBlock) expert blocks, then one rank block.
//   expert block b: experts [8 b, 8 b + 8). Scans the tokens in order: pos_in_expert[n][k] for
//                   entries naming one of its experts, and num_tokens_per_expert.
//   rank block:     every rank r at once: is_token_in_rank[n][r], token_slot_in_rank[n][r],
//                   slot_token[r][slot] and num_tokens_per_rank[r]; it also marks -1 entries
//                   (pos -1) and checks the range of every id.
// Each thread owns kTokensPerThread consecutive tokens of a pass, and one block scan serves all
// 8 targets of the block, so a pass costs one barrier round whatever E is; grouping targets
// cuts the re-reads of topk_idx by 8 against one block per expert.
#include "common/error.cuh"
#include "common/warp.cuh"

using namespace mdeep;

constexpr int kLayoutThreads = 512;
constexpr int kTargetsPerBlock = 8;
constexpr int kTokensPerThread = 4;

// hit[j]: how many of token row `ids`'s entries name target j (expert first + j, or rank j).
template <typename IdxT, int kTopk>
__device__ __forceinline__ void token_hits(const IdxT* ids, bool is_expert_block, int first,
                                           int num_targets, int num_local, int num_experts,
                                           int (&hit)[kTargetsPerBlock]) {
#pragma unroll
    for (int j = 0; j < kTargetsPerBlock; ++j) hit[j] = 0;
#pragma unroll
    for (int k = 0; k < kTopk; ++k) {
        const i64 id = (i64)ids[k];
        const bool valid = id >= 0 && id < num_experts;
        const i64 g = !valid ? -1 : is_expert_block ? id - first : id / num_local;
#pragma unroll
        for (int j = 0; j < kTargetsPerBlock; ++j) {
            if (is_expert_block) hit[j] += g == j && j < num_targets;
            else hit[j] |= g == j;
        }
    }
}

template <typename IdxT, int kTopk>
__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(
    const IdxT* topk_idx, int num_tokens, int num_experts, int num_ranks,
    int* num_tokens_per_expert, int* pos_in_expert, int* num_tokens_per_rank,
    u8* is_token_in_rank, int* token_slot_in_rank, int* slot_token, int* error_claim,
    ErrorRecord* error_record, int rank) {
    constexpr int G = kTargetsPerBlock, T = kTokensPerThread;
    __shared__ int scan_smem[G][33];
    const ErrorState err{error_claim, error_record};
    const int num_local = num_experts / num_ranks;
    const int num_expert_blocks = (num_experts + G - 1) / G;
    const bool is_expert_block = blockIdx.x < num_expert_blocks;
    const int first = is_expert_block ? blockIdx.x * G : 0;
    const int num_targets = is_expert_block ? min(G, num_experts - first) : num_ranks;
    int base[G];
#pragma unroll
    for (int j = 0; j < G; ++j) base[j] = 0;
    for (int chunk = 0; chunk < num_tokens; chunk += blockDim.x * T) {
        const int n0 = chunk + threadIdx.x * T;
        int count[G], hit[G];
#pragma unroll
        for (int j = 0; j < G; ++j) count[j] = 0;
#pragma unroll
        for (int t = 0; t < T; ++t) {
            if (n0 + t >= num_tokens) break;
            token_hits<IdxT, kTopk>(topk_idx + (i64)(n0 + t) * kTopk, is_expert_block, first,
                                    num_targets, num_local, num_experts, hit);
#pragma unroll
            for (int j = 0; j < G; ++j) count[j] += hit[j];
        }
        int offset[G], total[G];
        block_exclusive_scan_n<G>(count, scan_smem, offset, total);
#pragma unroll
        for (int t = 0; t < T; ++t) {
            const int n = n0 + t;
            if (n >= num_tokens) break;
            const IdxT* ids = topk_idx + (i64)n * kTopk;
            if (is_expert_block) {
#pragma unroll
                for (int k = 0; k < kTopk; ++k) {
                    const i64 id = (i64)ids[k];
                    const i64 g = id - first;
                    if (id < 0 || id >= num_experts || g < 0 || g >= num_targets) continue;
                    int pos = 0;
#pragma unroll
                    for (int j = 0; j < G; ++j)
                        if (g == j) pos = base[j] + offset[j]++;
                    pos_in_expert[(i64)n * kTopk + k] = pos;
                }
            } else {
#pragma unroll
                for (int k = 0; k < kTopk; ++k) {
                    const i64 id = (i64)ids[k];
                    if (id < -1 || id >= num_experts)
                        record_error(err, kErrBadExpertId, rank, -1, kPhaseLayout, n,
                                     (i64)num_experts, id);
                    if (id < 0 || id >= num_experts) pos_in_expert[(i64)n * kTopk + k] = -1;
                }
                token_hits<IdxT, kTopk>(ids, false, 0, num_targets, num_local, num_experts, hit);
#pragma unroll
                for (int j = 0; j < G; ++j) {
                    if (j >= num_ranks) break;
                    const int slot = base[j] + offset[j];
                    is_token_in_rank[(i64)n * num_ranks + j] = hit[j] ? 1 : 0;
                    token_slot_in_rank[(i64)n * num_ranks + j] = hit[j] ? slot : -1;
                    if (hit[j]) slot_token[(i64)j * num_tokens + slot] = n;
                    offset[j] += hit[j];
                }
            }
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
