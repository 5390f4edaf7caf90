// The two steps every communication kernel shares: wait for a flag from every peer at the start,
// and release a flag to every peer once the last block is done.
#pragma once
#include "common/buffer.cuh"
#include "common/error.cuh"
#include "common/warp.cuh"

namespace mdeep {

// Thread p waits until flags[p] (written by peer p) reaches `epoch`. Returns, in every thread of
// the block, whether all waits succeeded (a failed wait has recorded which peer stalled) and,
// with `give_up_on_error`, whether this rank has no error recorded. After an error the Buffer is
// broken (the host raises at its next call), but calls queued before the host saw it still run:
// a kernel that reads what an earlier kernel of its call wrote (the receive layout of a notify
// that gave up, the rows of a dispatch that did) must then do nothing, even where the peers'
// flags are already there. Notify passes false: EP = 1's given-layout dispatch reads its layout
// with no error check of its own, as before.
__device__ __forceinline__ bool block_wait_peers(const u32* flags, u32 epoch, int num_ranks,
                                                 int rank, bool include_self, u64 timeout_ns,
                                                 const ErrorState& err, int phase,
                                                 bool give_up_on_error = true) {
    __shared__ int failed;
    if (threadIdx.x == 0) failed = 0;
    __syncthreads();
    const int peer = threadIdx.x;
    if (peer < num_ranks && (include_self || peer != rank) &&
        !wait_epoch(&flags[peer], epoch, timeout_ns, err, rank, peer, phase))
        failed = 1;
    __syncthreads();
    if (give_up_on_error) {
        if (threadIdx.x == 0 && has_error(err)) failed = 1;  // one reader: a uniform answer
        __syncthreads();
    }
    return failed == 0;
}

// Call from every thread at the end of a kernel: once the last block has finished (its writes
// fenced), releases `epoch` into flag [rank] of every peer's Meta::*kFlags, unless an error was
// recorded (peers then time out instead of reading garbage).
template <u32 (Meta::*kFlags)[kMaxRanks]>
__device__ __forceinline__ void release_peers_when_done(const u64* peer_bases, const Regions& rg,
                                                        int counter, int rank, int num_ranks,
                                                        u32 epoch, const ErrorState& err) {
    auto* ws = reinterpret_cast<Workspace*>(reinterpret_cast<char*>(peer_bases[rank]) +
                                            rg.workspace);
    if (last_block_done(&ws->block_counter[counter]) && !has_error(err))
        for (int r = 0; r < num_ranks; ++r)
            if (r != rank) st_release_sys(&(meta_of(peer_bases[r])->*kFlags)[rank], epoch);
}

}  // namespace mdeep
