// Dispatch over NVLink, in two kernels on the communication stream:
//   dispatch_send: every token row is read once and written once into the staging region of
//     each peer rank that holds one of its experts (slot = its index among the tokens sent
//     there), with its slot metadata; the last block releases "done" to every peer.
//   dispatch_recv: waits for every source's "done", expands each staged row (or, for tokens
//     from this rank, the input row itself) into the expert-major rows of recv_x, zeroes the
//     padding rows, and releases "consumed" back to every source.
// Reuse hazard: a sender waits until the receiver has consumed the previous call's rows from
// its region before it writes the next call's rows there.
// kCached replays a previous dispatch: rows come from its slot_rows, no metadata is sent.
#include "common/protocol.cuh"

using namespace mdeep;

constexpr int kDispatchThreads = 512;
constexpr int kCopyUnroll = 8;  // 16 B x 8 in flight per lane: enough bytes to cover latency

// Copies one row of `num_int4` 16-byte words from `src` to up to kMaxDst destinations; the
// whole warp takes part, each lane holding kCopyUnroll words in flight.
template <int kMaxDst, bool kStagedSrc>
__device__ __forceinline__ void warp_copy_row(const int4* src, int4* const* dst, int num_dst,
                                              int num_int4, int lane) {
    for (int base = 0; base < num_int4; base += 32 * kCopyUnroll) {
        int4 v[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
            const int i = base + u * 32 + lane;
            if (i < num_int4) v[u] = kStagedSrc ? ld_cg_v4(src + i) : ld_nc_v4(src + i);
        }
#pragma unroll
        for (int d = 0; d < kMaxDst; ++d) {
            if (d >= num_dst) break;
#pragma unroll
            for (int u = 0; u < kCopyUnroll; ++u) {
                const int i = base + u * 32 + lane;
                if (i < num_int4) st_v4(dst[d] + i, v[u]);
            }
        }
    }
}

template <int kTopk, bool kCached, typename IdxT>
__global__ void __launch_bounds__(kDispatchThreads) dispatch_send(
    const int4* x, int num_tokens, int num_int4, const IdxT* topk_idx, const float* topk_weights,
    const int* pos_in_expert, const u8* is_token_in_rank, const int* token_slot_in_rank,
    const u64* peer_bases, const Regions* regions_ptr, int rank, int num_ranks, int num_local,
    u32 epoch, u64 timeout_ns, int* error_claim, ErrorRecord* error_record) {
    const ErrorState err{error_claim, error_record};
    const Regions rg = *regions_ptr;
    const bool ok = block_wait_peers(meta_of(peer_bases[rank])->dispatch_consumed, epoch - 1,
                                     num_ranks, rank, false, timeout_ns, err, kPhaseDispatchSend);
    if (ok) {
        const int lane = threadIdx.x & 31;
        const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
        const int num_warps = (gridDim.x * blockDim.x) >> 5;
        for (int n = warp; n < num_tokens; n += num_warps) {
            int4* dst[kMaxRanks];
            int dst_rank[kMaxRanks];
            int num_dst = 0;
            for (int r = 0; r < num_ranks; ++r) {
                if (r == rank || !is_token_in_rank[(i64)n * num_ranks + r]) continue;
                const int slot = token_slot_in_rank[(i64)n * num_ranks + r];
                dst[num_dst] = reinterpret_cast<int4*>(slot_ptr(
                    peer_bases[r], rg.dispatch_rows, rg.row_stride, rg.max_tokens, rank, slot));
                dst_rank[num_dst++] = r;
                if (!kCached && lane <= kTopk) {
                    SlotMeta<kTopk>* m = reinterpret_cast<SlotMeta<kTopk>*>(slot_ptr(
                        peer_bases[r], rg.dispatch_meta, rg.meta_stride, rg.max_tokens, rank,
                        slot));
                    if (lane == kTopk) {
                        m->token = n;
                    } else {
                        const i64 id = (i64)topk_idx[(i64)n * kTopk + lane];
                        const bool here = id >= 0 && id / num_local == r;
                        m->local_expert[lane] = here ? (int)(id - (i64)r * num_local) : -1;
                        m->pos[lane] = here ? pos_in_expert[(i64)n * kTopk + lane] : -1;
                        m->weight[lane] = topk_weights[(i64)n * kTopk + lane];
                    }
                }
            }
            (void)dst_rank;
            if (num_dst > 0)
                warp_copy_row<kMaxRanks, false>(x + (i64)n * num_int4, dst, num_dst, num_int4,
                                                lane);
        }
    }
    release_peers_when_done<&Meta::dispatch_done>(peer_bases, rg, 0, rank, num_ranks, epoch, err);
}

