"""The NVRTC compile checks of `test_kernels_compile.py`, run in the background.

Compiling every kernel instantiation is the costly part of the CPU suite, so it is planned here
as jobs (each one NVRTC program holding several instantiations of one source) and handed, as
soon as pytest has collected them (`conftest.py`), to two low-priority worker processes; the
other tests run meanwhile and the compile tests, ordered last, collect the results.

Two sweeps:
- every instantiation `ops.kernel_names` lists for top-k 1-16, bf16 and FP8 dispatch (and the
  fp16 / fp32 combine kernels at `WIDE_ROW_TOPKS`: their dtype code does not depend on top-k),
  plus `fp8.cu`, `fp8_columnwise.cu`, `bench/quantize.cu` and `bench/ceiling.cu`, compiled
  with `jit.FAST_COMPILE_OPTIONS` (front end, template instantiation and ptxas, ~30x faster
  than -O3), up to 60 instantiations a program;
- one instantiation of each (kernel, wire format, dequantize, combine row dtype) at top-k 8
  with the options the kernels run with (-O3), as `jit.get_kernel` compiles them.
Together ~60 CPU-seconds (a one-program-per-source sweep at -O3 took ~370). `python -m
megatron_deepep.tools.precompile --topk $(seq 16) --fp8 ...` compiles the lot at -O3.

`link_jobs` adds the NVSHMEM links of `internode/full.cu`, `internode/ring.cu` and
`internode/net_ring.cu` (NVRTC -rdc + nvJitLink, ~10 CPU-seconds each, into a fresh cache), one
per node staging, which `test_nvshmem_link.py` collects the same way.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import multiprocessing
import os
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

TOPKS = range(1, 17)
# Top-k values at which the fast sweep also compiles the fp16 and fp32 combine kernels.
WIDE_ROW_TOPKS = (1, 6, 8, 16)
WIDE_ROW_DTYPES = ("fp16", "fp32")
FP8_KERNELS = [f"{k}<{w}>" for k in ("dequantize_blockwise", "dequantize_mxfp8") for w in (4, 8)]
QUANTIZE_KERNELS = ([f"quantize_blockwise<{w}, {p}>" for w in (4, 8) for p in ("false", "true")]
                    + [f"quantize_mxfp8<{w}>" for w in (4, 8)])
CEILING_KERNELS = ["fill_kernel", "fan_out_copy", "fan_out_fp8_bytes", "fan_in_sum", "peer_copy"]
COLUMNWISE_KERNELS = [f"columnwise_from_rowwise<{p}>" for p in ("true", "false")]
WORKERS = 2


@dataclasses.dataclass(frozen=True)
class Job:
    """One NVRTC program: `exprs` of `source`, fast (`jit.FAST_COMPILE_OPTIONS`) or at -O3."""

    source: str
    exprs: Tuple[str, ...]
    fast: bool
    cost: float  # CPU seconds measured on a 2-core CI machine, to start the costly first
    link: bool = False  # NVSHMEM: `nvshmem_link.link_cubin` into a fresh cache, at -O3


def _names(k: int, fp8: bool = False, row_dtypes: Sequence[str] = ("bf16",)
           ) -> Dict[str, List[str]]:
    from megatron_deepep import ops
    return ops.kernel_names(k, fp8=fp8, row_dtypes=row_dtypes)


@functools.lru_cache(maxsize=None)
def jobs() -> Dict[str, Job]:
    """Job id -> job (the id names the source, top-k range and sweep)."""
    out: Dict[str, Job] = {}
    layout = sorted({e for k in TOPKS for e in _names(k)["layout.cu"]})
    out["fast-layout.cu-k1..16"] = Job("layout.cu", tuple(layout), True, 2.0)
    out["fast-notify.cu"] = Job("notify.cu", ("notify_kernel",), True, 0.1)
    for first in range(1, 17, 4):
        ks = range(first, first + 4)
        tag = f"k{first}..{first + 3}"
        out[f"fast-dispatch.cu-bf16-{tag}"] = Job(
            "dispatch.cu", tuple(e for k in ks for e in _names(k)["dispatch.cu"]), True, 1.5)
        out[f"fast-combine.cu-{tag}"] = Job(
            "combine.cu", tuple(e for k in ks for e in _names(k)["combine.cu"]), True, 1.0)
    out["fast-combine.cu-fp16-fp32"] = Job(
        "combine.cu", tuple(e for k in WIDE_ROW_TOPKS
                            for e in _names(k, row_dtypes=WIDE_ROW_DTYPES)["combine.cu"]),
        True, 2.0)
    for k in TOPKS:
        out[f"fast-dispatch.cu-fp8-k{k}"] = Job(
            "dispatch.cu", tuple(_names(k, fp8=True)["dispatch.cu"]), True, 2.0)
    out["fast-fp8.cu"] = Job("fp8.cu", tuple(FP8_KERNELS), True, 0.2)
    out["fast-quantize.cu"] = Job("bench/quantize.cu", tuple(QUANTIZE_KERNELS), True, 0.2)
    out["fast-ceiling.cu"] = Job("bench/ceiling.cu", tuple(CEILING_KERNELS), True, 0.1)
    out["fast-fp8_columnwise.cu"] = Job("fp8_columnwise.cu", tuple(COLUMNWISE_KERNELS), True,
                                        0.2)
    # -O3, top-k 8, int64 indices, not cached: one per (kernel, kFmt, kDequant).
    k8 = _names(8)
    k8_fp8 = _names(8, fp8=True)["dispatch.cu"]
    dispatch = [e for e in k8["dispatch.cu"] + k8_fp8 if e.startswith(
        ("dispatch_send<8, false, long long", "dispatch_recv<8, false, long long",
         "dispatch_local<8, false, long long", "dispatch_fused<8, false, long long"))]
    for kind, cost in (("dispatch_send", 2.0), ("dispatch_recv", 14.0),
                       ("dispatch_local", 5.0), ("dispatch_fused", 16.0)):
        out[f"O3-dispatch.cu-{kind}-k8"] = Job(
            "dispatch.cu", tuple(e for e in dispatch if e.startswith(kind + "<")), False, cost)
    k8_rows = _names(8, row_dtypes=("bf16",) + WIDE_ROW_DTYPES)["combine.cu"]
    out["O3-combine.cu-k8"] = Job(
        "combine.cu", tuple(e for e in k8_rows if ", true, true, " in e), False, 2.0)
    out["O3-layout.cu-k8"] = Job("layout.cu", ("layout_kernel<long long, 8>",), False, 0.3)
    out["O3-notify.cu"] = Job("notify.cu", ("notify_kernel",), False, 0.1)
    out["O3-fp8.cu"] = Job("fp8.cu", tuple(FP8_KERNELS), False, 0.2)
    out["O3-quantize.cu"] = Job("bench/quantize.cu", tuple(QUANTIZE_KERNELS), False, 0.3)
    out["O3-ceiling.cu"] = Job("bench/ceiling.cu", tuple(CEILING_KERNELS), False, 0.2)
    out["O3-fp8_columnwise.cu"] = Job("fp8_columnwise.cu", tuple(COLUMNWISE_KERNELS), False,
                                      0.3)
    return out


def internode_link_expressions(ring: bool = False, net: bool = False) -> Tuple[str, ...]:
    """Every instantiation kind the internode transport launches: dispatch for bf16 rows and
    two FP8 wire formats, both index types; combine for the three row dtypes. `ring`: the
    kernel families of ring staging (MDEEP_INTERNODE_STAGING=ring), `net`: of the network ring
    (MDEEP_INTERNODE_NET_RING_CHUNKS > 0), same coverage."""
    from megatron_deepep import ops
    from megatron_deepep.fp8.dispatch import Fp8Dispatch
    dispatch, combine = ops.internode_families("net" if net else "ring" if ring else "full")
    expressions = set()
    for num_topk, index_type, fp8 in ((8, "long long", None),
                                      (1, "int", Fp8Dispatch.named("blockwise", "bf16")),
                                      (4, "long long", Fp8Dispatch.named("mxfp8", "fp8"))):
        expressions.update(dispatch(num_topk, index_type, fp8))
    for row_dtype in ops.ROW_DTYPE_CODES.values():
        expressions.update(combine(8, row_dtype))
    return tuple(sorted(expressions))


def link_kernels(job_id: str) -> Tuple[str, ...]:
    """The kernels (names without template arguments) a link job must hold: every kernel of
    its staging's source."""
    from megatron_deepep import ops
    return ops.INTERNODE_STAGING_KERNELS[job_id.rsplit("-", 1)[1]]


