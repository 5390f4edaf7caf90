// Ring staging's producers and consumers (docs/internode.md, "Ring staging"), which the network
// ring reuses (internode/ring.cu, internode/net_ring.cu): the ring words and positions, a row
// written into a dispatch ring and expanded out of it, a partial written into a combine ring
// and the forwarder's sum of a token's partials.
// ring_seen (local u64 [4][8]): positions so far, [0] dispatch rings to each node rank, [1]
// dispatch rings from each forwarder, [2] combine rings to each forwarder, [3] combine rings
// from each node rank; each kernel's last block advances them by the call's rows.
#pragma once
#include "internode/common.cuh"
#include "internode/ring.cuh"
#include "internode/rows.cuh"

// Error-record phases (transport/errors.py names them; 15-18 wait on ring words).
constexpr int kPhaseInRingCount = 14, kPhaseInRingForward = 15, kPhaseInRingExpand = 16,
              kPhaseInRingCombineSend = 17, kPhaseInRingCombineForward = 18,
              kPhaseInRingCombineAck = 19;
// ring_words [4][L][S]: which word, then the ring (the peer's local index), then the slot.
constexpr int kRingDispReady = 0, kRingDispFreed = 1, kRingCombReady = 2, kRingCombFreed = 3;
constexpr int kSeenDispSent = 0, kSeenDispRecv = 1, kSeenCombSent = 2, kSeenCombRecv = 3;

// Word `which` of ring `ring` for position `pos`, in the symmetric block `block` (this rank's
// or a node peer's).
__device__ __forceinline__ u64* ring_word(u8* block, const InternodeArgs& a, int which, int ring,
                                          u64 pos) {
    return reinterpret_cast<u64*>(block + a.ring_words) +
           ((i64)which * a.ranks_per_node + ring) * a.ring_slots + (i64)(pos % (u64)a.ring_slots);
}

__device__ __forceinline__ u64* ring_seen(const InternodeArgs& a, int which, int t) {
    return a.ring_seen + which * kMaxRanksPerNode + t;
}

// A ring kernel's last block: advances my ring positions by the call's rows. A dispatch ring
// carries `ring_base` rows to each node rank and `src_start [L][M + 1]` (ring_source_prefix)
// rows from each forwarder; the combine rings carry them back.
__device__ void advance_rings(const InternodeArgs& a, const int (*src_start)[kMaxNodes + 1],
                              bool combine) {
    const int L = a.ranks_per_node, M = a.num_nodes;
    for (int t = 0; t < L; ++t) {
        const u64 to_node_rank = (u64)a.ring_base[t * (M + 1) + M];
        const u64 from_forwarder = (u64)src_start[t][M];
        *ring_seen(a, combine ? kSeenCombSent : kSeenDispSent, t) +=
            combine ? from_forwarder : to_node_rank;
        *ring_seen(a, combine ? kSeenCombRecv : kSeenDispRecv, t) +=
            combine ? to_node_rank : from_forwarder;
    }
}

// start[u][n + 1] = start[u][n] + the tokens source (node n, local u) sent me (threads u < L):
// where each source node's rows begin in the rings between me and node rank u.
__device__ __forceinline__ void ring_source_prefix(const InternodeArgs& a,
                                                   int (*start)[kMaxNodes + 1]) {
    const int L = a.ranks_per_node, u = threadIdx.x;
    if (u >= L) return;
    start[u][0] = 0;
    for (int n = 0; n < a.num_nodes; ++n)
        start[u][n + 1] = start[u][n] + a.num_recv_tokens_per_rank[n * L + u];
}

// Writes the network slot `slot` (a wire row, then its NetRecord) into slot pos % S of node
// rank t's ring from me (t's block: `peer`): the row and its SlotMeta as internode_forward
// writes them into the full staging. The whole warp takes part.
template <int kTopk>
__device__ __forceinline__ void ring_write_row(const InternodeArgs& a, int t, const u8* slot,
                                               u64 pos, u8* peer, int lane) {
    const int L = a.ranks_per_node, local = a.rank % L, num_local = a.num_local;
    const int d = (a.rank / L) * L + t;
    const int num_int4 = (int)((a.wire_bytes + 15) / 16);  // within row_stride
    const i64 c = (i64)local * a.ring_slots + (i64)(pos % (u64)a.ring_slots);
    const volatile NetRecord<kTopk>* rec =
        reinterpret_cast<const volatile NetRecord<kTopk>*>(slot + a.row_stride);
    SlotMeta<kTopk>* meta =
        reinterpret_cast<SlotMeta<kTopk>*>(peer + a.stage_meta + c * a.meta_stride);
    if (lane < kTopk) {
        const int id = rec->expert[lane];
        const bool here = id >= 0 && id / num_local == d;
        meta->local_expert[lane] = here ? id - d * num_local : -1;
        meta->pos[lane] = here ? rec->pos[lane] : -1;
        meta->weight[lane] = rec->weight[lane];
    } else if (lane == kTopk) {
        meta->token = rec->token;
    }
    int4* dst[1] = {reinterpret_cast<int4*>(peer + a.stage_rows + c * a.row_stride)};
    warp_copy_row<1, true>(reinterpret_cast<const int4*>(slot), dst, 1, num_int4, lane);
}

