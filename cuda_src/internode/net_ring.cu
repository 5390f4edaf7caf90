// The network ring of the internode transport (MDEEP_INTERNODE_NET_RING_CHUNKS = K > 0, with
// ring staging; docs/internode.md, "Network ring"; internode/common.cuh describes the
// transport): net_send / net_recv (dispatch) and comb_send / comb_recv (combine) hold [M][K]
// chunk slots of C = chunk_tokens network slots each, whatever N_max (internode/net_ring.cuh:
// chunk numbers, ready and credit words). Dispatch streams: me -> my rail peer on each node m
// (chunk c of the call: my node slots [c C, c C + C) for m); combine streams: forwarder ->
// source (the forwarded tokens' sums, chunked as dispatch chunked them). Each includes the
// stream to my own node (local words, packed in place). Chunk totals: net_sent (local u64
// [2][M], sent to each node) and chunks_seen (received from each node), advanced by each
// kernel's last block.
// Kernels (node layout and notify from internode/common.cuh, where notify also fills ring_base
// from the rail counts; the ring producers and consumers from internode/ring_rows.cuh):
//   internode_net_dispatch  senders + ring forward + ring expand in one persistent kernel: a
//                           sender may wait for a credit that only its rail peer's forwarder of
//                           the same call returns, while that rank's own sender may be waiting
//                           for this rank's forwarder
//   internode_net_combine   ring partials + the forwarder's sums (one put per chunk) + the
//                           source's reduce, likewise
// Roles: 3 L groups of warps (warp w in group w mod 3L): kind = group / L (0: senders or, in
// combine, partial producers; 1: ring forward or node sums; 2: ring expand or reduce), sub =
// group mod L (the ring's node rank where a ring is meant).
// Built by megatron_deepep/kernels/nvshmem_link.py; launched by the ops.internode_* wrappers.
#include "internode/common.cuh"
#include "internode/net_ring.cuh"
#include "internode/ring_rows.cuh"
#include "internode/rows.cuh"

constexpr int kPhaseInNetSend = 21, kPhaseInNetForward = 22, kPhaseInNetCombineSend = 23,
              kPhaseInNetReduce = 24;
// net_words [4][M][K]: which word, then the rail peer's node, then the slot.
constexpr int kNetDispReady = 0, kNetDispCredit = 1, kNetCombReady = 2, kNetCombCredit = 3;
constexpr int kNetGroupsPerRank = 3;  // ops.NET_ROLE_GROUPS_PER_RANK

// Word `which` of the stream between this rank and its rail peer on node `node`, for chunk
// `g`, in the symmetric block `block` (a signal's symmetric address is this rank's).
__device__ __forceinline__ u64* net_word(u8* block, const InternodeArgs& a, int which, int node,
                                         u64 g) {
    return reinterpret_cast<u64*>(block + a.net_words) +
           ((i64)which * a.num_nodes + node) * a.net_chunks + (i64)(g % (u64)a.net_chunks);
}

// Consumers done with received chunk g from node `node` (local u32 [2][M][K]; 0: dispatch,
// counting forward groups, 1: combine, counting reduced rows).
__device__ __forceinline__ u32* net_counter(const InternodeArgs& a, int which, int node, u64 g) {
    return reinterpret_cast<u32*>(a.heap + a.net_counters) +
           ((i64)which * a.num_nodes + node) * a.net_chunks + (i64)(g % (u64)a.net_chunks);
}

// First slot of chunk g's slot for node `node` in the region at `offset` (slots of `stride`).
__device__ __forceinline__ u8* net_chunk(u8* block, i64 offset, const InternodeArgs& a,
                                         int node, u64 g, i64 stride) {
    const i64 slot = (i64)node * a.net_chunks + (i64)(g % (u64)a.net_chunks);
    return block + offset + slot * a.chunk_tokens * stride;
}

