"""Multi-process launcher for tests: one process per rank over gloo (CPU) or NCCL.

On a machine without a GPU (the CPU tier), ranks are forked from one forkserver that has
imported torch once per pytest run (`FORKSERVER_PRELOAD`), so a rank starts in milliseconds
instead of a second of `import torch`; each rank takes the parent's environment and working
directory at launch time. With a GPU, ranks are spawned fresh, as the GPU tier was validated.

The GPU tier's multi-process tests launch with `backend=tier_backend()` (`MDEEP_TEST_BACKEND`):
"gloo" (default): the ranks share the GPU, gloo is the control plane; "nccl": one process per
GPU (rank r on GPU r, skipped when there are fewer GPUs than ranks), NCCL is the default group,
and a gloo side group made at launch carries what only gloo can (the reference transport's CPU
tensors, collectives on CPU tensors): workers reach it as `cpu_group()`, which is the default
group itself under gloo.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from multiprocessing import connection
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_deepep import knobs
from tests.helpers import knobs as test_knobs

TIER_BACKENDS = ("gloo", "nccl")
# NVLink multicast stays off in every rank (a program using it can take a shared host's GPUs out
# of service); a variable the launching test set wins.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}

# The gloo side group of a rank whose default group is NCCL (made by `_worker` at launch).
_cpu_side_group = None


def tier_backend() -> str:
    """The GPU tier's control plane, `MDEEP_TEST_BACKEND`: "gloo" (the ranks share the GPU) or
    "nccl" (one process per GPU).

    Raises:
        ValueError: any other value (the message names the variable).
    """
    backend = test_knobs.get("TEST_BACKEND").lower()
    if backend not in TIER_BACKENDS:
        raise ValueError(f"{knobs.PREFIX}TEST_BACKEND={backend!r}: choose one of "
                         f"{', '.join(TIER_BACKENDS)}")
    return backend


def cpu_group():
    """The group for CPU tensors and Python objects in a rank of `run_distributed`: the default
    group when it is gloo, else the gloo side group made at launch.

    Raises:
        RuntimeError: the default group is not gloo and this process has no side group (it was
            not started by `run_distributed`).
    """
    if _cpu_side_group is not None:
        return _cpu_side_group
    backend = dist.get_backend()
    if backend == "gloo":
        return dist.group.WORLD
    raise RuntimeError(f"the default group is {backend} and this process has no gloo side group "
                       "(cpu_group() serves ranks started by "
                       "tests.helpers.distributed.run_distributed)")


def use_rank_device(rank: int, gloo_device: Optional[int] = None) -> int:
    """Makes `rank`'s GPU current and returns its index: GPU `rank` under NCCL (one process per
    GPU); under gloo `gloo_device` when given (tests whose ranks must share one GPU), else
    `rank % device_count` (the gloo tier's choice: GPU 0 on a one-GPU machine)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        device = rank
    elif gloo_device is not None:
        device = gloo_device
    else:
        device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    return device


def _require_gpus(world_size: int) -> None:
    """Skips the test unless there is one CUDA GPU per rank (the NCCL backend's layout)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < world_size:
        pytest.skip(f"{world_size} ranks over NCCL run one process per GPU "
                    f"({knobs.PREFIX}TEST_BACKEND=nccl): torch sees {count} CUDA GPU(s); "
                    f"use fewer ranks ({knobs.PREFIX}TEST_PROCS) or gloo (ranks sharing a GPU)")

# Imported once by the forkserver; every gloo rank is a fork of it. Modules that read the
# environment at import time do not belong here (a rank gets the launch-time environment).
# Megatron-core (~1.5 s an import, in every rank of a Megatron test) is skipped if missing.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "tests.helpers.distributed",
                      "megatron.core.transformer.moe.moe_layer"]


def free_port() -> int:
    """A free TCP port on localhost."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context(backend: str):
    if backend != "gloo" or torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def _worker(rank, world_size, port, backend, fn, args, errors, hard_exit=False, launch=None):
    if launch is not None:  # a forkserver's child: take the launching test's environment, cwd
        environ, cwd = launch
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
    global _cpu_side_group
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    if backend == "gloo":  # the gloo tier's ranks share a GPU on purpose: declared, no warning
        os.environ.setdefault(f"{knobs.PREFIX}SHARED_GPU", "1")
    if not torch.cuda.is_available():
        # The CPU tier: the ranks share the machine's cores instead of each starting a thread
        # per core (on 2 cores, 4 ranks of 2 threads each ran 1.8x slower than 1 each).
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    try:
        if backend == "gloo":
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world_size)
        else:
            if backend == "nccl":
                torch.cuda.set_device(rank)  # one process per GPU; before NCCL picks a device
            # A store, not an init_method: the CPU tests' stand-in for NCCL, torch's "fake"
            # backend, ignores init_method (and its own store cannot host a gloo group).
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
            _cpu_side_group = dist.new_group(backend="gloo")  # collective: every rank, here
        fn(rank, world_size, *args)
        # Every rank's last collective must be done before any rank tears its group down
        # (gloo aborts a process whose peer vanishes mid-transfer), the side group's too.
        dist.barrier()
        if _cpu_side_group is not None:
            dist.barrier(group=_cpu_side_group)
        errors.put((rank, None))  # this rank's work is done and checked
    except BaseException:  # reported to the parent, which fails the test
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        _cpu_side_group = None
        if dist.is_initialized():
            dist.destroy_process_group()
    if hard_exit:
        # Skips the interpreter's exit handlers: NVSHMEM's finalization is a host collective,
        # which its several-processes-per-GPU mode does not support (it hangs there).
        os._exit(0)


