"""Builds every kernel a model shape needs into the kernel cache, ahead of a job (no GPU needed).

    python -m megatron_deepep.tools.precompile --topk 8 --fp8 blockwise_1x128 --cache-dir /shared/k

A first dispatch compiles each kernel it meets (seconds each, logged at INFO), on every rank
that has no cache entry yet. This tool compiles them all at once, in parallel, with NVRTC only,
so a cluster can fill a shared cache on a login node; jobs then point `MDEEP_CACHE_DIR` at that
directory and load instead of compiling. Jobs load only entries their own user wrote unless told
whom else to trust: run both with `MDEEP_CACHE_TRUST=user:<the account that fills it>` (entries
0644) or `group:<team>` (`megatron_deepep/kernels/cache_trust.py`). The entries are keyed by the
sources, options, arch and NVRTC version: build with the same install (or the same code and
cuda-bindings) as the job, for the job's GPU (`--arch`, sm_90 for H100/H200). With a blockwise
`--fp8` format and FP8 output it also builds the FP8 experts' columnwise-copy kernel
(`cuda_src/fp8_columnwise.cu`). `--internode` also links the internode transport's kernels
(NVRTC + nvJitLink against the nvidia-nvshmem wheel's device library), one module per (top-k,
index type, wire format) for dispatch and per (top-k, row dtype) for combine, for the node
staging `MDEEP_INTERNODE_STAGING` and the network ring `MDEEP_INTERNODE_NET_RING_CHUNKS` select
(the job must set the same; with `auto`, the default, the job picks its staging from the EP
group's shape, so all three are built).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_deepep import knobs
from megatron_deepep.kernels import jit

INDEX_TYPES = {"int64": "long long", "int32": "int"}
FP8_OUTPUTS = {"fp8": "false", "bf16": "true"}  # the kernels' kDequant argument
# The benchmark- and test-only kernels (cuda_src/bench/), built only with --bench: the ceilings,
# and the standalone quantize as ops.bench.quantize.quantize_rows launches it by default.
BENCH_KERNELS = ([("bench/ceiling.cu", e) for e in ("fill_kernel", "fan_out_copy",
                                                   "fan_out_fp8_bytes", "fan_in_sum", "peer_copy")]
                 + [("bench/quantize.cu", e) for e in ("quantize_blockwise<8, false>",
                                                      "quantize_blockwise<8, true>",
                                                      "quantize_mxfp8<8>")])


def _template_args(expr: str) -> List[str]:
    _, _, args = expr.partition("<")
    return [a.strip() for a in args.rstrip(">").split(",")] if args else []


def kernels_for(topks: Sequence[int], fp8_formats: Sequence[str] = (),
                fp8_outputs: Sequence[str] = ("fp8", "bf16"),
                index_dtypes: Sequence[str] = ("int64", "int32"), bf16: bool = True,
                bench: bool = False, row_dtypes: Sequence[str] = ("bf16",)
                ) -> List[Tuple[str, str]]:
    """(source file, name expression) of every kernel the shape needs, each once.

    Args:
        topks: the router's top-k values (1-16).
        fp8_formats: FP8 wire-format names dispatch may use (`megatron_deepep.fp8.FORMATS`).
        fp8_outputs: "fp8" (FP8 rows to the experts; with a blockwise format this includes the
            FP8 experts' columnwise-copy kernel) and/or "bf16" (dequantized on receive).
        index_dtypes: "int64" and/or "int32", the dtype of `topk_idx`.
        bf16: include the bf16 dispatch kernels (dispatch without FP8).
        bench: include the benchmark- and test-only kernels (`cuda_src/bench/`).
        row_dtypes: hidden-state dtypes ("bf16", "fp16", "fp32") to build the combine kernels
            for (dispatch copies bytes: its kernels serve every dtype).

    Raises:
        ValueError: naming the argument and what it accepts.
    """
    from megatron_deepep import ops
    from megatron_deepep.fp8.dispatch import Fp8Dispatch

    for k in topks:
        if not 1 <= int(k) <= 16:
            raise ValueError(f"topk: {k} is out of range (1-16)")
    bad = [d for d in index_dtypes if d not in INDEX_TYPES]
    if bad or not index_dtypes:
        raise ValueError(f"index dtype: {bad or 'none given'}; choose from {sorted(INDEX_TYPES)}")
    bad = [o for o in fp8_outputs if o not in FP8_OUTPUTS]
    if bad:
        raise ValueError(f"fp8 output: {bad}; choose from {sorted(FP8_OUTPUTS)}")
    bad = [d for d in row_dtypes if d not in ops.ROW_DTYPE_NAMES]
    if bad or not row_dtypes:
        raise ValueError(f"row dtype: {bad or 'none given'}; choose from "
                         f"{sorted(ops.ROW_DTYPE_NAMES)}")
    wire_codes = {str(Fp8Dispatch.named(name).wire_code) for name in fp8_formats}
    dequants = {FP8_OUTPUTS[o] for o in fp8_outputs}
    index_types = {INDEX_TYPES[d] for d in index_dtypes}
    out: Dict[Tuple[str, str], None] = {}
    for k in sorted(set(int(k) for k in topks)):
        bf16_names = ops.kernel_names(k)
        fp8_dispatch = ops.kernel_names(k, fp8=True)["dispatch.cu"] if wire_codes else []
        for source in ("layout.cu", "notify.cu"):
            for expr in bf16_names[source]:
                args = _template_args(expr)
                if source == "layout.cu" and args[0] not in index_types:
                    continue
                out[(source, expr)] = None
        dispatch = bf16_names["dispatch.cu"] if bf16 else []
        for expr in dispatch + fp8_dispatch:
            args = _template_args(expr)  # kTopk, kCached, IdxT, kFmt[, kDequant]
            if args[2] not in index_types:
                continue
            if args[3] != "0" and (args[3] not in wire_codes
                                   or (len(args) > 4 and args[4] not in dequants)):
                continue
            out[("dispatch.cu", expr)] = None
        for expr in ops.kernel_names(k, row_dtypes=row_dtypes)["combine.cu"]:
            out[("combine.cu", expr)] = None
    if "fp8" in fp8_outputs:
        out.update(dict.fromkeys(columnwise_kernels(fp8_formats)))
    if bench:
        out.update(dict.fromkeys(BENCH_KERNELS))
    return list(out)


def columnwise_kernels(fp8_formats: Sequence[str]) -> List[Tuple[str, str]]:
    """The FP8 experts' columnwise-copy kernel (`cuda_src/fp8_columnwise.cu`) for the blockwise
    formats among `fp8_formats` (its template argument: the format's power-of-two scales, which
    the recipe's input quantizer shares)."""
    from megatron_deepep.fp8.dispatch import Fp8Dispatch
    from megatron_deepep.fp8.formats import ScaleKind

    out = []
    for name in fp8_formats:
        spec = Fp8Dispatch.named(name)
        if spec is not None and spec.fmt.scale_kind is ScaleKind.FP32_SCALE_INV:
            power_2 = jit.render_template_arg(spec.fmt.power_2_scale)
            out.append(("fp8_columnwise.cu", f"columnwise_from_rowwise<{power_2}>"))
    return out


def internode_families_for(topks: Sequence[int], fp8_formats: Sequence[str] = (),
                           fp8_outputs: Sequence[str] = ("fp8", "bf16"),
                           index_dtypes: Sequence[str] = ("int64", "int32"), bf16: bool = True,
                           row_dtypes: Sequence[str] = ("bf16",),
                           staging: Optional[str] = None,
                           net_chunks: Optional[int] = None
                           ) -> List[Tuple[str, Tuple[str, ...]]]:
    """The internode transport's linked modules for the same choices as `kernels_for`: each
    (its staging's source under `cuda_src/`, its tuple of name expressions), exactly as the
    transport links them at run time with `staging`
    ("full", "ring" or "auto"; None: the knob `MDEEP_INTERNODE_STAGING`) and `net_chunks`
    (> 0: the network ring; None: the knob `MDEEP_INTERNODE_NET_RING_CHUNKS`). "auto" picks
    its staging from the EP group's shape at run time, so every staging it may pick is built."""
    from megatron_deepep import ops
    from megatron_deepep.fp8.dispatch import Fp8Dispatch
    from megatron_deepep.transport.internode_regions import net_ring_config, staging_config

    mode = staging_config(staging)[0]
    if net_ring_config(mode, net_chunks) > 0:
        modes = ["net"]
    else:
        modes = ["full", "ring", "net"] if mode == "auto" else [mode]

    wires = [None] if bf16 else []
    wires += [Fp8Dispatch.named(name, output) for name in fp8_formats for output in fp8_outputs]
    out: Dict[Tuple[str, Tuple[str, ...]], None] = {}
    for mode in modes:
        source = ops.INTERNODE_SOURCES[mode]
        dispatch, combine = ops.internode_families(mode)
        for k in sorted(set(int(k) for k in topks)):
            for index_dtype in index_dtypes:
                for wire in wires:
                    out[(source, dispatch(k, INDEX_TYPES[index_dtype], wire))] = None
            for row_dtype in row_dtypes:
                out[(source, combine(
                    k, ops.ROW_DTYPE_CODES[ops.ROW_DTYPE_NAMES[row_dtype]]))] = None
    return list(out)


def _link_family(module: Tuple[str, Tuple[str, ...]], arch: str, cache_dir: Optional[Path]
                 ) -> Tuple[str, str, float, bool]:
    from megatron_deepep.kernels import nvshmem_link
    source, family = module
    folder = nvshmem_link.link_cache_dir(cache_dir)
    before = set(folder.glob("*.kernel")) if folder.is_dir() else set()
    start = time.perf_counter()
    nvshmem_link.link_cubin(source, list(family), arch, cache_dir)
    from_cache = set(folder.glob("*.kernel")) == before
    return source, " ".join(family), time.perf_counter() - start, from_cache


def _build_one(source: str, expr: str, arch: str, cache_dir: Optional[Path]
               ) -> Tuple[str, str, float, bool]:
    result = jit.build(source, expr, arch, cache_dir)
    return source, expr, result.seconds, result.from_cache


def _default_arch() -> str:
    override = knobs.get("ARCH")
    if override:
        return override
    try:
        import torch
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}"
    except Exception:  # no usable torch.cuda: precompile for Hopper
        pass
    return "sm_90"


def precompile(kernels: Sequence[Tuple[str, str]], arch: str, jobs: int,
               cache_dir: Optional[Path] = None, report=None,
               families: Sequence[Tuple[str, ...]] = ()) -> Tuple[int, int, List[str]]:
    """Builds `kernels` (and links the internode `families`) into the cache with `jobs`
    processes.

    Args:
        kernels: (source file, name expression) pairs, as `kernels_for` gives them.
        families: internode modules, (source, name expressions) as `internode_families_for`
            gives them (one item each).
        arch: NVRTC target.
        jobs: worker processes (1: in this process).
        cache_dir: the cache (default: knob CACHE_DIR, else `~/.cache/megatron_deepep`).
        report: called as report(source, expr, seconds, from_cache) for each kernel built.

    Returns:
        (compiled, found in the cache, failures as "source expr: error" lines).
    """
    compiled = cached = 0
    failures: List[str] = []

    def done(source, expr, seconds, from_cache):
        nonlocal compiled, cached
        if from_cache:
            cached += 1
        else:
            compiled += 1
        if report:
            report(source, expr, seconds, from_cache)

    # The slowest first (dispatch, then combine), so the workers finish together.
    order = {"dispatch.cu": 0, "combine.cu": 1}
    todo = [(_link_family, family) for family in families]  # a link takes ~8 s: first
    todo += [(_build_one, kernel) for kernel in sorted(kernels, key=lambda k: order.get(k[0], 2))]
    if jobs <= 1:
        for build, item in todo:
            try:
                done(*(build(item, arch, cache_dir) if build is _link_family
                       else build(*item, arch, cache_dir)))
            except jit.CompileError as exc:
                failures.append(f"{_describe(item)}: {exc}")
        return compiled, cached, failures
    # fork: the workers run NVRTC only (no CUDA context), and start without re-importing torch.
    context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = {(pool.submit(build, item, arch, cache_dir) if build is _link_family
                    else pool.submit(build, *item, arch, cache_dir)): item
                   for build, item in todo}
        for future in concurrent.futures.as_completed(futures):
            try:
                done(*future.result())
            except Exception as exc:  # CompileError, or a worker that died
                failures.append(f"{_describe(futures[future])}: {type(exc).__name__}: {exc}")
    return compiled, cached, failures


def _describe(item) -> str:
    """A kernel (source, expr) or an internode module (source, exprs), for a failure line."""
    source, what = item
    return f"{source} {what if isinstance(what, str) else ' '.join(what)}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_deepep.tools.precompile",
        description="Compile every kernel a model shape needs into the kernel cache, ahead of "
                    "a job. Needs NVRTC (pip install \"megatron_deepep[jit]\"), no GPU; run "
                    "it on a login node into a shared directory and give jobs "
                    "MDEEP_CACHE_DIR=<that directory> (and, when another account fills it, "
                    "MDEEP_CACHE_TRUST=user:<that account> or group:<team> to both).")
    parser.add_argument("--topk", type=int, nargs="+", required=True, metavar="K",
                        help="the router's top-k (Megatron's --moe-router-topk), 1-16; several "
                             "values allowed")
    parser.add_argument("--fp8", nargs="*", default=[], metavar="FORMAT",
                        help="FP8 dispatch wire formats to build too (names as Buffer's `fp8=` "
                             "takes them, e.g. blockwise_1x128 mxfp8_1x32); default: none "
                             "(bf16 dispatch only)")
    parser.add_argument("--fp8-output", nargs="+", default=["fp8", "bf16"],
                        choices=sorted(FP8_OUTPUTS),
                        help="with --fp8: what the experts receive, FP8 rows or bf16 "
                             "dequantized on receive (Buffer's `fp8_output`); default: both")
    parser.add_argument("--index-dtype", nargs="+", default=["int64", "int32"],
                        choices=sorted(INDEX_TYPES),
                        help="dtype of topk_idx (Megatron passes int64); default: both")
    parser.add_argument("--row-dtype", nargs="+", default=["bf16"],
                        choices=["bf16", "fp16", "fp32"],
                        help="dtype of the hidden states (Megatron's --bf16 / --fp16 / "
                             "neither): the combine kernels are built for each; default: bf16")
    parser.add_argument("--no-bf16", action="store_true",
                        help="skip the bf16 dispatch kernels (a job that always dispatches FP8)")
    parser.add_argument("--internode", action="store_true",
                        help="also link the internode transport's kernels (EP across nodes; "
                             "needs the nvidia-nvshmem-cu13 wheel, no GPU)")
    parser.add_argument("--bench", action="store_true",
                        help="also build the benchmark- and test-only kernels "
                             "(cuda_src/bench/: the ceilings, the standalone FP8 quantize)")
    parser.add_argument("--arch", default=None,
                        help="NVRTC target, e.g. sm_90 (H100/H200) or sm_100; default: "
                             "MDEEP_ARCH, else this machine's GPU, else sm_90")
    parser.add_argument("--cache-dir", default=None,
                        help="the kernel cache to fill; default: MDEEP_CACHE_DIR, else "
                             "~/.cache/megatron_deepep. Jobs must use the same directory")
    parser.add_argument("--jobs", "-j", type=int, default=None,
                        help="compiler processes; default: the CPUs this process may use")
    parser.add_argument("--list", action="store_true",
                        help="print the kernels it would build, and exit")
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="print the summary only (not a line per kernel)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    cache_dir = Path(args.cache_dir).expanduser().resolve() if args.cache_dir else None
    try:
        kernels = kernels_for(args.topk, args.fp8, args.fp8_output, args.index_dtype,
                              bf16=not args.no_bf16, bench=args.bench,
                              row_dtypes=args.row_dtype)
    except ValueError as exc:
        print(f"precompile: {exc}", file=sys.stderr)
        return 2
    families = (internode_families_for(args.topk, args.fp8, args.fp8_output, args.index_dtype,
                                       bf16=not args.no_bf16, row_dtypes=args.row_dtype)
                if args.internode else [])
    if args.list:
        for source, expr in kernels:
            print(f"{source} {expr}")
        for source, family in families:
            print(f"{source} " + " ".join(family))
        return 0
    problem = jit.nvrtc_problem()
    if problem is not None:
        print(f"precompile: {problem}", file=sys.stderr)
        return 2
    arch = args.arch or _default_arch()
    cache = jit.cache_path("notify.cu", "notify_kernel", arch, cache_dir).parent
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    jobs = max(1, min(args.jobs or cpus, len(kernels) + len(families)))
    if knobs.get("JIT_NO_CACHE"):
        print("precompile: MDEEP_JIT_NO_CACHE is set, so nothing would be kept; unset it",
              file=sys.stderr)
        return 2
    print(f"precompile: {len(kernels)} kernels"
          f"{f' and {len(families)} internode modules' if families else ''} for {arch} "
          f"(top-k {sorted(set(args.topk))}"
          f"{', fp8 ' + ' '.join(args.fp8) if args.fp8 else ''}) with {jobs} processes "
          f"into {cache}", flush=True)

    def report(source, expr, seconds, from_cache):
        if not args.quiet:
            how = "cached  " if from_cache else "compiled"
            print(f"  {how} {seconds:6.1f} s  {source} {expr}", flush=True)

    start = time.perf_counter()
    compiled, cached, failures = precompile(kernels, arch, jobs, cache_dir, report, families)
    seconds = time.perf_counter() - start
    for failure in failures:
        print(f"precompile: FAILED {failure}", file=sys.stderr)
    modules = f" and {len(families)} internode modules" if families else ""
    print(f"precompile: {len(kernels)} kernels{modules} for {arch} in {seconds:.1f} s: {compiled} "
          f"compiled, {cached} already cached, {len(failures)} failed; cache: {cache}"
          + (f" (give jobs MDEEP_CACHE_DIR={cache})" if cache_dir and not failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
