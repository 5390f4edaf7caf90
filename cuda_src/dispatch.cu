// Dispatch over NVLink. dispatch_fused does it in one launch (below); the split kernels, two
// kernels on the communication stream:
//   dispatch_send: every token row is read once and written once into the staging region of
//     each peer rank that holds one of its experts (slot = its index among the tokens sent
//     there), with its slot metadata; the last block releases "done" to every peer.
//   dispatch_recv: waits for every source's "done", expands each staged row (or, for tokens
//     from this rank, the input row itself) into the expert-major rows of recv_x, zeroes the
//     padding rows, and releases "consumed" back to every source.
// Reuse hazard: a sender waits until the receiver has consumed the previous call's rows from
// its region before it writes the next call's rows there.
// kCached replays a previous dispatch: rows come from its slot_rows, no metadata is sent.
// kFmt (common/fp8_row.cuh) is the wire format: bf16, or e4m3 with block scales, quantized in
// the send (bf16 input) or copied (pre-quantized input). kDequant: the receiver expands FP8 rows
// into bf16 rows; otherwise recv_x holds e4m3 rows and recv_scales their scales.
#include "common/args.cuh"
#include "common/fp8_row.cuh"
#include "common/fused.cuh"
#include "common/recv_rows.cuh"
#include "common/protocol.cuh"

using namespace mdeep;

constexpr int kDispatchThreads = 512;

// The most 16-byte words per lane dispatch_local stages in shared memory.
constexpr int kDispatchStageWords = 64;

// Bytes of one output row of recv_x: bf16 unless the rows stay in FP8.
template <int kFmt, bool kDequant>
__device__ __forceinline__ i64 out_row_bytes(int hidden) {
    return kFmt == fp8::kWireBf16 || kDequant ? (i64)hidden * 2 : (i64)hidden;
}

// Bytes per row of the input x (bf16, or pre-quantized e4m3 with scales) and of recv_x.
template <int kFmt, bool kDequant>
struct RowBytes {
    i64 in_row, out_row;
    int in_scales, out_scales;
    __device__ RowBytes(int hidden, bool pre_quantized) {
        constexpr bool kFp8Out = kFmt != fp8::kWireBf16 && !kDequant;
        in_row = kFmt == fp8::kWireBf16 || !pre_quantized ? (i64)hidden * 2 : (i64)hidden;
        out_row = out_row_bytes<kFmt, kDequant>(hidden);
        in_scales = kFmt == fp8::kWireBf16 ? 0 : fp8::scale_row_bytes<kFmt>(hidden);
        out_scales = kFp8Out ? fp8::scale_row_bytes<kFmt>(hidden) : 0;
    }
};

// Writes one token row (bf16 `x` row, or a pre-quantized (data, scales) pair when `x_scales`
// is given) to every destination, in the destination form kFmt/kDequant asks for. Destination
// scales are dst_scales[d] (unused for bf16 and dequantized rows).
template <int kFmt, bool kDequant, int kMaxDst, bool kStagedSrc>
__device__ __forceinline__ void write_row(const u8* src, const u8* src_scales, int hidden,
                                          u8* const* dst, u8* const* dst_scales, int num_dst,
                                          float amax_epsilon, int lane) {
    if (kFmt == fp8::kWireBf16) {
        warp_copy_row<kMaxDst, kStagedSrc>(reinterpret_cast<const int4*>(src),
                                           reinterpret_cast<int4* const*>(dst), num_dst,
                                           hidden / 8, lane);
    } else if (src_scales == nullptr) {
        fp8::quantize_row<kFmt, kMaxDst, kDequant>(reinterpret_cast<const int4*>(src), hidden,
                                                    dst, dst_scales, num_dst, amax_epsilon,
                                                    lane);
    } else if (kDequant) {
        fp8::dequant_fp8_row<kFmt, kMaxDst, kStagedSrc>(
            src, src_scales, hidden, reinterpret_cast<int4* const*>(dst), num_dst, lane);
    } else {
        fp8::copy_fp8_row<kFmt, kMaxDst, kStagedSrc>(src, src_scales, hidden, dst, dst_scales,
                                                     num_dst, lane);
    }
}

// Writes token n's slot record into peer r's dispatch metadata [rank][slot]: lane k < kTopk
// its entry k (the peer-local expert, or -1 where entry k is not on r), lane 0 the token.
template <int kTopk, typename IdxT>
__device__ __forceinline__ void write_slot_meta(u64 peer_base, const Regions& rg, int rank,
                                                int slot, int r, int n, const IdxT* topk_idx,
                                                const float* topk_weights,
                                                const int* pos_in_expert, int num_local,
                                                int lane) {
    SlotMeta<kTopk>* m = reinterpret_cast<SlotMeta<kTopk>*>(
        slot_ptr(peer_base, rg.dispatch_meta, rg.meta_stride, rg.max_tokens, rank, slot));
    if (lane < kTopk) {
        const i64 id = (i64)topk_idx[(i64)n * kTopk + lane];
        const bool here = id >= 0 && id / num_local == r;
        m->local_expert[lane] = here ? (int)(id - (i64)r * num_local) : -1;
        m->pos[lane] = here ? pos_in_expert[(i64)n * kTopk + lane] : -1;
        m->weight[lane] = topk_weights[(i64)n * kTopk + lane];
    }
    if (lane == 0) m->token = n;
}

