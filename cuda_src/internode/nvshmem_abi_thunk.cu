// ABI thunk between NVRTC-compiled code and the prebuilt libnvshmem_device.a.
//
// Why: the library was compiled by nvcc on LP64 Linux, where uint64_t is `unsigned long`; under
// NVRTC, uint64_t is `unsigned long long`. The two are the same 64-bit type in registers but
// mangle differently, so the NVRTC-compiled call to NVSHMEM's internal put with signal (made
// by nvshmemx_putmem_signal_nbi_{block,warp} and nvshmem_putmem_signal_nbi; its name and
// arguments per release: internode/nvshmem_version.cuh) refers to a symbol the library does
// not define, and nvJitLink fails with an undefined reference. This unit defines the
// NVRTC-mangled specializations as forwards to the library's. It is compiled by NVRTC (-rdc)
// with no NVSHMEM or system header but the macros of NVSHMEM's version header, so its
// `unsigned long` and `unsigned long long` are exactly the two spellings that mangle as the
// library and NVRTC do. An undefined-symbol scan of our kernels against NVSHMEM 3.4.5 found
// only this one function affected, and with this unit alone they link against every release
// from 3.4.5 to 3.8.0; megatron_deepep/kernels/nvshmem_link.py links it into every NVSHMEM
// cubin.
//
// The declarations mirror NVSHMEM's (non_abi/device/pt-to-pt/nvshmemi_transfer_api.cuh and the
// typedef'd enums threadgroup_t / nvshmemi_amo_t, which mangle by their typedef names;
// nvshmemx_qp_handle_t is a typedef of int, so it mangles as int).
#include "internode/nvshmem_version.cuh"

typedef unsigned long size_t;

enum threadgroup_t {
    NVSHMEMI_THREADGROUP_THREAD = 0,
    NVSHMEMI_THREADGROUP_WARP = 1,
    NVSHMEMI_THREADGROUP_WARPGROUP = 2,
    NVSHMEMI_THREADGROUP_BLOCK = 3,
};
enum nvshmemi_amo_t { NVSHMEMI_AMO_PLACEHOLDER = 0 };  // only passed through

#if MDEEP_NVSHMEM_PUT_SIGNAL_HAS_QP
#define MDEEP_QP_PARAM , int qp_index
#define MDEEP_QP_ARG , qp_index
#else
#define MDEEP_QP_PARAM
#define MDEEP_QP_ARG
#endif

// The library's specializations (signal as `unsigned long`).
template <threadgroup_t kScope>
__device__ void MDEEP_NVSHMEM_PUT_SIGNAL(void* rptr, void* lptr, size_t bytes, void* sig_addr,
                                         unsigned long signal, nvshmemi_amo_t sig_op, int pe,
                                         bool is_nbi MDEEP_QP_PARAM);

// The ones NVRTC-compiled callers refer to (signal as `unsigned long long`).
template <threadgroup_t kScope>
__device__ void MDEEP_NVSHMEM_PUT_SIGNAL(void* rptr, void* lptr, size_t bytes, void* sig_addr,
                                         unsigned long long signal, nvshmemi_amo_t sig_op,
                                         int pe, bool is_nbi MDEEP_QP_PARAM);

#define MDEEP_FORWARD_PUT_SIGNAL(kScope)                                                       \
    template <>                                                                                \
    __device__ void MDEEP_NVSHMEM_PUT_SIGNAL<kScope>(                                          \
        void* rptr, void* lptr, size_t bytes, void* sig_addr, unsigned long long signal,      \
        nvshmemi_amo_t sig_op, int pe, bool is_nbi MDEEP_QP_PARAM) {                           \
        MDEEP_NVSHMEM_PUT_SIGNAL<kScope>(rptr, lptr, bytes, sig_addr,                          \
                                         static_cast<unsigned long>(signal), sig_op, pe,       \
                                         is_nbi MDEEP_QP_ARG);                                 \
    }

MDEEP_FORWARD_PUT_SIGNAL(NVSHMEMI_THREADGROUP_THREAD)
MDEEP_FORWARD_PUT_SIGNAL(NVSHMEMI_THREADGROUP_WARP)
MDEEP_FORWARD_PUT_SIGNAL(NVSHMEMI_THREADGROUP_BLOCK)

#undef MDEEP_FORWARD_PUT_SIGNAL
#undef MDEEP_QP_PARAM
#undef MDEEP_QP_ARG
