// Dispatch layout (local, no communication). Grid: num_experts + num_ranks blocks.
//   block b <  E: expert b. Scans tokens in order: pos_in_expert[n][k] for entries naming b,
//                 and num_tokens_per_expert[b].
//   block b >= E: rank r = b - E. is_token_in_rank[n][r], token_slot_in_rank[n][r] (scan),
//                 slot_token[r][slot] and num_tokens_per_rank[r]. Block r == 0 also marks -1
//                 entries (pos -1) and checks the range of every id.
#include "common/error.cuh"
#include "common/warp.cuh"

using namespace mdeep;

template <typename IdxT, int kTopk>
__global__ void __launch_bounds__(512) layout_kernel(
    const IdxT* topk_idx, int num_tokens, int num_experts, int num_ranks,
    int* num_tokens_per_expert, int* pos_in_expert, int* num_tokens_per_rank,
    u8* is_token_in_rank, int* token_slot_in_rank, int* slot_token, int* error_claim,
    ErrorRecord* error_record, int rank) {
    __shared__ int scan_smem[33];
    const ErrorState err{error_claim, error_record};
    const int num_local = num_experts / num_ranks;
    const bool is_expert_block = blockIdx.x < num_experts;
    const int target = is_expert_block ? blockIdx.x : blockIdx.x - num_experts;
    int base = 0;
    for (int chunk = 0; chunk < num_tokens; chunk += blockDim.x) {
        const int n = chunk + threadIdx.x;
        IdxT ids[kTopk];
        int count = 0;
        if (n < num_tokens) {
#pragma unroll
            for (int k = 0; k < kTopk; ++k) {
                ids[k] = topk_idx[(i64)n * kTopk + k];
                const bool valid = ids[k] >= 0 && ids[k] < num_experts;
                if (is_expert_block) {
                    count += ids[k] == target;
                } else {
                    count |= valid && ids[k] / num_local == target;
                    if (target == 0) {
                        if (ids[k] < -1 || ids[k] >= num_experts)
                            record_error(err, kErrBadExpertId, rank, -1, kPhaseLayout, n,
                                         (i64)num_experts, (i64)ids[k]);
                        if (!valid) pos_in_expert[(i64)n * kTopk + k] = -1;
                    }
                }
            }
        }
        int total;
        const int offset = base + block_exclusive_scan(count, scan_smem, &total);
        if (n < num_tokens) {
            if (is_expert_block) {
                int seen = 0;
#pragma unroll
                for (int k = 0; k < kTopk; ++k)
                    if (ids[k] == target) pos_in_expert[(i64)n * kTopk + k] = offset + seen++;
            } else {
                is_token_in_rank[(i64)n * num_ranks + target] = count ? 1 : 0;
                token_slot_in_rank[(i64)n * num_ranks + target] = count ? offset : -1;
                if (count) slot_token[(i64)target * num_tokens + offset] = n;
            }
        }
        base += total;
    }
    if (threadIdx.x == 0) {
        if (is_expert_block) num_tokens_per_expert[target] = base;
        else num_tokens_per_rank[target] = base;
    }
}
