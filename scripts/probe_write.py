#!/usr/bin/env python3
"""Write-rate probe: how fast can this GPU write rows, and which store path gets there?

The EP=1 expand writes M = N * K rows and reads only N, so the write rate bounds it. This probe
measures, on one buffer of the size the bench's first shape writes:
  - fills: torch `zero_`, plain 16-byte stores, streaming (`.cs`) stores, TMA bulk stores from a
    zeroed shared-memory tile;
  - the expand pattern (read a row once, write it to K scattered rows) with plain stores,
    streaming stores, TMA (bulk load of the row into shared memory, K bulk stores from it), and
    in global phases (batches of rows read into shared memory, a grid barrier, their K copies
    written, a grid barrier), with and without the barriers.

    python scripts/probe_write.py [--tokens 4096 --hidden 7168 --topk 8]

Prints one line per variant (µs, GB/s written, GB/s read + written) and a table at the end.
Needs CuPy and a GPU; it is a measurement script, not part of the library.
"""

from __future__ import annotations

import argparse
import statistics

import cupy as cp
import torch

SOURCE = r"""
typedef unsigned long long u64;

__device__ __forceinline__ void st_plain(int4* p, int4 v) { *p = v; }
__device__ __forceinline__ void st_cs(int4* p, int4 v) {
    asm volatile("st.global.cs.v4.s32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ int4 ld_nc(const int4* p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

template <bool kCs>
__device__ __forceinline__ void fill_impl(int4* dst, long long n) {
    const int4 z = make_int4(0, 0, 0, 0);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        if (kCs) st_cs(dst + i, z); else st_plain(dst + i, z);
    }
}
extern "C" __global__ void fill_plain(int4* dst, long long n) { fill_impl<false>(dst, n); }
extern "C" __global__ void fill_cs(int4* dst, long long n) { fill_impl<true>(dst, n); }

// One thread per block streams `chunk`-byte bulk stores from a zeroed tile.
extern "C" __global__ void fill_tma(char* dst, long long bytes, int chunk) {
    extern __shared__ __align__(128) int4 tile[];
    for (int i = threadIdx.x; i < chunk / 16; i += blockDim.x) tile[i] = make_int4(0, 0, 0, 0);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x != 0) return;
    const unsigned src = (unsigned)__cvta_generic_to_shared(tile);
    const long long num_chunks = bytes / chunk;
    for (long long c = blockIdx.x; c < num_chunks; c += gridDim.x) {
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     :: "l"(dst + c * chunk), "r"(src), "r"(chunk) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 8;" ::: "memory");
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Expand, warp per token: x[n] -> out[rows[n * K + k]] for k < K (rows < 0 skipped).
template <bool kCs, int kUnroll>
__device__ __forceinline__ void expand_impl(const int4* x, const int* rows, int4* out,
                                            int num_tokens, int num_int4, int topk) {
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int num_warps = (gridDim.x * blockDim.x) >> 5;
    for (int n = warp; n < num_tokens; n += num_warps) {
        int my_row = lane < topk ? rows[(long long)n * topk + lane] : -1;
        for (int base = 0; base < num_int4; base += 32 * kUnroll) {
            int4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int i = base + u * 32 + lane;
                if (i < num_int4) v[u] = ld_nc(x + (long long)n * num_int4 + i);
            }
            for (int k = 0; k < topk; ++k) {
                const int r = __shfl_sync(0xffffffff, my_row, k);
                if (r < 0) continue;
                int4* d = out + (long long)r * num_int4;
#pragma unroll
                for (int u = 0; u < kUnroll; ++u) {
                    const int i = base + u * 32 + lane;
                    if (i < num_int4) { if (kCs) st_cs(d + i, v[u]); else st_plain(d + i, v[u]); }
                }
            }
        }
    }
}
__device__ __forceinline__ void st_evict_first(int4* p, int4 v, u64 policy) {
    asm volatile("st.global.L2::cache_hint.v4.s32 [%0], {%1, %2, %3, %4}, %5;"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(policy) : "memory");
}

// The expand with the next chunk's loads in flight while this chunk's stores issue
// (register double buffer); kPolicy: stores carry an L2 evict-first policy.
template <bool kPolicy>
__device__ __forceinline__ void expand_pipelined_impl(const int4* x, const int* rows, int4* out,
                                                      int num_tokens, int num_int4, int topk) {
    constexpr int kU = 8;
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int num_warps = (gridDim.x * blockDim.x) >> 5;
    u64 policy = 0;
    if (kPolicy)
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    const int chunks_per_row = (num_int4 + 32 * kU - 1) / (32 * kU);
    // Work items: (token, chunk) in token-major order, this warp's share.
    const long long total = (long long)num_tokens * chunks_per_row;
    long long item = warp;
    int4 cur[kU], nxt[kU];
    auto load = [&](long long it, int4* v) {
        const int n = (int)(it / chunks_per_row), c = (int)(it % chunks_per_row);
#pragma unroll
        for (int u = 0; u < kU; ++u) {
            const int i = c * 32 * kU + u * 32 + lane;
            if (i < num_int4) v[u] = ld_nc(x + (long long)n * num_int4 + i);
        }
    };
    if (item < total) load(item, cur);
    for (; item < total; item += num_warps) {
        const long long next = item + num_warps;
        if (next < total) load(next, nxt);
        const int n = (int)(item / chunks_per_row), c = (int)(item % chunks_per_row);
        int my_row = lane < topk ? rows[(long long)n * topk + lane] : -1;
        for (int k = 0; k < topk; ++k) {
            const int r = __shfl_sync(0xffffffff, my_row, k);
            if (r < 0) continue;
            int4* d = out + (long long)r * num_int4;
#pragma unroll
            for (int u = 0; u < kU; ++u) {
                const int i = c * 32 * kU + u * 32 + lane;
                if (i < num_int4) {
                    if (kPolicy) st_evict_first(d + i, cur[u], policy);
                    else st_plain(d + i, cur[u]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) cur[u] = nxt[u];
    }
}
extern "C" __global__ void expand_pipelined(const int4* x, const int* rows, int4* out, int n,
                                            int num_int4, int topk) {
    expand_pipelined_impl<false>(x, rows, out, n, num_int4, topk);
}
extern "C" __global__ void expand_pipelined_ef(const int4* x, const int* rows, int4* out, int n,
                                               int num_int4, int topk) {
    expand_pipelined_impl<true>(x, rows, out, n, num_int4, topk);
}

// The expand's stores without its loads: K scattered copies of a constant row.
extern "C" __global__ void scatter_only(const int* rows, int4* out, int num_tokens, int num_int4,
                                        int topk) {
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int num_warps = (gridDim.x * blockDim.x) >> 5;
    const int4 v = make_int4(lane, 1, 2, 3);
    for (int n = warp; n < num_tokens; n += num_warps) {
        int my_row = lane < topk ? rows[(long long)n * topk + lane] : -1;
        for (int k = 0; k < topk; ++k) {
            const int r = __shfl_sync(0xffffffff, my_row, k);
            if (r < 0) continue;
            int4* d = out + (long long)r * num_int4;
            for (int i = lane; i < num_int4; i += 32) st_plain(d + i, v);
        }
    }
}

extern "C" __global__ void expand_plain(const int4* x, const int* rows, int4* out, int n,
                                        int num_int4, int topk) {
    expand_impl<false, 8>(x, rows, out, n, num_int4, topk);
}
extern "C" __global__ void expand_cs(const int4* x, const int* rows, int4* out, int n,
                                     int num_int4, int topk) {
    expand_impl<true, 8>(x, rows, out, n, num_int4, topk);
}

// Expand through TMA: one thread per block keeps `stages` rows in flight in shared memory
// (bulk load, mbarrier-completed), then issues K bulk stores per row.
extern "C" __global__ void expand_tma(const char* x, const int* rows, char* out, int num_tokens,
                                      int row_bytes, int topk, int stages) {
    extern __shared__ __align__(128) char smem[];
    __shared__ __align__(8) u64 bar[16];
    if (threadIdx.x != 0) return;
    const unsigned base = (unsigned)__cvta_generic_to_shared(smem);
    for (int s = 0; s < stages; ++s) {
        const unsigned b = (unsigned)__cvta_generic_to_shared(&bar[s]);
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(b) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    auto issue_load = [&](int it) {
        const int n = blockIdx.x + it * gridDim.x;
        if (n >= num_tokens) return;
        const int s = it % stages;
        const unsigned b = (unsigned)__cvta_generic_to_shared(&bar[s]);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(b), "r"(row_bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                     "[%0], [%1], %2, [%3];"
                     :: "r"(base + s * row_bytes), "l"(x + (long long)n * row_bytes),
                        "r"(row_bytes), "r"(b) : "memory");
    };
    for (int it = 0; it < stages; ++it) issue_load(it);
    for (int it = 0;; ++it) {
        const int n = blockIdx.x + it * gridDim.x;
        if (n >= num_tokens) break;
        const int s = it % stages;
        const unsigned b = (unsigned)__cvta_generic_to_shared(&bar[s]);
        const unsigned parity = (it / stages) & 1;
        unsigned done = 0;
        while (!done) {
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;"
                         " selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(b), "r"(parity) : "memory");
        }
        for (int k = 0; k < topk; ++k) {
            const int r = rows[(long long)n * topk + k];
            if (r < 0) continue;
            asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                         :: "l"(out + (long long)r * row_bytes), "r"(base + s * row_bytes),
                            "r"(row_bytes) : "memory");
        }
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        // The stage is refilled once its stores have read it.
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        issue_load(it + stages);
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
// The expand in global phases: every block (one per SM) loads `rows_per_block` token rows into
// shared memory, all blocks meet at a grid barrier, then write the K copies of those rows and
// meet again, so DRAM sees read bursts and write bursts instead of a 1:K mix. kBarrier = false
// keeps the per-block batches without the grid barriers (the same phases, unsynchronized).
__device__ __forceinline__ void grid_barrier(unsigned* count, volatile unsigned* gen) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned my_gen = *gen;
        __threadfence();
        if (atomicAdd(count, 1u) == gridDim.x - 1) {
            *count = 0;
            __threadfence();
            atomicAdd((unsigned*)gen, 1u);
        } else {
            while (*gen == my_gen) {}
        }
        __threadfence();
    }
    __syncthreads();
}
template <bool kBarrier>
__device__ __forceinline__ void expand_phased_impl(const int4* x, const int* rows, int4* out,
                                                   int num_tokens, int num_int4, int topk,
                                                   int rows_per_block, unsigned* sync) {
    extern __shared__ __align__(128) int4 row_tile[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    const int per_phase = rows_per_block * gridDim.x;
    for (int first = 0; first < num_tokens; first += per_phase) {
        const int n0 = first + blockIdx.x * rows_per_block;
        const int count = max(0, min(rows_per_block, num_tokens - n0));
        const int words = count * num_int4;
        for (int i = threadIdx.x; i < words; i += blockDim.x)
            row_tile[i] = ld_nc(x + (long long)n0 * num_int4 + i);
        if (kBarrier) grid_barrier(sync, sync + 1); else __syncthreads();
        for (int item = warp; item < count * topk; item += num_warps) {
            const int t = item / topk, r = rows[(long long)(n0 + t) * topk + item % topk];
            if (r < 0) continue;
            const int4* s = row_tile + t * num_int4;
            int4* d = out + (long long)r * num_int4;
            for (int i = lane; i < num_int4; i += 32) st_plain(d + i, s[i]);
        }
        if (kBarrier) grid_barrier(sync, sync + 1); else __syncthreads();
    }
}
extern "C" __global__ void expand_phased(const int4* x, const int* rows, int4* out, int n,
                                         int num_int4, int topk, int rows_per_block,
                                         unsigned* sync) {
    expand_phased_impl<true>(x, rows, out, n, num_int4, topk, rows_per_block, sync);
}
extern "C" __global__ void expand_batched(const int4* x, const int* rows, int4* out, int n,
                                          int num_int4, int topk, int rows_per_block,
                                          unsigned* sync) {
    expand_phased_impl<false>(x, rows, out, n, num_int4, topk, rows_per_block, sync);
}
"""


