// Typed views of one rank's symmetric buffer. Every rank's buffer has the same layout, so a
// region of peer r is `peer_base[r] + offset`. Offsets come from the host
// (megatron_deepep/transport/regions.py, which mirrors this file).
#pragma once
#include "common/types.cuh"

namespace mdeep {

constexpr int kCountStride = 8 + kMaxLocalExperts;  // header ints, then per-expert counts
// Header ints of a notify row.
constexpr int kHdrTokens = 0, kHdrHidden = 1, kHdrTopk = 2, kHdrExperts = 3, kHdrAlign = 4;

// The metadata region at offset 0 of every buffer. Index [s] of a flag array is written by peer s.
struct Meta {
    u32 notify_flag[kMaxRanks];
    u32 dispatch_done[kMaxRanks];
    u32 dispatch_consumed[kMaxRanks];
    u32 combine_done[kMaxRanks];
    u32 combine_consumed[kMaxRanks];
    u32 pad[3 * kMaxRanks];
    // Notify's rows, in the half of the call's epoch parity: a peer already in the next call's
    // notify writes the other half, so rows still being read are never overwritten (a peer can
    // be at most one notify ahead: the next one waits for this rank's flag of the current one).
    int counts[2][kMaxRanks][kCountStride];
};

// The half of Meta::counts notify uses at `epoch`.
__host__ __device__ constexpr int counts_half(u32 epoch) { return (int)(epoch & 1u); }

// Block-completion counters, local to the owning rank (never written by peers).
// work_counter: the next item each role of a fused NVLink kernel hands out (kWork*), reset by
// the kernel's last block. kernel_arrivals / kernel_epoch: per kind of fused kernel, how many
// of its blocks have started and the epoch it last completed (a call that overlaps another of
// its kind, or reuses its epoch, is refused: `check_call_alone`).
struct Workspace {
    u32 block_counter[8];
    int error_claim;
    u32 work_counter[4];
    u32 kernel_arrivals[2];
    u32 kernel_epoch[2];
};

// Workspace::work_counter and kernel_* indices of the fused NVLink kernels.
constexpr int kWorkDispatchSend = 0, kWorkDispatchRecv = 1;
constexpr int kWorkCombineSend = 2, kWorkCombineReduce = 3;
constexpr int kKindDispatch = 0, kKindCombine = 1;

// Where the staging regions are, per call (all byte offsets from the buffer base).
struct Regions {
    i64 dispatch_rows;      // [R][N_max] rows of row_stride bytes
    i64 dispatch_meta;      // [R][N_max] slot metadata of meta_stride bytes
    i64 combine_rows;       // [R][N_max] partial rows of row_stride bytes
    i64 combine_weights;    // [R][N_max] K floats of weight_stride bytes
    i64 dispatch_flags;     // [R][N_max] u32: the epoch of the dispatch that filled the slot
    i64 combine_flags;      // [R][N_max] u32: the epoch of the combine that filled the slot
    i64 row_stride;
    i64 meta_stride;
    i64 weight_stride;
    int max_tokens;         // N_max
    int workspace;          // offset of Workspace (local)
};

__device__ __forceinline__ Meta* meta_of(u64 base) { return reinterpret_cast<Meta*>(base); }

// The epoch word of slot [src][slot] in a flag region (dispatch_flags, combine_flags).
__device__ __forceinline__ u32* slot_flag(u64 base, i64 region, int max_tokens, int src,
                                         int slot) {
    return reinterpret_cast<u32*>(reinterpret_cast<char*>(base) + region) +
           (i64)src * max_tokens + slot;
}

__device__ __forceinline__ char* slot_ptr(u64 base, i64 region, i64 stride, int max_tokens,
                                          int src, int slot) {
    return reinterpret_cast<char*>(base) + region + ((i64)src * max_tokens + slot) * stride;
}

// Slot metadata written by the sender next to each staged row: the source token, then per k
// the destination-local expert (or -1), the entry's position in that expert and its weight.
template <int kTopk>
struct SlotMeta {
    int token;
    int local_expert[kTopk];
    int pos[kTopk];
    float weight[kTopk];
};

}  // namespace mdeep