def run_distributed(world_size: int, fn, *args, backend: str = "gloo", timeout_s: float = 600,
                    hard_exit: bool = False, exit_grace_s: float = 30.0):
    """Runs `fn(rank, world_size, *args)` on `world_size` processes; re-raises the first failure.

    `fn` must be a module-level function (it is pickled into the spawned processes).
    `hard_exit`: a rank leaves with `os._exit(0)` once its work is checked (no exit handlers).
    A rank that fails in its teardown, after its checks passed, fails the test too: a process
    still alive `exit_grace_s` after every rank reported success (stopped, then reported as
    hung), or one that exits with a non-zero code. A teardown that crashes or hangs is a bug
    (a group torn down under a peer's transfer, a finalizer waiting on a vanished peer) that
    the next job on that machine meets.
    `backend` "nccl" runs rank r on GPU r (the test is skipped, saying why, when there are fewer
    GPUs than ranks) with a gloo side group for CPU work (`cpu_group()`); the GPU tier passes
    `tier_backend()`.
    """
    if backend == "nccl":
        _require_gpus(world_size)
    ctx = _context(backend)
    errors = ctx.SimpleQueue()
    port = free_port()
    launch = (dict(os.environ), os.getcwd()) if ctx.get_start_method() == "forkserver" else None
    procs = [ctx.Process(target=_worker,
                         args=(r, world_size, port, backend, fn, args, errors, hard_exit,
                               launch))
             for r in range(world_size)]
    for p in procs:
        p.start()
    # Fail fast: the first rank that reports a failure ends the run (its peers would otherwise
    # wait in a collective until the timeout).
    deadline = time.monotonic() + timeout_s
    done, failure = set(), None
    while failure is None and any(p.is_alive() for p in procs):
        if time.monotonic() > deadline:
            break
        if len(done) == world_size:
            deadline = min(deadline, time.monotonic() + exit_grace_s)
        connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=1.0)
        while not errors.empty():
            rank, tb = errors.get()
            if tb is not None and failure is None:
                failure = (rank, tb)
            elif tb is None:
                done.add(rank)
    if failure is not None:
        # Let the other ranks report theirs (up to 2 s, or until all have exited), then stop them.
        grace = time.monotonic() + 2.0
        while any(p.is_alive() for p in procs) and time.monotonic() < grace:
            connection.wait([p.sentinel for p in procs if p.is_alive()],
                            timeout=max(0.0, grace - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        raise AssertionError(f"rank {failure[0]} failed:\n{failure[1]}")
    hung = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            if r not in done:
                raise TimeoutError(f"rank process {p.pid} did not finish within {timeout_s}s")
            hung.append(r)
    for p in procs:
        p.join()
    while not errors.empty():
        rank, tb = errors.get()
        if tb is not None:
            raise AssertionError(f"rank {rank} failed:\n{tb}")
        done.add(rank)
    bad = [(r, p.exitcode) for r, p in enumerate(procs)
           if p.exitcode != 0 and r not in done]
    if bad:
        raise AssertionError(f"rank processes exited with codes {bad} before finishing")
    teardown = [f"rank {r} hung (stopped {exit_grace_s:g} s after every rank passed)"
                for r in hung]
    teardown += [f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(procs)
                 if p.exitcode != 0 and r not in hung]
    if teardown:
        raise AssertionError("every rank passed its checks, then failed in teardown: "
                             + "; ".join(teardown))
