// Combine over NVLink. combine_fused does it in one launch (below); the split kernels, two
// kernels on the communication stream:
//   combine_send (expert side): for every slot received from a peer, the slot's rows of y are
//     summed in k order in fp32 (times their routing weight when kWeighted), rounded to the row
//     dtype and written once into that peer's combine region; with kWithWeights the per-k values of
//     grad_row_weights go along. The last block releases "done" to every peer.
//   combine_reduce (source side): waits for every peer's "done", then for each token sums its
//     partials over ranks in ascending order in fp32 (its own rank's partial is computed from
//     y directly, with the same rounding) and rounds once; releases "consumed" to every peer.
// kDtype is the element type of y, the partials and out (ops.ROW_DTYPE_CODES): 0 bf16, 1 fp16,
// 2 fp32. Rows are handled as 16-byte words of 8 (16-bit) or 4 (fp32) elements; every sum is in
// fp32, so fp32 rows are never rounded.
#include "common/args.cuh"
#include "common/fused.cuh"
#include "common/protocol.cuh"
#include "common/row_dtype.cuh"

using namespace mdeep;

constexpr int kCombineThreads = 512;
// 16-byte words per lane per step: every row of a token (and every peer's partial) is loaded
// before any is summed, so a warp keeps kTopk * kUnroll loads in flight.
template <int kTopk>
struct CombineUnroll {
    static constexpr int value = kTopk <= 2 ? 2 : 1;
};

// Sums one slot's rows of y for the int4 words [base, base + 32 * kU) of a lane.
template <int kTopk, bool kWeighted, int kU, int kDtype>
__device__ __forceinline__ void slot_partial(float (*acc)[8], const int4* y, const int* rows,
                                             const float* row_weights, int num_int4, int base,
                                             int lane) {
    int4 v[kTopk][kU];
#pragma unroll
    for (int k = 0; k < kTopk; ++k)
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            const int i = base + u * 32 + lane;
            if (rows[k] >= 0 && i < num_int4) v[k][u] = ld_nc_v4(y + (i64)rows[k] * num_int4 + i);
        }
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[u][c] = 0.f;
#pragma unroll
    for (int k = 0; k < kTopk; ++k) {
        if (rows[k] < 0) continue;
        const float w = kWeighted ? row_weights[k] : 1.f;
#pragma unroll
        for (int u = 0; u < kU; ++u)
            if (base + u * 32 + lane < num_int4)
                accumulate_word<kDtype, kWeighted>(acc[u], v[k][u], w);
    }
}

template <int kTopk, bool kWeighted>
__device__ __forceinline__ void load_slot_rows(const int* slot_rows, const float* recv_weights,
                                               i64 slot, int* rows, float* weights) {
#pragma unroll
    for (int k = 0; k < kTopk; ++k) {
        rows[k] = slot_rows[slot * kTopk + k];
        weights[k] = (kWeighted && rows[k] >= 0) ? recv_weights[rows[k]] : 1.f;
    }
}

// Slot (s, j)'s partial: its rows of y summed in k order in fp32, rounded to the row dtype and
// written into peer s's combine region [rank][j] (with the per-k grad_row_weights values when
// kWithWeights), kU words per lane per step.
template <int kTopk, bool kWeighted, bool kWithWeights, int kDtype, int kU>
__device__ __forceinline__ void send_partial(const int4* y, int num_int4,
                                             const float* recv_weights,
                                             const float* grad_row_weights,
                                             const int* slot_rows, const u64* peer_bases,
                                             const Regions& rg, int rank, int s, int j,
                                             int lane) {
    int rows[kTopk];
    float weights[kTopk];
    load_slot_rows<kTopk, kWeighted>(slot_rows, recv_weights, (i64)s * rg.max_tokens + j, rows,
                                     weights);
    int4* dst = reinterpret_cast<int4*>(
        slot_ptr(peer_bases[s], rg.combine_rows, rg.row_stride, rg.max_tokens, rank, j));
    for (int base = 0; base < num_int4; base += 32 * kU) {
        float acc[kU][8];
        slot_partial<kTopk, kWeighted, kU, kDtype>(acc, y, rows, weights, num_int4, base, lane);
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            const int w = base + u * 32 + lane;
            if (w < num_int4) st_v4(dst + w, pack_word<kDtype>(acc[u]));
        }
    }
    if (kWithWeights && lane < kTopk) {
        float* wdst = reinterpret_cast<float*>(
            slot_ptr(peer_bases[s], rg.combine_weights, rg.weight_stride, rg.max_tokens, rank, j));
        int row_lane = -1;
#pragma unroll
        for (int k = 0; k < kTopk; ++k)
            if (k == lane) row_lane = rows[k];
        wdst[lane] = row_lane >= 0 ? grad_row_weights[row_lane] : 0.f;
    }
}

