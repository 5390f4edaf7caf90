"""CPU tier: the bench's ceiling helpers describe the layout our expand writes."""

from __future__ import annotations

import pytest
import torch

from megatron_deepep import bench
from megatron_deepep.layout import compute_layout


@pytest.mark.parametrize("num_tokens,num_experts,num_topk", [(37, 16, 4), (64, 256, 8),
                                                              (5, 3, 3), (0, 8, 2)])
def test_expert_major_rows_match_the_layout(num_tokens, num_experts, num_topk):
    g = torch.Generator().manual_seed(num_tokens * 31 + num_experts)
    topk_idx = torch.rand(num_tokens, num_experts, generator=g).topk(num_topk, dim=1).indices
    rows = bench.expert_major_rows(topk_idx)

    layout = compute_layout(topk_idx, num_experts, num_ranks=1)
    counts = layout.num_tokens_per_expert.long()
    starts = torch.cumsum(counts, 0) - counts
    expected = starts[topk_idx.flatten()] + layout.pos_in_expert.flatten().long()
    assert rows.dtype == torch.int32
    assert torch.equal(rows.long(), expected)
    assert torch.equal(torch.sort(rows).values, torch.arange(num_tokens * num_topk,
                                                              dtype=torch.int32))
