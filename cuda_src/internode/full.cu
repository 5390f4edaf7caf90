// Full staging of the internode transport (the default; internode/common.cuh describes the
// transport): the node's NVLink staging holds a slot for every (source rank, token slot).
//
// Kernels, in stream order on every rank (R ranks, N tokens, N_max slots, C tokens per chunk):
//   internode_node_layout     node-level layout from is_token_in_rank (local)
//   internode_notify          counts to every PE over NVSHMEM; receive layout (as notify.cu)
//   internode_dispatch_send   packs each token once per destination node, by chunks of C slots,
//                             and puts every remote chunk with a signal (own node: in place)
//   internode_forward         (rail peer) copies each received token into the NVLink staging of
//                             each rank of its node that holds one of its experts
//   internode_dispatch_recv   expands the staged rows of all R sources into recv_x
//   internode_combine_send    (expert rank) one partial per staged token, to its forwarder
//   internode_combine_forward (forwarder) sums its node's partials, puts one row per token back
//   internode_combine_reduce  (source) sums the partials of its nodes in node order
// Node layout and notify come from internode/common.cuh, send and reduce from
// internode/send_reduce.cuh (ring staging runs them too).
//
// Reuse hazards: every writer first waits until its reader consumed the previous call: network
// data by acknowledgement signals (rail peers), NVLink staging by epoch flags (node peers).
// Built by megatron_deepep/kernels/nvshmem_link.py; launched by the ops.internode_* wrappers.
#include "internode/common.cuh"
#include "internode/rows.cuh"
#include "internode/send_reduce.cuh"

// Epoch flags written by node peers into this rank's block, index = the writer's local rank.
struct NodeFlags {
    u32 fwd_done[kMaxRanksPerNode];        // forwarder t finished writing my staging
    u32 stage_consumed[kMaxRanksPerNode];  // rank t expanded what I staged for it
    u32 comb_done[kMaxRanksPerNode];       // rank t wrote its partials into my combine staging
    u32 comb_consumed[kMaxRanksPerNode];   // forwarder t consumed the partials I wrote
};

__device__ __forceinline__ NodeFlags* flags_of(u8* block, const InternodeArgs& a) {
    return reinterpret_cast<NodeFlags*>(block + a.flags);
}

// Sets flag [my local index] of `kFlags` to the call's epoch on every rank of this node (the
// last block of a kernel, once every block's writes are fenced).
template <u32 (NodeFlags::*kFlags)[kMaxRanksPerNode]>
__device__ __forceinline__ void release_node(u8* const* peers, const InternodeArgs& a) {
    const int L = a.ranks_per_node, local = a.rank % L;
    const u32 epoch = epoch_of(a);
    for (int t = 0; t < L; ++t) st_release_sys(&(flags_of(peers[t], a)->*kFlags)[local], epoch);
}

// Thread t < L waits until flags[t] reaches `epoch`; returns in every thread whether all did.
__device__ __forceinline__ bool block_wait_node(const u32* flags, u32 epoch,
                                                const InternodeArgs& a, const ErrorState& err,
                                                int phase) {
    __shared__ int failed;
    if (threadIdx.x == 0) failed = 0;
    __syncthreads();
    const int L = a.ranks_per_node, t = threadIdx.x;
    if (t < L && !wait_epoch(&flags[t], epoch, a.timeout_ns, err, a.rank,
                             (a.rank / L) * L + t, phase))
        failed = 1;
    __syncthreads();
    return failed == 0;
}

// ------------------------------------------------------------------------------------ dispatch

