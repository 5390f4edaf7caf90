// The error record: the first failing wait or check writes (code, rank, peer, phase, detail,
// expected, seen) there and every kernel of the buffer stops early. The record lives in
// host-mapped pinned memory, so Python reads it without synchronizing the device; the claim word
// lives in device memory (system-scope atomics on host memory are not portable).
#pragma once
#include "common/ptx.cuh"

namespace mdeep {

enum ErrorCode : int {
    kErrNone = 0,
    kErrTimeout = 1,
    kErrBadExpertId = 2,
    kErrRankMismatch = 3,
    kErrRecvOverflow = 4,
    // 5: internode/common.cuh's kErrPeerUnreachable
    kErrBadPeerRow = 6,       // a peer's slot record names a row outside its expert's segment
    kErrConcurrentCall = 7,   // two calls of one buffer overlapped or shared an epoch
};

enum Phase : int {
    kPhaseLayout = 0,
    kPhaseNotify = 1,
    kPhaseDispatchSend = 2,
    kPhaseDispatchRecv = 3,
    kPhaseCombineSend = 4,
    kPhaseCombineReduce = 5,
};

struct ErrorRecord {  // 40 bytes, mirrored by megatron_deepep/transport/errors.py
    int code;
    int rank;
    int peer;
    int phase;
    int detail;
    int pad;
    i64 expected;
    i64 seen;
};

struct ErrorState {
    int* claim;            // device memory: 0 until the first error
    ErrorRecord* record;   // host-mapped
};

__device__ __forceinline__ bool has_error(const ErrorState& e) { return ld_volatile(e.claim) != 0; }

__device__ __noinline__ void record_error(const ErrorState& e, int code, int rank, int peer,
                                          int phase, int detail, i64 expected, i64 seen) {
    if (atomicCAS(e.claim, 0, 1) != 0) return;
    ErrorRecord* r = e.record;
    st_volatile(&r->rank, rank);
    st_volatile(&r->peer, peer);
    st_volatile(&r->phase, phase);
    st_volatile(&r->detail, detail);
    st_volatile64(&r->expected, expected);
    st_volatile64(&r->seen, seen);
    __threadfence_system();
    st_volatile(&r->code, code);
    __threadfence_system();
}

// Whether `seen` has reached `need`, across the 32-bit wrap: epochs restart at 0 after 2^32
// calls, and a flag is never 2^31 calls away from what a wait needs.
__host__ __device__ constexpr bool epoch_reached(u32 seen, u32 need) {
    return (int)(seen - need) >= 0;
}

// Spins until `*flag` reaches `epoch` (wrap-safe), or records a timeout naming `peer` and
// returns false. Also gives up at once when another wait of this buffer already failed.
__device__ __forceinline__ bool wait_epoch(const u32* flag, u32 epoch, u64 timeout_ns,
                                           const ErrorState& err, int rank, int peer, int phase) {
    const u64 start = global_timer_ns();
    for (u32 iter = 0;; ++iter) {
        const u32 seen = ld_acquire_sys(flag);
        if (epoch_reached(seen, epoch)) return true;
        if ((iter & 255u) == 255u) {
            if (has_error(err)) return false;
            if (global_timer_ns() - start > timeout_ns) {
                record_error(err, kErrTimeout, rank, peer, phase, 0, (i64)epoch, (i64)seen);
                return false;
            }
        }
    }
}

}  // namespace mdeep