def time_us(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    args = p.parse_args()
    n, h, k = args.tokens, args.hidden, args.topk
    row_bytes = h * 2
    m = n * k
    mod = cp.RawModule(code=SOURCE, options=("-std=c++17",))
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    out = torch.empty(m * row_bytes, dtype=torch.uint8, device="cuda")
    x = torch.randn(n, h, device="cuda").to(torch.bfloat16)
    rows = torch.randperm(m, device="cuda", dtype=torch.int64).to(torch.int32)
    out_c = cp.asarray(out)
    x_c, rows_c = cp.asarray(x.view(torch.uint8)), cp.asarray(rows)
    write_bytes, read_bytes = m * row_bytes, n * row_bytes
    results = []

    def record(name, us, reads=0):
        gbs_w = write_bytes / us / 1e3
        gbs_rw = (write_bytes + reads) / us / 1e3
        results.append((name, us, gbs_w, gbs_rw))
        print(f"{name:34s} {us:8.1f} us  write {gbs_w:7.0f} GB/s  read+write {gbs_rw:7.0f} GB/s",
              flush=True)

    record("torch zero_", time_us(lambda: out.zero_()))
    n_int4 = write_bytes // 16
    for name in ("fill_plain", "fill_cs"):
        fn = mod.get_function(name)
        for blocks_per_sm in (2, 4, 8):
            grid = sms * blocks_per_sm
            record(f"{name} {blocks_per_sm}x{sms}x256",
                   time_us(lambda: fn((grid,), (256,), (out_c, cp.int64(n_int4)))))
    fill_tma = mod.get_function("fill_tma")
    for chunk in (16384, 32768):
        fill_tma.max_dynamic_shared_size_bytes = chunk
        for blocks_per_sm in (2, 4):
            grid = sms * blocks_per_sm
            record(f"fill_tma chunk {chunk} {blocks_per_sm}x{sms}",
                   time_us(lambda: fill_tma((grid,), (32,), (out_c, cp.int64(write_bytes),
                                                             cp.int32(chunk)),
                                            shared_mem=chunk)))
    scatter = mod.get_function("scatter_only")
    seq_rows = torch.arange(m, device="cuda", dtype=torch.int32)
    # Expert-major rows as the kernel writes them: K distinct experts of E per token, each
    # expert's rows in token order.
    num_experts = 256
    ids = torch.rand(n, num_experts, device="cuda").topk(k, dim=1).indices
    order = torch.argsort(ids.flatten() * n + torch.arange(n, device="cuda").repeat_interleave(k))
    expert_rows = torch.empty(m, dtype=torch.int32, device="cuda")
    expert_rows[order] = torch.arange(m, device="cuda", dtype=torch.int32)
    for label, rr in (("random", rows), ("sequential", seq_rows), ("expert-major", expert_rows)):
        rr_c = cp.asarray(rr)
        record(f"scatter_only {label} 2x{sms}x512",
               time_us(lambda: scatter((sms * 2,), (512,), (rr_c, out_c, cp.int32(n),
                                                             cp.int32(h // 8), cp.int32(k)))))
        fn = mod.get_function("expand_plain")
        record(f"expand_plain {label} 2x{sms}x512",
               time_us(lambda: fn((sms * 2,), (512,), (x_c, rr_c, out_c, cp.int32(n),
                                                        cp.int32(h // 8), cp.int32(k)))),
               read_bytes)
    ref = None
    for name in ("expand_plain", "expand_cs", "expand_pipelined", "expand_pipelined_ef"):
        fn = mod.get_function(name)
        for blocks_per_sm, threads in ((1, 512), (2, 512), (4, 256)):
            grid = sms * blocks_per_sm
            record(f"{name} {blocks_per_sm}x{sms}x{threads}",
                   time_us(lambda: fn((grid,), (threads,),
                                      (x_c, rows_c, out_c, cp.int32(n), cp.int32(h // 8),
                                       cp.int32(k)))), read_bytes)
        if ref is None:
            ref = out.clone()
        assert torch.equal(out, ref), f"{name} wrote different rows"
    tma = mod.get_function("expand_tma")
    for stages, blocks_per_sm in ((2, 4), (3, 4), (4, 3), (2, 7)):
        smem = stages * row_bytes
        if smem * blocks_per_sm > 227 * 1024:
            continue
        tma.max_dynamic_shared_size_bytes = smem
        grid = sms * blocks_per_sm
        out.zero_()
        record(f"expand_tma stages {stages} {blocks_per_sm}x{sms}",
               time_us(lambda: tma((grid,), (32,), (x_c, rows_c, out_c, cp.int32(n),
                                                     cp.int32(row_bytes), cp.int32(k),
                                                     cp.int32(stages)), shared_mem=smem)),
               read_bytes)
        assert torch.equal(out, ref), "expand_tma wrote different rows"
    sync = cp.zeros(2, dtype=cp.uint32)
    for name in ("expand_phased", "expand_batched"):
        fn = mod.get_function(name)
        for rows_per_block in (4, 8, 11, 14):
            smem = rows_per_block * row_bytes
            if smem > 227 * 1024:
                continue
            fn.max_dynamic_shared_size_bytes = smem
            out.zero_()
            record(f"{name} {rows_per_block} rows/block 1x{sms}x1024",
                   time_us(lambda: fn((sms,), (1024,), (x_c, rows_c, out_c, cp.int32(n),
                                                         cp.int32(h // 8), cp.int32(k),
                                                         cp.int32(rows_per_block), sync),
                                      shared_mem=smem)), read_bytes)
            assert torch.equal(out, ref), f"{name} wrote different rows"
    print("\n| variant | µs | write GB/s | read+write GB/s |\n|---|---|---|---|")
    for name, us, gbs_w, gbs_rw in results:
        print(f"| {name} | {us:.1f} | {gbs_w:.0f} | {gbs_rw:.0f} |")


if __name__ == "__main__":
    main()