template <int kTopk>
__global__ void __launch_bounds__(kInternodeThreads) internode_forward(
    const __grid_constant__ InternodeArgs a) {
    const ErrorState err{a.error_claim, a.error_record};
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    const int num_local = a.num_local;
    const i64 slot_stride = a.row_stride + a.record_stride;
    const int num_int4 = (int)((a.wire_bytes + 15) / 16);  // within row_stride
    const Signals sig(a);
    NodeFlags* const mine = flags_of(a.heap, a);
    __shared__ u8* peers[kMaxRanksPerNode];
    __shared__ int tok_start[kMaxNodes + 1];
    if (threadIdx.x == 0) exclusive_chunk_prefix(a.fwd_count, M, 1, tok_start);
    bool ok = map_node_peers(a, peers, err, kPhaseInForward);
    ok = ok && block_wait_node(mine->stage_consumed, epoch_of(a) - 1, a, err, kPhaseInForward);
    const auto chunks_from = [&](int n) { return (u64)num_chunks(a.fwd_count[n], a.chunk_tokens); };
    ok = ok && block_wait_rail(sig.disp, a.chunks_seen, chunks_from, a, err, kPhaseInForward);
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int num_warps = (gridDim.x * blockDim.x) >> 5;
    for (int i = warp; ok && i < tok_start[M]; i += num_warps) {
        const int n = find_segment(tok_start, M, i);
        const int j = i - tok_start[n];
        const int source = n * L + local;
        const u8* slot = a.heap + a.net_recv + ((i64)n * N_max + j) * slot_stride;
        const volatile NetRecord<kTopk>* rec =
            reinterpret_cast<const volatile NetRecord<kTopk>*>(slot + a.row_stride);
        int4* dst[kMaxRanksPerNode];
        int num_dst = 0;
        for (int t = 0; t < L; ++t) {
            const int dst_slot = rec->slot_in_rank[t];
            if (lane == t) a.fwd_slots[((i64)n * N_max + j) * L + t] = dst_slot;
            if (dst_slot < 0) continue;
            const i64 at = (i64)source * N_max + dst_slot;
            dst[num_dst++] = reinterpret_cast<int4*>(peers[t] + a.stage_rows + at * a.row_stride);
            SlotMeta<kTopk>* meta =
                reinterpret_cast<SlotMeta<kTopk>*>(peers[t] + a.stage_meta + at * a.meta_stride);
            const int d = node * L + t;
            if (lane < kTopk) {
                const int id = rec->expert[lane];
                const bool here = id >= 0 && id / num_local == d;
                meta->local_expert[lane] = here ? id - d * num_local : -1;
                meta->pos[lane] = here ? rec->pos[lane] : -1;
                meta->weight[lane] = rec->weight[lane];
            } else if (lane == kTopk) {
                meta->token = rec->token;
            }
        }
        warp_copy_row<kMaxRanksPerNode, true>(reinterpret_cast<const int4*>(slot), dst, num_dst,
                                              num_int4, lane);
    }
    if (last_block_done(&a.block_counters[0]) && !has_error(err)) {
        release_node<&NodeFlags::fwd_done>(peers, a);
        ack_rail_peers(a, a.chunks_seen, a.fwd_count, sig.disp_ack);
    }
}

template <int kTopk, bool kCached, int kFmt, bool kDequant>
__global__ void __launch_bounds__(kInternodeThreads) internode_dispatch_recv(
    const __grid_constant__ InternodeArgs a) {
    const ErrorState err{a.error_claim, a.error_record};
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    const int num_local = a.num_local, hidden = a.hidden;
    constexpr bool kFp8Out = kFmt != fp8::kWireBf16 && !kDequant;
    const i64 row_bytes = kFp8Out ? (i64)hidden : (i64)hidden * 2;
    const int scale_bytes = kFp8Out ? fp8::scale_row_bytes<kFmt>(hidden) : 0;
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int num_warps = (gridDim.x * blockDim.x) >> 5;
    for (int e = warp; e < num_local; e += num_warps)
        zero_padding_rows<kFp8Out, kCached>(e, a.recv_x, a.recv_scales, a.recv_weights, row_bytes,
                                            scale_bytes, a.max_rows, a.num_recv_tokens_per_expert,
                                            a.expert_row_start, lane);
    __shared__ int slot_start[kMaxInternodeRanks + 1];
    if (threadIdx.x == 0) exclusive_chunk_prefix(a.num_recv_tokens_per_rank, R, 1, slot_start);
    const bool ok = block_wait_node(flags_of(a.heap, a)->fwd_done, epoch_of(a), a, err,
                                    kPhaseInDispatchRecv);
    for (int i = warp; ok && i < slot_start[R]; i += num_warps) {
        const int s = find_segment(slot_start, R, i);
        const int j = i - slot_start[s];
        const i64 at = (i64)s * N_max + j;
        const u8* staged = a.heap + a.stage_rows + at * a.row_stride;
        int* my_rows = a.slot_rows + at * kTopk;
        expand_staged_row<kTopk, kCached, kFmt, kDequant>(
            a, staged, a.heap + a.stage_meta + at * a.meta_stride, my_rows, s, lane);
    }
    __shared__ u8* peers[kMaxRanksPerNode];
    if (threadIdx.x < L)
        peers[threadIdx.x] = static_cast<u8*>(
            net::peer_ptr(a.heap, a.pe_of_rank[(a.rank / L) * L + threadIdx.x]));
    if (last_block_done(&a.block_counters[1]) && !has_error(err))
        release_node<&NodeFlags::stage_consumed>(peers, a);
}

// ------------------------------------------------------------------------------------ combine

