"""Host time per EP = 1 dispatch call, measured on a CPU machine (no GPU).

Runs the real `Buffer.dispatch` -> `Buffer._run` -> `LocalTransport.dispatch` /
`cached_dispatch` -> `ops.dispatch_layout` / `ops.dispatch_local` -> `KernelArgs.fill` path with
CPU tensors, faking only what needs a GPU:

- `jit._get_kernel` returns a kernel whose `launch` does nothing (`jit.get_kernel` itself runs);
- `jit.current_raw_stream` returns a fixed `RawStream`;
- `torch.cuda.current_stream`, `torch.cuda.Event`, `torch.cuda.current_device`,
  `torch.cuda.is_available`, `torch.cuda.is_initialized` (true) and
  `torch.cuda.is_current_stream_capturing` are cheap stand-ins
  (the Buffer runs its CUDA path: a comm stream and a `CallOrder`, whose events are stand-ins
  too) that count their calls;
- `torch.empty` hands back a view of a block kept per (shape, dtype), as the CUDA caching
  allocator hands back a cached block (real CPU allocations of the 470 MB output rows would
  mmap and unmap them on every call, and their page-table work would swamp the host path);
- `KernelStatus`'s mapped host arrays are ctypes buffers; before each sync call the harness
  writes the mailbox words of the epoch the call will wait for (outside the timed region).

The stand-ins cost next to nothing, so a torch.cuda call or an allocation the path makes
costs here far less than on a GPU host (µs each there): their counts per call are printed
beside the times. This CPU is slower
than a GPU host; compare modes and before/after ratios, not absolute µs.

Usage (from the repository root):

    python dev/host_path_cpu.py                   # every mode, bf16 and blockwise FP8
    python dev/host_path_cpu.py --profile nosync  # also a cProfile of one mode (all: every one)
    python dev/host_path_cpu.py --calls 500 --shape 4096,7168,256,8
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import io
import os
import pstats
import statistics
import sys
import time
from typing import Callable, Dict

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_deepep import buffer as buffer_module  # noqa: E402
from megatron_deepep.fp8.dispatch import Fp8Dispatch  # noqa: E402
from megatron_deepep.kernels import jit  # noqa: E402
from megatron_deepep.transport import local as local_module  # noqa: E402
from megatron_deepep.transport import status as status_module  # noqa: E402
from megatron_deepep.transport.status import KernelStatus  # noqa: E402
from tests.helpers.mirrors import host_word  # noqa: E402

MODES = ("sync", "nosync", "cached")


class CudaCallCounter:
    """How many times each faked torch.cuda entry point ran."""

    def __init__(self):
        self.counts: Dict[str, int] = {}

    def hit(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1


class _FakeEvent:
    def __init__(self, counter: CudaCallCounter):
        self._counter = counter
        counter.hit("Event()")

    def record(self, stream=None) -> None:
        self._counter.hit("Event.record")

    def wait(self, stream=None) -> None:
        self._counter.hit("Event.wait")


class _FakeStream:
    """A torch stream stand-in: the calls `Buffer._run` and `CallOrder` make."""

    def __init__(self, counter: CudaCallCounter, handle: int):
        self._counter, self.cuda_stream = counter, handle

    def wait_event(self, event) -> None:
        self._counter.hit("Stream.wait_event")

    def wait_stream(self, stream) -> None:
        self._counter.hit("Stream.wait_stream")

    def synchronize(self) -> None:
        pass


class _NoopKernel:
    def launch(self, grid, block, args, stream, shared_mem=0, programmatic=False,
               cooperative=False) -> None:
        pass


class _HostArray:
    """`ipc.MappedHostArray` on ordinary (8-byte aligned) host memory."""

    def __init__(self, num_int32: int):
        self._buf = (ctypes.c_uint64 * (-(-num_int32 // 2)))()
        self.host_ptr = self.device_ptr = ctypes.addressof(self._buf)
        self.words = np.ctypeslib.as_array((ctypes.c_int32 * num_int32).from_address(
            self.host_ptr))

    def destroy(self) -> None:
        pass


@contextlib.contextmanager
def fake_gpu(counter: CudaCallCounter):
    """Replaces the GPU-only entry points (see the module doc) for the duration."""
    saved = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    stream = _FakeStream(counter, 7)

    def current_stream(device=None):
        counter.hit("current_stream")
        return stream

    def current_device():
        counter.hit("current_device")
        return 0

    def is_available():
        counter.hit("is_available")
        return True

    def is_capturing():
        counter.hit("is_current_stream_capturing")
        return False

    kernels = {}

    def get_kernel_cached(source, name, template_args, device_index):
        key = (source, name, template_args, device_index)
        kernel = kernels.get(key)
        if kernel is None:
            kernel = kernels[key] = _NoopKernel()
        return kernel

    patch(jit, "_get_kernel", get_kernel_cached)
    patch(jit, "current_raw_stream", lambda: jit.RawStream(7, 0))
    patch(torch.cuda, "current_stream", current_stream)
    patch(torch.cuda, "current_device", current_device)
    patch(torch.cuda, "is_available", is_available)
    patch(torch.cuda, "is_initialized", lambda: True)  # as on a GPU host: the capture query runs
    patch(torch.cuda, "is_current_stream_capturing", is_capturing)
    patch(torch.cuda, "Event", lambda *a, **k: _FakeEvent(counter))
    patch(torch.cuda, "ExternalStream", lambda *a, **k: None)
    patch(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    patch(status_module, "MappedHostArray", _HostArray)
    real_empty = torch.empty
    allocations = {}

    def empty(*size, dtype=None, device=None):
        # torch's CUDA caching allocator hands back a cached block: so does this (a CPU
        # allocation of the output rows would mmap and unmap hundreds of MB per call).
        counter.hit("torch.empty")
        key = (size, dtype)
        block = allocations.get(key)
        if block is None:
            block = allocations[key] = real_empty(*size, dtype=dtype, device=device)
        return block.view(block.shape)

    patch(torch, "empty", empty)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def make_buffer(counter: CudaCallCounter, max_tokens: int, hidden: int, num_topk: int,
                num_sms: int = 132):
    """A `Buffer` on the local transport as `Buffer.__init__` builds it on a GPU (comm stream,
    `CallOrder`), but on the CPU and without a process group."""
    t = local_module.LocalTransport.__new__(local_module.LocalTransport)
    t.device = torch.device("cpu")
    t.max_tokens, t.num_sms, t.timeout_ns = max_tokens, num_sms, int(100 * 1e9)
    t.status = KernelStatus(0x1000, 0, 100.0)
    t.epoch = 0
    t._meta_bases = torch.zeros(1, dtype=torch.int64)
    buf = buffer_module.Buffer.__new__(buffer_module.Buffer)
    buf.group, buf.rank, buf.num_ranks = None, 0, 1
    buf.num_max_tokens_per_rank, buf.hidden, buf.dtype = max_tokens, hidden, torch.bfloat16
    buf.row_bytes, buf.num_topk, buf.num_sms = hidden * 2, num_topk, num_sms
    buf.timeout_s = 100.0
    buf._transport, buf.device = t, t.device
    buf._comm_stream = _FakeStream(counter, 9)
    buf._successor, buf._lineage, buf.captured = None, 0, False
    buf._call_order = buffer_module.CallOrder(lambda: _FakeEvent(counter))
    return buf


def publish(buf, counts_per_expert: np.ndarray) -> None:
    """Writes the mailbox words the next sync call will wait for (its epoch: the next one)."""
    status = buf._transport.status
    epoch = np.uint64((buf._transport.epoch + 1) & 0xFFFFFFFF)
    words = status._host_words
    words[1:1 + len(counts_per_expert)] = (counts_per_expert << np.uint64(32)) | epoch
    words[0] = np.uint64(host_word(int(counts_per_expert.sum()), int(epoch)))


def time_calls(fn: Callable, before: Callable, calls: int) -> float:
    """Median over 5 rounds of the mean µs per call of `fn` (`before` runs untimed)."""
    rounds = []
    for _ in range(5):
        total = 0.0
        for _ in range(calls):
            before()
            t0 = time.perf_counter()
            fn()
            total += time.perf_counter() - t0
        rounds.append(total / calls * 1e6)
    return statistics.median(rounds)


def mode_runner(buf, x, idx, w, num_experts: int, mode: str, fp8, counts):
    """(call, untimed setup) of one mode."""
    bound = x.shape[0] * idx.shape[1]
    nothing = lambda: None  # noqa: E731
    if mode == "sync":
        return (lambda: buf.dispatch(x, idx, w, num_experts=num_experts, fp8=fp8),
                lambda: publish(buf, counts))
    if mode == "nosync":
        return (lambda: buf.dispatch(x, idx, w, num_experts=num_experts,
                                     num_max_recv_rows=bound, fp8=fp8), nothing)
    publish(buf, counts)
    _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=num_experts, fp8=fp8)
    return lambda: buf.dispatch(x, handle=handle, fp8=fp8), nothing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="4096,7168,256,8", help="N,H,E,K")
    parser.add_argument("--calls", type=int, default=1000, help="calls per timed round")
    parser.add_argument("--profile", default="", help="a mode (sync, nosync, cached) or 'all'")
    parser.add_argument("--profile-lines", type=int, default=25)
    args = parser.parse_args(argv)
    num_tokens, hidden, num_experts, num_topk = (int(v) for v in args.shape.split(","))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    idx = torch.rand(num_tokens, num_experts, generator=g).topk(num_topk, dim=1).indices
    w = torch.rand(num_tokens, num_topk, generator=g)
    counts = torch.bincount(idx.flatten(), minlength=num_experts).numpy().astype(np.uint64)
    counter = CudaCallCounter()
    print(f"shape (N, H, E, K) = {(num_tokens, hidden, num_experts, num_topk)}, "
          f"{args.calls} calls x 5 rounds, topk_idx {idx.dtype}")
    print(f"{'variant':<22} {'host µs/call':>12}  torch.cuda calls per call")
    with fake_gpu(counter):
        buf = make_buffer(counter, num_tokens, hidden, num_topk)
        for fp8_name in ("", "blockwise"):
            fp8 = Fp8Dispatch.named(fp8_name) if fp8_name else None
            for mode in MODES:
                fn, before = mode_runner(buf, x, idx, w, num_experts, mode, fp8, counts)
                for _ in range(20):  # warm the caches (plans, kernels, packers)
                    before()
                    fn()
                us = time_calls(fn, before, args.calls)
                counter.counts.clear()
                before()
                fn()
                calls = ", ".join(f"{k} {v}" for k, v in sorted(counter.counts.items()))
                label = f"{mode}{' fp8 ' + fp8_name if fp8_name else ' bf16'}"
                print(f"{label:<22} {us:>12.1f}  {calls}")
                if args.profile in (mode, "all"):
                    prof = cProfile.Profile()
                    for _ in range(args.calls):
                        before()
                        prof.enable()
                        fn()
                        prof.disable()
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(
                        args.profile_lines)
                    print(text.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
