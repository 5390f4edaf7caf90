// The internode transport's work on one row (one warp each), shared by every node staging
// (internode/common.cuh lists the sources): a token packed into its network slot, a staged row
// expanded into the expert-major rows, partials summed, an expert rank's partial of a token.
// FP8 dispatch (kFmt != bf16): the send quantizes each row once (or copies a pre-quantized
// row), the network and the NVLink staging carry the wire row (e4m3 data, then its scales), and
// the expand dequantizes it or hands data and scales on.
#pragma once
#include "common/copy.cuh"
#include "common/fp8_row.cuh"
#include "common/recv_rows.cuh"
#include "common/row_dtype.cuh"
#include "internode/common.cuh"

// ------------------------------------------------------------------------------------ dispatch

// Writes token row i of x (bf16, or pre-quantized data + scales) as one wire row at `dst`.
template <int kFmt>
__device__ __forceinline__ void write_wire_row(const InternodeArgs& a, int i, u8* dst, int lane) {
    const int hidden = a.hidden;
    if (kFmt == fp8::kWireBf16) {
        int4* dsts[1] = {reinterpret_cast<int4*>(dst)};
        warp_copy_row<1, false>(reinterpret_cast<const int4*>(a.x + (i64)i * hidden * 2), dsts,
                                1, hidden * 2 / 16, lane);
    } else if (a.x_scales == nullptr) {
        u8* data[1] = {dst};
        u8* scales[1] = {dst + hidden};
        fp8::quantize_row<kFmt, 1, false>(reinterpret_cast<const int4*>(a.x + (i64)i * hidden * 2),
                                          hidden, data, scales, 1, a.amax_epsilon, lane);
    } else {
        const int scale_bytes = fp8::scale_row_bytes<kFmt>(hidden);
        u8* data[1] = {dst};
        u8* scales[1] = {dst + hidden};
        fp8::copy_fp8_row<kFmt, 1, false>(a.x + (i64)i * hidden,
                                          a.x_scales + (i64)i * scale_bytes, hidden, data,
                                          scales, 1, lane);
    }
}

// Packs node slot j of destination node m (token node_slot_token[m][j]) into the network slot
// `slot`: the wire row, then its NetRecord (the whole warp takes part).
template <int kTopk, bool kCached, typename IdxT, int kFmt>
__device__ __forceinline__ void pack_net_slot(const InternodeArgs& a, int m, int j, u8* slot,
                                              int lane) {
    const int R = a.num_ranks, L = a.ranks_per_node;
    const IdxT* const topk_idx = static_cast<const IdxT*>(a.topk_idx);
    const int i = a.node_slot_token[(i64)m * a.num_tokens + j];
    write_wire_row<kFmt>(a, i, slot, lane);
    NetRecord<kTopk>* rec = reinterpret_cast<NetRecord<kTopk>*>(slot + a.row_stride);
    if (lane == 0) rec->token = i;
    if (lane < kMaxRanksPerNode)
        rec->slot_in_rank[lane] = lane < L ? a.token_slot_in_rank[(i64)i * R + m * L + lane] : -1;
    if (lane < kTopk) {
        rec->expert[lane] = (int)topk_idx[(i64)i * kTopk + lane];
        rec->pos[lane] = a.pos_in_expert[(i64)i * kTopk + lane];
        rec->weight[lane] = kCached ? 0.f : a.topk_weights[(i64)i * kTopk + lane];
    }
}

// One staged row of source rank `s` (wire row `staged`, its SlotMeta at `meta`) into its
// expert-major rows, one warp: the rows from the receive layout (or, cached, from `my_rows`,
// which a fresh call fills for combine), the weights, then the copy (FP8 kept, dequantized, or
// bf16). Shared by internode_dispatch_recv (full staging) and the ring expand.
template <int kTopk, bool kCached, int kFmt, bool kDequant>
__device__ __forceinline__ void expand_staged_row(const InternodeArgs& a, const u8* staged,
                                                  const u8* meta_bytes, int* my_rows, int s,
                                                  int lane) {
    const int num_local = a.num_local, hidden = a.hidden;
    constexpr bool kFp8Out = kFmt != fp8::kWireBf16 && !kDequant;
    const i64 row_bytes = kFp8Out ? (i64)hidden : (i64)hidden * 2;
    const int scale_bytes = kFp8Out ? fp8::scale_row_bytes<kFmt>(hidden) : 0;
    int row_lane = -1;  // lane k: the row of entry k
    if (kCached) {
        if (lane < kTopk) row_lane = my_rows[lane];
    } else if (lane < kTopk) {
        const volatile SlotMeta<kTopk>* meta =
            reinterpret_cast<const volatile SlotMeta<kTopk>*>(meta_bytes);
        const int e = meta->local_expert[lane];
        if (e >= 0) {
            row_lane = a.expert_row_start[e] + a.src_expert_offset[s * num_local + e] +
                       meta->pos[lane];
            if (row_lane >= a.max_rows) row_lane = -1;  // overflow: reported by notify
        }
        my_rows[lane] = row_lane;
        if (row_lane >= 0) a.recv_weights[row_lane] = meta->weight[lane];
    }
    u8* dst[kTopk];
    u8* dst_scales[kTopk];
    const int num_dst = lane_rows_to_dsts<kTopk>(row_lane, a.recv_x, row_bytes, a.recv_scales,
                                                 scale_bytes, dst, dst_scales);
    if (kFmt == fp8::kWireBf16)
        warp_copy_row<kTopk, true>(reinterpret_cast<const int4*>(staged),
                                   reinterpret_cast<int4* const*>(dst), num_dst,
                                   hidden * 2 / 16, lane);
    else if (kDequant)
        fp8::dequant_fp8_row<kFmt, kTopk, true>(staged, staged + hidden, hidden,
                                                reinterpret_cast<int4* const*>(dst), num_dst,
                                                lane);
    else
        fp8::copy_fp8_row<kFmt, kTopk, true>(staged, staged + hidden, hidden, dst,
                                             dst_scales, num_dst, lane);
}

