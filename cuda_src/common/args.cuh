// Every kernel's argument struct: a kernel takes one of these by value (`const
// __grid_constant__`, read from parameter space like separate parameters). The Python side
// mirrors each one field by field, in this order (megatron_deepep/ops/, `KernelArgs`
// subclasses of the same name); tests/kernels/test_kernel_args.py checks sizes and offsets with
// NVRTC.
// Pointers are 64-bit; `regions` points to a `Regions` in device memory (common/buffer.cuh).
// `epoch_word`: the protocol kernels read their call's epoch from a device word that the
// transport advances in stream order before the call, never from a launch argument, so a CUDA
// graph that captured the calls replays with new epochs (flags and signals keep advancing).
#pragma once
#include "common/buffer.cuh"
#include "common/error.cuh"
#include "common/host_info.cuh"

namespace mdeep {

// layout.cu: layout_kernel. The recv_* fields, host_info .. host_epoch: the EP = 1 receive
// layout (recv_tokens_per_expert null: none).
template <typename IdxT>
struct LayoutArgs {
    const IdxT* topk_idx;
    int num_tokens, num_experts, num_ranks, chunk_tokens;
    int* num_tokens_per_expert;
    int* pos_in_expert;
    int* num_tokens_per_rank;
    u8* is_token_in_rank;
    int* token_slot_in_rank;
    int* slot_token;
    u32* state;
    u32* chunk_status;
    int* chunk_counts;
    u64 timeout_ns;
    int* error_claim;
    ErrorRecord* error_record;
    int rank;
    int* recv_tokens_per_expert;
    int* recv_padded;
    int* recv_row_start;
    int* recv_src_offset;
    int* recv_tokens_per_rank;
    HostInfo* host_info;
    int alignment, max_recv_rows;
    u32 host_epoch;
};

// notify.cu: notify_kernel.
struct NotifyArgs {
    const u64* peer_bases;
    int rank, num_ranks;
    const u32* epoch_word;  // the call's epoch (see the top of this file)
    const int* num_tokens_per_rank;
    const int* num_tokens_per_expert;
    int num_local, hidden, num_topk, alignment, max_recv_rows;
    int* num_recv_tokens_per_rank;
    int* num_recv_tokens_per_expert;
    int* tokens_per_expert;
    int* expert_row_start;
    int* src_expert_offset;
    HostInfo* host_info;
    u32 host_epoch;  // what host_info publishes (a synchronous call's host-side count)
    u64 timeout_ns;
    int* error_claim;
    ErrorRecord* error_record;
};

// dispatch.cu: dispatch_send.
template <typename IdxT>
struct DispatchSendArgs {
    const u8* x;
    const u8* x_scales;
    int num_tokens, hidden;
    float amax_epsilon;
    const IdxT* topk_idx;
    const float* topk_weights;
    const int* pos_in_expert;
    const u8* is_token_in_rank;
    const int* token_slot_in_rank;
    const u64* peer_bases;
    const Regions* regions;
    int rank, num_ranks, num_local;
    const u32* epoch_word;  // the call's epoch (see the top of this file)
    u64 timeout_ns;
    int* error_claim;
    ErrorRecord* error_record;
};

// dispatch.cu: dispatch_recv.
template <typename IdxT>
struct DispatchRecvArgs {
    u8* recv_x;
    u8* recv_scales;
    float* recv_weights;
    int max_rows, hidden;
    const int* num_recv_tokens_per_rank;
    const int* num_recv_tokens_per_expert;
    const int* expert_row_start;
    const int* src_expert_offset;
    int* slot_rows;
    const u8* x;
    const u8* x_scales;
    float amax_epsilon;
    const IdxT* topk_idx;
    const float* topk_weights;
    const int* pos_in_expert;
    const int* slot_token;
    int num_tokens;
    const u64* peer_bases;
    const Regions* regions;
    int rank, num_ranks, num_local;
    const u32* epoch_word;  // the call's epoch (see the top of this file)
    u64 timeout_ns;
    int* error_claim;
    ErrorRecord* error_record;
};

// dispatch.cu: dispatch_fused (EP > 1 over NVLink: send and expand in one launch).
template <typename IdxT>
struct DispatchFusedArgs {
    u8* recv_x;
    u8* recv_scales;
    float* recv_weights;
    int max_rows, hidden;
    const int* num_recv_tokens_per_rank;
    const int* num_recv_tokens_per_expert;
    const int* expert_row_start;
    const int* src_expert_offset;
    int* slot_rows;
    const u8* x;
    const u8* x_scales;
    float amax_epsilon;
    const IdxT* topk_idx;
    const float* topk_weights;
    const int* pos_in_expert;
    const u8* is_token_in_rank;
    const int* token_slot_in_rank;
    int num_tokens;
    const u64* peer_bases;
    const Regions* regions;
    int rank, num_ranks, num_local;
    const u32* epoch_word;  // the call's epoch (see the top of this file)
    u64 timeout_ns;
    int* error_claim;
    ErrorRecord* error_record;
};

// dispatch.cu: dispatch_local (EP = 1). host_info null: nothing published to the host.
template <typename IdxT>
struct DispatchLocalArgs {
    u8* recv_x;
    u8* recv_scales;
    float* recv_weights;
    int max_rows, hidden;
    const int* num_recv_tokens_per_expert;
    const int* expert_row_start;
    int* slot_rows;
    const u8* x;
    const u8* x_scales;
    float amax_epsilon;
    const IdxT* topk_idx;
    const float* topk_weights;
    const int* pos_in_expert;
    const int* token_slot_in_rank;
    int num_tokens, num_local;
    HostInfo* host_info;
    const int* tokens_per_expert;
    u32 host_epoch;
};

// combine.cu: combine_send.
struct CombineSendArgs {
    const int4* y;
    int num_int4;
    const float* recv_weights;
    const float* grad_row_weights;
    const int* slot_rows;
    const int* num_recv_tokens_per_rank;
    const u64* peer_bases;
    const Regions* regions;
    int rank, num_ranks;
    const u32* epoch_word;  // the call's epoch (see the top of this file)
    u64 timeout_ns;
    int* error_claim;
    ErrorRecord* error_record;
};

// combine.cu: combine_reduce.
struct CombineReduceArgs {
    int4* out;
    float* out_weights;
    int num_tokens, num_int4;
    const int4* y;
    const float* recv_weights;
    const float* grad_row_weights;
    const int* slot_rows;
    const u8* is_token_in_rank;
    const int* token_slot_in_rank;
    const u64* peer_bases;
    const Regions* regions;
    int rank, num_ranks;
    const u32* epoch_word;  // the call's epoch (see the top of this file)
    u64 timeout_ns;
    int* error_claim;
    ErrorRecord* error_record;
};

// combine.cu: combine_fused (EP > 1 over NVLink: partials out and sums in one launch).
struct CombineFusedArgs {
    int4* out;
    float* out_weights;
    int num_tokens, num_int4;
    const int4* y;
    const float* recv_weights;
    const float* grad_row_weights;
    const int* slot_rows;
    const int* num_recv_tokens_per_rank;
    const u8* is_token_in_rank;
    const int* token_slot_in_rank;
    const u64* peer_bases;
    const Regions* regions;
    int rank, num_ranks;
    const u32* epoch_word;  // the call's epoch (see the top of this file)
    u64 timeout_ns;
    int* error_claim;
    ErrorRecord* error_record;
};

// combine.cu: combine_local (EP = 1).
struct CombineLocalArgs {
    int4* out;
    float* out_weights;
    int num_tokens, num_int4;
    const int4* y;
    const float* recv_weights;
    const float* grad_row_weights;
    const int* slot_rows;
    const int* token_slot_in_rank;
};

// bench/quantize.cu: quantize_blockwise (ScaleT float: scale_inv) and quantize_mxfp8 (ScaleT
// u8: E8M0, amax_epsilon unused).
template <typename ScaleT>
struct QuantizeArgs {
    const u16* x;
    u8* q;
    ScaleT* scales;
    int num_tokens, hidden;
    float amax_epsilon;
};

// fp8.cu: dequantize_blockwise (ScaleT float) and dequantize_mxfp8 (ScaleT u8).
template <typename ScaleT>
struct DequantizeArgs {
    const u8* q;
    const ScaleT* scales;
    u16* out;
    int num_tokens, hidden;
};

// fp8_columnwise.cu: columnwise_from_rowwise. The row scales of (row r, 128-column block b) are
// at scales[r * token_stride + b * block_stride] (the wire's [rows, nb] or TE's GEMM-ready
// [nb, round_up(rows, 4)]); outputs are packed per expert (layout in fp8_columnwise.cu).
struct ColumnwiseArgs {
    const u8* q;                 // [num_rows, hidden] e4m3, rows grouped by expert
    const float* scales;
    i64 token_stride, block_stride;
    const int* row_offsets;      // [num_experts + 1], device
    u8* col_data;                // [hidden * num_rows] e4m3
    float* col_scales;           // [num_blocks, scale_cols] fp32 scale_inv
    int num_experts, num_rows, hidden, scale_cols, num_blocks;
    float amax_epsilon;
};

// ceiling.cu: fill_kernel.
struct FillArgs {
    int4* dst;
    i64 num_int4;
};

// ceiling.cu: fan_out_copy.
struct FanOutArgs {
    const int4* src;
    const int* dst_rows;
    int4* dst;
    int num_rows, num_int4, fan_out;
};

// ceiling.cu: fan_out_fp8_bytes.
struct FanOutBytesArgs {
    const int4* src;
    const int* dst_rows;
    int4* dst;
    int4* dst_scales;
    int num_rows, num_int4, fan_out, scale_int4, narrow_stores;
};

// ceiling.cu: fan_in_sum.
struct FanInArgs {
    const int4* src;
    const int* src_rows;
    int4* dst;
    int num_rows, num_int4;
};

// ceiling.cu: peer_copy. Rank `rank` writes row d of `src` ([num_ranks, num_int4_per_peer]
// int4, local) into slot `rank` of rank d's symmetric buffer (peer_bases[d] + rank * row bytes),
// for every d != rank.
struct PeerCopyArgs {
    const int4* src;
    const i64* peer_bases;       // [num_ranks] device: every rank's buffer as this rank maps it
    i64 num_int4_per_peer;
    int rank, num_ranks;
};

// internode_leg.cu: internode_leg_send and internode_leg_wait (the network leg alone: the
// GPU tier's smoke test and the per-byte cost the internode model takes).
struct LegArgs {
    u8* recv;                   // symmetric [num_pes][bytes]: slot p receives PE p's bytes
    const u8* send;             // [bytes]: what I send
    u64* signals;               // symmetric [num_pes]: signals[p] counts PE p's chunks landed
    i64 bytes;                  // bytes per PE
    u64 expected;               // wait: signals[source] to wait for
    u64 timeout_ns;             // wait: give up (and record) after this long
    int peer;                   // send: destination PE, < 0: send nothing
    int source;                 // wait: source PE
    int* error_claim;
    ErrorRecord* error_record;
    i64* info;                  // wait: [my_pe, num_pes]
};

// internode/*.cu: every kernel of the internode transport (one struct for the family; a kernel
// reads the fields of its step, the others are null). Offsets are bytes from `heap`, the
// symmetric block of this PE (the same offsets on every PE; megatron_deepep/transport/
// internode_regions.py lays it out). R ranks, L ranks per node, M nodes, N_max slots.
struct InternodeArgs {
    u8* heap;
    i64 notify_recv, notify_send, signals, flags;  // counts [2][R] / [R] rows, u64 / u32 words
    i64 net_send, net_recv;      // [M][N_max] slots of row_stride + record_stride bytes
    i64 stage_rows, stage_meta;  // [R][N_max] rows / SlotMeta of meta_stride bytes
    i64 comb_stage;              // [L][M][N_max] slots of row_stride + weight_stride bytes
    i64 comb_send, comb_recv;    // [M][N_max] slots of row_stride + weight_stride bytes
    i64 row_stride, record_stride, meta_stride, weight_stride;
    int max_tokens, chunk_tokens;
    int rank, num_ranks, ranks_per_node, num_nodes;
    const int* pe_of_rank;       // [R]: NVSHMEM PE of each EP rank
    const u32* epoch_word;       // the call's epoch (see the top of this file)
    u64 timeout_ns;
    int* error_claim;
    ErrorRecord* error_record;
    u32* block_counters;         // local [8]
    u64* chunks_seen;            // local [2][M]: dispatch, combine chunks received per node
    // Sender-side layout.
    const void* topk_idx;        // [N, K] int or long long (the kernel's IdxT)
    const float* topk_weights;
    const int* pos_in_expert;
    const int* num_tokens_per_rank;
    const int* num_tokens_per_expert;
    const u8* is_token_in_rank;
    const int* token_slot_in_rank;
    int* num_tokens_per_node;    // [M]
    int* token_slot_in_node;     // [N, M]
    int* node_slot_token;        // [M, N]
    int num_tokens, num_experts, num_local, hidden, num_topk, alignment, max_recv_rows;
    // Receive layout and forwarding state (the handle's).
    int* num_recv_tokens_per_rank;
    int* num_recv_tokens_per_expert;
    int* tokens_per_expert;
    int* expert_row_start;
    int* src_expert_offset;
    int* fwd_count;              // [M]: tokens from the rail peer on each node
    int* fwd_slots;              // [M, N_max, L]: their slot on each rank of this node, or -1
    int* slot_rows;              // [R, N_max, K]
    HostInfo* host_info;
    u32 host_epoch;              // what host_info publishes
    // Rows.
    const u8* x;                 // [N, H] bf16
    u8* recv_x;                  // [max_rows, H] bf16
    float* recv_weights;
    int max_rows;
    const u8* y;                 // [M_rows, H] bf16
    u8* out;                     // [N, H] bf16
    float* out_weights;          // [N, K]
    const float* grad_row_weights;
    // FP8 dispatch (kFmt != bf16): the network and the staging carry wire rows (e4m3 data, then
    // the row's scales) of `wire_bytes`.
    const u8* x_scales;          // pre-quantized input's scales, or null (quantized in send)
    u8* recv_scales;             // [max_rows, scale bytes] when the rows stay in FP8
    float amax_epsilon;
    i64 wire_bytes;              // bytes of one wire row (2 H for bf16)
    // Ring staging (MDEEP_INTERNODE_STAGING=ring; internode/ring.cuh): stage_rows / stage_meta
    // then hold [L][ring_slots] slots by forwarder, comb_stage [L][ring_slots] by expert rank.
    // Zero in the full layout, whose kernels read none of these.
    i64 ring_words;              // u64 [4][L][ring_slots]: dispatch ready, freed; combine same
    u64* ring_seen;              // local [4][8]: ring positions so far (internode/ring_rows.cuh)
    int* ring_base;              // [L][M + 1]: per node rank, first position per source node
    int ring_slots;              // C
    // Network ring (MDEEP_INTERNODE_NET_RING_CHUNKS, ring staging only; internode/net_ring.cuh):
    // net_send / net_recv / comb_send / comb_recv then hold [M][net_chunks][chunk_tokens]
    // slots. Zero without it, and no kernel of the other layouts reads these.
    i64 net_words;               // u64 [4][M][net_chunks]: dispatch ready, credit; combine same
    i64 net_counters;            // u32 [2][M][net_chunks]: consumers done per received chunk
    i64 rail_counts;             // u64 signals [2][M], int [2][M][8] received, int [M][8] sent
    u64* net_sent;               // local [2][M]: dispatch, combine chunks sent to each node
    int net_chunks;              // K: chunk slots per rail peer and region
};

}  // namespace mdeep
