// The internode transport (docs/internode.md): EP groups of M nodes x L ranks. A token crosses
// the network once per destination node, to its rail peer there (the rank with the sender's
// local index), which forwards it over NVLink to each destination rank of that node, where it is
// expanded into the expert-major rows. Combine runs the same path backwards, in the rows' type
// (kDtype: bf16, fp16 or fp32; sums in fp32, partials rounded to the row type, so fp32 rows are
// never rounded).
//
// One kernel source per node staging, each linked on its own by
// megatron_deepep/kernels/nvshmem_link.py (ops.internode names each staging's kernel family):
//   internode/full.cu      full staging (the default)
//   internode/ring.cu      ring staging (MDEEP_INTERNODE_STAGING=ring)
//   internode/net_ring.cu  the network ring (MDEEP_INTERNODE_NET_RING_CHUNKS, on ring staging)
// and the headers they share:
//   internode/common.cuh       this one: the call's shape, the network record and signal
//                              words, the node peers' map, and the two kernels every staging
//                              runs first
//   internode/rows.cuh         one row at a time: pack for the network, expand, sum partials
//   internode/send_reduce.cuh  the network send and the final reduce (full and ring staging)
//   internode/ring_rows.cuh    the rings' producers and consumers (ring staging and the
//                              network ring)
//
// Kernels here, first in stream order on every rank of every staging:
//   internode_node_layout     node-level layout from is_token_in_rank (local)
//   internode_notify          counts to every PE over NVSHMEM; receive layout (as notify.cu)
#pragma once
#include "common/args.cuh"
#include "common/warp.cuh"
#include "internode/net.cuh"

// Every internode source works in mdeep's names; its kernels stay in the global namespace (the
// name expressions ops.internode lists).
using namespace mdeep;

constexpr int kInternodeThreads = 512;  // ops.INTERNODE_THREADS
constexpr int kInternodeNotifyThreads = kMaxLocalExperts;  // one thread per local expert
constexpr int kMaxRanksPerNode = 8;     // one NVLink domain
constexpr int kMaxNodes = 32;
constexpr int kMaxInternodeRanks = kMaxRanksPerNode * kMaxNodes;
constexpr int kHdrNodeTokens = 5;       // notify header: tokens the source sends to my node

// Error-record phases (transport/errors.py names them).
constexpr int kPhaseInNotify = 7, kPhaseInDispatchSend = 8, kPhaseInForward = 9,
              kPhaseInDispatchRecv = 10, kPhaseInCombineSend = 11, kPhaseInCombineForward = 12,
              kPhaseInCombineReduce = 13;
constexpr int kErrPeerUnreachable = 5;

// What travels with each row over the network: the source token and, for the rank's node, the
// token's slot on each rank (or -1), then its global expert ids, positions and weights.
template <int kTopk>
struct NetRecord {
    int token;
    int slot_in_rank[kMaxRanksPerNode];
    int expert[kTopk];
    int pos[kTopk];
    float weight[kTopk];
};

// Signal words (u64) of the block: notify [2][R], then per source node: dispatch data,
// dispatch acknowledgement, combine data, combine acknowledgement.
struct Signals {
    u64* notify;
    u64 *disp, *disp_ack, *comb, *comb_ack;
    __device__ Signals(const InternodeArgs& a) {
        notify = reinterpret_cast<u64*>(a.heap + a.signals);
        disp = notify + 2 * a.num_ranks;
        disp_ack = disp + a.num_nodes;
        comb = disp_ack + a.num_nodes;
        comb_ack = comb + a.num_nodes;
    }
};

// The call's epoch, from the word the transport advanced before the call (args.cuh).
__device__ __forceinline__ u32 epoch_of(const InternodeArgs& a) { return *a.epoch_word; }

__device__ __forceinline__ int num_chunks(int count, int chunk) {
    return (count + chunk - 1) / chunk;
}

