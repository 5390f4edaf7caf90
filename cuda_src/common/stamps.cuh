// Phase clocks for measurement runs (scripts/probe_phases.py): built with MDEEP_STAMPS=1
// (MEGATRON_DEEPEP_JIT_DEFINES), thread 0 of each block takes globaltimer stamps at a kernel's
// phase ends and prints them when the block ends; with the default 0 all of it compiles away.
#pragma once
#include "common/ptx.cuh"

#ifndef MDEEP_STAMPS
#define MDEEP_STAMPS 0
#endif

namespace mdeep {

constexpr int kMaxStamps = 8;

struct PhaseStamps {
    u64 ns[kMaxStamps] = {};

    // Stamps phase `i` (a constant, so the stamps stay in registers).
    __device__ __forceinline__ void mark(int i) {
        if (MDEEP_STAMPS && threadIdx.x == 0) ns[i] = global_timer_ns();
    }

    // One line per block: "mdeep-stamps <kernel> <block> <ns 0> ... <ns 7>" (0: not reached).
    __device__ __forceinline__ void print(const char* kernel) const {
        if (MDEEP_STAMPS && threadIdx.x == 0)
            printf("mdeep-stamps %s %d %llu %llu %llu %llu %llu %llu %llu %llu\n", kernel,
                   (int)blockIdx.x, ns[0], ns[1], ns[2], ns[3], ns[4], ns[5], ns[6], ns[7]);
    }
};

}  // namespace mdeep
