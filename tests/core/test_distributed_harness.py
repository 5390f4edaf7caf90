"""CPU tier: the multi-process harness fails a test for every rank that does not finish; its
GPU-tier backend knob (`MDEEP_TEST_BACKEND`), the skip when NCCL has fewer GPUs than ranks, and
the gloo group for CPU work under either default group (torch's "fake" backend stands in for
NCCL here: a default group that is not gloo, with a real gloo side group beside it)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
# Registers torch's "fake" backend, here and in the spawned ranks (they import this module to
# find their worker function before the harness initializes their default group).
import torch.testing._internal.distributed.fake_pg  # noqa: F401

from megatron_deepep.buffer import Buffer
from tests.helpers import distributed
from tests.helpers.cases import expert_scale, make_inputs
from tests.helpers.distributed import cpu_group, run_distributed, tier_backend
from tests.helpers.oracle import oracle_combine, oracle_dispatch


def _raise_on_last(rank, world):
    if rank == world - 1:
        raise ValueError("planted failure")


def _die_on_last(rank, world):
    if rank == world - 1:
        os._exit(3)


def _fine(rank, world):
    return None


def _exit_code_in_teardown(rank, world, code):
    """The last rank's checks pass; then its process exits with `code` in teardown (a
    finalizer multiprocessing runs after the worker has returned)."""
    from multiprocessing import util
    if rank == world - 1:
        util.Finalize(None, os._exit, args=(code,), exitpriority=100)


def _hang_in_teardown(rank, world):
    from multiprocessing import util
    if rank == world - 1:
        util.Finalize(None, time.sleep, args=(600,), exitpriority=100)


def test_raising_rank_fails_the_test():
    with pytest.raises(AssertionError, match="planted failure"):
        run_distributed(2, _raise_on_last, timeout_s=120)


def test_rank_dying_before_it_finishes_fails_the_test():
    with pytest.raises((AssertionError, TimeoutError)):
        run_distributed(2, _die_on_last, timeout_s=60)


def test_finished_ranks_pass():
    run_distributed(2, _fine, timeout_s=120)


def test_rank_failing_in_teardown_fails_the_test():
    with pytest.raises(AssertionError, match=r"passed its checks, then failed in teardown: "
                                             r"rank 1 exited with code 7"):
        run_distributed(2, _exit_code_in_teardown, 7, timeout_s=120)


def test_rank_hanging_in_teardown_fails_the_test():
    with pytest.raises(AssertionError, match=r"failed in teardown: rank 1 hung \(stopped 3 s"):
        run_distributed(2, _hang_in_teardown, timeout_s=120, exit_grace_s=3)


def _sees_launch_state(rank, world, value, cwd):
    assert os.environ.get("MDEEP_TEST_HARNESS_PROBE") == value
    assert os.getcwd() == cwd


def test_ranks_see_the_environment_and_directory_at_launch(monkeypatch, tmp_path):
    # Forked ranks (the CPU tier's forkserver) must not keep the environment of an earlier test.
    for value in ("first", "second"):
        monkeypatch.setenv("MDEEP_TEST_HARNESS_PROBE", value)
        monkeypatch.chdir(tmp_path)
        run_distributed(2, _sees_launch_state, value, str(tmp_path), timeout_s=120)


@pytest.mark.parametrize("text,expected", [(None, "gloo"), ("", "gloo"), ("gloo", "gloo"),
                                           ("nccl", "nccl"), (" NCCL ", "nccl")])
def test_tier_backend_values(monkeypatch, text, expected):
    if text is None:
        monkeypatch.delenv("MDEEP_TEST_BACKEND", raising=False)
    else:
        monkeypatch.setenv("MDEEP_TEST_BACKEND", text)
    assert tier_backend() == expected


@pytest.mark.parametrize("text", ["mpi", "gloo,nccl", "1"])
def test_tier_backend_names_the_knob_for_other_values(monkeypatch, text):
    monkeypatch.setenv("MDEEP_TEST_BACKEND", text)
    with pytest.raises(ValueError, match=r"MDEEP_TEST_BACKEND=.*choose one of gloo, nccl"):
        tier_backend()


def test_nccl_with_fewer_gpus_than_ranks_skips_saying_why(monkeypatch):
    monkeypatch.setenv("MDEEP_TEST_BACKEND", "nccl")
    num_ranks = (torch.cuda.device_count() if torch.cuda.is_available() else 0) + 1
    with pytest.raises(pytest.skip.Exception) as info:
        run_distributed(num_ranks, _fine, backend=tier_backend(), timeout_s=60)
    reason = str(info.value)
    assert f"{num_ranks} ranks over NCCL run one process per GPU" in reason, reason
    assert "MDEEP_TEST_BACKEND=nccl" in reason and "MDEEP_TEST_PROCS" in reason, reason


def _reference_round_trip(rank, world, group):
    """The reference transport over `group` (CPU tensors) against the single-process oracle."""
    experts, topk = 4 * world, 2
    xs, idxs, ws = make_inputs(40 + world, world, 12, 32, experts, topk, "random")
    buf = Buffer(group, 12, 32, topk, transport="reference")
    assert buf.transport_name == "reference"
    recv_x, recv_w, handle, _ = buf.dispatch(xs[rank], idxs[rank], ws[rank], num_experts=experts)
    expected = oracle_dispatch(xs, idxs, ws, experts, 1)
    assert torch.equal(recv_x, expected[rank][0]) and torch.equal(recv_w, expected[rank][1])
    ys = [expert_scale(e[0], e[2]) for e in expected]
    out, _, _ = buf.combine(ys[rank], handle)
    exp_out = oracle_combine(ys, [e[3] for e in expected], [x.shape[0] for x in xs])[rank]
    assert torch.equal(out, exp_out)


def _check_cpu_group(rank, world, default_backend):
    assert dist.get_backend() == default_backend
    group = cpu_group()
    assert dist.get_backend(group) == "gloo"
    assert (group is dist.group.WORLD) == (default_backend == "gloo")
    for name, value in distributed.MULTICAST_OFF.items():  # multicast stays off in every rank
        assert os.environ.get(name) == value, name
    gathered = [None] * world
    dist.all_gather_object(gathered, ("rank", rank), group=group)
    assert gathered == [("rank", r) for r in range(world)]
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total, group=group)
    assert total.item() == world * (world + 1) / 2
    _reference_round_trip(rank, world, group)


@pytest.mark.parametrize("world", [2, 3])
def test_cpu_group_is_the_default_group_under_gloo(world):
    run_distributed(world, _check_cpu_group, "gloo", timeout_s=120)


def test_cpu_group_is_a_gloo_side_group_beside_another_default_group():
    """The NCCL path of the harness (store, side group, both final barriers), with torch's fake
    backend as the default group: every CPU collective must go through the side group."""
    run_distributed(2, _check_cpu_group, "fake", backend="fake", timeout_s=180)


def test_cpu_group_outside_the_harness_says_why(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(RuntimeError, match="no gloo side group.*run_distributed"):
        cpu_group()
