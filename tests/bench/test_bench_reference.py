"""CPU tier: `bench.reference` counts the reference transport's collectives and host reads."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_deepep.bench import reference as bench_reference
from tests.helpers.distributed import run_distributed

#: Collectives per transport call of one layer step, forward and backward: the dispatch's
#: header all-gather and record all-to-all, then one all-to-all each.
EXPECTED_COLLECTIVES = {"dispatch": 2, "combine": 1, "cached_dispatch (combine backward)": 1,
                        "combine (dispatch backward)": 1}


def _layer_steps(rank, world):
    originals = (dist.all_to_all_single, dist.all_gather, torch.Tensor.tolist,
                 torch.Tensor.__bool__)
    recorder, wall = bench_reference.profile_layer_steps(
        None, tokens=40, hidden=32, experts=2 * world, topk=2, iters=3, warmup=1)
    assert len(wall) == 3
    summary = bench_reference.summarize(recorder.events, recorder.phases, 3)
    phases = {row["phase"]: row for row in summary["phases"]}
    assert {p: row["collectives"] for p, row in phases.items()} == EXPECTED_COLLECTIVES
    assert all(row["calls"] == 1 for row in phases.values())
    # Host reads: the expert-id range check (min, max), the header table, the segment sizes.
    assert phases["dispatch"]["host_reads"] == 4
    assert sum(row["host_reads"] for row in phases.values()) == 4
    # One store write per call: where this rank is, for a timeout's message.
    assert all(row["store_writes"] == 1 for row in phases.values())
    sites = {(row["phase"], row["kind"], row["site"]) for row in summary["sites"]}
    assert ("dispatch", "collective all_gather", "exchange_header:dist.all_gather") in sites
    assert ("dispatch", "collective all_to_all_single", "_dispatch_rows:received") in sites
    text = bench_reference.format_table(summary, 1e6 * wall[0])
    assert ("per layer step (forward + backward): 5 collectives, 4 host reads, 4 store writes"
            in text)
    # Leaving the recorder restores what it wrapped.
    assert (dist.all_to_all_single, dist.all_gather, torch.Tensor.tolist,
            torch.Tensor.__bool__) == originals


@pytest.mark.parametrize("world_size", [2, 3])
def test_layer_step_runs_five_collectives(world_size):
    run_distributed(world_size, _layer_steps)


def test_summarize_and_table_from_events():
    events = [("dispatch", "collective all_gather", "f:a", 0.002, 8),
              ("combine", "store write", "enter:combine", 0.0, 0),
              ("dispatch", "host read tolist", "f:b", 0.001, 0),
              ("dispatch", "collective all_gather", "f:a", 0.004, 8),
              ("combine", "collective all_to_all_single", "g:c", 0.003, 100)]
    phases = [("dispatch", 0.010), ("dispatch", 0.012), ("combine", 0.005)]
    summary = bench_reference.summarize(events, phases, iters=2)
    sites = {row["site"]: row for row in summary["sites"]}
    assert sites["f:a"]["calls"] == 1 and sites["f:a"]["us_per_call"] == pytest.approx(3000)
    assert sites["f:a"]["us"] == pytest.approx(3000) and sites["f:a"]["bytes_per_call"] == 8
    rows = {row["phase"]: row for row in summary["phases"]}
    assert rows["dispatch"]["us"] == pytest.approx(11000)
    assert rows["dispatch"]["other_us"] == pytest.approx(7500)  # (22 - 7) ms / 2
    assert (rows["dispatch"]["collectives"], rows["dispatch"]["host_reads"]) == (1, 0.5)
    assert (rows["combine"]["store_writes"], rows["dispatch"]["store_writes"]) == (0.5, 0)
    text = bench_reference.format_table(summary, 9000)
    assert "| dispatch | collective all_gather | `f:a` | 1 | 3000 | 3000 | 8 |" in text
    assert "2 collectives" in text and "9000 µs wall" in text