// A network-ring kernel's last block: advances the chunk totals of my streams by the call's.
// Dispatch sends my tokens for each node (num_tokens_per_node) and receives my rail peers'
// (fwd_count); combine sends the forwarded tokens' sums back and receives my tokens' sums.
__device__ void advance_net_streams(const InternodeArgs& a, bool combine) {
    const int M = a.num_nodes, C = a.chunk_tokens;
    for (int n = 0; n < M; ++n) {
        const u64 mine = num_chunks(a.num_tokens_per_node[n], C);
        const u64 forwarded = num_chunks(a.fwd_count[n], C);
        a.net_sent[(combine ? M : 0) + n] += combine ? forwarded : mine;
        a.chunks_seen[(combine ? M : 0) + n] += combine ? mine : forwarded;
    }
}

// A warp's role in the network ring's kernels (the roles above). Every role gets its own warps
// (3 L groups of equal size; the < 3 L spare warps idle), so no role waits behind another's
// wait: the deadlock argument (docs/internode.md, "Network ring") needs each role to progress.
struct NetRoles {
    int kind, sub, index, per_group;
    __device__ explicit NetRoles(int L) {
        const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
        const int num_warps = (gridDim.x * blockDim.x) >> 5;
        const int groups = kNetGroupsPerRank * L, group = warp % groups;
        kind = group / L;
        sub = group % L;
        index = warp / groups;
        per_group = num_warps / groups;
    }
};

// Sender warp `member` of `members`: my chunks for every node, chunk-major (item c M + m is
// chunk c of node m; strided over the senders, so every rail peer's stream advances at once
// and each warp takes its chunks in increasing (c, m), which the deadlock argument needs).
// Each chunk is packed (as internode_dispatch_send packs) into its send slot once chunk g - K
// was consumed, then put with its ready word; my own node's straight into my receive slot.
template <int kTopk, bool kCached, typename IdxT, int kFmt>
__device__ __forceinline__ void net_send_chunks(const InternodeArgs& a, int member, int members,
                                                const ErrorState& err, int lane) {
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    const int K = a.net_chunks;
    const i64 slot_stride = a.row_stride + a.record_stride;
    const int lane_chunks = lane < M ? num_chunks(a.num_tokens_per_node[lane], C) : 0;
    const int max_chunks = __reduce_max_sync(ring::kFullMask, lane_chunks);
    ring::PendingWords none;  // senders publish no ring words
    for (int item = member; item < max_chunks * M; item += members) {
        const int c = item / M, m = item % M;
        const int first = c * C, last = min(a.num_tokens_per_node[m], first + C);
        if (last <= first) continue;
        const u64 g = a.net_sent[m] + (u64)c;
        const bool own = m == node;
        const int peer = m * L + local;
        if (!netring::warp_wait(net_word(a.heap, a, kNetDispCredit, m, g),
                                netring::credit_needed(g, K), own, none, a.timeout_ns, err,
                                a.rank, peer, kPhaseInNetSend, lane))
            return;
        u8* const recv_chunk = net_chunk(a.heap, a.net_recv, a, node, g, slot_stride);
        u8* const chunk = own ? recv_chunk : net_chunk(a.heap, a.net_send, a, m, g, slot_stride);
        for (int j = first; j < last; ++j)
            pack_net_slot<kTopk, kCached, IdxT, kFmt>(
                a, m, j, chunk + (i64)(j - first) * slot_stride, lane);
        __threadfence_system();  // every lane's stores before the put or the ready word
        __syncwarp();
        u64* const ready = net_word(a.heap, a, kNetDispReady, node, g);
        if (own) {
            if (lane == 0) netring::set_word(ready, g + 1, true, 0);
        } else {
            net::put_signal_warp(recv_chunk, chunk, (size_t)(last - first) * slot_stride, ready,
                                 g + 1, a.pe_of_rank[peer], net::Signal::kSet);
        }
    }
    __syncwarp();
    if (lane == 0) net::quiet();
}

