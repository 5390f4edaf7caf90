// The network leg alone, for the GPU smoke test and the per-byte cost measurement: every PE
// puts `bytes` to one peer (the internode transport's pattern: the PE with the same local index
// on the next node) with a signal, then waits for its own incoming slot with a timeout.
//   internode_leg_send: block b puts chunk b of `send` into slot [my_pe] of the peer's `recv`
//     and adds 1 to the peer's signals[my_pe] (so after round r the peer sees r * gridDim.x),
//     then completes its puts (quiet). peer < 0: sends nothing (a planted stall for tests).
//   internode_leg_wait: one thread waits until signals[source] >= expected, or records a
//     timeout naming `source`; writes what the kernel saw (my_pe, num_pes) to `info`.
// Built by megatron_deepep/kernels/nvshmem_link.py (NVRTC -rdc + nvJitLink with
// libnvshmem_device.a); launched by ops.bench.internode_leg's internode_leg_send /
// internode_leg_wait with `LegArgs` (common/args.cuh).
#include "common/args.cuh"
#include "internode/net.cuh"

using namespace mdeep;

// Error-record phase of the network leg (error.cuh's phases are the NVLink path's 0-5).
constexpr int kPhaseNetLeg = 6;

__global__ void internode_leg_send(const __grid_constant__ LegArgs args) {
    if (args.peer < 0) return;
    const int me = net::my_pe();
    const i64 chunk = (args.bytes + gridDim.x - 1) / gridDim.x;
    const i64 begin = min(args.bytes, (i64)blockIdx.x * chunk);
    const i64 end = min(args.bytes, begin + chunk);
    // Every block adds its 1, even with an empty chunk, so the count is always gridDim.x.
    net::put_signal_block(args.recv + (i64)me * args.bytes + begin, args.send + begin,
                          (size_t)(end - begin), args.signals + me, 1, args.peer,
                          net::Signal::kAdd);
    __syncthreads();
    if (threadIdx.x == 0) net::quiet();
}

__global__ void internode_leg_wait(const __grid_constant__ LegArgs args) {
    if (threadIdx.x != 0) return;
    const ErrorState err{args.error_claim, args.error_record};
    const int me = net::my_pe();
    net::wait_signal_ge(args.signals + args.source, args.expected, args.timeout_ns, err, me,
                        args.source, kPhaseNetLeg);
    args.info[0] = me;
    args.info[1] = net::num_pes();
}