// Consumer warp `index` of `per_group` of ring (forwarder u -> me): positions in order (strided
// over the group); each staged row of source (node n, local u), slot j, expanded as
// internode_dispatch_recv does, then its slot freed on the forwarder.
template <int kTopk, bool kCached, int kFmt, bool kDequant>
__device__ __forceinline__ void ring_expand_rows(const InternodeArgs& a, int u, int index,
                                                 int per_group, u8* const* peers,
                                                 const int* start, const ErrorState& err,
                                                 int lane) {
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    const int S = a.ring_slots;
    const u64 first_pos = *ring_seen(a, kSeenDispRecv, u);
    const u8* const rows = a.heap + a.stage_rows + (i64)u * S * a.row_stride;
    const u8* const metas = a.heap + a.stage_meta + (i64)u * S * a.meta_stride;
    ring::PendingWords pending;
    for (int q = index; q < start[M]; q += per_group) {
        const int n = find_segment(start, M, q);
        const int j = q - start[n], s = n * L + u;
        const u64 pos = first_pos + (u64)q;
        if (!ring::warp_wait_word(ring_word(a.heap, a, kRingDispReady, u, pos), pos + 1, pending,
                                  a.timeout_ns, err, a.rank, node * L + u, kPhaseInRingExpand,
                                  lane))
            return;
        const i64 c = (i64)(pos % (u64)S);
        const u8* staged = rows + c * a.row_stride;
        int* my_rows = a.slot_rows + ((i64)s * N_max + j) * kTopk;
        expand_staged_row<kTopk, kCached, kFmt, kDequant>(a, staged, metas + c * a.meta_stride,
                                                          my_rows, s, lane);
        pending.add(ring_word(peers[u], a, kRingDispFreed, local, pos), pos + 1, lane);
    }
    pending.flush(lane);
}

// Producer warp `index` of `per_group` of combine ring (me -> forwarder u): the partial of each
// token I received from source (node n, local u), in position order, as internode_combine_send
// computes it, into slot pos % S of u's ring [me] once position pos - S is consumed.
template <int kTopk, bool kWeighted, bool kWithWeights, int kDtype>
__device__ __forceinline__ void ring_partials(const InternodeArgs& a, int u, int index,
                                              int per_group, u8* const* peers, const int* start,
                                              const ErrorState& err, int lane) {
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    const int S = a.ring_slots;
    const i64 comb_stride = a.row_stride + a.weight_stride;
    const u64 first_pos = *ring_seen(a, kSeenCombSent, u);
    u8* const ring_rows = peers[u] + a.comb_stage + (i64)local * S * comb_stride;
    ring::PendingWords pending;
    for (int q = index; q < start[M]; q += per_group) {
        const int n = find_segment(start, M, q);
        const int j = q - start[n], s = n * L + u;
        const u64 pos = first_pos + (u64)q;
        if (!ring::warp_wait_word(ring_word(a.heap, a, kRingCombFreed, u, pos),
                                  ring::space_needed(pos, S), pending, a.timeout_ns, err, a.rank,
                                  node * L + u, kPhaseInRingCombineSend, lane))
            return;
        const int* rows = a.slot_rows + ((i64)s * N_max + j) * kTopk;
        u8* const dst = ring_rows + (i64)(pos % (u64)S) * comb_stride;
        write_partial<kTopk, kWeighted, kWithWeights, kDtype>(a, rows, dst, lane);
        pending.add(ring_word(peers[u], a, kRingCombReady, local, pos), pos + 1, lane);
    }
    pending.flush(lane);
}

// Forwarded token (source node n, slot j): this node's partials of it from their rings
// (ascending local rank, as internode_combine_forward sums them) summed into `dst` (the row,
// then the K weight sums), their ring slots freed (pending). The whole warp takes part; false
// after a failed wait.
template <int kTopk, bool kWithWeights, int kDtype>
__device__ __forceinline__ bool ring_sum_token(const InternodeArgs& a, int n, int j, u8* dst,
                                               u8* const* peers, ring::PendingWords& pending,
                                               const ErrorState& err, int lane) {
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    const int S = a.ring_slots, num_int4 = a.hidden * 2 / 16;
    const i64 comb_stride = a.row_stride + a.weight_stride;
    const int* slots = a.fwd_slots + ((i64)n * N_max + j) * L;
    const u8* src[kMaxRanksPerNode];
    u64 src_pos[kMaxRanksPerNode];
    int src_rank[kMaxRanksPerNode];
    int num_src = 0;
    for (int t = 0; t < L; ++t) {
        if (slots[t] < 0) continue;
        const u64 pos = *ring_seen(a, kSeenCombRecv, t) +
                        (u64)(a.ring_base[t * (M + 1) + n] + slots[t]);
        if (!ring::warp_wait_word(ring_word(a.heap, a, kRingCombReady, t, pos), pos + 1, pending,
                                  a.timeout_ns, err, a.rank, node * L + t,
                                  kPhaseInRingCombineForward, lane))
            return false;
        src[num_src] = a.heap + a.comb_stage + ((i64)t * S + (i64)(pos % (u64)S)) * comb_stride;
        src_pos[num_src] = pos;
        src_rank[num_src++] = t;
    }
    warp_sum_partials<kTopk, kWithWeights, kDtype>(src, num_src, a.row_stride,
                                                   reinterpret_cast<int4*>(dst),
                                                   reinterpret_cast<float*>(dst + a.row_stride),
                                                   num_int4, lane);
    for (int k = 0; k < num_src; ++k)
        pending.add(ring_word(peers[src_rank[k]], a, kRingCombFreed, local, src_pos[k]),
                    src_pos[k] + 1, lane);
    return true;
}