// Producer warp `index` of `per_group` of ring (me -> t), fed by the network ring: whole
// received chunks in (source node, chunk) order strided over the group, so in ring position
// order; each chunk once its ready word says it landed, its rows that go to t forwarded as
// ring_forward_rows forwards them; then the chunk counted consumed, and the last of the L
// groups returns the chunk's credit to its sender.
template <int kTopk>
__device__ __forceinline__ void net_forward_rows(const InternodeArgs& a, int t, int index,
                                                 int per_group, u8* const* peers,
                                                 const int* chunk_start, const ErrorState& err,
                                                 int lane) {
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    const int S = a.ring_slots;
    const i64 slot_stride = a.row_stride + a.record_stride;
    const u64 first_pos = *ring_seen(a, kSeenDispSent, t);
    const int* base = a.ring_base + t * (M + 1);
    const int d = node * L + t;
    ring::PendingWords pending;
    for (int item = index; item < chunk_start[M]; item += per_group) {
        const int n = find_segment(chunk_start, M, item);
        const int c = item - chunk_start[n], first = c * C;
        const int count = min(C, a.fwd_count[n] - first);
        const u64 g = a.chunks_seen[n] + (u64)c;
        const bool own = n == node;
        const int sender = n * L + local;
        if (!netring::warp_wait(net_word(a.heap, a, kNetDispReady, n, g), g + 1, own, pending,
                                a.timeout_ns, err, a.rank, sender, kPhaseInNetForward, lane))
            return;
        const u8* const chunk = net_chunk(a.heap, a.net_recv, a, n, g, slot_stride);
        int dst_slot = -1;
        if (lane < count) {
            const volatile NetRecord<kTopk>* rec =
                reinterpret_cast<const volatile NetRecord<kTopk>*>(
                    chunk + (i64)lane * slot_stride + a.row_stride);
            dst_slot = rec->slot_in_rank[t];
            a.fwd_slots[((i64)n * N_max + first + lane) * L + t] = dst_slot;
        }
        for (u32 todo = __ballot_sync(ring::kFullMask, dst_slot >= 0); todo != 0;
             todo &= todo - 1) {
            const int from = __ffs(todo) - 1;
            const int rslot = __shfl_sync(ring::kFullMask, dst_slot, from);
            const u64 pos = first_pos + (u64)(base[n] + rslot);
            if (!ring::warp_wait_word(ring_word(a.heap, a, kRingDispFreed, t, pos),
                                      ring::space_needed(pos, S), pending, a.timeout_ns, err,
                                      a.rank, d, kPhaseInRingForward, lane))
                return;
            ring_write_row<kTopk>(a, t, chunk + (i64)from * slot_stride, pos, peers[t], lane);
            pending.add(ring_word(peers[t], a, kRingDispReady, local, pos), pos + 1, lane);
        }
        __threadfence();  // every lane's reads of the chunk before it is counted consumed
        __syncwarp();
        if (lane == 0 && netring::count_consumed(net_counter(a, 0, n, g), (u32)L))
            netring::set_word(net_word(a.heap, a, kNetDispCredit, node, g), g + 1, own,
                              a.pe_of_rank[sender]);
    }
    pending.flush(lane);
    __syncwarp();
    if (lane == 0) net::quiet();  // the credits' signals
}

