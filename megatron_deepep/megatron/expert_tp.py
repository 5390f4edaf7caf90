"""Expert tensor parallelism (`--expert-tensor-parallel-size` > 1) around the EP dispatch.

What Megatron's `alltoall` dispatcher does, on top of our EP dispatch and combine:

- The EP dispatch runs over Megatron's `ep` group, whose ranks share one expert-TP rank: each
  rank receives the rows its EP peers send to its local experts, expert-major.
- Dispatch: the rows and their probs are all-gathered across the expert-TP group (`expt_tp`,
  variable sizes), so every expert-TP rank runs its weight shard on the rows of the whole group,
  then the `[TP rank, local expert]` chunks are sorted into `[local expert, TP rank]` chunks
  (expert-major again; within an expert: TP rank, then EP source rank, then token, as
  `alltoall`). The experts get the counts summed over the group.
- Combine: the sort is undone and the expert outputs (partial sums of the row-parallel fc2) are
  reduce-scattered back, summed in the probs' dtype as `alltoall` does, before the EP combine.
- Backward: the gather's backward reduce-scatters the gradients of the rows and of the probs
  (each expert-TP rank holds a partial one); the reduce-scatter's backward all-gathers.

The counts cost one small all-gather of `[E_local]` integers and a host read (`gather_layout`).
Under `--moe-pad-expert-input-to-capacity` every expert-TP rank holds the same capacity segments
(`padded_layout`: host integers, no collective, no host synchronization); a rank capacity factor
is refused with expert TP > 1 (`options.check_config`).
"""

from __future__ import annotations

import dataclasses
from typing import List

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class ExpertTPLayout:
    """Where the rows of every expert-TP rank sit in the gathered rows.

    Attributes:
        counts: `[TP, E_local]` int64 on the host: the rows (padded segment sizes) each
            expert-TP rank received per local expert from its EP dispatch.
    """

    counts: torch.Tensor

    @property
    def rows_per_rank(self) -> List[int]:
        """Rows each expert-TP rank received (the gather's split sizes)."""
        return self.counts.sum(dim=1).tolist()

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """`[E_local]` int64 on the host: rows per local expert after the gather."""
        return self.counts.sum(dim=0)

    def sort_by_expert(self) -> torch.Tensor:
        """Chunk order `[TP, E_local]` -> `[E_local, TP]` (`sort_input_by_local_experts`)."""
        tp, e_local = self.counts.shape
        return torch.arange(tp * e_local).reshape(tp, e_local).T.ravel()

    def restore_by_rank(self) -> torch.Tensor:
        """Chunk order `[E_local, TP]` -> `[TP, E_local]` (`restore_output_by_local_experts`)."""
        tp, e_local = self.counts.shape
        return torch.arange(tp * e_local).reshape(e_local, tp).T.ravel()


def gather_layout(local_counts: List[int], group, device) -> ExpertTPLayout:
    """All-gathers every expert-TP rank's per-expert row counts (one small collective).

    Args:
        local_counts: `[E_local]` padded segment sizes of this rank's EP dispatch (host ints).
        group: the expert-TP process group.
        device: where the collective's tensors live (the rows' device: NCCL needs CUDA).
    """
    mine = torch.tensor(local_counts, dtype=torch.int64, device=device)
    size = dist.get_world_size(group)
    everyone = mine.new_empty(size * mine.numel())
    dist.all_gather_into_tensor(everyone, mine, group=group)
    return ExpertTPLayout(everyone.view(size, -1).cpu())


def padded_layout(segment_rows: int, num_local_experts: int, group) -> ExpertTPLayout:
    """Pad-to-capacity: every expert-TP rank holds `segment_rows` rows per local expert (the
    ranks of an expert-TP group dispatch the same number of tokens, as `alltoall` assumes
    there: its capacity gather has equal sizes)."""
    size = dist.get_world_size(group)
    return ExpertTPLayout(torch.full((size, num_local_experts), segment_rows, dtype=torch.int64))


def gather_rows(rows: torch.Tensor, probs: torch.Tensor, layout: ExpertTPLayout, group):
    """Dispatch side: all-gather `rows [M, H]` and `probs [M]` across the expert-TP group and
    sort them expert-major (differentiable; the backward reduce-scatters).

    Returns:
        `(rows [sum M, H], probs [sum M])`.
    """
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    splits = layout.rows_per_rank
    rows = gather_from_sequence_parallel_region(rows, group=group, output_split_sizes=splits)
    probs = gather_from_sequence_parallel_region(probs, group=group, output_split_sizes=splits)
    if layout.counts.shape[1] > 1:
        rows, probs = sort_chunks_by_idxs(rows, layout.counts.ravel(), layout.sort_by_expert(),
                                          probs=probs)
    return rows, probs


def scatter_rows(rows: torch.Tensor, layout: ExpertTPLayout, group,
                 reduce_dtype: torch.dtype) -> torch.Tensor:
    """Combine side: undo `gather_rows`' sort and reduce-scatter the expert outputs (partial
    sums) back to the expert-TP rank whose EP dispatch received them, summed in `reduce_dtype`.

    Returns:
        `[M, H]` in the dtype of `rows`, this rank's rows in its EP dispatch's order.
    """
    from megatron.core.tensor_parallel import reduce_scatter_to_sequence_parallel_region
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    if layout.counts.shape[1] > 1:
        rows, _ = sort_chunks_by_idxs(rows, layout.counts.T.ravel(), layout.restore_by_rank())
    return reduce_scatter_to_sequence_parallel_region(
        rows.to(reduce_dtype), group=group, input_split_sizes=layout.rows_per_rank,
    ).to(rows.dtype)
