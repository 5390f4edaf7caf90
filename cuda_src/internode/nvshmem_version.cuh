// The NVSHMEM version switch: which release's device library a unit is linked against, from
// NVSHMEM's own version header, and the form of the one internal symbol we must name
// (`nvshmem_abi_thunk.cu`). Only macros: the thunk includes it without any other header.
//
// Put with signal (what nvshmemx_putmem_signal_nbi_{block,warp} call into the library):
//   3.4       nvshmemi_transfer_put_signal<S>(rptr, lptr, bytes, sig, signal, op, pe, is_nbi)
//   3.5-3.7   the same + a trailing `nvshmemx_qp_handle_t qp_index` (a typedef of int)
//   3.8       renamed nvshmemi_transfer_put_signal_dispatch<S>, same arguments as 3.5-3.7
// A release newer than the newest tested takes the newest form; megatron_deepep/kernels/
// nvshmem_link.py warns naming both versions (and says so again if the link then fails). The
// tested releases are nvshmem_link.TESTED_NVSHMEM; a new one is taken up as docs/internode.md,
// "New NVSHMEM or torch releases", says.
#pragma once
#include <non_abi/nvshmem_version.h>

#define MDEEP_NVSHMEM_VERSION                                                          \
    (NVSHMEM_VENDOR_MAJOR_VERSION * 10000 + NVSHMEM_VENDOR_MINOR_VERSION * 100 +       \
     NVSHMEM_VENDOR_PATCH_VERSION)

#if MDEEP_NVSHMEM_VERSION < 30400
#error "megatron_deepep: NVSHMEM older than 3.4 is not supported (the oldest tested is 3.4.5)"
#elif MDEEP_NVSHMEM_VERSION < 30500
#define MDEEP_NVSHMEM_PUT_SIGNAL nvshmemi_transfer_put_signal
#define MDEEP_NVSHMEM_PUT_SIGNAL_HAS_QP 0
#elif MDEEP_NVSHMEM_VERSION < 30800
#define MDEEP_NVSHMEM_PUT_SIGNAL nvshmemi_transfer_put_signal
#define MDEEP_NVSHMEM_PUT_SIGNAL_HAS_QP 1
#else
#define MDEEP_NVSHMEM_PUT_SIGNAL nvshmemi_transfer_put_signal_dispatch
#define MDEEP_NVSHMEM_PUT_SIGNAL_HAS_QP 1
#endif