// Grid: a persistent grid of at most one block per SM (co-resident), at least 3 L warps.
// Senders put my chunks; producer groups t forward the chunks my rail peers sent to node rank
// t's ring; consumer groups u expand the rows from forwarder u. The last block advances the
// ring positions and the chunk totals (no acknowledgements: the credits replace them).
template <int kTopk, bool kCached, typename IdxT, int kFmt, bool kDequant>
__global__ void __launch_bounds__(kInternodeThreads) internode_net_dispatch(
    const __grid_constant__ InternodeArgs a) {
    const ErrorState err{a.error_claim, a.error_record};
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    constexpr bool kFp8Out = kFmt != fp8::kWireBf16 && !kDequant;
    const i64 row_bytes = kFp8Out ? (i64)a.hidden : (i64)a.hidden * 2;
    const int scale_bytes = kFp8Out ? fp8::scale_row_bytes<kFmt>(a.hidden) : 0;
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int num_warps = (gridDim.x * blockDim.x) >> 5;
    __shared__ u8* peers[kMaxRanksPerNode];
    __shared__ int chunk_start[kMaxNodes + 1];
    __shared__ int src_start[kMaxRanksPerNode][kMaxNodes + 1];
    if (threadIdx.x == 0) exclusive_chunk_prefix(a.fwd_count, M, C, chunk_start);
    ring_source_prefix(a, src_start);
    const bool ok = map_node_peers(a, peers, err, kPhaseInRingForward);  // syncs the block
    for (int e = warp; e < a.num_local; e += num_warps)
        zero_padding_rows<kFp8Out, kCached>(e, a.recv_x, a.recv_scales, a.recv_weights, row_bytes,
                                            scale_bytes, a.max_rows, a.num_recv_tokens_per_expert,
                                            a.expert_row_start, lane);
    const NetRoles role(L);
    if (ok && role.index < role.per_group) {
        if (role.kind == 0)
            net_send_chunks<kTopk, kCached, IdxT, kFmt>(a, role.index * L + role.sub,
                                                        role.per_group * L, err, lane);
        else if (role.kind == 1)
            net_forward_rows<kTopk>(a, role.sub, role.index, role.per_group, peers, chunk_start,
                                    err, lane);
        else
            ring_expand_rows<kTopk, kCached, kFmt, kDequant>(a, role.sub, role.index,
                                                             role.per_group, peers,
                                                             src_start[role.sub], err, lane);
    }
    if (last_block_done(&a.block_counters[6]) && !has_error(err)) {
        advance_rings(a, src_start, false);
        advance_net_streams(a, false);
    }
}

// Summing warp `member` of `members` (the forwarder): whole chunks of forwarded tokens in
// (source node, chunk) order, strided, as ring_node_sums takes them; each chunk once the
// source consumed chunk g - K (its credit), its tokens summed from the combine rings into the
// send slot, then put with its ready word (the own node's summed in place).
template <int kTopk, bool kWithWeights, int kDtype>
__device__ __forceinline__ void net_node_sums(const InternodeArgs& a, int member, int members,
                                              u8* const* peers, const int* chunk_start,
                                              const ErrorState& err, int lane) {
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    const int K = a.net_chunks;
    const i64 comb_stride = a.row_stride + a.weight_stride;
    ring::PendingWords pending;
    for (int item = member; item < chunk_start[M]; item += members) {
        const int n = find_segment(chunk_start, M, item);
        const int c = item - chunk_start[n], first = c * C;
        const int last = min(a.fwd_count[n], first + C);
        const u64 g = a.net_sent[M + n] + (u64)c;
        const bool own = n == node;
        const int source = n * L + local;
        if (!netring::warp_wait(net_word(a.heap, a, kNetCombCredit, n, g),
                                netring::credit_needed(g, K), own, pending, a.timeout_ns, err,
                                a.rank, source, kPhaseInNetCombineSend, lane))
            return;
        u8* const recv_chunk = net_chunk(a.heap, a.comb_recv, a, node, g, comb_stride);
        u8* const chunk = own ? recv_chunk : net_chunk(a.heap, a.comb_send, a, n, g, comb_stride);
        for (int j = first; j < last; ++j)
            if (!ring_sum_token<kTopk, kWithWeights, kDtype>(
                    a, n, j, chunk + (i64)(j - first) * comb_stride, peers, pending, err, lane))
                return;
        __threadfence_system();  // the network engine reads the chunk from outside the SMs
        __syncwarp();
        u64* const ready = net_word(a.heap, a, kNetCombReady, node, g);
        if (own) {
            if (lane == 0) netring::set_word(ready, g + 1, true, 0);
        } else {
            net::put_signal_warp(recv_chunk, chunk, (size_t)(last - first) * comb_stride, ready,
                                 g + 1, a.pe_of_rank[source], net::Signal::kSet);
        }
    }
    pending.flush(lane);
    __syncwarp();
    if (lane == 0) net::quiet();
}

