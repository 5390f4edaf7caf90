"""CPU tier: a model of notify's count exchange (`cuda_src/notify.cu`) on random schedules.

Each rank writes its count row into every peer's `Meta.counts[half][rank]`, releases its flag
with the call's epoch, waits for every peer's flag, then reads the rows. With nothing else
between two notifies (no dispatch, whose own flags happen to hold a fast rank back today), a
rank can start the next notify while a slow peer still reads the rows of this one. The model
runs each rank as a generator that yields at every store, load and spin, under a random
scheduler: with the two halves chosen by the epoch's parity (buffer.cuh's `counts_half`,
mirrored in `tests.helpers.mirrors`) every read sees the row of its own call; with one half (the
layout before), some schedule overwrites a row before it is read.
"""

from __future__ import annotations

import random

import pytest

from megatron_deepep.transport.regions import COUNT_HALVES
from tests.helpers.mirrors import counts_half


class _Notify:
    """Shared memory of the model: per rank, the flags its peers release and its count rows."""

    def __init__(self, num_ranks: int, halves: int):
        self.num_ranks, self.halves = num_ranks, halves
        self.flags = [[0] * num_ranks for _ in range(num_ranks)]          # [owner][peer]
        self.counts = [[[None] * num_ranks for _ in range(halves)] for _ in range(num_ranks)]
        self.bad_reads = []

    def half(self, epoch: int) -> int:
        return counts_half(epoch) if self.halves == 2 else 0

    def rank(self, me: int, epochs):
        """One rank's notifies, in stream order; yields where the kernel may be preempted."""
        for epoch in epochs:
            half = self.half(epoch)
            for dst in range(self.num_ranks):            # 1. my row into every peer
                self.counts[dst][half][me] = (epoch, me)
                yield
            for dst in range(self.num_ranks):            # release my flag to every peer
                self.flags[dst][me] = epoch
                yield
            for src in range(self.num_ranks):            # 2. wait for every peer's flag
                while self.flags[me][src] < epoch:
                    yield
            for src in range(self.num_ranks):            # 3. read every row (one at a time)
                row = self.counts[me][half][src]
                if row != (epoch, src):
                    self.bad_reads.append((me, src, epoch, row))
                yield


def _run(num_ranks: int, num_calls: int, halves: int, seed: int) -> _Notify:
    rng = random.Random(seed)
    model = _Notify(num_ranks, halves)
    runners = {r: model.rank(r, range(1, num_calls + 1)) for r in range(num_ranks)}
    # A skewed scheduler: some ranks run much faster than others, as on a loaded node.
    speed = {r: rng.choice((1, 1, 8)) for r in range(num_ranks)}
    steps = 0
    while runners:
        alive = list(runners)
        r = rng.choices(alive, weights=[speed[a] for a in alive])[0]
        try:
            next(runners[r])
        except StopIteration:
            del runners[r]
        steps += 1
        assert steps < 1_000_000, "the model deadlocked"
    return model


@pytest.mark.parametrize("num_ranks", [2, 3, 8])
def test_parity_halves_never_overwrite_a_row_before_it_is_read(num_ranks):
    assert COUNT_HALVES == 2
    for seed in range(30):
        model = _run(num_ranks, num_calls=6, halves=COUNT_HALVES, seed=seed)
        assert not model.bad_reads, (seed, model.bad_reads[:3])


def test_one_half_loses_rows_on_some_schedule():
    # The control: the same schedules with a single region of rows (the layout before).
    losses = [seed for seed in range(60) if _run(2, num_calls=6, halves=1, seed=seed).bad_reads]
    assert losses, "the model cannot show the hazard it guards against"


def test_counts_half_is_the_epoch_parity_across_the_wrap():
    assert [counts_half(e) for e in (0, 1, 2, 0xFFFFFFFF)] == [0, 1, 0, 1]
    # epoch 2^32 - 1 and the next epoch (0 after the 32-bit wrap) use different halves
    assert counts_half(0xFFFFFFFF) != counts_half((0xFFFFFFFF + 1) & 0xFFFFFFFF)
