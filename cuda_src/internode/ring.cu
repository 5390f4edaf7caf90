// Ring staging of the internode transport (MDEEP_INTERNODE_STAGING=ring; docs/internode.md,
// "Ring staging"; internode/common.cuh describes the transport): the same protocol as full
// staging, with the node's staging bounded to L rings of S = ring_slots slots per rank whatever
// R and N_max (internode/ring.cuh: positions, ready and freed words). Dispatch ring (u -> t):
// forwarder u streams the rows its rail peers sent that go to node rank t, ordered by (source
// node, slot on t), into t's stage_rows / stage_meta [u][S]. Combine ring (t -> u): expert rank
// t streams its partials of the tokens forwarder u sent it, in the same order, into u's
// comb_stage [t][S].
// The network leg, notify, send and reduce are the full staging's kernels (internode/common.cuh,
// internode/send_reduce.cuh). Kernels of ring staging alone:
//   internode_ring_count     (forwarder) rows per (node rank, source node), as ring_base
//   internode_ring_dispatch  forward and expand in one persistent kernel: the producer and the
//                            consumer warps of every ring run at once, since a producer may wait
//                            for space that only a consumer of the same call frees
//   internode_ring_combine   the partials and the forwarder's sums in one kernel, likewise
// Built by megatron_deepep/kernels/nvshmem_link.py; launched by the ops.internode_* wrappers.
#include "internode/common.cuh"
#include "internode/ring_rows.cuh"
#include "internode/rows.cuh"
#include "internode/send_reduce.cuh"

// The warp waits until signals[n] >= base[n] + extra(n) for every other node n (lane n; the
// peer named on a timeout is the rail peer); returns the same in every lane.
template <typename Extra>
__device__ __forceinline__ bool warp_wait_rail(u64* signals, const u64* base, Extra extra,
                                               const InternodeArgs& a, const ErrorState& err,
                                               int phase, int lane) {
    const int L = a.ranks_per_node, node = a.rank / L;
    bool failed = false;
    if (lane < a.num_nodes && lane != node) {
        const u64 target = (base != nullptr ? base[lane] : 0) + extra(lane);
        failed = !net::wait_signal_ge(signals + lane, target, a.timeout_ns, err, a.rank,
                                      lane * L + a.rank % L, phase);
    }
    const bool any_failed = __any_sync(ring::kFullMask, failed);
    __syncwarp();
    return !any_failed;
}

// Roles of the persistent ring kernels: 2 L groups of `per_group` warps each (warp w is warp
// `index` = w / 2L of group w % 2L; the < 2 L spare warps idle). Dedicated warps per ring and
// side make every ring progress on its own (docs/internode.md, "Deadlock"); a block has 16
// warps >= 2 L, so any grid gives every group a warp.
struct RingRoles {
    int group, index, per_group;
    __device__ explicit RingRoles(int L) {
        const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
        const int num_warps = (gridDim.x * blockDim.x) >> 5;
        group = warp % (2 * L);
        index = warp / (2 * L);
        per_group = num_warps / (2 * L);
    }
};

// Grid: one block per source node n. Counts the rows the rail peer on node n sent (once they
// landed) that go to each rank t of this node into ring_base[t][n + 1]; the last block turns
// the counts into prefixes over n (ring_base[t][0] = 0). A column slot_in_rank[t] is dense
// (0 .. count - 1, in token order), so node n's rows take positions ring_base[t][n] +
// slot_in_rank[t] of the call's stream to t, in increasing order.
template <int kTopk>
__global__ void __launch_bounds__(kInternodeThreads) internode_ring_count(
    const __grid_constant__ InternodeArgs a) {
    const ErrorState err{a.error_claim, a.error_record};
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    const i64 slot_stride = a.row_stride + a.record_stride;
    const int n = blockIdx.x;
    __shared__ int count[kMaxRanksPerNode];
    __shared__ int failed;
    if (threadIdx.x < L) count[threadIdx.x] = 0;
    if (threadIdx.x == 0) {
        failed = 0;
        const u64 target = a.chunks_seen[n] + (u64)num_chunks(a.fwd_count[n], C);
        if (n != node && !net::wait_signal_ge(Signals(a).disp + n, target, a.timeout_ns, err,
                                              a.rank, n * L + local, kPhaseInRingCount))
            failed = 1;
    }
    __syncthreads();
    for (int j = threadIdx.x; !failed && j < a.fwd_count[n]; j += blockDim.x) {
        const volatile NetRecord<kTopk>* rec = reinterpret_cast<const volatile NetRecord<kTopk>*>(
            a.heap + a.net_recv + ((i64)n * N_max + j) * slot_stride + a.row_stride);
        for (int t = 0; t < L; ++t)
            if (rec->slot_in_rank[t] >= 0) atomicAdd(&count[t], 1);
    }
    __syncthreads();
    if (threadIdx.x < L) a.ring_base[threadIdx.x * (M + 1) + n + 1] = count[threadIdx.x];
    if (last_block_done(&a.block_counters[5]) && !has_error(err)) {
        for (int t = 0; t < L; ++t) {
            volatile int* base = a.ring_base + t * (M + 1);
            base[0] = 0;
            for (int m = 0; m < M; ++m) base[m + 1] = base[m + 1] + base[m];
        }
    }
}