template <int kTopk, bool kCached, typename IdxT, int kFmt>
__global__ void __launch_bounds__(kDispatchThreads) dispatch_send(
    const __grid_constant__ DispatchSendArgs<IdxT> args) {
    const u8* const x = args.x;
    const u8* const x_scales = args.x_scales;
    const int num_tokens = args.num_tokens, hidden = args.hidden;
    const float amax_epsilon = args.amax_epsilon;
    const IdxT* const topk_idx = args.topk_idx;
    const float* const topk_weights = args.topk_weights;
    const int* const pos_in_expert = args.pos_in_expert;
    const u8* const is_token_in_rank = args.is_token_in_rank;
    const int* const token_slot_in_rank = args.token_slot_in_rank;
    const u64* const peer_bases = args.peer_bases;
    const Regions* const regions_ptr = args.regions;
    const int rank = args.rank, num_ranks = args.num_ranks, num_local = args.num_local;
    const u32 epoch = *args.epoch_word;
    const u64 timeout_ns = args.timeout_ns;
    const ErrorState err{args.error_claim, args.error_record};
    const Regions rg = *regions_ptr;
    const i64 in_row_bytes = kFmt == fp8::kWireBf16 || x_scales == nullptr ? (i64)hidden * 2
                                                                           : (i64)hidden;
    const int in_scale_bytes = kFmt == fp8::kWireBf16 ? 0 : fp8::scale_row_bytes<kFmt>(hidden);
    const bool ok = block_wait_peers(meta_of(peer_bases[rank])->dispatch_consumed, epoch - 1,
                                     num_ranks, rank, false, timeout_ns, err, kPhaseDispatchSend);
    if (ok) {
        const int lane = threadIdx.x & 31;
        const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
        const int num_warps = (gridDim.x * blockDim.x) >> 5;
        for (int n = warp; n < num_tokens; n += num_warps) {
            u8* dst[kMaxRanks];
            u8* dst_scales[kMaxRanks];
            int num_dst = 0;
            for (int r = 0; r < num_ranks; ++r) {
                if (r == rank || !is_token_in_rank[(i64)n * num_ranks + r]) continue;
                const int slot = token_slot_in_rank[(i64)n * num_ranks + r];
                dst[num_dst] = reinterpret_cast<u8*>(slot_ptr(
                    peer_bases[r], rg.dispatch_rows, rg.row_stride, rg.max_tokens, rank, slot));
                dst_scales[num_dst] = dst[num_dst] + hidden;  // wire row: data, then scales
                ++num_dst;
                if (!kCached)
                    write_slot_meta<kTopk>(peer_bases[r], rg, rank, slot, r, n, topk_idx,
                                           topk_weights, pos_in_expert, num_local, lane);
            }
            if (num_dst > 0)
                write_row<kFmt, false, kMaxRanks, false>(
                    x + n * in_row_bytes, x_scales ? x_scales + (i64)n * in_scale_bytes : nullptr,
                    hidden, dst, dst_scales, num_dst, amax_epsilon, lane);
        }
    }
    release_peers_when_done<&Meta::dispatch_done>(peer_bases, rg, 0, rank, num_ranks, epoch, err);
}

// Entry k of a peer's slot record (local expert e, position pos): e if it lies in the segment
// source s fills inside expert e (e < num_local and 0 <= pos < the tokens s sends to e, from
// notify's counts), else -1, the record refused (recorded when `record`): a bad record never
// writes over other experts' rows.
__device__ __forceinline__ int peer_expert_or_refuse(int e, int pos, int s, int k, int num_ranks,
                                                     int num_local, const int* src_expert_offset,
                                                     const int* num_recv_tokens_per_expert,
                                                     const ErrorState& err, int rank,
                                                     bool record) {
    if (e < 0) return -1;
    if (e < num_local && pos >= 0) {
        const int start = src_expert_offset[s * num_local + e];
        const int end = s + 1 < num_ranks ? src_expert_offset[(s + 1) * num_local + e]
                                          : num_recv_tokens_per_expert[e];
        if (pos < end - start) return e;
    }
    if (record)
        record_error(err, kErrBadPeerRow, rank, s, kPhaseDispatchRecv, k, num_local,
                     (i64)e * (1ll << 32) + pos);
    return -1;
}