// Token n's output: its partials summed over ranks in ascending order in fp32 (its own rank's
// partial computed from y with the same rounding) and rounded once; `slots` [kMaxRanks]: its
// slot on each rank (-1: none); kU words per lane per step.
template <int kTopk, bool kWeighted, bool kWithWeights, int kDtype, int kU>
__device__ __forceinline__ void reduce_token(int4* out, float* out_weights, int n, int num_int4,
                                             const int4* y, const float* recv_weights,
                                             const float* grad_row_weights,
                                             const int* slot_rows, const int* slots,
                                             const u64* peer_bases, const Regions& rg,
                                             int rank, int num_ranks, int lane) {
    int self_rows[kTopk];
    float self_weights[kTopk];
    if (slots[rank] >= 0)
        load_slot_rows<kTopk, kWeighted>(slot_rows, recv_weights,
                                         (i64)rank * rg.max_tokens + slots[rank],
                                         self_rows, self_weights);
    for (int base = 0; base < num_int4; base += 32 * kU) {
        // Peers' partials first (all loads in flight), then the sum in rank order.
        int4 partial[kMaxRanks][kU];
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r) {
            if (r >= num_ranks || r == rank || slots[r] < 0) continue;
            const int4* src = reinterpret_cast<const int4*>(slot_ptr(
                peer_bases[rank], rg.combine_rows, rg.row_stride, rg.max_tokens, r,
                slots[r]));
#pragma unroll
            for (int u = 0; u < kU; ++u) {
                const int i = base + u * 32 + lane;
                if (i < num_int4) partial[r][u] = ld_cg_v4(src + i);
            }
        }
        float acc[kU][8];
#pragma unroll
        for (int u = 0; u < kU; ++u)
#pragma unroll
            for (int c = 0; c < 8; ++c) acc[u][c] = 0.f;
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r) {
            if (r >= num_ranks || slots[r] < 0) continue;
            if (r == rank) {
                float self_acc[kU][8];
                slot_partial<kTopk, kWeighted, kU, kDtype>(self_acc, y, self_rows,
                                                           self_weights, num_int4, base,
                                                           lane);
#pragma unroll
                for (int u = 0; u < kU; ++u) partial[r][u] = pack_word<kDtype>(self_acc[u]);
            }
#pragma unroll
            for (int u = 0; u < kU; ++u)
                if (base + u * 32 + lane < num_int4)
                    accumulate_word<kDtype, false>(acc[u], partial[r][u], 1.f);
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            const int i = base + u * 32 + lane;
            if (i < num_int4) out[(i64)n * num_int4 + i] = pack_word<kDtype>(acc[u]);
        }
    }
    if (kWithWeights && lane < kTopk) {
        float wsum = 0.f;
        for (int r = 0; r < num_ranks; ++r) {
            if (slots[r] < 0) continue;
            float v;
            if (r == rank) {
                int row_lane = -1;
#pragma unroll
                for (int k = 0; k < kTopk; ++k)
                    if (k == lane) row_lane = self_rows[k];
                v = row_lane >= 0 ? grad_row_weights[row_lane] : 0.f;
            } else {
                const volatile float* src = reinterpret_cast<const volatile float*>(
                    slot_ptr(peer_bases[rank], rg.combine_weights, rg.weight_stride,
                             rg.max_tokens, r, slots[r]));
                v = src[lane];
            }
            wsum = __fadd_rn(wsum, v);
        }
        out_weights[(i64)n * kTopk + lane] = wsum;
    }
}