template <int kTopk, bool kWeighted, bool kWithWeights, int kDtype>
__global__ void __launch_bounds__(kInternodeThreads) internode_combine_send(
    const __grid_constant__ InternodeArgs a) {
    const ErrorState err{a.error_claim, a.error_record};
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    const i64 comb_stride = a.row_stride + a.weight_stride;
    __shared__ u8* peers[kMaxRanksPerNode];
    __shared__ int slot_start[kMaxInternodeRanks + 1];
    if (threadIdx.x == 0) exclusive_chunk_prefix(a.num_recv_tokens_per_rank, R, 1, slot_start);
    bool ok = map_node_peers(a, peers, err, kPhaseInCombineSend);
    ok = ok && block_wait_node(flags_of(a.heap, a)->comb_consumed, epoch_of(a) - 1, a, err,
                               kPhaseInCombineSend);
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int num_warps = (gridDim.x * blockDim.x) >> 5;
    for (int i = warp; ok && i < slot_start[R]; i += num_warps) {
        const int s = find_segment(slot_start, R, i);
        const int j = i - slot_start[s];
        const int* rows = a.slot_rows + ((i64)s * N_max + j) * kTopk;
        // Partial of my rows, in k order, to my slot of the source's forwarder (its local index
        // is the source's): staging [my local][source node][slot].
        u8* const dst = peers[s % L] + a.comb_stage +
                        (((i64)local * M + s / L) * N_max + j) * comb_stride;
        write_partial<kTopk, kWeighted, kWithWeights, kDtype>(a, rows, dst, lane);
    }
    if (last_block_done(&a.block_counters[2]) && !has_error(err))
        release_node<&NodeFlags::comb_done>(peers, a);
}

template <int kTopk, bool kWithWeights, int kDtype>
__global__ void __launch_bounds__(kInternodeThreads) internode_combine_forward(
    const __grid_constant__ InternodeArgs a) {
    const ErrorState err{a.error_claim, a.error_record};
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    const int num_int4 = a.hidden * 2 / 16;
    const i64 comb_stride = a.row_stride + a.weight_stride;
    const Signals sig(a);
    __shared__ u8* peers[kMaxRanksPerNode];
    __shared__ int chunk_start[kMaxNodes + 1];
    if (threadIdx.x == 0) exclusive_chunk_prefix(a.fwd_count, M, C, chunk_start);
    bool ok = map_node_peers(a, peers, err, kPhaseInCombineForward);
    ok = ok && block_wait_node(flags_of(a.heap, a)->comb_done, epoch_of(a), a, err,
                               kPhaseInCombineForward);
    const u64 previous = epoch_of(a) - 1u;
    ok = ok && block_wait_rail(sig.comb_ack, nullptr, [&](int) { return previous; }, a, err,
                               kPhaseInCombineForward);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    for (int item = blockIdx.x; ok && item < chunk_start[M]; item += gridDim.x) {
        const int n = find_segment(chunk_start, M, item);
        const int first = (item - chunk_start[n]) * C;
        const int last = min(a.fwd_count[n], first + C);
        const bool own = n == node;
        u8* const region = a.heap + (own ? a.comb_recv + (i64)node * N_max * comb_stride
                                         : a.comb_send + (i64)n * N_max * comb_stride);
        for (int j = first + warp; j < last; j += num_warps) {
            // This node's partials of the token, in ascending local rank.
            const int* slots = a.fwd_slots + ((i64)n * N_max + j) * L;
            const u8* src[kMaxRanksPerNode];
            int num_src = 0;
            for (int t = 0; t < L; ++t)
                if (slots[t] >= 0)
                    src[num_src++] = a.heap + a.comb_stage +
                                     (((i64)t * M + n) * N_max + slots[t]) * comb_stride;
            u8* const dst = region + (i64)j * comb_stride;
            warp_sum_partials<kTopk, kWithWeights, kDtype>(src, num_src, a.row_stride,
                                                   reinterpret_cast<int4*>(dst),
                                                   reinterpret_cast<float*>(dst + a.row_stride),
                                                   num_int4, lane);
        }
        __threadfence_system();
        __syncthreads();
        if (!own)
            net::put_signal_block(a.heap + a.comb_recv + ((i64)node * N_max + first) * comb_stride,
                                  region + (i64)first * comb_stride,
                                  (size_t)(last - first) * comb_stride, sig.comb + node, 1,
                                  a.pe_of_rank[n * L + local], net::Signal::kAdd);
    }
    __syncthreads();
    if (threadIdx.x == 0) net::quiet();
    if (last_block_done(&a.block_counters[3]) && !has_error(err))
        release_node<&NodeFlags::comb_consumed>(peers, a);
}
