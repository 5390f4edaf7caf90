// ABI thunk between NVRTC-compiled code and the prebuilt libnvshmem_device.a.
//
// Why: the library was compiled by nvcc on LP64 Linux, where uint64_t is `unsigned long`; under
// NVRTC, uint64_t is `unsigned long long`. The two are the same 64-bit type in registers but
// mangle differently, so the NVRTC-compiled call
//     nvshmemi_transfer_put_signal<S>(void*, void*, size_t, void*, uint64_t, nvshmemi_amo_t, int,
//                                     bool)
// (made by nvshmemx_putmem_signal_nbi_{block,warp} and nvshmem_putmem_signal_nbi) refers to a
// symbol the library does not define, and nvJitLink fails with an undefined reference. This
// unit defines the NVRTC-mangled specializations as forwards to the library's. It is compiled
// by NVRTC (-rdc) without any NVSHMEM or system header, so its `unsigned long` and
// `unsigned long long` are exactly the two spellings that mangle as the library and NVRTC do.
// An undefined-symbol scan of our kernels against NVSHMEM 3.4.5 found only this one function
// affected; megatron_deepep/kernels/nvshmem_link.py links this unit into every NVSHMEM cubin.
//
// The declarations mirror NVSHMEM's (non_abi/device/pt-to-pt/nvshmemi_transfer_api.cuh and the
// typedef'd enums threadgroup_t / nvshmemi_amo_t, which mangle by their typedef names).

typedef unsigned long size_t;

enum threadgroup_t {
    NVSHMEMI_THREADGROUP_THREAD = 0,
    NVSHMEMI_THREADGROUP_WARP = 1,
    NVSHMEMI_THREADGROUP_WARPGROUP = 2,
    NVSHMEMI_THREADGROUP_BLOCK = 3,
};
enum nvshmemi_amo_t { NVSHMEMI_AMO_PLACEHOLDER = 0 };  // only passed through

// The library's specializations (signal as `unsigned long`).
template <threadgroup_t kScope>
__device__ void nvshmemi_transfer_put_signal(void* rptr, void* lptr, size_t bytes, void* sig_addr,
                                             unsigned long signal, nvshmemi_amo_t sig_op, int pe,
                                             bool is_nbi);

// The ones NVRTC-compiled callers refer to (signal as `unsigned long long`).
template <threadgroup_t kScope>
__device__ void nvshmemi_transfer_put_signal(void* rptr, void* lptr, size_t bytes, void* sig_addr,
                                             unsigned long long signal, nvshmemi_amo_t sig_op,
                                             int pe, bool is_nbi);

#define MDEEP_FORWARD_PUT_SIGNAL(kScope)                                                       \
    template <>                                                                                \
    __device__ void nvshmemi_transfer_put_signal<kScope>(                                      \
        void* rptr, void* lptr, size_t bytes, void* sig_addr, unsigned long long signal,      \
        nvshmemi_amo_t sig_op, int pe, bool is_nbi) {                                          \
        nvshmemi_transfer_put_signal<kScope>(rptr, lptr, bytes, sig_addr,                      \
                                             static_cast<unsigned long>(signal), sig_op, pe,   \
                                             is_nbi);                                          \
    }

MDEEP_FORWARD_PUT_SIGNAL(NVSHMEMI_THREADGROUP_THREAD)
MDEEP_FORWARD_PUT_SIGNAL(NVSHMEMI_THREADGROUP_WARP)
MDEEP_FORWARD_PUT_SIGNAL(NVSHMEMI_THREADGROUP_BLOCK)

#undef MDEEP_FORWARD_PUT_SIGNAL
