// Bounded rings between the ranks of one node (MDEEP_INTERNODE_STAGING=ring; docs/internode.md,
// "Ring staging"): the words that say which ring slots hold rows and which were consumed, and
// the waits on them.
//
// A ring of C slots carries one ordered stream of rows from one producer rank to one consumer
// rank. Every row has a position Q, counted from the buffer's start and never reset (u64: no
// wrap), so slot Q % C holds positions Q, Q + C, Q + 2 C, ... in turn. Per slot two words:
//   ready (on the consumer)  = Q + 1 once the producer has written position Q into the slot
//   freed (on the producer)  = Q + 1 once the consumer has read position Q out of it
// The producer of Q waits for freed >= Q + 1 - C (position Q - C consumed); the consumer of Q
// waits for ready >= Q + 1. Each side spins on words in its own memory; the other side stores
// them over NVLink. Positions carry across calls and CUDA-graph replays (the running totals live
// in device words), so the words need no epoch and no zeroing between calls.
#pragma once
#include "common/error.cuh"

namespace mdeep {
namespace ring {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ u64 ld_acquire_sys_u64(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// Relaxed at system scope: the caller fenced the row it announces before.
__device__ __forceinline__ void st_relaxed_sys_u64(u64* p, u64 v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Spins until `*word` >= `need`, or records a timeout (rank, the peer that owes the word,
// phase, expected = need, seen) and returns false. Gives up at once when another wait of the
// buffer already failed. One thread calls it.
__device__ __forceinline__ bool wait_word(const u64* word, u64 need, u64 timeout_ns,
                                          const ErrorState& err, int rank, int peer, int phase) {
    const u64 start = global_timer_ns();
    for (u32 iter = 0;; ++iter) {
        const u64 seen = ld_acquire_sys_u64(word);
        if (seen >= need) return true;
        if ((iter & 255u) == 255u) {
            if (has_error(err)) return false;
            if (global_timer_ns() - start > timeout_ns) {
                record_error(err, kErrTimeout, rank, peer, phase, 0, (i64)need, (i64)seen);
                return false;
            }
        }
    }
}

// Ring words a warp has yet to publish, lane k holding the k-th (`count` is the same in every
// lane): the ready words of rows it wrote, or the freed words of rows it read. Publishing them
// together costs one system fence for up to 32 rows. The warp must publish before it blocks
// (a peer may be waiting for exactly these words) and before it ends.
struct PendingWords {
    u64* word = nullptr;
    u64 value = 0;
    int count = 0;

    // The warp: every row's stores (or loads) are done before, in every lane.
    __device__ __forceinline__ void flush(int lane) {
        if (count == 0) return;
        __threadfence_system();  // each lane's row stores before any word
        __syncwarp();
        if (lane < count) st_relaxed_sys_u64(word, value);
        __syncwarp();
        count = 0;
    }

    __device__ __forceinline__ void add(u64* w, u64 v, int lane) {
        if (lane == count) {
            word = w;
            value = v;
        }
        if (++count == 32) flush(lane);
    }
};

// The warp waits until `*word` >= `need`. A free probe first; if it would block, the warp
// publishes its pending words, then lane 0 spins (its timeout names `peer`). Returns the same
// in every lane; afterwards the whole warp may read what the word announced.
__device__ __forceinline__ bool warp_wait_word(const u64* word, u64 need, PendingWords& pending,
                                               u64 timeout_ns, const ErrorState& err, int rank,
                                               int peer, int phase, int lane) {
    int ok = 0;
    if (lane == 0) ok = ld_acquire_sys_u64(word) >= need;
    ok = __shfl_sync(kFullMask, ok, 0);
    if (!ok) {
        pending.flush(lane);
        if (lane == 0) ok = wait_word(word, need, timeout_ns, err, rank, peer, phase);
        ok = __shfl_sync(kFullMask, ok, 0);
    }
    __syncwarp();  // lane 0's acquire orders the slot for the other lanes' reads
    return ok != 0;
}

// What the producer of position `pos` must see in the slot's freed word: position pos - C
// consumed (0: the slot was never used, nothing to wait for).
__device__ __forceinline__ u64 space_needed(u64 pos, int slots) {
    return pos + 1 > (u64)slots ? pos + 1 - (u64)slots : 0;
}

}  // namespace ring
}  // namespace mdeep