// Segment s of the exclusive prefix `start [num + 1]` holding item i (binary search).
__device__ __forceinline__ int find_segment(const int* start, int num, int i) {
    int lo = 0, hi = num - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (start[mid] <= i) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// start[n + 1] = start[n] + ceil(counts[n] / chunk), start[0] = 0 (one thread; `start
// [num + 1]`): the first chunk (chunk = 1: item) of each segment.
__device__ __forceinline__ void exclusive_chunk_prefix(const int* counts, int num, int chunk,
                                                       int* start) {
    start[0] = 0;
    for (int n = 0; n < num; ++n) start[n + 1] = start[n] + (counts[n] + chunk - 1) / chunk;
}

// This rank's place and the call's sizes, as the kernels name them.
struct Shape {
    int R, L, M, C, N_max, node, local;
    __device__ explicit Shape(const InternodeArgs& a)
        : R(a.num_ranks), L(a.ranks_per_node), M(a.num_nodes), C(a.chunk_tokens),
          N_max(a.max_tokens), node(a.rank / a.ranks_per_node),
          local(a.rank % a.ranks_per_node) {}
};

// Fills `peers[t]` (shared) with a load/store pointer to the block of every rank of this node;
// records an error naming the first unreachable one. Returns false in every thread on failure.
__device__ __forceinline__ bool map_node_peers(const InternodeArgs& a, u8** peers,
                                               const ErrorState& err, int phase) {
    __shared__ int unreachable;
    const int L = a.ranks_per_node, node = a.rank / L;
    if (threadIdx.x == 0) unreachable = 0;
    __syncthreads();
    if (threadIdx.x < L) {
        const int peer = node * L + threadIdx.x;
        peers[threadIdx.x] = static_cast<u8*>(net::peer_ptr(a.heap, a.pe_of_rank[peer]));
        if (peers[threadIdx.x] == nullptr) {
            record_error(err, kErrPeerUnreachable, a.rank, peer, phase, L, 0, 0);
            unreachable = 1;
        }
    }
    __syncthreads();
    return unreachable == 0;
}

// ------------------------------------------------------------------------------------ layout

// Grid: one block per node m. token_slot_in_node[:, m], node_slot_token[m, :] and
// num_tokens_per_node[m] from is_token_in_rank, in token order (node_layout.py defines them).
__global__ void __launch_bounds__(kInternodeThreads) internode_node_layout(
    const __grid_constant__ InternodeArgs a) {
    __shared__ int scan_smem[33];
    const int m = blockIdx.x, L = a.ranks_per_node, R = a.num_ranks, M = a.num_nodes;
    const int N = a.num_tokens;
    int base = 0;
    for (int first = 0; first < N; first += blockDim.x) {
        const int i = first + threadIdx.x;
        int in_node = 0;
        if (i < N)
            for (int t = 0; t < L; ++t) in_node |= a.is_token_in_rank[(i64)i * R + m * L + t];
        int total;
        const int slot = base + block_exclusive_scan(in_node, scan_smem, &total);
        if (i < N) {
            a.token_slot_in_node[(i64)i * M + m] = in_node ? slot : -1;
            if (in_node) a.node_slot_token[(i64)m * N + slot] = i;
        }
        base += total;
    }
    if (threadIdx.x == 0) a.num_tokens_per_node[m] = base;
}

// ------------------------------------------------------------------------------------ notify

// Network ring only (net_chunks > 0, docs/internode.md "Network ring"): the rail counts. The
// forwarder must know its ring positions (ring_base) before the rows stream in, so every
// source also tells its rail peer on each node how many tokens it sends to each rank there.
// Region rail_counts: u64 signals [2][M], int received [2][M][8] (by epoch parity, then
// source node), int sent [M][8] (the source of the puts).
constexpr int kPhaseInNetNotify = 20;

struct RailCounts {
    u64* signals;
    int (*received)[kMaxRanksPerNode];
    int (*sent)[kMaxRanksPerNode];
    __device__ explicit RailCounts(const InternodeArgs& a) {
        const int M = a.num_nodes;
        signals = reinterpret_cast<u64*>(a.heap + a.rail_counts);
        received = reinterpret_cast<int(*)[kMaxRanksPerNode]>(signals + 2 * M);
        sent = received + 2 * M;
    }
};

// The whole block: my token counts for the ranks of every node, put to my rail peer there
// with a signal carrying the notify epoch (my own node's straight into my half), into the half
// of the epoch's parity (as the count rows: a source is at most one call ahead).
__device__ __forceinline__ void put_rail_counts(const InternodeArgs& a, int parity) {
    const int L = a.ranks_per_node, M = a.num_nodes, node = a.rank / L, local = a.rank % L;
    const RailCounts rc(a);
    for (int i = threadIdx.x; i < M * kMaxRanksPerNode; i += blockDim.x) {
        const int n = i / kMaxRanksPerNode, t = i % kMaxRanksPerNode;
        const int value = t < L ? a.num_tokens_per_rank[n * L + t] : 0;
        rc.sent[n][t] = value;
        if (n == node) rc.received[parity * M + node][t] = value;
    }
    __threadfence_system();  // the network engine reads `sent` from outside the SMs
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    for (int n = warp; n < M; n += num_warps)
        if (n != node)
            net::put_signal_warp(rc.received[parity * M + node], rc.sent[n],
                                 kMaxRanksPerNode * sizeof(int), rc.signals + parity * M + node,
                                 epoch_of(a), a.pe_of_rank[n * L + local], net::Signal::kSet);
    __syncwarp();
    if (lane == 0) net::quiet();
}

// The whole block: waits for every rail peer's counts of this call (the timeout names it),
// then ring_base[t][n + 1] = ring_base[t][n] + the tokens rail source (node n, my local)
// sends node rank t: the forwarder's first ring position per (rank t, source node n), as
// internode_ring_count counts them from the landed rows with ring staging alone.
__device__ __forceinline__ void rail_ring_base(const InternodeArgs& a, int parity,
                                               const ErrorState& err) {
    const int L = a.ranks_per_node, M = a.num_nodes, node = a.rank / L, local = a.rank % L;
    const RailCounts rc(a);
    __shared__ int rail_failed;
    if (threadIdx.x == 0) rail_failed = 0;
    __syncthreads();
    for (int n = threadIdx.x; n < M; n += blockDim.x)
        if (n != node && !net::wait_signal_ge(rc.signals + parity * M + n, epoch_of(a),
                                              a.timeout_ns, err, a.rank, n * L + local,
                                              kPhaseInNetNotify))
            rail_failed = 1;
    __syncthreads();
    if (rail_failed) return;
    const volatile int(*received)[kMaxRanksPerNode] = rc.received + parity * M;
    if (threadIdx.x < L) {
        int* base = a.ring_base + threadIdx.x * (M + 1);
        base[0] = 0;
        for (int n = 0; n < M; ++n) base[n + 1] = base[n] + received[n][threadIdx.x];
    }
}

// One block. Every source puts to every PE its header and its counts for that PE's local
// experts (with a signal carrying the epoch), into a region of two halves by epoch parity (a
// source can be one call ahead of a reader, never two: its own notify waits for everyone's).
// Then the receive layout exactly as notify.cu, over R sources, and the forwarding counts.
__global__ void __launch_bounds__(kInternodeNotifyThreads) internode_notify(
    const __grid_constant__ InternodeArgs a) {
    const ErrorState err{a.error_claim, a.error_record};
    const int R = a.num_ranks, L = a.ranks_per_node, M = a.num_nodes, me = a.rank;
    const int num_local = a.num_local, row_len = 8 + num_local;
    const int parity = epoch_of(a) & 1;
    int* send = reinterpret_cast<int*>(a.heap + a.notify_send);
    int(*counts)[kCountStride] =
        reinterpret_cast<int(*)[kCountStride]>(a.heap + a.notify_recv) + parity * R;
    u64* const signals = Signals(a).notify + parity * R;
    // 1. My row for every destination (mine goes straight into my own region).
    for (int i = threadIdx.x; i < R * row_len; i += blockDim.x) {
        const int d = i / row_len, col = i % row_len;
        int value;
        switch (col) {
            case kHdrTokens: value = a.num_tokens_per_rank[d]; break;
            case kHdrHidden: value = a.hidden; break;
            case kHdrTopk: value = a.num_topk; break;
            case kHdrExperts: value = a.num_experts; break;
            case kHdrAlign: value = a.alignment; break;
            case kHdrNodeTokens: value = a.num_tokens_per_node[d / L]; break;
            default: value = col >= 8 ? a.num_tokens_per_expert[d * num_local + col - 8] : 0;
        }
        send[d * kCountStride + col] = value;
        if (d == me) counts[me][col] = value;
    }
    __threadfence_system();  // the network engine reads `send` from outside the SMs
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    for (int d = warp; d < R; d += num_warps)
        if (d != me)
            net::put_signal_warp(&counts[me][0], send + d * kCountStride, row_len * sizeof(int),
                                 signals + me, epoch_of(a), a.pe_of_rank[d], net::Signal::kSet);
    __syncwarp();
    if (lane == 0) net::quiet();
    if (a.net_chunks > 0) put_rail_counts(a, parity);
    // 2. Everyone's row.
    __shared__ int failed;
    if (threadIdx.x == 0) failed = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < R; s += blockDim.x)
        if (s != me && !net::wait_signal_ge(signals + s, epoch_of(a), a.timeout_ns, err, me, s,
                                            kPhaseInNotify))
            failed = 1;
    __syncthreads();
    if (failed) return;
    volatile int(*rows)[kCountStride] = counts;
    for (int s = threadIdx.x; s < R; s += blockDim.x) {
        const int mine[5] = {0, a.hidden, a.num_topk, a.num_experts, a.alignment};
        for (int f = kHdrHidden; f <= kHdrAlign; ++f)
            if (rows[s][f] != mine[f])
                record_error(err, kErrRankMismatch, me, s, kPhaseInNotify, f, mine[f],
                             rows[s][f]);
        a.num_recv_tokens_per_rank[s] = rows[s][kHdrTokens];
    }
    for (int n = threadIdx.x; n < M; n += blockDim.x)
        a.fwd_count[n] = rows[n * L + me % L][kHdrNodeTokens];
    // 3. Receive layout: one thread per local expert, as notify.cu.
    __shared__ int scan_smem[33];
    const int e = threadIdx.x;
    int padded = 0;
    if (e < num_local) {
        int running = 0;
        for (int s = 0; s < R; ++s) {
            a.src_expert_offset[s * num_local + e] = running;
            running += rows[s][8 + e];
        }
        a.num_recv_tokens_per_expert[e] = running;
        padded = (running + a.alignment - 1) / a.alignment * a.alignment;
        a.tokens_per_expert[e] = padded;
        if (a.host_info != nullptr) store_expert_rows(a.host_info, e, padded, a.host_epoch);
    }
    if (a.host_info != nullptr) __threadfence_system();
    int num_rows;
    const int row_start = block_exclusive_scan(padded, scan_smem, &num_rows);
    if (e < num_local) a.expert_row_start[e] = row_start;
    if (threadIdx.x == 0) {
        a.expert_row_start[num_local] = num_rows;
        if (a.max_recv_rows >= 0 && num_rows > a.max_recv_rows)
            record_error(err, kErrRecvOverflow, me, -1, kPhaseInNotify, 0, a.max_recv_rows,
                         num_rows);
        if (a.host_info != nullptr) publish_host_info(a.host_info, num_rows, a.host_epoch);
    }
    if (a.net_chunks > 0) rail_ring_base(a, parity, err);
}