template <int kTopk, bool kCached, typename IdxT>
__global__ void __launch_bounds__(kDispatchThreads) dispatch_recv(
    int4* recv_x, float* recv_weights, int max_rows, int num_int4,
    const int* num_recv_tokens_per_rank, const int* num_recv_tokens_per_expert,
    const int* expert_row_start, const int* src_expert_offset, int* slot_rows,
    const int4* x, const IdxT* topk_idx, const float* topk_weights, const int* pos_in_expert,
    const int* slot_token, int num_tokens, const u64* peer_bases, const Regions* regions_ptr,
    int rank, int num_ranks, int num_local, u32 epoch, u64 timeout_ns, int* error_claim,
    ErrorRecord* error_record) {
    const ErrorState err{error_claim, error_record};
    const Regions rg = *regions_ptr;
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int num_warps = (gridDim.x * blockDim.x) >> 5;
    const int4 zero = make_int4(0, 0, 0, 0);

    // Padding rows (no wait needed: the layout is known from notify); one expert per warp.
    for (int e = warp; e < num_local; e += num_warps) {
        const int first = expert_row_start[e] + num_recv_tokens_per_expert[e];
        const int last = min(expert_row_start[e + 1], max_rows);
        for (int row = first; row < last; ++row) {
            for (int i = lane; i < num_int4; i += 32) recv_x[(i64)row * num_int4 + i] = zero;
            if (!kCached && lane == 0) recv_weights[row] = 0.f;
        }
    }

    __shared__ int slot_start[kMaxRanks + 1];
    if (threadIdx.x == 0) {
        slot_start[0] = 0;
        for (int s = 0; s < num_ranks; ++s)
            slot_start[s + 1] = slot_start[s] + num_recv_tokens_per_rank[s];
    }
    const bool ok = block_wait_peers(meta_of(peer_bases[rank])->dispatch_done, epoch, num_ranks,
                                     rank, false, timeout_ns, err, kPhaseDispatchRecv);
    if (ok) {
        const int total = slot_start[num_ranks];
        for (int i = warp; i < total; i += num_warps) {
            int s = 0;
            while (i >= slot_start[s + 1]) ++s;
            const int j = i - slot_start[s];
            const int4* src;
            int rows[kTopk];
            float weight = 0.f;
            int* my_rows = slot_rows + ((i64)s * rg.max_tokens + j) * kTopk;
            if (kCached) {
#pragma unroll
                for (int k = 0; k < kTopk; ++k) rows[k] = my_rows[k];
                src = s == rank ? x + (i64)slot_token[(i64)rank * num_tokens + j] * num_int4
                                : reinterpret_cast<const int4*>(slot_ptr(
                                      peer_bases[rank], rg.dispatch_rows, rg.row_stride,
                                      rg.max_tokens, s, j));
            } else {
                int e[kTopk], pos[kTopk];
                if (s == rank) {
                    const int n = slot_token[(i64)rank * num_tokens + j];
                    src = x + (i64)n * num_int4;
#pragma unroll
                    for (int k = 0; k < kTopk; ++k) {
                        const i64 id = (i64)topk_idx[(i64)n * kTopk + k];
                        const bool here = id >= 0 && id / num_local == rank;
                        e[k] = here ? (int)(id - (i64)rank * num_local) : -1;
                        pos[k] = here ? pos_in_expert[(i64)n * kTopk + k] : -1;
                    }
                    if (lane < kTopk) weight = topk_weights[(i64)n * kTopk + lane];
                } else {
                    src = reinterpret_cast<const int4*>(slot_ptr(
                        peer_bases[rank], rg.dispatch_rows, rg.row_stride, rg.max_tokens, s, j));
                    const volatile SlotMeta<kTopk>* m =
                        reinterpret_cast<const volatile SlotMeta<kTopk>*>(slot_ptr(
                            peer_bases[rank], rg.dispatch_meta, rg.meta_stride, rg.max_tokens, s,
                            j));
#pragma unroll
                    for (int k = 0; k < kTopk; ++k) {
                        e[k] = m->local_expert[k];
                        pos[k] = m->pos[k];
                    }
                    if (lane < kTopk) weight = m->weight[lane];
                }
#pragma unroll
                for (int k = 0; k < kTopk; ++k) {
                    rows[k] = e[k] < 0 ? -1
                                       : expert_row_start[e[k]] +
                                             src_expert_offset[s * num_local + e[k]] + pos[k];
                    if (rows[k] >= max_rows) rows[k] = -1;  // overflow: reported by notify
                }
                if (lane < kTopk) {
                    int row_lane = -1;
#pragma unroll
                    for (int k = 0; k < kTopk; ++k)
                        if (k == lane) row_lane = rows[k];
                    my_rows[lane] = row_lane;
                    if (row_lane >= 0) recv_weights[row_lane] = weight;
                }
            }
            int4* dst[kTopk];
            int num_dst = 0;
#pragma unroll
            for (int k = 0; k < kTopk; ++k)
                if (rows[k] >= 0) dst[num_dst++] = recv_x + (i64)rows[k] * num_int4;
            if (num_dst == 0) continue;
            if (s == rank)
                warp_copy_row<kTopk, false>(src, dst, num_dst, num_int4, lane);
            else
                warp_copy_row<kTopk, true>(src, dst, num_dst, num_int4, lane);
        }
    }
    release_peers_when_done<&Meta::dispatch_consumed>(peer_bases, rg, 1, rank, num_ranks, epoch,
                                                      err);
}
