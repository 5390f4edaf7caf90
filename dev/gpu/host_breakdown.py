"""Where one EP = 1 dispatch call's host time goes on a GPU host, function by function.

The timeline (`fp8_profile.py --timeline`) splits a call at its host wait; this splits it by
the functions it runs. Each function of `TARGETS` is wrapped by a timer (two
`time.perf_counter_ns` reads, no profiler: cProfile's per-call cost inflated the host time
2-3x); per format (bf16, then each of `--fp8`) and mode (sync, nosync, cached) it prints each
target's inclusive µs per call (the mean over `--calls` back-to-back calls) and how often it
ran per call, beside the call's host µs with and without the timers. Then the raw cost of the
CUDA entry points a call makes (allocation, event record, stream query), each alone.

Inclusive: a target's time holds the targets it calls (`Buffer.dispatch` holds all).

Usage (on the device machine, from the repository root; PYTHONPATH picks the package, as
fp8.sh's piece `breakdown` does for this tree and the before one):

    PYTHONPATH=$PWD python3 dev/gpu/host_breakdown.py --fp8 blockwise_1x128 --num-sms 132
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import os
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from megatron_deepep.bench.run import host_profile_calls
from megatron_deepep.buffer import Buffer

# fp8_profile.py beside this script: its one-rank group and inputs (this folder is no package,
# so it goes on sys.path here, for a test that loads this file as well).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp8_profile  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (module, attribute path): what a dispatch call runs, outermost first. Module-level names are
# patched where the caller looks them up (e.g. `local.empty_recv`, imported by name there).
TARGETS: Tuple[Tuple[str, str], ...] = (
    ("megatron_deepep.buffer", "Buffer.dispatch"),
    ("megatron_deepep.buffer", "Buffer._dispatch_input"),
    ("megatron_deepep.validate", "check_tensor"),
    ("megatron_deepep.validate", "check_routing"),
    ("megatron_deepep.validate", "check_fp8_input"),
    ("megatron_deepep.validate", "check_fp8_hidden"),
    ("megatron_deepep.buffer", "Buffer._check_handle"),
    ("megatron_deepep.buffer", "Buffer._run"),
    ("megatron_deepep.buffer", "is_capturing"),
    ("megatron_deepep.buffer", "CallOrder.before"),
    ("megatron_deepep.buffer", "CallOrder.after"),
    ("megatron_deepep.transport.local", "LocalTransport.dispatch"),
    ("megatron_deepep.transport.local", "LocalTransport.cached_dispatch"),
    ("megatron_deepep.transport.local", "LocalTransport.check_errors"),
    ("megatron_deepep.transport.local", "dispatch_plan"),
    ("megatron_deepep.arena", "ArenaPlan.allocate"),
    ("megatron_deepep.ops", "dispatch_layout"),
    ("megatron_deepep.ops", "dispatch_local"),
    ("megatron_deepep.transport.local", "empty_recv"),
    ("megatron_deepep.kernels.jit", "get_kernel"),
    ("megatron_deepep.kernels.jit", "KernelArgs.fill"),
    ("megatron_deepep.kernels.jit", "Kernel.launch"),
    ("megatron_deepep.transport.status", "KernelStatus.wait_num_rows"),
    ("megatron_deepep.transport.status", "KernelStatus.tokens_per_expert"),
    ("megatron_deepep.arena", "ArenaFields.from_arena"),
    ("torch", "empty"),
    ("torch.cuda", "current_stream"),
)


class Timers:
    """Inclusive ns and call counts per target while `enabled`."""

    def __init__(self):
        self.ns: Dict[str, int] = collections.defaultdict(int)
        self.count: Dict[str, int] = collections.defaultdict(int)
        self.enabled = False
        self._undo: List[Callable[[], None]] = []

    def wrap(self, label: str, fn: Callable) -> Callable:
        ns, count, clock = self.ns, self.count, time.perf_counter_ns

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[label] += clock() - t0
                count[label] += 1
        return timed

    def patch(self, module_name: str, path: str) -> bool:
        """Wraps `module_name.path` (a function, or a method / classmethod of a class); False
        when this package has no such target (an older tree)."""
        owner = importlib.import_module(module_name)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part, None)
        if owner is None or name not in (owner.__dict__ if isinstance(owner, type)
                                         else dir(owner)):
            return False
        raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        if isinstance(raw, classmethod):
            new = classmethod(self.wrap(path, raw.__func__))
        elif isinstance(raw, staticmethod):
            new = staticmethod(self.wrap(path, raw.__func__))
        else:
            new = self.wrap(path, raw)
        setattr(owner, name, new)
        self._undo.append(lambda: setattr(owner, name, raw))
        return True

    def unpatch(self) -> None:
        while self._undo:
            self._undo.pop()()

    def reset(self) -> None:
        self.ns.clear()
        self.count.clear()


def _host_us(fn: Callable, calls: int) -> float:
    """Host µs per call of `calls` back-to-back calls (the GPU left to lag)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize() if DEVICE == "cuda" else None
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    us = (time.perf_counter_ns() - t0) / calls / 1e3
    torch.cuda.synchronize() if DEVICE == "cuda" else None
    return us


