"""CPU tier: Buffer on the reference transport against the oracle, on examples Hypothesis draws.

`tests/helpers/buffer_properties.py` draws token counts (0 included), hidden sizes, top-k 1-16,
experts per rank, -1 ids, skew, row and index dtypes, alignment and no-sync row bounds, and
checks dispatch, cached dispatch, combine and weighted combine (bit-exact) on 1, 2 and 4 gloo
ranks: 200 examples per world size, 600 in all.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytest.importorskip("hypothesis", reason="the property tests need hypothesis: pip install "
                    "-e '.[test]'")

# world size -> examples (each one runs on every rank)
EXAMPLES = {1: 200, 2: 200, 4: 200}


def _reference(rank, world, max_examples):
    from tests.helpers.buffer_properties import make_buffer, run_property

    buf = make_buffer(transport="reference", timeout_s=60)
    done = run_property(rank, world, buf, torch.device("cpu"), max_examples)
    buf.destroy()
    assert done["examples"] == max_examples, done
    if rank == 0:
        print(f"\nreference transport, {world} rank(s): {done['examples']} examples in "
              f"{done['seconds']:.1f} s")


@pytest.mark.parametrize("world", sorted(EXAMPLES))
def test_reference_buffer_matches_the_oracle_on_drawn_examples(world):
    run_distributed(world, _reference, EXAMPLES[world], timeout_s=300)