template <int kTopk, bool kWeighted, bool kWithWeights, int kDtype>
__global__ void __launch_bounds__(kCombineThreads) combine_send(
    const __grid_constant__ CombineSendArgs args) {
    const int4* const y = args.y;
    const int num_int4 = args.num_int4;
    const float* const recv_weights = args.recv_weights;
    const float* const grad_row_weights = args.grad_row_weights;
    const int* const slot_rows = args.slot_rows;
    const int* const num_recv_tokens_per_rank = args.num_recv_tokens_per_rank;
    const u64* const peer_bases = args.peer_bases;
    const Regions* const regions_ptr = args.regions;
    const int rank = args.rank, num_ranks = args.num_ranks;
    const u32 epoch = *args.epoch_word;
    const u64 timeout_ns = args.timeout_ns;
    const ErrorState err{args.error_claim, args.error_record};
    const Regions rg = *regions_ptr;
    __shared__ int slot_start[kMaxRanks + 1];
    if (threadIdx.x == 0) {
        slot_start[0] = 0;
        for (int s = 0; s < num_ranks; ++s)
            slot_start[s + 1] = slot_start[s] + (s == rank ? 0 : num_recv_tokens_per_rank[s]);
    }
    const bool ok = block_wait_peers(meta_of(peer_bases[rank])->combine_consumed, epoch - 1,
                                     num_ranks, rank, false, timeout_ns, err, kPhaseCombineSend);
    if (ok) {
        const int lane = threadIdx.x & 31;
        const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
        const int num_warps = (gridDim.x * blockDim.x) >> 5;
        const int total = slot_start[num_ranks];
        for (int i = warp; i < total; i += num_warps) {
            int s = 0;
            while (i >= slot_start[s + 1]) ++s;
            const int j = i - slot_start[s];
            send_partial<kTopk, kWeighted, kWithWeights, kDtype, CombineUnroll<kTopk>::value>(
                y, num_int4, recv_weights, grad_row_weights, slot_rows, peer_bases, rg, rank, s,
                j, lane);
        }
    }
    release_peers_when_done<&Meta::combine_done>(peer_bases, rg, 2, rank, num_ranks, epoch, err);
}

template <int kTopk, bool kWeighted, bool kWithWeights, int kDtype>
__global__ void __launch_bounds__(kCombineThreads) combine_reduce(
    const __grid_constant__ CombineReduceArgs args) {
    int4* const out = args.out;
    float* const out_weights = args.out_weights;
    const int num_tokens = args.num_tokens, num_int4 = args.num_int4;
    const int4* const y = args.y;
    const float* const recv_weights = args.recv_weights;
    const float* const grad_row_weights = args.grad_row_weights;
    const int* const slot_rows = args.slot_rows;
    const u8* const is_token_in_rank = args.is_token_in_rank;
    const int* const token_slot_in_rank = args.token_slot_in_rank;
    const u64* const peer_bases = args.peer_bases;
    const Regions* const regions_ptr = args.regions;
    const int rank = args.rank, num_ranks = args.num_ranks;
    const u32 epoch = *args.epoch_word;
    const u64 timeout_ns = args.timeout_ns;
    const ErrorState err{args.error_claim, args.error_record};
    const Regions rg = *regions_ptr;
    const bool ok = block_wait_peers(meta_of(peer_bases[rank])->combine_done, epoch, num_ranks,
                                     rank, false, timeout_ns, err, kPhaseCombineReduce);
    if (ok) {
        const int lane = threadIdx.x & 31;
        const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
        const int num_warps = (gridDim.x * blockDim.x) >> 5;
        for (int n = warp; n < num_tokens; n += num_warps) {
            int slots[kMaxRanks];
#pragma unroll
            for (int r = 0; r < kMaxRanks; ++r)
                slots[r] = (r < num_ranks && is_token_in_rank[(i64)n * num_ranks + r])
                               ? token_slot_in_rank[(i64)n * num_ranks + r] : -1;
            reduce_token<kTopk, kWeighted, kWithWeights, kDtype, CombineUnroll<kTopk>::value>(
                out, out_weights, n, num_int4, y, recv_weights, grad_row_weights, slot_rows,
                slots, peer_bases, rg, rank, num_ranks, lane);
        }
    }
    release_peers_when_done<&Meta::combine_consumed>(peer_bases, rg, 3, rank, num_ranks, epoch,
                                                     err);
}

// The fused combine's 16-byte words per lane per step: a partial's rows (send) and a token's
// partials with its own rows (reduce) are all loaded before any is summed; the reduce keeps
// kMaxRanks partials and kTopk rows live, so it unrolls less.
template <int kTopk>
struct FusedSendUnroll {
    static constexpr int value = kTopk <= 2 ? 4 : kTopk <= 8 ? 2 : 1;
};
template <int kTopk>
struct FusedReduceUnroll {
    static constexpr int value = kTopk <= 4 ? 2 : 1;
};

// Threads of a combine_fused block (ops.combine.FUSED_COMBINE_THREADS): fewer than the split
// kernels' 512, so that a warp keeps FusedSendUnroll words of every row in flight in registers
// (up to 168 a thread) rather than spilling them.
constexpr int kFusedCombineThreads = 384;

// Received slots a warp sends per claim: one system-scope fence publishes the batch, lane b the
// flag of slot b.
constexpr int kPartialBatch = 4;