@functools.lru_cache(maxsize=None)
def link_jobs() -> Dict[str, Job]:
    """Job id (`link-internode-<staging>`) -> NVSHMEM link job (one compile, one link)."""
    from megatron_deepep import ops
    return {f"link-internode-{staging}": Job(
                source, internode_link_expressions(staging == "ring", staging == "net"), False,
                10.0, link=True)
            for staging, source in ops.INTERNODE_SOURCES.items()}


def _table() -> Dict[str, Job]:
    return {**jobs(), **link_jobs()}


@functools.lru_cache(maxsize=None)
def fast_options() -> Tuple[str, ...]:
    """`jit.FAST_COMPILE_OPTIONS` if this NVRTC takes them (12.8+), else none (slower)."""
    from megatron_deepep.kernels import jit
    try:
        jit.compile_code("__global__ void probe() {}\n", "probe.cu", ["probe"],
                         extra_options=jit.FAST_COMPILE_OPTIONS)
    except jit.CompileError:
        return ()
    return tuple(jit.FAST_COMPILE_OPTIONS)


def run(job: Job, options: Sequence[str]) -> Tuple[bytes, int, List[str]]:
    """Compiles a job: (the cubin's first 4 bytes, its size, the lowered name expressions)."""
    from megatron_deepep.kernels import jit, nvshmem_link
    if job.link:
        with tempfile.TemporaryDirectory(prefix="mdeep-link-") as cache:
            cubin, lowered = nvshmem_link.link_cubin(job.source, list(job.exprs), "sm_90",
                                                     cache_dir=Path(cache))
    else:
        cubin, lowered = jit.compile_cubin(job.source, list(job.exprs), "sm_90",
                                           extra_options=options if job.fast else ())
    for expr, name in lowered.items():
        if name.encode() not in cubin:
            raise AssertionError(f"{job.source}: {expr} ({name}) is not in the cubin")
    return cubin[:4], len(cubin), sorted(lowered)