def breakdown(buf, x, idx, weights, num_experts: int, specs, calls: int) -> None:
    """Prints, per format and mode, each target's inclusive µs and runs per call."""
    timers = Timers()
    for module_name, path in TARGETS:
        if not timers.patch(module_name, path):
            print(f"host_breakdown: {module_name}.{path}: not in this package", flush=True)
    try:
        for name, fp8 in specs:
            fns = host_profile_calls(buf, x, idx, weights, num_experts, fp8)
            for mode, fn in fns.items():
                plain = _host_us(fn, calls)
                timers.reset()
                timers.enabled = True
                timed = _host_us(fn, calls)
                timers.enabled = False
                # _host_us ran 5 warm-up calls under the timers too.
                runs = calls + 5
                print(f"host_breakdown: {name} {mode}: host {plain:.1f} µs/call "
                      f"({timed:.1f} with the timers)", flush=True)
                for _, path in TARGETS:
                    if timers.count.get(path):
                        print(f"host_breakdown:   {path:<38} {timers.ns[path] / runs / 1e3:7.1f}"
                              f" µs x{timers.count[path] / runs:g}", flush=True)
    finally:
        timers.unpatch()


def raw_costs(hidden: int, num_rows: int, calls: int) -> None:
    """Host µs of the CUDA entry points a dispatch call makes, each alone."""
    stream = torch.cuda.current_stream()
    event = torch.cuda.Event()
    cases = {
        "torch.empty fp8 rows": lambda: torch.empty(num_rows, hidden, dtype=torch.float8_e4m3fn,
                                                    device=DEVICE),
        "torch.empty bf16 rows": lambda: torch.empty(num_rows, hidden, dtype=torch.bfloat16,
                                                     device=DEVICE),
        "torch.empty 4 KiB": lambda: torch.empty(1024, dtype=torch.int32, device=DEVICE),
        "tensor[:n] (slice)": (lambda t=torch.empty(num_rows, 8, device=DEVICE):
                               t[:num_rows - 1]),
        "Event.record": lambda: event.record(stream),
        "torch.cuda.current_stream": torch.cuda.current_stream,
        "torch.cuda.is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
        "Stream.wait_stream": lambda: stream.wait_stream(stream),
    }
    cases.update(_launch_cases())
    for label, fn in cases.items():
        for _ in range(20):
            fn()
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        print(f"host_breakdown: raw {label:<40} "
              f"{(time.perf_counter_ns() - t0) / calls / 1e3:6.2f} µs", flush=True)


def _launch_cases() -> Dict[str, Callable]:
    """An empty kernel's launch through cuda.bindings (as `Kernel.launch` makes it), and the
    same launch through ctypes straight into libcuda: what the binding's own layer costs."""
    import ctypes

    from cuda.bindings import driver

    from megatron_deepep.kernels import jit
    source = 'extern "C" __global__ void empty_kernel(long long p) {}'
    cubin, _ = jit.compile_program(source, "empty.cu", [], [f"-arch={jit.device_arch()}"])
    jit.ensure_context(torch.cuda.current_device())
    image = ctypes.create_string_buffer(cubin, len(cubin))
    module = jit.cu_check(driver.cuModuleLoadData(ctypes.addressof(image)), "load")
    function = jit.cu_check(driver.cuModuleGetFunction(module, b"empty_kernel"), "function")
    value = ctypes.c_longlong(0)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(value))
    params_ptr = ctypes.addressof(params)
    handle = torch.cuda.current_stream().cuda_stream
    libcuda = ctypes.CDLL("libcuda.so.1")
    launch = libcuda.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    raw_function = int(function)
    keep = (image, params, module)

    def bindings():
        keep  # noqa: B018 (alive while timed)
        return driver.cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, handle, params_ptr, 0)

    return {"launch, cuda.bindings cuLaunchKernel": bindings,
            "launch, ctypes libcuda cuLaunchKernel":
                lambda: launch(raw_function, 1, 1, 1, 32, 1, 1, 0, handle, params_ptr, None)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="4096,7168,256,8", help="N,H,E,K")
    parser.add_argument("--num-sms", type=int, default=132)
    parser.add_argument("--fp8", default="blockwise_1x128", help="formats, comma-separated")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    num_tokens, hidden, num_experts, num_topk = (int(v) for v in args.shape.split(","))
    fp8_profile.join_as_one_rank("29543")
    buf = Buffer(dist.group.WORLD, num_tokens, hidden, num_topk, num_sms=args.num_sms)
    x, idx, weights, specs = fp8_profile.make_inputs(num_tokens, hidden, num_experts, num_topk,
                                                     args.fp8)
    breakdown(buf, x, idx, weights, num_experts, specs, args.calls)
    if DEVICE == "cuda":
        raw_costs(hidden, num_tokens * num_topk, args.calls)
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