// The fused kernel's calls of send_partial and reduce_token, not inlined: each gets registers of
// its own (inlined together in one loop, their loads spilled).
template <int kTopk, bool kWeighted, bool kWithWeights, int kDtype>
__device__ __noinline__ void fused_send_partial(const int4* y, int num_int4,
                                                const float* recv_weights,
                                                const float* grad_row_weights,
                                                const int* slot_rows, const u64* peer_bases,
                                                const Regions& rg, int rank, int s, int j,
                                                int lane) {
    send_partial<kTopk, kWeighted, kWithWeights, kDtype, FusedSendUnroll<kTopk>::value>(
        y, num_int4, recv_weights, grad_row_weights, slot_rows, peer_bases, rg, rank, s, j, lane);
}

template <int kTopk, bool kWeighted, bool kWithWeights, int kDtype>
__device__ __noinline__ void fused_reduce_token(int4* out, float* out_weights, int n,
                                                int num_int4, const int4* y,
                                                const float* recv_weights,
                                                const float* grad_row_weights,
                                                const int* slot_rows, const int* slots,
                                                const u64* peer_bases, const Regions& rg,
                                                int rank, int num_ranks, int lane) {
    reduce_token<kTopk, kWeighted, kWithWeights, kDtype, FusedReduceUnroll<kTopk>::value>(
        out, out_weights, n, num_int4, y, recv_weights, grad_row_weights, slot_rows, slots,
        peer_bases, rg, rank, num_ranks, lane);
}

// EP > 1 over NVLink in one launch: warps take send items (kPartialBatch received slots, each
// slot's partial row out to its source rank) and reduce items (a token, summed once every peer
// holding it has flagged its partial with this call's epoch), never blocking on a reduce while
// sends are left (common/fused.cuh). No barrier between the two: a partial is read back while
// it is still in L2. The last block releases "consumed" to every peer.
template <int kTopk, bool kWeighted, bool kWithWeights, int kDtype>
__global__ void __launch_bounds__(kFusedCombineThreads) combine_fused(
    const __grid_constant__ CombineFusedArgs args) {
    int4* const out = args.out;
    float* const out_weights = args.out_weights;
    const int num_tokens = args.num_tokens, num_int4 = args.num_int4;
    const int4* const y = args.y;
    const float* const recv_weights = args.recv_weights;
    const float* const grad_row_weights = args.grad_row_weights;
    const int* const slot_rows = args.slot_rows;
    const int* const num_recv_tokens_per_rank = args.num_recv_tokens_per_rank;
    const u8* const is_token_in_rank = args.is_token_in_rank;
    const int* const token_slot_in_rank = args.token_slot_in_rank;
    const u64* const peer_bases = args.peer_bases;
    const Regions rg = *args.regions;
    const int rank = args.rank, num_ranks = args.num_ranks;
    const u32 epoch = *args.epoch_word;
    const u64 timeout_ns = args.timeout_ns;
    const ErrorState err{args.error_claim, args.error_record};
    const int lane = threadIdx.x & 31;
    Workspace* const ws = workspace_of(peer_bases, rank, rg);
    __shared__ PeerSlots send_slots;  // send items: the peers' slots, interleaved
    build_peer_slots(&send_slots, num_recv_tokens_per_rank, rank, num_ranks);
    bool ok = check_call_alone(ws, kKindCombine, epoch, rank, err, kPhaseCombineReduce);
    ok = ok && block_wait_peers(meta_of(peer_bases[rank])->combine_consumed, epoch - 1,
                                num_ranks, rank, false, timeout_ns, err, kPhaseCombineSend);
    if (ok) {
        const int total_send = send_slots.num_items;
        int send_first = warp_claim(&ws->work_counter[kWorkCombineSend], kPartialBatch, lane);
        int n = warp_claim(&ws->work_counter[kWorkCombineReduce], 1, lane);
        for (;;) {
            const bool has_send = send_first < total_send;
            if (n < num_tokens) {
                int slots[kMaxRanks];
#pragma unroll
                for (int r = 0; r < kMaxRanks; ++r)
                    slots[r] = (r < num_ranks && is_token_in_rank[(i64)n * num_ranks + r])
                                   ? token_slot_in_rank[(i64)n * num_ranks + r] : -1;
                // Lane r < num_ranks looks at peer r's flag for this token's slot.
                int lane_slot = -1;
#pragma unroll
                for (int r = 0; r < kMaxRanks; ++r)
                    if (r == lane && r != rank) lane_slot = slots[r];
                const u32* flag = lane_slot >= 0 ? slot_flag(peer_bases[rank], rg.combine_flags,
                                                             rg.max_tokens, lane, lane_slot)
                                                 : nullptr;
                bool ready = __all_sync(0xffffffffu,
                                        flag == nullptr || epoch_reached(ld_acquire_sys(flag),
                                                                         epoch));
                __syncwarp();
                if (!ready && !has_send) {
                    ready = true;
                    for (int r = 0; r < num_ranks && ready; ++r) {
                        if (r == rank || slots[r] < 0) continue;
                        ready = warp_wait_slot(
                            slot_flag(peer_bases[rank], rg.combine_flags, rg.max_tokens, r,
                                      slots[r]),
                            epoch, timeout_ns, err, rank, r, kPhaseCombineReduce, lane);
                    }
                    if (!ready) break;
                }
                if (ready) {
                    fused_reduce_token<kTopk, kWeighted, kWithWeights, kDtype>(
                        out, out_weights, n, num_int4, y, recv_weights, grad_row_weights,
                        slot_rows, slots, peer_bases, rg, rank, num_ranks, lane);
                    n = warp_claim(&ws->work_counter[kWorkCombineReduce], 1, lane);
                    continue;
                }
            }
            if (!has_send) break;
            u32* flag_of_lane = nullptr;  // lane b: the flag of the batch's slot b
            for (int b = 0; b < kPartialBatch; ++b) {
                int s, j;
                if (send_first + b >= total_send) break;
                if (!peer_slot_of(send_slots, send_first + b, rank, num_ranks, &s, &j)) continue;
                fused_send_partial<kTopk, kWeighted, kWithWeights, kDtype>(
                    y, num_int4, recv_weights, grad_row_weights, slot_rows, peer_bases, rg,
                    rank, s, j, lane);
                if (lane == b)
                    flag_of_lane = slot_flag(peer_bases[s], rg.combine_flags, rg.max_tokens,
                                             rank, j);
            }
            warp_publish_slots(flag_of_lane, epoch);
            if (has_error(err)) break;
            send_first = warp_claim(&ws->work_counter[kWorkCombineSend], kPartialBatch, lane);
        }
    }
    end_fused_call<&Meta::combine_consumed>(peer_bases, ws, kKindCombine, 2, kWorkCombineSend,
                                            rank, num_ranks, epoch, err);
}