// ------------------------------------------------------------------------------------ combine

// Adds the kDtype row `src` (16-byte words [base, base + 32 * kCopyUnroll) of a lane) to `acc`
// in fp32, times `scale` when kScaled.
template <int kDtype, bool kScaled>
__device__ __forceinline__ void accumulate_chunk(float (*acc)[8], const int4* src, int base,
                                                 int num_int4, int lane, float scale) {
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i < num_int4) accumulate_word<kDtype, kScaled>(acc[u], ld_cg_v4(src + i), scale);
    }
}

// The lane's words of `acc`, rounded once to kDtype, into the row `dst`.
template <int kDtype>
__device__ __forceinline__ void store_chunk_rows(int4* dst, float (*acc)[8], int base,
                                                 int num_int4, int lane) {
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
        const int i = base + u * 32 + lane;
        if (i < num_int4) st_v4(dst + i, pack_word<kDtype>(acc[u]));
    }
}

__device__ __forceinline__ void zero_acc(float (*acc)[8]) {
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u)
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[u][c] = 0.f;
}

// Sums the partial slots `src[0 .. num_src)` (each a kDtype row, then K fp32 routing-weight
// gradients at +row_stride) in the given order in fp32: the rounded row to `dst`, with
// kWithWeights the K sums to `dst_weights`. The whole warp takes part.
template <int kTopk, bool kWithWeights, int kDtype>
__device__ __forceinline__ void warp_sum_partials(const u8* const* src, int num_src,
                                                  i64 row_stride, int4* dst, float* dst_weights,
                                                  int num_int4, int lane) {
    for (int base = 0; base < num_int4; base += 32 * kCopyUnroll) {
        float acc[kCopyUnroll][8];
        zero_acc(acc);
        for (int s = 0; s < num_src; ++s)
            accumulate_chunk<kDtype, false>(acc, reinterpret_cast<const int4*>(src[s]), base,
                                            num_int4, lane, 1.f);
        store_chunk_rows<kDtype>(dst, acc, base, num_int4, lane);
    }
    if (kWithWeights && lane < kTopk) {
        float sum = 0.f;
        for (int s = 0; s < num_src; ++s) {
            const volatile float* weights =
                reinterpret_cast<const volatile float*>(src[s] + row_stride);
            sum = __fadd_rn(sum, weights[lane]);
        }
        dst_weights[lane] = sum;
    }
}

// The partial of one token on an expert rank, one warp: its rows `rows [K]` (-1: none) summed
// in k order in fp32 (weighted if asked), rounded once into `dst`, and with kWithWeights the
// per-k routing-weight gradients after the row. Shared by internode_combine_send (full staging)
// and the combine ring's producers.
template <int kTopk, bool kWeighted, bool kWithWeights, int kDtype>
__device__ __forceinline__ void write_partial(const InternodeArgs& a, const int* rows, u8* dst,
                                              int lane) {
    const int num_int4 = a.hidden * 2 / 16;
    const int4* const y = reinterpret_cast<const int4*>(a.y);
    for (int base = 0; base < num_int4; base += 32 * kCopyUnroll) {
        float acc[kCopyUnroll][8];
        zero_acc(acc);
#pragma unroll
        for (int k = 0; k < kTopk; ++k) {
            const int row = rows[k];
            if (row < 0) continue;
            const float w = kWeighted ? a.recv_weights[row] : 1.f;
            accumulate_chunk<kDtype, kWeighted>(acc, y + (i64)row * num_int4, base, num_int4,
                                                lane, w);
        }
        store_chunk_rows<kDtype>(reinterpret_cast<int4*>(dst), acc, base, num_int4, lane);
    }
    if (kWithWeights && lane < kTopk) {
        const int row = rows[lane];
        reinterpret_cast<float*>(dst + a.row_stride)[lane] =
            row >= 0 ? a.grad_row_weights[row] : 0.f;
    }
}