// Producer warp `index` of `per_group` of ring (me -> t): every record whose token goes to t,
// in record order (so in position order), batches of 32 records strided over the group; each
// row and its SlotMeta (as internode_forward writes them) into slot pos % S of t's ring [me],
// once position pos - S is consumed. Keeps each record's slot on t for combine (fwd_slots).
template <int kTopk>
__device__ __forceinline__ void ring_forward_rows(const InternodeArgs& a, int t, int index,
                                                  int per_group, u8* const* peers,
                                                  const int* tok_start, const ErrorState& err,
                                                  int lane) {
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    const int S = a.ring_slots, total = tok_start[M];
    const i64 slot_stride = a.row_stride + a.record_stride;
    const u64 first_pos = *ring_seen(a, kSeenDispSent, t);
    const int* base = a.ring_base + t * (M + 1);
    const int d = node * L + t;
    ring::PendingWords pending;
    for (int first = index * 32; first < total; first += per_group * 32) {
        const int i = first + lane;
        int n = 0, j = 0, dst_slot = -1;
        if (i < total) {
            n = find_segment(tok_start, M, i);
            j = i - tok_start[n];
            const volatile NetRecord<kTopk>* rec =
                reinterpret_cast<const volatile NetRecord<kTopk>*>(
                    a.heap + a.net_recv + ((i64)n * N_max + j) * slot_stride + a.row_stride);
            dst_slot = rec->slot_in_rank[t];
            a.fwd_slots[((i64)n * N_max + j) * L + t] = dst_slot;
        }
        for (u32 todo = __ballot_sync(ring::kFullMask, dst_slot >= 0); todo != 0;
             todo &= todo - 1) {
            const int from = __ffs(todo) - 1;
            const int rn = __shfl_sync(ring::kFullMask, n, from);
            const int rj = __shfl_sync(ring::kFullMask, j, from);
            const int rslot = __shfl_sync(ring::kFullMask, dst_slot, from);
            const u64 pos = first_pos + (u64)(base[rn] + rslot);
            if (!ring::warp_wait_word(ring_word(a.heap, a, kRingDispFreed, t, pos),
                                      ring::space_needed(pos, S), pending, a.timeout_ns, err,
                                      a.rank, d, kPhaseInRingForward, lane))
                return;
            const u8* slot = a.heap + a.net_recv + ((i64)rn * N_max + rj) * slot_stride;
            ring_write_row<kTopk>(a, t, slot, pos, peers[t], lane);
            pending.add(ring_word(peers[t], a, kRingDispReady, local, pos), pos + 1, lane);
        }
    }
    pending.flush(lane);
}

// Grid: a persistent grid of at most one block per SM (co-resident). Producer groups t < L
// forward the rows to node rank t; consumer groups L + u expand the rows from forwarder u. The
// last block advances the ring positions and the chunk totals, and acknowledges the rail
// peers (their send may reuse the network slots) as internode_forward does.
template <int kTopk, bool kCached, int kFmt, bool kDequant>
__global__ void __launch_bounds__(kInternodeThreads) internode_ring_dispatch(
    const __grid_constant__ InternodeArgs a) {
    const ErrorState err{a.error_claim, a.error_record};
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    constexpr bool kFp8Out = kFmt != fp8::kWireBf16 && !kDequant;
    const i64 row_bytes = kFp8Out ? (i64)a.hidden : (i64)a.hidden * 2;
    const int scale_bytes = kFp8Out ? fp8::scale_row_bytes<kFmt>(a.hidden) : 0;
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int num_warps = (gridDim.x * blockDim.x) >> 5;
    const Signals sig(a);
    __shared__ u8* peers[kMaxRanksPerNode];
    __shared__ int tok_start[kMaxNodes + 1];
    __shared__ int src_start[kMaxRanksPerNode][kMaxNodes + 1];
    if (threadIdx.x == 0) exclusive_chunk_prefix(a.fwd_count, M, 1, tok_start);
    ring_source_prefix(a, src_start);
    const bool ok = map_node_peers(a, peers, err, kPhaseInRingForward);  // syncs the block
    for (int e = warp; e < a.num_local; e += num_warps)
        zero_padding_rows<kFp8Out, kCached>(e, a.recv_x, a.recv_scales, a.recv_weights, row_bytes,
                                            scale_bytes, a.max_rows, a.num_recv_tokens_per_expert,
                                            a.expert_row_start, lane);
    const RingRoles role(L);
    if (ok && role.index < role.per_group) {
        if (role.group < L) {
            // internode_ring_count waited for these chunks; this returns at once and gives the
            // warp NVSHMEM's post-wait ordering before it reads them.
            const auto chunks_from = [&](int n) {
                return (u64)num_chunks(a.fwd_count[n], a.chunk_tokens);
            };
            if (warp_wait_rail(sig.disp, a.chunks_seen, chunks_from, a, err, kPhaseInRingCount,
                               lane))
                ring_forward_rows<kTopk>(a, role.group, role.index, role.per_group, peers,
                                         tok_start, err, lane);
        } else {
            const int u = role.group - L;
            ring_expand_rows<kTopk, kCached, kFmt, kDequant>(a, u, role.index, role.per_group,
                                                             peers, src_start[u], err, lane);
        }
    }
    if (last_block_done(&a.block_counters[6]) && !has_error(err)) {
        advance_rings(a, src_start, false);
        ack_rail_peers(a, a.chunks_seen, a.fwd_count, sig.disp_ack);
    }
}

