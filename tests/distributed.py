"""Multi-process launcher for tests: one process per rank over gloo (CPU) or NCCL.

On a machine without a GPU (the CPU tier), ranks are forked from one forkserver that has
imported torch once per test session (`FORKSERVER_PRELOAD`), so a rank starts in milliseconds
instead of a second of `import torch`; each rank takes the parent's environment and working
directory at launch time. With a GPU, ranks are spawned fresh, as the GPU tier was validated.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from multiprocessing import connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

logger = logging.getLogger(__name__)

# Imported once by the forkserver; every gloo rank is a fork of it. Modules that read the
# environment at import time do not belong here (a rank gets the launch-time environment).
# Megatron-core (~1.5 s an import, in every rank of a Megatron test) is skipped if missing.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "tests.distributed",
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
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        fn(rank, world_size, *args)
        # Every rank's last collective must be done before any rank tears its group down
        # (gloo aborts a process whose peer vanishes mid-transfer).
        dist.barrier()
        errors.put((rank, None))  # this rank's work is done and checked
    except BaseException:  # reported to the parent, which fails the test
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
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
    A process still alive `exit_grace_s` after every rank reported success is stopped, with a
    warning: its checks passed, only its teardown hung.
    """
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
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            if r not in done:
                raise TimeoutError(f"rank process {p.pid} did not finish within {timeout_s}s")
            logger.warning("rank %d passed its checks but hung in teardown; stopped", r)
    for p in procs:
        p.join()
    while not errors.empty():
        rank, tb = errors.get()
        if tb is not None:
            raise AssertionError(f"rank {rank} failed:\n{tb}")
        done.add(rank)
    # A rank that finished its work and the final barrier can still be aborted by gloo's
    # background threads while the group is torn down ("terminate called without an active
    # exception"): that is not a test failure. Any other non-zero exit is.
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0 and r not in done]
    if bad:
        raise AssertionError(f"rank processes exited with codes {bad} before finishing")
    for r, p in enumerate(procs):
        if p.exitcode != 0:
            logger.warning("rank %d exited with code %d during teardown, after its checks passed",
                           r, p.exitcode)