// Reducing warp `member` of `members` (the source): my tokens in order, strided; each token's
// rows from its destination nodes once their chunks landed, summed in ascending node order as
// internode_combine_reduce sums them; then each row counted consumed, and the warp that
// completes a chunk returns its credit to the forwarder.
template <int kTopk, bool kWithWeights, int kDtype>
__device__ __forceinline__ void net_reduce(const InternodeArgs& a, int member, int members,
                                           const ErrorState& err, int lane) {
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    const int num_int4 = a.hidden * 2 / 16;
    const i64 comb_stride = a.row_stride + a.weight_stride;
    int4* const out = reinterpret_cast<int4*>(a.out);
    ring::PendingWords none;  // reducers publish no ring words
    for (int i = member; i < a.num_tokens; i += members) {
        const int* slots = a.token_slot_in_node + (i64)i * M;
        const u8* src[kMaxNodes];
        int num_src = 0;
        for (int n = 0; n < M; ++n) {
            if (slots[n] < 0) continue;
            const u64 g = a.chunks_seen[M + n] + (u64)(slots[n] / C);
            if (!netring::warp_wait(net_word(a.heap, a, kNetCombReady, n, g), g + 1, n == node,
                                    none, a.timeout_ns, err, a.rank, n * L + local,
                                    kPhaseInNetReduce, lane))
                return;
            src[num_src++] = net_chunk(a.heap, a.comb_recv, a, n, g, comb_stride) +
                             (i64)(slots[n] % C) * comb_stride;
        }
        warp_sum_partials<kTopk, kWithWeights, kDtype>(src, num_src, a.row_stride,
                                                       out + (i64)i * num_int4,
                                                       a.out_weights + (i64)i * kTopk, num_int4,
                                                       lane);
        __threadfence();  // every lane's reads of the rows before they are counted consumed
        __syncwarp();
        if (lane == 0) {
            for (int n = 0; n < M; ++n) {
                if (slots[n] < 0) continue;
                const int c = slots[n] / C;
                const u64 g = a.chunks_seen[M + n] + (u64)c;
                const int rows = min(C, a.num_tokens_per_node[n] - c * C);
                if (netring::count_consumed(net_counter(a, 1, n, g), (u32)rows))
                    netring::set_word(net_word(a.heap, a, kNetCombCredit, node, g), g + 1,
                                      n == node, a.pe_of_rank[n * L + local]);
            }
        }
        __syncwarp();
    }
    __syncwarp();
    if (lane == 0) net::quiet();  // the credits' signals
}

// Grid: a persistent grid of at most one block per SM (co-resident), at least 3 L warps.
// Producer groups u send my partials to forwarder u's ring; the sum groups sum my forwarded
// tokens and put them back by chunks; the reduce groups sum my tokens' rows from every node.
// The last block advances the ring positions and the chunk totals.
template <int kTopk, bool kWeighted, bool kWithWeights, int kDtype>
__global__ void __launch_bounds__(kInternodeThreads) internode_net_combine(
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
    const NetRoles role(L);
    const int member = role.index * L + role.sub, members = role.per_group * L;
    if (ok && role.index < role.per_group) {
        if (role.kind == 0)
            ring_partials<kTopk, kWeighted, kWithWeights, kDtype>(
                a, role.sub, role.index, role.per_group, peers, src_start[role.sub], err, lane);
        else if (role.kind == 1)
            net_node_sums<kTopk, kWithWeights, kDtype>(a, member, members, peers, chunk_start,
                                                       err, lane);
        else
            net_reduce<kTopk, kWithWeights, kDtype>(a, member, members, err, lane);
    }
    if (last_block_done(&a.block_counters[7]) && !has_error(err)) {
        advance_rings(a, src_start, true);
        advance_net_streams(a, true);
    }
}