// Consumer warp `index` of `num_consumers` (the forwarder's sums): whole network chunks of
// forwarded tokens, strided, in token order; per token the partials of this node's ranks from
// their rings (ascending local rank, as internode_combine_forward sums them), the sum into the
// network slot, the ring slots freed; then the chunk put to the source's rail peer.
template <int kTopk, bool kWithWeights, int kDtype>
__device__ __forceinline__ void ring_node_sums(const InternodeArgs& a, int index,
                                               int num_consumers, u8* const* peers,
                                               const int* chunk_start, const ErrorState& err,
                                               int lane) {
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    const i64 comb_stride = a.row_stride + a.weight_stride;
    const Signals sig(a);
    // Rail peers consumed the previous combine's rows (comb_send and their comb_recv).
    const u64 previous = epoch_of(a) - 1u;
    if (!warp_wait_rail(sig.comb_ack, nullptr, [&](int) { return previous; }, a, err,
                        kPhaseInRingCombineAck, lane))
        return;
    ring::PendingWords pending;
    for (int item = index; item < chunk_start[M]; item += num_consumers) {
        const int n = find_segment(chunk_start, M, item);
        const int first = (item - chunk_start[n]) * C;
        const int last = min(a.fwd_count[n], first + C);
        const bool own = n == node;
        u8* const region = a.heap + (own ? a.comb_recv + (i64)node * N_max * comb_stride
                                         : a.comb_send + (i64)n * N_max * comb_stride);
        for (int j = first; j < last; ++j)
            if (!ring_sum_token<kTopk, kWithWeights, kDtype>(
                    a, n, j, region + (i64)j * comb_stride, peers, pending, err, lane))
                return;
        __threadfence_system();  // the network engine reads the chunk from outside the SMs
        __syncwarp();
        if (!own && last > first)
            net::put_signal_warp(a.heap + a.comb_recv + ((i64)node * N_max + first) * comb_stride,
                                 region + (i64)first * comb_stride,
                                 (size_t)(last - first) * comb_stride, sig.comb + node, 1,
                                 a.pe_of_rank[n * L + local], net::Signal::kAdd);
    }
    pending.flush(lane);
    __syncwarp();
    if (lane == 0) net::quiet();
}

// Grid: a persistent grid of at most one block per SM (co-resident). Producer groups u < L send
// the partials to forwarder u; the L consumer groups together sum this rank's forwarded tokens
// and put them back by chunks (internode_combine_reduce then runs as with full staging).
template <int kTopk, bool kWeighted, bool kWithWeights, int kDtype>
__global__ void __launch_bounds__(kInternodeThreads) internode_ring_combine(
    const __grid_constant__ InternodeArgs a) {
    const ErrorState err{a.error_claim, a.error_record};
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    const int lane = threadIdx.x & 31;
    __shared__ u8* peers[kMaxRanksPerNode];
    __shared__ int chunk_start[kMaxNodes + 1];
    __shared__ int src_start[kMaxRanksPerNode][kMaxNodes + 1];
    if (threadIdx.x == 0) exclusive_chunk_prefix(a.fwd_count, M, C, chunk_start);
    ring_source_prefix(a, src_start);
    const bool ok = map_node_peers(a, peers, err, kPhaseInRingCombineSend);  // syncs the block
    const RingRoles role(L);
    if (ok && role.index < role.per_group) {
        if (role.group < L)
            ring_partials<kTopk, kWeighted, kWithWeights, kDtype>(
                a, role.group, role.index, role.per_group, peers, src_start[role.group], err,
                lane);
        else
            ring_node_sums<kTopk, kWithWeights, kDtype>(a, role.index * L + role.group - L,
                                                        role.per_group * L, peers, chunk_start,
                                                        err, lane);
    }
    if (last_block_done(&a.block_counters[7]) && !has_error(err)) {
        advance_rings(a, src_start, true);
    }
}
