"""CPU tier: a rank that fails mid-step gives its peers a clear error within the timeout.

The reference transport's collectives wait at most the Buffer's `timeout_s`. Here one of 2-3
gloo ranks raises between dispatch and combine (and stays alive, as a rank stuck elsewhere
would): every other rank's combine must raise `PeerTimeoutError` within the timeout, naming
the stalled rank and where it is. A peer whose process has exited is named too.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from megatron_deepep.buffer import Buffer
from megatron_deepep.transport.errors import PeerTimeoutError
from tests.helpers.cases import make_inputs
from tests.helpers.distributed import run_distributed

TIMEOUT_S = 2.0
HIDDEN, NUM_TOPK = 32, 2


def _step_with_a_failing_rank(rank, world, failing):
    # The Buffer gets its own gloo group: the default one stays clean for the launcher's barrier
    # (the timed-out all-to-all is left pending on the side group).
    group = dist.new_group(backend="gloo")
    num_experts = 4 * world
    xs, idxs, ws = make_inputs(5, world, [6] * world, HIDDEN, num_experts, NUM_TOPK, "uniform",
                               dtype=torch.float32)
    buf = Buffer(group, 16, 4 * HIDDEN, NUM_TOPK, transport="reference", timeout_s=TIMEOUT_S)
    recv_x, _, handle, _ = buf.dispatch(xs[rank], idxs[rank], ws[rank], num_experts=num_experts)
    if rank == failing:  # e.g. the experts raised on this rank: it never reaches combine
        time.sleep(TIMEOUT_S + 3.0)
        return
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError) as info:
        buf.combine(recv_x, handle)
    elapsed = time.monotonic() - start
    message = str(info.value)
    if rank == 0:
        print(f"\n--- {world} ranks, rank {failing} fails; rank 0 after {elapsed:.2f} s ---\n"
              f"{message}")
    # Not before its timeout; how late on a loaded machine is not asserted (the message says
    # it was the timeout, and run_distributed's own limit catches a hang).
    assert elapsed >= TIMEOUT_S - 0.1, elapsed
    assert f"combine (call 2 of rank {rank} of {world})" in message
    assert f"waited {TIMEOUT_S:g} s" in message
    assert f"rank {failing} (global {failing}) is still at its call 1 (dispatch)" in message
    others = [r for r in range(world) if r not in (rank, failing)]
    assert all(f"rank {r} " not in message for r in others)  # only the stalled one is named


@pytest.mark.parametrize("world, failing", [(2, 1), (3, 0)])
def test_a_rank_failing_between_dispatch_and_combine_times_out_its_peers(world, failing):
    run_distributed(world, _step_with_a_failing_rank, failing, timeout_s=60)


def _peer_process_gone(rank, world, queue):
    import os
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{queue[1]}", rank=rank,
                            world_size=world)
    xs, idxs, ws = make_inputs(5, world, [6] * world, HIDDEN, 8, NUM_TOPK, "uniform",
                               dtype=torch.float32)
    buf = Buffer(None, 16, 4 * HIDDEN, NUM_TOPK, transport="reference", timeout_s=30.0)
    recv_x, _, handle, _ = buf.dispatch(xs[rank], idxs[rank], ws[rank], num_experts=8)
    if rank == 1:
        os._exit(3)  # the process dies between dispatch and combine
    start = time.monotonic()
    try:
        buf.combine(recv_x, handle)
        queue[0].put("combine returned")
    except RuntimeError as exc:
        queue[0].put(f"{time.monotonic() - start:.1f} s: {type(exc).__name__}: {exc}")
    os._exit(0)


def test_a_peer_whose_process_exited_is_named():
    import torch.multiprocessing as mp

    from tests.helpers.distributed import free_port
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_peer_process_gone, args=(r, 2, (queue, port))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    text = queue.get()
    print(f"\n--- rank 1's process exited after dispatch; rank 0's combine ---\n{text}")
    assert "waited 30 s" not in text  # the process's exit, not the 30 s timeout
    assert "combine (call 2 of rank 0 of 2)" in text
    assert "rank 1 (global 1) is still at its call 1 (dispatch)" in text


def _peer_never_builds(rank, world, transport):
    group = dist.new_group(backend="gloo")
    if rank == 1:  # never builds its Buffer (a rank stuck elsewhere)
        time.sleep(TIMEOUT_S + 3.0)
        return
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError) as info:
        Buffer(group, 16, HIDDEN, NUM_TOPK, transport=transport, timeout_s=TIMEOUT_S)
    assert time.monotonic() - start >= TIMEOUT_S - 0.1
    message = str(info.value)
    assert f"waited {TIMEOUT_S:g} s (the Buffer's timeout_s)" in message, message
    assert "for rank 1 (global 1): every rank of the EP group must build the Buffer" in message


@pytest.mark.parametrize("transport", ["reference", "auto"])
def test_a_peer_that_never_builds_its_buffer_times_out_naming_it(transport):
    """The set-up's exchanges (which transport; with `auto`, how many hosts) wait at most the
    Buffer's timeout_s, as its calls do (before, gloo waited until the peer's process ended)."""
    run_distributed(2, _peer_never_builds, transport, timeout_s=60)
