// Bounded rings of network chunks between rail peers (MDEEP_INTERNODE_NET_RING_CHUNKS = K > 0;
// docs/internode.md, "Network ring"): the words that say which chunk slots hold data and which
// were consumed, and the waits on them.
//
// A stream carries one ordered sequence of chunks (chunk_tokens rows each, the last one of a
// call shorter) from a sender rank to a receiver rank: dispatch rows from a source to its rail
// peer on a destination node, combine sums from a forwarder back to the source. Chunk g counts
// from the buffer's start and is never reset (u64), so slot g % K of the sender's send region
// and of the receiver's receive region hold chunks g, g + K, g + 2 K, ... in turn. Per slot two
// words, one on each end:
//   ready  (on the receiver) = g + 1 once chunk g landed (the put's own signal, SET)
//   credit (on the sender)   = g + 1 once the receiver consumed chunk g (a bare signal, SET)
// The sender of chunk g waits for credit >= g + 1 - K (chunk g - K consumed); the consumer of
// chunk g waits for ready >= g + 1. Each end spins on its own memory. A rank's stream to its
// own node has the same words, written by its own warps with local stores (no put).
// The chunk totals live in device words the kernels advance (net_sent on the sender,
// chunks_seen on the receiver), so the words need no epoch and no zeroing between calls, and
// CUDA-graph replays continue the same sequence.
#pragma once
#include "internode/net.cuh"
#include "internode/ring.cuh"

namespace mdeep {
namespace netring {

// What the sender of chunk `g` must see in the slot's credit word: chunk g - K consumed (0:
// the slot was never used, nothing to wait for).
__device__ __forceinline__ u64 credit_needed(u64 g, int chunks) {
    return ring::space_needed(g, chunks);
}

// The warp waits until the chunk word `word` (this rank's symmetric memory) >= `need`.
// `local`: the word belongs to this rank's stream to its own node and its own warps store it;
// else `peer`'s NVSHMEM signal sets it, and the wait goes through NVSHMEM's (its post-wait
// consistency step makes the put's data visible). A free probe first; if it would block, the
// warp publishes its pending ring words and lane 0 completes its outstanding puts and signals
// (a peer may be waiting for exactly these; completing them waits for no kernel), then lane 0
// spins (its timeout names `peer`). Returns the same in every lane; afterwards the whole warp
// may read what the word announced.
__device__ __forceinline__ bool warp_wait(u64* word, u64 need, bool local,
                                          ring::PendingWords& pending, u64 timeout_ns,
                                          const ErrorState& err, int rank, int peer, int phase,
                                          int lane) {
    if (need == 0) return true;  // the same in every lane
    int ok = 0;
    if (lane == 0) ok = (local ? ring::ld_acquire_sys_u64(word) : net::signal_fetch(word)) >= need;
    ok = __shfl_sync(ring::kFullMask, ok, 0);
    if (!ok) {
        pending.flush(lane);
        if (lane == 0) net::quiet();
    }
    if (lane == 0)
        ok = local ? ring::wait_word(word, need, timeout_ns, err, rank, peer, phase)
                   : net::wait_signal_ge(word, need, timeout_ns, err, rank, peer, phase);
    ok = __shfl_sync(ring::kFullMask, ok, 0);
    __syncwarp();  // lane 0's acquire orders the chunk for the other lanes' reads
    return ok != 0;
}

// Sets the chunk word `word` (symmetric) of `pe` to `value`: a system-scope store when it is
// this rank's own (`local`), else an NVSHMEM signal (SET). One thread calls it, after the
// accesses it announces are fenced (it fences its own again first).
__device__ __forceinline__ void set_word(u64* word, u64 value, bool local, int pe) {
    __threadfence_system();
    if (local)
        ring::st_relaxed_sys_u64(word, value);
    else
        net::signal(word, value, pe, net::Signal::kSet);
}

// One of `consumers` consumers of a chunk slot is done with the slot's current chunk (lane 0
// of a warp whose lanes fenced their reads of it). Returns true in exactly one of them, the
// last, which resets the counter for the slot's next chunk (that chunk can only arrive after
// this one's credit, which the caller returns afterwards).
__device__ __forceinline__ bool count_consumed(u32* counter, u32 consumers) {
    const u32 before = atomicAdd(counter, 1u);
    if (before + 1u < consumers) return false;
    atomicExch(counter, 0u);
    return true;
}

}  // namespace netring
}  // namespace mdeep