// EP = 1: no peer partials and no protocol (no regions are touched). For each token, its rows
// of y summed in k order in fp32 and rounded once, the value combine_reduce computes for a
// single rank (its rounded partial plus nothing rounds to itself). One block per budgeted SM, of
// 1024 threads up to top-8 (twice combine_reduce's loads in flight; 64 registers), else 512.
template <int kTopk>
struct CombineLocalThreads {
    static constexpr int value = kTopk <= 8 ? 1024 : 512;
};

template <int kTopk, bool kWeighted, bool kWithWeights, int kDtype>
__global__ void __launch_bounds__(CombineLocalThreads<kTopk>::value) combine_local(
    const __grid_constant__ CombineLocalArgs args) {
    int4* const out = args.out;
    float* const out_weights = args.out_weights;
    const int num_tokens = args.num_tokens, num_int4 = args.num_int4;
    const int4* const y = args.y;
    const float* const recv_weights = args.recv_weights;
    const float* const grad_row_weights = args.grad_row_weights;
    const int* const slot_rows = args.slot_rows;
    const int* const token_slot_in_rank = args.token_slot_in_rank;
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int num_warps = (gridDim.x * blockDim.x) >> 5;
    for (int n = warp; n < num_tokens; n += num_warps) {
        const int slot = token_slot_in_rank[n];
        int rows[kTopk];
        float weights[kTopk];
#pragma unroll
        for (int k = 0; k < kTopk; ++k) rows[k] = -1, weights[k] = 1.f;
        if (slot >= 0) load_slot_rows<kTopk, kWeighted>(slot_rows, recv_weights, slot, rows,
                                                        weights);
        for (int base = 0; base < num_int4; base += 32) {
            float acc[1][8];
            slot_partial<kTopk, kWeighted, 1, kDtype>(acc, y, rows, weights, num_int4, base, lane);
            if (base + lane < num_int4)
                out[(i64)n * num_int4 + base + lane] = pack_word<kDtype>(acc[0]);
        }
        if (kWithWeights && lane < kTopk) {
            int row_lane = -1;
#pragma unroll
            for (int k = 0; k < kTopk; ++k)
                if (k == lane) row_lane = rows[k];
            // combine_reduce's sum over ranks of one value: 0 + v
            out_weights[(i64)n * kTopk + lane] =
                __fadd_rn(0.f, row_lane >= 0 ? grad_row_weights[row_lane] : 0.f);
        }
    }
}