def _lower_priority() -> None:
    try:
        os.nice(10)  # the tests in the foreground come first
    except OSError:
        pass


_pool: Optional[concurrent.futures.ProcessPoolExecutor] = None
_futures: Dict[str, concurrent.futures.Future] = {}


def start(job_ids: Sequence[str]) -> None:
    """Submits the jobs to the worker processes (costly first); `result` waits for one."""
    global _pool
    if _pool is not None or not job_ids:
        return
    options = fast_options()
    context = multiprocessing.get_context("spawn")
    _pool = concurrent.futures.ProcessPoolExecutor(WORKERS, mp_context=context,
                                                   initializer=_lower_priority)
    table = _table()
    for job_id in sorted(set(job_ids), key=lambda j: -table[j].cost):
        _futures[job_id] = _pool.submit(run, table[job_id], options)


def result(job_id: str) -> Tuple[bytes, int, List[str]]:
    """A job's result: from the background workers, or compiled here if none were started."""
    future = _futures.get(job_id)
    if future is None:
        return run(_table()[job_id], fast_options())
    return future.result()


def stop() -> None:
    global _pool
    if _pool is not None:
        _pool.shutdown(wait=False, cancel_futures=True)
        _pool = None
        _futures.clear()


def warm_up(num_topks, row_dtypes: Sequence[str] = ("bf16",)) -> None:
    """Compiles (or loads from the disk cache) every kernel `ops.kernel_names` lists for the
    given top-k values and row dtypes, so a GPU test's spawned ranks do not compile on their
    first dispatch."""
    from megatron_deepep import ops
    from megatron_deepep.kernels import jit

    for num_topk in num_topks:
        for source, exprs in ops.kernel_names(num_topk, row_dtypes=row_dtypes).items():
            for expr in exprs:
                name, _, args = expr.partition("<")
                jit.get_kernel(source, name, [a.strip() for a in args.rstrip(">").split(",")]
                               if args else [])
