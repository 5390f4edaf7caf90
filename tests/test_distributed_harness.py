"""CPU tier: the multi-process harness fails a test for every rank that does not finish."""

from __future__ import annotations

import os

import pytest

from tests.distributed import run_distributed


def _raise_on_last(rank, world):
    if rank == world - 1:
        raise ValueError("planted failure")


def _die_on_last(rank, world):
    if rank == world - 1:
        os._exit(3)


def _fine(rank, world):
    return None


def test_raising_rank_fails_the_test():
    with pytest.raises(AssertionError, match="planted failure"):
        run_distributed(2, _raise_on_last, timeout_s=120)


def test_rank_dying_before_it_finishes_fails_the_test():
    with pytest.raises((AssertionError, TimeoutError)):
        run_distributed(2, _die_on_last, timeout_s=60)


def test_finished_ranks_pass():
    run_distributed(2, _fine, timeout_s=120)


def _sees_launch_state(rank, world, value, cwd):
    assert os.environ.get("MDEEP_TEST_HARNESS_PROBE") == value
    assert os.getcwd() == cwd


def test_ranks_see_the_environment_and_directory_at_launch(monkeypatch, tmp_path):
    # Forked ranks (the CPU tier's forkserver) must not keep the environment of an earlier test.
    for value in ("first", "second"):
        monkeypatch.setenv("MDEEP_TEST_HARNESS_PROBE", value)
        monkeypatch.chdir(tmp_path)
        run_distributed(2, _sees_launch_state, value, str(tmp_path), timeout_s=120)
