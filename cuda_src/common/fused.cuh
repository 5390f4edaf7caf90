// What the fused NVLink kernels (one launch per dispatch or combine: senders and receivers at
// once) share: items handed out to warps through a counter, per-slot epoch flags, the check
// that no other call of the buffer runs beside this one, and the end of the call.
//
// Each warp works through two queues: send items (tokens, or received slots, whose rows go to
// peers) and receive items (slots a peer fills, or tokens whose partials peers send). A warp
// never blocks on a receive item while its rank has send items left: it sends instead. Send
// items never wait on peers, so every send is taken by a running warp and ends, and then every
// receive can end too: no block needs any other to be resident (no co-residency limit).
#pragma once
#include "common/buffer.cuh"
#include "common/error.cuh"
#include "common/warp.cuh"

namespace mdeep {

// Lane 0 takes the next `count` items of `counter` for the whole warp; returns the first.
__device__ __forceinline__ int warp_claim(u32* counter, int count, int lane) {
    u32 first = 0;
    if (lane == 0) first = atomicAdd(counter, (u32)count);
    return (int)__shfl_sync(0xffffffffu, first, 0);
}

// Whether the slot's flag has reached `epoch` (one acquire load, its answer in every lane; the
// acquire and the __syncwarp order the lanes' later reads of the slot after it).
__device__ __forceinline__ bool warp_slot_ready(const u32* flag, u32 epoch, int lane) {
    u32 seen = 0;
    if (lane == 0) seen = ld_acquire_sys(flag);
    seen = __shfl_sync(0xffffffffu, seen, 0);
    __syncwarp();
    return epoch_reached(seen, epoch);
}

// Spins (whole warp) until the slot's flag reaches `epoch`, or records a timeout naming `peer`
// and returns false.
__device__ __forceinline__ bool warp_wait_slot(const u32* flag, u32 epoch, u64 timeout_ns,
                                               const ErrorState& err, int rank, int peer,
                                               int phase, int lane) {
    bool ok = true;
    if (lane == 0) ok = wait_epoch(flag, epoch, timeout_ns, err, rank, peer, phase);
    ok = __shfl_sync(0xffffffffu, (int)ok, 0) != 0;
    __syncwarp();
    return ok;
}

// After a warp's stores of one batch of slots: every lane's stores are fenced at system scope
// (one fence for the warp), then the lanes holding a flag pointer publish `epoch` there.
__device__ __forceinline__ void warp_publish_slots(u32* flag, u32 epoch) {
    __syncwarp();
    __threadfence_system();
    if (flag != nullptr)
        asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(flag), "r"(epoch) : "memory");
    __syncwarp();
}

// At a fused kernel's start (every thread): counts the block in and, in thread 0, refuses a
// call that overlaps another of its kind on this buffer (more arrivals than blocks) or reuses
// the epoch the last one completed (a CUDA-graph replay racing eager calls: both advance the
// same epoch word and share these counters). Returns false in every thread after an error.
__device__ __forceinline__ bool check_call_alone(Workspace* ws, int kind, u32 epoch, int rank,
                                                 const ErrorState& err, int phase) {
    __shared__ int refused;
    if (threadIdx.x == 0) {
        const u32 arrival = atomicAdd(&ws->kernel_arrivals[kind], 1u);
        const u32 last_epoch = ld_volatile(reinterpret_cast<const int*>(&ws->kernel_epoch[kind]));
        const bool overlap = arrival >= gridDim.x || last_epoch == epoch;
        if (overlap)
            record_error(err, kErrConcurrentCall, rank, -1, phase, (int)arrival,
                         (i64)gridDim.x, (i64)epoch);
        refused = overlap || has_error(err);  // one reader: the same answer in every thread
    }
    __syncthreads();
    return !refused;
}

// At a fused kernel's end (every thread): once the last block has finished (its writes fenced),
// resets the kind's counters for the next call, records its epoch as completed and releases
// `epoch` into flag [rank] of every peer's Meta::*kFlags (unless an error was recorded).
template <u32 (Meta::*kFlags)[kMaxRanks]>
__device__ __forceinline__ void end_fused_call(const u64* peer_bases, Workspace* ws, int kind,
                                               int counter, int work0, int rank, int num_ranks,
                                               u32 epoch, const ErrorState& err) {
    if (!last_block_done(&ws->block_counter[counter])) return;
    ws->work_counter[work0] = 0;
    ws->work_counter[work0 + 1] = 0;
    ws->kernel_epoch[kind] = epoch;
    ws->kernel_arrivals[kind] = 0;
    __threadfence_system();
    if (has_error(err)) return;
    for (int r = 0; r < num_ranks; ++r)
        if (r != rank) st_release_sys(&(meta_of(peer_bases[r])->*kFlags)[rank], epoch);
}

__device__ __forceinline__ Workspace* workspace_of(const u64* peer_bases, int rank,
                                                   const Regions& rg) {
    return reinterpret_cast<Workspace*>(reinterpret_cast<char*>(peer_bases[rank]) +
                                        rg.workspace);
}

// The peer slots a rank serves as items, interleaved over its peers: item i is slot i / P of
// peer i % P (P = num_ranks - 1 peers in rank order, this rank skipped), so every peer's slots
// advance together, as the peers' own token-ordered sends fill them; an item past its peer's
// count is void. Built once per block in shared memory by thread 0.
struct PeerSlots {
    int count[kMaxRanks];  // slots of each rank (0 for this rank)
    int num_items;         // P x the largest count
};

__device__ __forceinline__ void build_peer_slots(PeerSlots* ps, const int* num_tokens_per_rank,
                                                 int rank, int num_ranks) {
    if (threadIdx.x != 0) return;
    int most = 0;
    for (int s = 0; s < num_ranks; ++s) {
        ps->count[s] = s == rank ? 0 : num_tokens_per_rank[s];
        most = max(most, ps->count[s]);
    }
    ps->num_items = (num_ranks - 1) * most;
}

// Item i's peer `s` and slot `j`; false for a void item.
__device__ __forceinline__ bool peer_slot_of(const PeerSlots& ps, int i, int rank, int num_ranks,
                                             int* s, int* j) {
    const int p = i % (num_ranks - 1);
    *s = p + (p >= rank);
    *j = i / (num_ranks - 1);
    return *j < ps.count[*s];
}

}  // namespace mdeep
