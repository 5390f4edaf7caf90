// The network leg's device interface: put with signal, wait for a signal (with a timeout),
// quiet, and who am I. Dispatch and combine call only these, so a second engine (NCCL's device
// API, GIN) can slot in by reimplementing this header, without touching their logic.
//
// This implementation: NVSHMEM's device API (linked by megatron_deepep/kernels/nvshmem_link.py
// against
// the nvidia-nvshmem-cu13 wheel's libnvshmem_device.a). Addresses passed as `dst` and `signal`
// are symmetric: the local address of an object allocated on the symmetric heap
// (torch's symm_mem.empty with the NVSHMEM backend); the engine translates them for `pe`.
// `src` may be any local device memory (on the IBRC/IBGDA transports it must be on the
// symmetric heap or registered; keep it there).
//
// Ordering: a put_signal delivers its data before the signal's new value becomes visible at
// `pe`; wait_signal_ge returning true makes that data visible to the calling thread; the caller
// spreads it to the rest of its block or grid with __syncthreads() / its own flags.
#pragma once
#include <nvshmem.h>
#include <nvshmemx.h>

#include "common/error.cuh"

namespace mdeep {
namespace net {

// How a put_signal updates the signal word at the destination.
enum class Signal : int {
    kSet = NVSHMEM_SIGNAL_SET,  // signal = value (one writer per signal word)
    kAdd = NVSHMEM_SIGNAL_ADD,  // signal += value (several writers count up one word)
};

__device__ __forceinline__ int my_pe() { return nvshmem_my_pe(); }

__device__ __forceinline__ int num_pes() { return nvshmem_n_pes(); }

// Non-blocking put of `bytes` from local `src` to symmetric `dst` on `pe`, then the signal
// update at symmetric `signal` on `pe`. Every thread of the block calls it with the same
// arguments (a collective of the block). `src` may be reused only after quiet().
__device__ __forceinline__ void put_signal_block(void* dst, const void* src, size_t bytes,
                                                 u64* signal, u64 value, int pe,
                                                 Signal op = Signal::kSet) {
    nvshmemx_putmem_signal_nbi_block(dst, src, bytes, signal, value, static_cast<int>(op), pe);
}

// The same for one warp: every lane calls it with the same arguments.
__device__ __forceinline__ void put_signal_warp(void* dst, const void* src, size_t bytes,
                                                u64* signal, u64 value, int pe,
                                                Signal op = Signal::kSet) {
    nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, signal, value, static_cast<int>(op), pe);
}

// Updates the symmetric `signal` word on `pe` alone (no data): one thread calls it. Used for
// acknowledgements ("I consumed your data of epoch e"), so it needs no quiet before reuse.
__device__ __forceinline__ void signal(u64* signal, u64 value, int pe, Signal op = Signal::kSet) {
    nvshmemx_signal_op(signal, value, static_cast<int>(op), pe);
}

// The current value of the local symmetric `signal` (no wait, no ordering): a probe before a
// wait_signal_ge, which the caller still makes before it reads what the signal announced.
__device__ __forceinline__ u64 signal_fetch(u64* signal) { return nvshmem_signal_fetch(signal); }

// A pointer through which this thread can load and store `pe`'s copy of the symmetric object
// at `sym`, or null when `pe` is not reachable by load/store (another node). Ranks of one node
// (NVLink P2P, or processes sharing a GPU) are reachable.
__device__ __forceinline__ void* peer_ptr(void* sym, int pe) { return nvshmem_ptr(sym, pe); }

// Completes every put this thread (or the threadgroup it issued them with) has outstanding:
// afterwards their source buffers may be reused. Call from one thread after the block's or
// warp's puts (after __syncthreads() / __syncwarp()).
__device__ __forceinline__ void quiet() { nvshmem_quiet(); }

// Whether a signal has reached `need`, wrap-safe like wait_epoch (common/error.cuh): epoch
// signals carry the call's 32-bit epoch (after 2^32 calls it restarts at 0, which a 64-bit `>=`
// would take as reached at once, and a peer already there would never reach the previous
// 2^32 - 1), and running chunk counts are never 2^31 away from what a wait needs, so both
// compare as the signed difference of their low 32 bits.
__host__ __device__ constexpr bool signal_reached(u64 seen, u64 need) {
    return epoch_reached((u32)seen, (u32)need);
}

// Spins until the local symmetric `signal` (written by `peer`'s put_signal) has reached `value`
// (`signal_reached`), or records a timeout (rank, peer, phase, expected = value, seen) in `err`
// and returns false, never hanging. Also gives up at once when another wait of the same error
// state already failed. One thread calls it.
__device__ __forceinline__ bool wait_signal_ge(u64* signal, u64 value, u64 timeout_ns,
                                               const ErrorState& err, int rank, int peer,
                                               int phase) {
    const u64 start = global_timer_ns();
    for (u32 iter = 0;; ++iter) {
        const u64 seen = nvshmem_signal_fetch(signal);
        if (signal_reached(seen, value)) {
            // NVSHMEM's post-wait consistency step, which a bare polled load skips: on proxy
            // transports (IBRC) it makes the proxy enforce the put's data at this target before
            // we read it. nvshmem_uint64_wait_until runs it after its compare;
            // nvshmem_signal_wait_until does not (it only spins), so it is not the one to use.
            // Its compare is a plain 64-bit >=, so it gets 0, which holds at once (the real,
            // wrap-safe compare is above).
            nvshmem_uint64_wait_until(signal, NVSHMEM_CMP_GE, 0);
            return true;
        }
        if ((iter & 255u) == 255u) {
            if (has_error(err)) return false;
            if (global_timer_ns() - start > timeout_ns) {
                record_error(err, kErrTimeout, rank, peer, phase, 0, (i64)value, (i64)seen);
                return false;
            }
        }
    }
}

}  // namespace net
}  // namespace mdeep
