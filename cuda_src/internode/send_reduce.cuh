// The network leg of full and ring staging (internode/full.cu, internode/ring.cu; the network
// ring replaces both kernels):
//   internode_dispatch_send   packs each token once per destination node, by chunks of C slots,
//                             and puts every remote chunk with a signal (own node: in place)
//   internode_combine_reduce  (source) sums the partials of its nodes in node order
// Network data is counted in chunks: a receiver expects ceil(count / C) signal increments per
// source node on top of the running total it keeps in `chunks_seen` (block_wait_rail); the
// kernel that consumed a call's chunks hands them back to their senders (ack_rail_peers). Both
// helpers serve the other kernels of full and ring staging too.
#pragma once
#include "internode/common.cuh"
#include "internode/rows.cuh"

// Thread n < M (other than this rank's node) waits until signals[n] >= base[n] + extra(n);
// returns in every thread whether all did. The peer named on a timeout is the rail peer.
template <typename Extra>
__device__ __forceinline__ bool block_wait_rail(u64* signals, const u64* base, Extra extra,
                                                const InternodeArgs& a, const ErrorState& err,
                                                int phase) {
    __shared__ int failed;
    if (threadIdx.x == 0) failed = 0;
    __syncthreads();
    const int L = a.ranks_per_node, node = a.rank / L;
    for (int n = threadIdx.x; n < a.num_nodes; n += blockDim.x) {
        if (n == node) continue;
        const u64 target = (base != nullptr ? base[n] : 0) + extra(n);
        if (!net::wait_signal_ge(signals + n, target, a.timeout_ns, err, a.rank,
                                 n * L + a.rank % L, phase))
            failed = 1;
    }
    __syncthreads();
    return failed == 0;
}

template <int kTopk, bool kCached, typename IdxT, int kFmt>
__global__ void __launch_bounds__(kInternodeThreads) internode_dispatch_send(
    const __grid_constant__ InternodeArgs a) {
    const ErrorState err{a.error_claim, a.error_record};
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    const i64 slot_stride = a.row_stride + a.record_stride;
    const Signals sig(a);
    __shared__ int chunk_start[kMaxNodes + 1];
    if (threadIdx.x == 0) exclusive_chunk_prefix(a.num_tokens_per_node, M, C, chunk_start);
    // Rail peers consumed the previous call's slots (the signal carries their epoch; 32-bit,
    // compared wrap-safe by net::signal_reached).
    const u64 previous = epoch_of(a) - 1u;
    const bool ok = block_wait_rail(sig.disp_ack, nullptr, [&](int) { return previous; }, a, err,
                                    kPhaseInDispatchSend);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    for (int item = blockIdx.x; ok && item < chunk_start[M]; item += gridDim.x) {
        const int m = find_segment(chunk_start, M, item);
        const int first = (item - chunk_start[m]) * C;
        const int last = min(a.num_tokens_per_node[m], first + C);
        // The own node's slots go straight where the forward kernel reads them.
        const bool own = m == node;
        u8* const region = a.heap + (own ? a.net_recv + (i64)node * N_max * slot_stride
                                         : a.net_send + (i64)m * N_max * slot_stride);
        for (int j = first + warp; j < last; j += num_warps)
            pack_net_slot<kTopk, kCached, IdxT, kFmt>(a, m, j, region + (i64)j * slot_stride,
                                                      lane);
        __threadfence_system();  // the network engine reads the chunk from outside the SMs
        __syncthreads();
        if (!own)
            net::put_signal_block(a.heap + a.net_recv + ((i64)node * N_max + first) * slot_stride,
                                  region + (i64)first * slot_stride,
                                  (size_t)(last - first) * slot_stride, sig.disp + node, 1,
                                  a.pe_of_rank[m * L + local], net::Signal::kAdd);
    }
    __syncthreads();
    if (threadIdx.x == 0) net::quiet();
}

// The hand-back of the last block of a kernel that consumed one call's chunks from every other
// node (`counts[n]` tokens from node n): adds them to my running totals `seen [M]` and sets my
// word of `ack` on the rank of my local index on that node, so its sender may reuse the staging.
__device__ void ack_rail_peers(const InternodeArgs& a, u64* seen, const int* counts, u64* ack) {
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    for (int n = 0; n < M; ++n) {
        if (n == node) continue;
        seen[n] += num_chunks(counts[n], C);
        net::signal(ack + node, epoch_of(a), a.pe_of_rank[n * L + local]);
    }
    net::quiet();
}

template <int kTopk, bool kWithWeights, int kDtype>
__global__ void __launch_bounds__(kInternodeThreads) internode_combine_reduce(
    const __grid_constant__ InternodeArgs a) {
    const ErrorState err{a.error_claim, a.error_record};
    const auto [R, L, M, C, N_max, node, local] = Shape(a);
    const int num_int4 = a.hidden * 2 / 16;
    const i64 comb_stride = a.row_stride + a.weight_stride;
    const Signals sig(a);
    const bool ok = block_wait_rail(
        sig.comb, a.chunks_seen + M,
        [&](int n) { return (u64)num_chunks(a.num_tokens_per_node[n], a.chunk_tokens); }, a, err,
        kPhaseInCombineReduce);
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int num_warps = (gridDim.x * blockDim.x) >> 5;
    int4* const out = reinterpret_cast<int4*>(a.out);
    for (int i = warp; ok && i < a.num_tokens; i += num_warps) {
        // The token's rows from its destination nodes, in ascending node order.
        const int* slots = a.token_slot_in_node + (i64)i * M;
        const u8* src[kMaxNodes];
        int num_src = 0;
        for (int n = 0; n < M; ++n)
            if (slots[n] >= 0)
                src[num_src++] = a.heap + a.comb_recv + ((i64)n * N_max + slots[n]) * comb_stride;
        warp_sum_partials<kTopk, kWithWeights, kDtype>(src, num_src, a.row_stride,
                                               out + (i64)i * num_int4,
                                               a.out_weights + (i64)i * kTopk, num_int4, lane);
    }
    if (last_block_done(&a.block_counters[4]) && !has_error(err)) {
        ack_rail_peers(a, a.chunks_seen + M, a.num_tokens_per_node, sig.comb_ack);
    }
}
