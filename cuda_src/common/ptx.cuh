// Memory-ordering primitives at system scope (peers reach this memory over NVLink) and loads
// and stores with cache hints.
#pragma once
#include "common/types.cuh"

namespace mdeep {

__device__ __forceinline__ u32 ld_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The same at GPU scope: for flags only this GPU's blocks read (cheaper than .sys).
__device__ __forceinline__ u32 ld_acquire_gpu(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_gpu(u32* p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int ld_volatile(const int* p) {
    int v;
    asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_volatile(int* p, int v) {
    asm volatile("st.volatile.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_volatile64(i64* p, i64 v) {
    asm volatile("st.volatile.global.s64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ u64 global_timer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Read-only input (never written while the kernel runs): the non-coherent path, no L1 keep.
__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Data a peer wrote during this kernel's life: the coherent L2 path.
__device__ __forceinline__ int4 ld_cg_v4(const int4* p) { return __ldcg(p); }

__device__ __forceinline__ void st_v4(int4* p, const int4& v) { *p = v; }

// Programmatic dependent launch (sm_90+). griddep_wait: blocks until the previous kernel on the
// stream has finished and its writes are visible (returns at once after a normal launch).
// griddep_launch_dependents: the next kernel, if launched programmatically, may start now.
__device__ __forceinline__ void griddep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void griddep_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// 16 bytes global -> shared without a register round trip (sm_80+); the copy completes at the
// issuing thread's cp_async_wait_all, after which that thread may read it.
__device__ __forceinline__ void cp_async_v4(int4* smem, const int4* gmem) {
    const u32 dst = static_cast<u32>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_all;" ::: "memory");
}

// Bytes of dynamic shared memory this launch was given.
__device__ __forceinline__ u32 dynamic_smem_bytes() {
    u32 bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes;
}

}  // namespace mdeep
