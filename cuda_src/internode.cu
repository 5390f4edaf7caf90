// The internode transport (docs/internode.md): EP groups of M nodes x L ranks. A token crosses
// the network once per destination node, to its rail peer there (the rank with the sender's
// local index), which forwards it over NVLink to each destination rank of that node, where it is
// expanded into the expert-major rows. Combine runs the same path backwards, in the rows' type
// (kDtype: bf16, fp16 or fp32; sums in fp32, partials rounded to the row type, so fp32 rows are
// never rounded).
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
//
// Reuse hazards: every writer first waits until its reader consumed the previous call: network
// data by acknowledgement signals (rail peers), NVLink staging by epoch flags (node peers).
// Network data is counted in chunks: a receiver expects ceil(count / C) signal increments per
// source node on top of the running total it keeps in `chunks_seen`.
// Ring staging (MDEEP_INTERNODE_STAGING=ring, the section at the end): the node's staging becomes
// L rings of ring_slots slots per rank; forward + expand and combine send + forward then run as
// one persistent kernel each (internode_ring_dispatch, internode_ring_combine).
// Network ring (MDEEP_INTERNODE_NET_RING_CHUNKS, with ring staging; the last section): the
// network regions become K chunk slots per rail peer; send + forward + expand and partials +
// sums + reduce then run as one persistent kernel each (internode_net_dispatch,
// internode_net_combine), and notify also gives each forwarder its ring positions.
// FP8 dispatch (kFmt != bf16): the send quantizes each row once (or copies a pre-quantized
// row), the network and the NVLink staging carry the wire row (e4m3 data, then its scales), and
// the expand dequantizes it or hands data and scales on.
// Built by megatron_deepep/kernels/nvshmem_link.py; launched by the ops.internode_* wrappers.
#include "common/args.cuh"
#include "common/copy.cuh"
#include "common/fp8_row.cuh"
#include "common/recv_rows.cuh"
#include "common/row_dtype.cuh"
#include "common/warp.cuh"
#include "internode/net.cuh"
#include "internode/net_ring.cuh"
#include "internode/ring.cuh"

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

// Epoch flags written by node peers into this rank's block, index = the writer's local rank.
struct NodeFlags {
    u32 fwd_done[kMaxRanksPerNode];        // forwarder t finished writing my staging
    u32 stage_consumed[kMaxRanksPerNode];  // rank t expanded what I staged for it
    u32 comb_done[kMaxRanksPerNode];       // rank t wrote its partials into my combine staging
    u32 comb_consumed[kMaxRanksPerNode];   // forwarder t consumed the partials I wrote
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

__device__ __forceinline__ NodeFlags* flags_of(u8* block, const InternodeArgs& a) {
    return reinterpret_cast<NodeFlags*>(block + a.flags);
}

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

// ------------------------------------------------------------------------------- ring staging
//
// MDEEP_INTERNODE_STAGING=ring (docs/internode.md, "Ring staging"): the same protocol, with the
// node's staging bounded to L rings of S = ring_slots slots per rank whatever R and N_max
// (internode/ring.cuh: positions, ready and freed words). Dispatch ring (u -> t): forwarder u
// streams the rows its rail peers sent that go to node rank t, ordered by (source node, slot on
// t), into t's stage_rows / stage_meta [u][S]. Combine ring (t -> u): expert rank t streams its
// partials of the tokens forwarder u sent it, in the same order, into u's comb_stage [t][S].
// The network leg, notify, send and reduce are the full staging's kernels. New kernels:
//   internode_ring_count     (forwarder) rows per (node rank, source node), as ring_base
//   internode_ring_dispatch  forward and expand in one persistent kernel: the producer and the
//                            consumer warps of every ring run at once, since a producer may wait
//                            for space that only a consumer of the same call frees
//   internode_ring_combine   the partials and the forwarder's sums in one kernel, likewise
// ring_seen (local u64 [4][8]): positions so far, [0] dispatch rings to each node rank, [1]
// dispatch rings from each forwarder, [2] combine rings to each forwarder, [3] combine rings
// from each node rank; each kernel's last block advances them by the call's rows.

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

// ------------------------------------------------------------------------------- network ring
//
// MDEEP_INTERNODE_NET_RING_CHUNKS = K > 0, with ring staging (docs/internode.md, "Network
// ring"): net_send / net_recv (dispatch) and comb_send / comb_recv (combine) hold [M][K] chunk
// slots of C = chunk_tokens network slots each, whatever N_max (internode/net_ring.cuh: chunk
// numbers, ready and credit words). Dispatch streams: me -> my rail peer on each node m (chunk
// c of the call: my node slots [c C, c C + C) for m); combine streams: forwarder -> source (the
// forwarded tokens' sums, chunked as dispatch chunked them). Each includes the stream to my own
// node (local words, packed in place). Chunk totals: net_sent (local u64 [2][M], sent to each
// node) and chunks_seen (received from each node), advanced by each kernel's last block.
// Kernels (node layout and notify as before; notify also fills ring_base from the rail counts):
//   internode_net_dispatch  senders + ring forward + ring expand in one persistent kernel: a
//                           sender may wait for a credit that only its rail peer's forwarder of
//                           the same call returns, while that rank's own sender may be waiting
//                           for this rank's forwarder
//   internode_net_combine   ring partials + the forwarder's sums (one put per chunk) + the
//                           source's reduce, likewise
// Roles: 3 L groups of warps (warp w in group w mod 3L): kind = group / L (0: senders or, in
// combine, partial producers; 1: ring forward or node sums; 2: ring expand or reduce), sub =
// group mod L (the ring's node rank where a ring is meant).

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