template <int kTopk, bool kCached, typename IdxT, int kFmt, bool kDequant>
__global__ void __launch_bounds__(kDispatchThreads) dispatch_recv(
    const __grid_constant__ DispatchRecvArgs<IdxT> args) {
    u8* const recv_x = args.recv_x;
    u8* const recv_scales = args.recv_scales;
    float* const recv_weights = args.recv_weights;
    const int max_rows = args.max_rows, hidden = args.hidden;
    const int* const num_recv_tokens_per_rank = args.num_recv_tokens_per_rank;
    const int* const num_recv_tokens_per_expert = args.num_recv_tokens_per_expert;
    const int* const expert_row_start = args.expert_row_start;
    const int* const src_expert_offset = args.src_expert_offset;
    int* const slot_rows = args.slot_rows;
    const u8* const x = args.x;
    const u8* const x_scales = args.x_scales;
    const float amax_epsilon = args.amax_epsilon;
    const IdxT* const topk_idx = args.topk_idx;
    const float* const topk_weights = args.topk_weights;
    const int* const pos_in_expert = args.pos_in_expert;
    const int* const slot_token = args.slot_token;
    const int num_tokens = args.num_tokens;
    const u64* const peer_bases = args.peer_bases;
    const Regions* const regions_ptr = args.regions;
    const int rank = args.rank, num_ranks = args.num_ranks, num_local = args.num_local;
    const u32 epoch = *args.epoch_word;
    const u64 timeout_ns = args.timeout_ns;
    const ErrorState err{args.error_claim, args.error_record};
    const Regions rg = *regions_ptr;
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int num_warps = (gridDim.x * blockDim.x) >> 5;
    constexpr bool kFp8Out = kFmt != fp8::kWireBf16 && !kDequant;
    const RowBytes<kFmt, kDequant> sizes(hidden, x_scales != nullptr);
    const i64 row_bytes = sizes.out_row, in_row_bytes = sizes.in_row;
    const int scale_bytes = sizes.out_scales, in_scale_bytes = sizes.in_scales;

    // Padding rows (no wait needed: the layout is known from notify, unless notify gave up on an
    // error: then there is no layout to read); one expert per warp.
    if (!has_error(err)) {
        for (int e = warp; e < num_local; e += num_warps)
            zero_padding_rows<kFp8Out, kCached>(e, recv_x, recv_scales, recv_weights, row_bytes,
                                                scale_bytes, max_rows,
                                                num_recv_tokens_per_expert, expert_row_start,
                                                lane);
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
            const bool from_self = s == rank;
            const u8* staged = reinterpret_cast<const u8*>(slot_ptr(
                peer_bases[rank], rg.dispatch_rows, rg.row_stride, rg.max_tokens, s, j));
            int n = -1;  // the source token, for this rank's own tokens
            int rows[kTopk];
            int* my_rows = slot_rows + ((i64)s * rg.max_tokens + j) * kTopk;
            if (from_self) n = slot_token[(i64)rank * num_tokens + j];
            if (kCached) {
#pragma unroll
                for (int k = 0; k < kTopk; ++k) rows[k] = my_rows[k];
            } else {
                int e[kTopk], pos[kTopk];
                float weight = 0.f;
                if (from_self) {
#pragma unroll
                    for (int k = 0; k < kTopk; ++k) {
                        const i64 id = (i64)topk_idx[(i64)n * kTopk + k];
                        const bool here = id >= 0 && id / num_local == rank;
                        e[k] = here ? (int)(id - (i64)rank * num_local) : -1;
                        pos[k] = here ? pos_in_expert[(i64)n * kTopk + k] : -1;
                    }
                    if (lane < kTopk) weight = topk_weights[(i64)n * kTopk + lane];
                } else {
                    const volatile SlotMeta<kTopk>* m =
                        reinterpret_cast<const volatile SlotMeta<kTopk>*>(slot_ptr(
                            peer_bases[rank], rg.dispatch_meta, rg.meta_stride, rg.max_tokens, s,
                            j));
#pragma unroll
                    for (int k = 0; k < kTopk; ++k) {
                        e[k] = m->local_expert[k];
                        pos[k] = m->pos[k];
                        e[k] = peer_expert_or_refuse(e[k], pos[k], s, k, num_ranks, num_local,
                                                     src_expert_offset,
                                                     num_recv_tokens_per_expert, err, rank,
                                                     lane == 0);
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
            u8* dst[kTopk];
            u8* dst_scales[kTopk];
            int num_dst = 0;
#pragma unroll
            for (int k = 0; k < kTopk; ++k) {
                if (rows[k] < 0) continue;
                dst[num_dst] = recv_x + rows[k] * row_bytes;
                dst_scales[num_dst++] = recv_scales + (i64)rows[k] * scale_bytes;
            }
            if (num_dst == 0) continue;
            if (from_self) {
                write_row<kFmt, kDequant, kTopk, false>(
                    x + n * in_row_bytes, x_scales ? x_scales + (i64)n * in_scale_bytes : nullptr,
                    hidden, dst, dst_scales, num_dst, amax_epsilon, lane);
            } else {
                // Peers sent FP8 rows as (data, scales) on the wire: never quantize again.
                write_row<kFmt, kDequant, kTopk, true>(
                    staged, kFmt == fp8::kWireBf16 ? nullptr : staged + hidden, hidden, dst,
                    dst_scales, num_dst, amax_epsilon, lane);
            }
        }
    }
    release_peers_when_done<&Meta::dispatch_consumed>(peer_bases, rg, 1, rank, num_ranks, epoch,
                                                      err);
}

// Tokens a warp sends per claim: one system-scope fence publishes the batch's slots, one flag
// per (token, destination rank) in lane b * num_ranks + r (kSendBatch * kMaxRanks <= 32).
constexpr int kSendBatch = 4;
static_assert(kSendBatch * kMaxRanks <= 32, "a lane per (token, rank) flag of a batch");

// The expert-major rows of one token's entries on this rank (lane k < kTopk: entry k's row, or
// -1), from the layout (fresh: written to `my_rows` with the weights) or from `my_rows`.
template <int kTopk, bool kCached, typename IdxT>
__device__ __forceinline__ int self_entry_row(const IdxT* topk_idx, const float* topk_weights,
                                              const int* pos_in_expert, int n, int rank,
                                              int num_local, const int* expert_row_start,
                                              const int* self_offset, int max_rows,
                                              int* my_rows, float* recv_weights, int lane) {
    if (lane >= kTopk) return -1;
    if (kCached) return my_rows[lane];
    const i64 id = (i64)topk_idx[(i64)n * kTopk + lane];
    int row = -1;
    if (id >= 0 && id / num_local == rank) {
        const int e = (int)(id - (i64)rank * num_local);
        row = expert_row_start[e] + self_offset[e] + pos_in_expert[(i64)n * kTopk + lane];
        if (row >= max_rows) row = -1;  // overflow: reported by notify
    }
    my_rows[lane] = row;
    if (row >= 0) recv_weights[row] = topk_weights[(i64)n * kTopk + lane];
    return row;
}

// The rows of a peer's staged slot (lane k < kTopk: entry k's row, or -1): from its slot record
// (fresh: checked against its source's segment, written to `my_rows` with the weights) or from
// `my_rows` (cached).
template <int kTopk, bool kCached>
__device__ __forceinline__ int peer_entry_row(const volatile SlotMeta<kTopk>* m, int s,
                                              int rank, int num_ranks, int num_local,
                                              const int* expert_row_start,
                                              const int* src_expert_offset,
                                              const int* num_recv_tokens_per_expert, int max_rows,
                                              int* my_rows, float* recv_weights,
                                              const ErrorState& err, int lane) {
    if (lane >= kTopk) return -1;
    if (kCached) return my_rows[lane];
    const int pos = m->pos[lane];
    const int e = peer_expert_or_refuse(m->local_expert[lane], pos, s, lane, num_ranks,
                                        num_local, src_expert_offset,
                                        num_recv_tokens_per_expert, err, rank, true);
    int row = -1;
    if (e >= 0) {
        row = expert_row_start[e] + src_expert_offset[s * num_local + e] + pos;
        if (row >= max_rows) row = -1;  // overflow: reported by notify
    }
    my_rows[lane] = row;
    if (row >= 0) recv_weights[row] = m->weight[lane];
    return row;
}

// EP > 1 over NVLink in one launch after notify: warps take send items (kSendBatch tokens: each
// row read from x once, written into the staging slot of every peer rank that holds one of its
// experts, with its slot record, and into this rank's own expert-major rows) and receive items
// (one peer's staged slot, expanded into recv_x while its row is still in L2 once the slot's
// flag carries this call's epoch), never blocking on a receive while sends are left
// (common/fused.cuh). Padding rows are zeroed first; the last block releases "consumed" to
// every peer. Per call: one cross-rank wait before the first send (the previous call's rows
// consumed) and one flag per staged slot.
template <int kTopk, bool kCached, typename IdxT, int kFmt, bool kDequant>
__global__ void __launch_bounds__(kDispatchThreads) dispatch_fused(
    const __grid_constant__ DispatchFusedArgs<IdxT> args) {
    u8* const recv_x = args.recv_x;
    u8* const recv_scales = args.recv_scales;
    float* const recv_weights = args.recv_weights;
    const int max_rows = args.max_rows, hidden = args.hidden;
    const int* const num_recv_tokens_per_rank = args.num_recv_tokens_per_rank;
    const int* const num_recv_tokens_per_expert = args.num_recv_tokens_per_expert;
    const int* const expert_row_start = args.expert_row_start;
    const int* const src_expert_offset = args.src_expert_offset;
    int* const slot_rows = args.slot_rows;
    const u8* const x = args.x;
    const u8* const x_scales = args.x_scales;
    const float amax_epsilon = args.amax_epsilon;
    const IdxT* const topk_idx = args.topk_idx;
    const float* const topk_weights = args.topk_weights;
    const int* const pos_in_expert = args.pos_in_expert;
    const u8* const is_token_in_rank = args.is_token_in_rank;
    const int* const token_slot_in_rank = args.token_slot_in_rank;
    const int num_tokens = args.num_tokens;
    const u64* const peer_bases = args.peer_bases;
    const Regions rg = *args.regions;
    const int rank = args.rank, num_ranks = args.num_ranks, num_local = args.num_local;
    const u32 epoch = *args.epoch_word;
    const u64 timeout_ns = args.timeout_ns;
    const ErrorState err{args.error_claim, args.error_record};
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int num_warps = (gridDim.x * blockDim.x) >> 5;
    constexpr bool kFp8Out = kFmt != fp8::kWireBf16 && !kDequant;
    const RowBytes<kFmt, kDequant> sizes(hidden, x_scales != nullptr);
    const i64 row_bytes = sizes.out_row, in_row_bytes = sizes.in_row;
    const int scale_bytes = sizes.out_scales, in_scale_bytes = sizes.in_scales;
    Workspace* const ws = workspace_of(peer_bases, rank, rg);

    bool ok = check_call_alone(ws, kKindDispatch, epoch, rank, err, kPhaseDispatchRecv);
    if (ok) {
        for (int e = num_warps - 1 - warp; e >= 0 && e < num_local; e -= num_warps)
            zero_padding_rows<kFp8Out, kCached>(e, recv_x, recv_scales, recv_weights, row_bytes,
                                                scale_bytes, max_rows,
                                                num_recv_tokens_per_expert, expert_row_start,
                                                lane);
    }
    __shared__ PeerSlots recv_slots;  // receive items: the peers' slots, interleaved
    build_peer_slots(&recv_slots, num_recv_tokens_per_rank, rank, num_ranks);
    ok = ok && block_wait_peers(meta_of(peer_bases[rank])->dispatch_consumed, epoch - 1,
                                num_ranks, rank, false, timeout_ns, err, kPhaseDispatchSend);
    if (ok) {
        const int total_recv = recv_slots.num_items;
        const int* const self_offset = src_expert_offset + rank * num_local;
        constexpr int kMaxDst = kMaxRanks - 1 + kTopk;
        int send_first = warp_claim(&ws->work_counter[kWorkDispatchSend], kSendBatch, lane);
        int recv_item = warp_claim(&ws->work_counter[kWorkDispatchRecv], 1, lane);
        for (;;) {
            const bool has_send = send_first < num_tokens;
            if (recv_item < total_recv) {
                int s, j;
                if (!peer_slot_of(recv_slots, recv_item, rank, num_ranks, &s, &j)) {
                    recv_item = warp_claim(&ws->work_counter[kWorkDispatchRecv], 1, lane);
                    continue;  // void: past this peer's slots
                }
                const u32* flag = slot_flag(peer_bases[rank], rg.dispatch_flags, rg.max_tokens,
                                            s, j);
                bool ready = warp_slot_ready(flag, epoch, lane);
                if (!ready && !has_send) {
                    if (!warp_wait_slot(flag, epoch, timeout_ns, err, rank, s,
                                        kPhaseDispatchRecv, lane))
                        break;
                    ready = true;
                }
                if (ready) {
                    const u8* staged = reinterpret_cast<const u8*>(slot_ptr(
                        peer_bases[rank], rg.dispatch_rows, rg.row_stride, rg.max_tokens, s, j));
                    const volatile SlotMeta<kTopk>* m =
                        reinterpret_cast<const volatile SlotMeta<kTopk>*>(slot_ptr(
                            peer_bases[rank], rg.dispatch_meta, rg.meta_stride, rg.max_tokens,
                            s, j));
                    const int row_lane = peer_entry_row<kTopk, kCached>(
                        m, s, rank, num_ranks, num_local, expert_row_start, src_expert_offset,
                        num_recv_tokens_per_expert, max_rows,
                        slot_rows + ((i64)s * rg.max_tokens + j) * kTopk, recv_weights, err,
                        lane);
                    u8* dst[kTopk];
                    u8* dst_scales[kTopk];
                    const int num_dst = lane_rows_to_dsts<kTopk>(
                        row_lane, recv_x, row_bytes, recv_scales, scale_bytes, dst, dst_scales);
                    // Peers sent FP8 rows as (data, scales) on the wire: never quantized again.
                    if (num_dst > 0)
                        write_row<kFmt, kDequant, kTopk, true>(
                            staged, kFmt == fp8::kWireBf16 ? nullptr : staged + hidden, hidden,
                            dst, dst_scales, num_dst, amax_epsilon, lane);
                    recv_item = warp_claim(&ws->work_counter[kWorkDispatchRecv], 1, lane);
                    continue;
                }
            }
            if (!has_send) break;
            u32* flag_of_lane = nullptr;  // lane b * num_ranks + r: (token b, peer r)'s flag
            for (int b = 0; b < kSendBatch; ++b) {
                const int n = send_first + b;
                if (n >= num_tokens) break;
                u8* dst[kMaxDst];
                u8* dst_scales[kMaxDst];
                int num_peer_dst = 0;
                for (int r = 0; r < num_ranks; ++r) {
                    if (r == rank || !is_token_in_rank[(i64)n * num_ranks + r]) continue;
                    const int slot = token_slot_in_rank[(i64)n * num_ranks + r];
                    dst[num_peer_dst] = reinterpret_cast<u8*>(slot_ptr(
                        peer_bases[r], rg.dispatch_rows, rg.row_stride, rg.max_tokens, rank,
                        slot));
                    dst_scales[num_peer_dst] = dst[num_peer_dst] + hidden;  // data, then scales
                    ++num_peer_dst;
                    if (!kCached)
                        write_slot_meta<kTopk>(peer_bases[r], rg, rank, slot, r, n, topk_idx,
                                               topk_weights, pos_in_expert, num_local, lane);
                    if (lane == b * num_ranks + r)
                        flag_of_lane = slot_flag(peer_bases[r], rg.dispatch_flags,
                                                 rg.max_tokens, rank, slot);
                }
                int num_self_dst = 0;
                if (is_token_in_rank[(i64)n * num_ranks + rank]) {
                    const int slot = token_slot_in_rank[(i64)n * num_ranks + rank];
                    const int row_lane = self_entry_row<kTopk, kCached>(
                        topk_idx, topk_weights, pos_in_expert, n, rank, num_local,
                        expert_row_start, self_offset, max_rows,
                        slot_rows + ((i64)rank * rg.max_tokens + slot) * kTopk, recv_weights,
                        lane);
                    num_self_dst = lane_rows_to_dsts<kTopk>(
                        row_lane, recv_x, row_bytes, recv_scales, scale_bytes,
                        dst + num_peer_dst, dst_scales + num_peer_dst);
                }
                const u8* row = x + n * in_row_bytes;
                const u8* row_scales = x_scales ? x_scales + (i64)n * in_scale_bytes : nullptr;
                if (kFmt == fp8::kWireBf16) {  // the wire row is the output row: one pass
                    if (num_peer_dst + num_self_dst > 0)
                        write_row<kFmt, false, kMaxDst, false>(row, nullptr, hidden, dst,
                                                               dst_scales,
                                                               num_peer_dst + num_self_dst,
                                                               amax_epsilon, lane);
                } else {  // peers get the wire form, this rank its output form (row in L2)
                    if (num_peer_dst > 0)
                        write_row<kFmt, false, kMaxRanks, false>(row, row_scales, hidden, dst,
                                                                 dst_scales, num_peer_dst,
                                                                 amax_epsilon, lane);
                    if (num_self_dst > 0)
                        write_row<kFmt, kDequant, kTopk, false>(
                            row, row_scales, hidden, dst + num_peer_dst,
                            dst_scales + num_peer_dst, num_self_dst, amax_epsilon, lane);
                }
            }
            warp_publish_slots(flag_of_lane, epoch);
            if (has_error(err)) break;
            send_first = warp_claim(&ws->work_counter[kWorkDispatchSend], kSendBatch, lane);
        }
    }
    end_fused_call<&Meta::dispatch_consumed>(peer_bases, ws, kKindDispatch, 0, kWorkDispatchSend,
                                             rank, num_ranks, epoch, err);
}

// Lane k < kTopk's routing entry k of one token, as dispatch_local reads it (a fresh dispatch
// only: a cached one reads its rows from slot_rows): loaded apart from its use, so that the
// loads can be in flight while the warp quantizes the token's row.
struct LocalEntry {
    i64 id;
    float weight;
    int pos;
};

template <int kTopk, bool kCached, typename IdxT>
__device__ __forceinline__ LocalEntry load_local_entry(const IdxT* topk_idx,
                                                       const float* topk_weights,
                                                       const int* pos_in_expert, int n,
                                                       int lane) {
    LocalEntry entry{-1, 0.0f, 0};
    if (!kCached && lane < kTopk) {
        entry.id = (i64)topk_idx[(i64)n * kTopk + lane];
        entry.weight = topk_weights[(i64)n * kTopk + lane];
        entry.pos = pos_in_expert[(i64)n * kTopk + lane];
    }
    return entry;
}

// Lane k's row of entry k (-1: none) in a fresh dispatch: from its expert's row start and its
// position, written to the token's slot_rows (`my_rows`) with its weight.
__device__ __forceinline__ int local_entry_row(const LocalEntry& entry, int* my_rows,
                                               const int* expert_row_start, int num_local,
                                               int max_rows, float* recv_weights, int lane) {
    int row = -1;
    if (entry.id >= 0 && entry.id < num_local) {  // a bad id (recorded by layout) gets no row
        row = expert_row_start[entry.id] + entry.pos;
        if (row >= max_rows) row = -1;  // overflow: reported by notify
    }
    my_rows[lane] = row;
    if (row >= 0) recv_weights[row] = entry.weight;
    return row;
}

// A cached dispatch's rows: lane k < kTopk's row of entry k from slot_rows, through the token's
// slot, two dependent loads per token. Past a warp's first token, they run a token ahead: the
// next token's rows and the slot after it go out before the warp reads a token's row, so that
// neither waits in front of a token's writes. The first token loads its rows once its row is
// read (the slots it needs are then in), as the rows were loaded before.
template <int kTopk>
struct CachedRowsAhead {
    const int* token_slot_in_rank;
    const int* slot_rows;
    int num_tokens, stride, lane;
    int slot, row;              // the current token's slot and (past the first) lane row
    int next_slot, next_row;    // the next token's
    int after_slot;             // the slot of the token after the next
    bool is_first;

    __device__ int slot_of(int n) const { return n < num_tokens ? token_slot_in_rank[n] : -1; }
    __device__ int row_of(int s) const {
        return s >= 0 && lane < kTopk ? slot_rows[(i64)s * kTopk + lane] : -1;
    }
    // Before the warp's first token `n`: its slot and the next token's go out.
    __device__ void start(int n) {
        slot = slot_of(n);
        next_slot = slot_of(n + stride);
        row = next_row = after_slot = -1;
        is_first = true;
    }
    // Before token `n`'s row is read: past the first token, the loads a token ahead.
    __device__ void before_read(int n) {
        if (is_first) return;
        next_row = row_of(next_slot);
        after_slot = slot_of(n + 2 * stride);
    }
    // Once token `n`'s row is read: its lane row; then on to the next token.
    __device__ int take_row(int n) {
        int current = row;
        if (is_first) {
            current = row_of(slot);
            next_row = row_of(next_slot);
            after_slot = slot_of(n + 2 * stride);
            is_first = false;
        }
        slot = next_slot;
        row = next_row;
        next_slot = after_slot;
        return current;
    }
};

// EP = 1: each token row read from x once and written to its expert-major rows; no staging and
// no protocol (no regions are touched). The same recv_x, recv_weights and slot_rows as
// dispatch_recv on one rank (the self source's offsets inside every expert are 0). One warp per
// token, so the token's ids, positions and row starts are one round of parallel loads; blocks of
// 1024 threads per budgeted SM for bf16 (the bare read-once-write-K kernel's warps per SM).
// Given `host_info` (a synchronous call launched before its host wait), the last warp publishes
// the layout kernel's receive layout to the host, off the layout's critical path.
template <int kFmt>
struct DispatchLocalThreads {
    static constexpr int value = kFmt == fp8::kWireBf16 ? 1024 : kDispatchThreads;
};

template <int kTopk, bool kCached, typename IdxT, int kFmt, bool kDequant>
__global__ void __launch_bounds__(DispatchLocalThreads<kFmt>::value) dispatch_local(
    const __grid_constant__ DispatchLocalArgs<IdxT> args) {
    u8* const recv_x = args.recv_x;
    u8* const recv_scales = args.recv_scales;
    float* const recv_weights = args.recv_weights;
    const int max_rows = args.max_rows, hidden = args.hidden;
    const int* const num_recv_tokens_per_expert = args.num_recv_tokens_per_expert;
    const int* const expert_row_start = args.expert_row_start;
    int* const slot_rows = args.slot_rows;
    const u8* const x = args.x;
    const u8* const x_scales = args.x_scales;
    const float amax_epsilon = args.amax_epsilon;
    const IdxT* const topk_idx = args.topk_idx;
    const float* const topk_weights = args.topk_weights;
    const int* const pos_in_expert = args.pos_in_expert;
    const int* const token_slot_in_rank = args.token_slot_in_rank;
    const int num_tokens = args.num_tokens, num_local = args.num_local;
    HostInfo* const host_info = args.host_info;
    const int* const tokens_per_expert = args.tokens_per_expert;
    const u32 host_epoch = args.host_epoch;
    static_assert(kTopk <= 32, "one lane per top-k entry");
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int num_warps = (gridDim.x * blockDim.x) >> 5;
    constexpr bool kFp8Out = kFmt != fp8::kWireBf16 && !kDequant;
    const RowBytes<kFmt, kDequant> sizes(hidden, x_scales != nullptr);
    const i64 row_bytes = sizes.out_row, in_row_bytes = sizes.in_row;
    const int scale_bytes = sizes.out_scales, in_scale_bytes = sizes.in_scales;
    extern __shared__ int4 dispatch_stage[];

    // FP8 rows quantized here (bf16 input, FP8 output), as the host's shared memory says:
    // - a row stage per warp: each warp quantizes a token row into it once, then writes the
    //   stage to the token's rows with 16-byte stores. A fresh dispatch quantizes each warp's
    //   first token before the wait for the layout kernel: the read of x and the arithmetic
    //   overlap the layout, as bf16's preload does;
    // - a scale stage per warp: each warp quantizes in registers and writes each chunk to the
    //   token's rows at once (quantize_row_to_lane_rows; less shared-memory traffic per row).
    u8* quant_stage = nullptr;
    u8* scale_stage = nullptr;
    int staged_token = -1;
    if (kFp8Out && x_scales == nullptr) {
        const int stride = fp8::stage_stride<kFmt>(hidden);
        const int scale_stride = fp8::scale_stage_stride<kFmt>(hidden);
        if (dynamic_smem_bytes() >= (u32)stride * (blockDim.x / 32))
            quant_stage = reinterpret_cast<u8*>(dispatch_stage) + (threadIdx.x >> 5) * stride;
        else if (dynamic_smem_bytes() >= (u32)scale_stride * (blockDim.x / 32))
            scale_stage =
                reinterpret_cast<u8*>(dispatch_stage) + (threadIdx.x >> 5) * scale_stride;
    }
    if (!kCached && quant_stage != nullptr && warp < num_tokens) {
        fp8::stage_quantized_row<kFmt>(reinterpret_cast<const int4*>(x + warp * in_row_bytes),
                                       hidden, quant_stage, amax_epsilon, lane);
        staged_token = warp;
    }

    // bf16: a token's first chunk is in flight while its ids and rows are loaded; the first
    // token's even before the wait for the layout kernel (launched programmatically after it,
    // this kernel may start while the layout still runs; x was complete before the layout).
    // A cached dispatch loads x only after the wait.
    constexpr bool kPreload = kFmt == fp8::kWireBf16;
    constexpr bool kPreloadBeforeWait = kPreload && !kCached;
    // The rest of that row, as far as the dynamic shared memory holds it, is copied into the
    // warp's stage meanwhile, so that less of the expand's reads meet its writes at HBM.
    int4 first[kCopyUnroll];
    int4* stage = nullptr;
    int stage_end = 0;  // the row's words below it come from `first` and `stage`
    if (kPreloadBeforeWait && warp < num_tokens) {
        const int4* row = reinterpret_cast<const int4*>(x + warp * in_row_bytes);
        load_chunk<false>(row, 0, hidden / 8, lane, first);
        const int words_per_warp = min(int(dynamic_smem_bytes() / 16 / (blockDim.x / 32)),
                                       32 * kDispatchStageWords);
        stage = dispatch_stage + (threadIdx.x >> 5) * words_per_warp;
        stage_end = min(hidden / 8, 32 * kCopyUnroll + words_per_warp);
        warp_stage_row(row, stage, stage_end, lane);
    }
    griddep_wait();
    if (host_info != nullptr && warp == num_warps - 1)
        warp_publish_host_info(host_info, tokens_per_expert, expert_row_start, num_local,
                               host_epoch, lane);

    // Padding rows, one expert per warp from the last warp down: the first warps take tokens.
    for (int e = num_warps - 1 - warp; e >= 0 && e < num_local; e -= num_warps)
        zero_padding_rows<kFp8Out, kCached>(e, recv_x, recv_scales, recv_weights, row_bytes,
                                            scale_bytes, max_rows, num_recv_tokens_per_expert,
                                            expert_row_start, lane);

    CachedRowsAhead<kTopk> cached_rows{token_slot_in_rank, slot_rows, num_tokens, num_warps,
                                       lane};
    if (kCached) cached_rows.start(warp);
    for (int n = warp; n < num_tokens; n += num_warps) {
        if (kPreload && (n != warp || !kPreloadBeforeWait))
            load_chunk<false>(reinterpret_cast<const int4*>(x + n * in_row_bytes), 0,
                              hidden / 8, lane, first);
        const int slot = kCached ? cached_rows.slot : token_slot_in_rank[n];
        if (kCached) cached_rows.before_read(n);
        const LocalEntry entry = load_local_entry<kTopk, kCached>(topk_idx, topk_weights,
                                                                  pos_in_expert, n, lane);
        if (quant_stage != nullptr && n != staged_token) {
            // Quantized while the token's routing loads above are in flight.
            __syncwarp();  // every lane has read the previous row from the stage
            fp8::stage_quantized_row<kFmt>(reinterpret_cast<const int4*>(x + n * in_row_bytes),
                                           hidden, quant_stage, amax_epsilon, lane);
        }
        const int cached_row = kCached ? cached_rows.take_row(n) : -1;
        if (slot < 0) continue;  // no expert on this rank: no rows, no slot
        const int row_lane =
            kCached ? cached_row
                    : (lane < kTopk ? local_entry_row(entry, slot_rows + (i64)slot * kTopk,
                                                      expert_row_start, num_local, max_rows,
                                                      recv_weights, lane)
                                    : -1);
        if (kPreload) {
            const bool staged = kPreloadBeforeWait && n == warp;
            if (staged) cp_async_wait_all();
            warp_copy_row_to_lane_rows<kTopk>(reinterpret_cast<const int4*>(x + n * in_row_bytes),
                                              first, recv_x, row_bytes, row_lane, hidden / 8,
                                              lane, stage, staged ? stage_end : 0);
            continue;
        }
        if (quant_stage != nullptr) {
            __syncwarp();  // the stage is complete before any lane reads another lane's part
            fp8::write_staged_row<kFmt, kTopk>(quant_stage, hidden, recv_x, recv_scales,
                                               row_lane, lane);
            continue;
        }
        if (scale_stage != nullptr) {
            fp8::quantize_row_to_lane_rows<kFmt, kTopk>(
                reinterpret_cast<const int4*>(x + n * in_row_bytes), hidden, recv_x, recv_scales,
                row_lane, scale_stage, amax_epsilon, lane);
            continue;
        }
        u8* dst[kTopk];
        u8* dst_scales[kTopk];
        const int num_dst = lane_rows_to_dsts<kTopk>(row_lane, recv_x, row_bytes, recv_scales,
                                                     scale_bytes, dst, dst_scales);
        if (num_dst > 0)
            write_row<kFmt, kDequant, kTopk, false>(
                x + n * in_row_bytes, x_scales ? x_scales + (i64)n * in_scale_bytes : nullptr,
                hidden, dst, dst_scales, num_dst, amax_epsilon, lane);
    }
    if (kPreloadBeforeWait) cp_async_wait_all();  // a token with no rows left its copies
}
