"""Property-based check of `Buffer` against the oracle, run inside every rank.

Hypothesis draws each example (token counts per rank, 0 included; hidden size; top-k 1-16;
experts per rank; -1 ids; skew; row dtype; index dtype; alignment; a no-sync row bound or none)
and every rank builds the same inputs of every rank from the drawn seed, runs dispatch, cached
dispatch, combine and weighted combine on its own, and compares its part with the oracle
(`tests/helpers/oracle.py`). Every rank draws the same examples in the same order (derandomized,
no database, no shrinking, no timing health checks) and the ranks agree on each verdict (an
all-reduce, then the messages of a failure) before the next example, so a failure on one rank
fails the same example on all of them and no collective is left waiting.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.helpers.oracle import oracle_combine, oracle_dispatch

MAX_TOKENS = 24           # tokens per rank, 0 included
MAX_EXPERTS_PER_RANK = 8
MAX_TOPK = 16
MAX_ROW_BYTES = 256       # the Buffer's rows: hidden 128 in 2-byte elements
ALIGNMENTS = (1, 2, 3, 4, 8, 16, 128)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def routing(gen: torch.Generator, num_tokens: int, num_experts: int, num_topk: int,
            drop: float, skew: bool) -> torch.Tensor:
    """`[N, K]` expert ids, distinct per token; -1 where a token has fewer than K experts
    (K > E) or where an entry is dropped (probability `drop`); with `skew` every token's first
    pick is expert 0 (one hot expert, one hot rank)."""
    idx = torch.full((num_tokens, num_topk), -1, dtype=torch.int64)
    for n in range(num_tokens):
        picks = torch.randperm(num_experts, generator=gen)[:num_topk]
        if skew and 0 not in picks.tolist():
            picks[0] = 0
        idx[n, :picks.numel()] = picks
    dropped = torch.rand(num_tokens, num_topk, generator=gen) < drop
    return torch.where(dropped, torch.full_like(idx, -1), idx)


def expert_rows(recv_x: torch.Tensor, sizes: List[int]) -> torch.Tensor:
    """A stand-in expert: scales local expert e's rows by (e + 1) / 4 (the oracle's combine
    gets the same rows)."""
    scale = torch.repeat_interleave(torch.tensor([(e + 1) / 4 for e in range(len(sizes))]),
                                    torch.tensor(sizes, dtype=torch.long))
    return (recv_x.float() * scale.unsqueeze(1)).to(recv_x.dtype)


@st.composite
def examples(draw, world: int, dtypes):
    dtype = draw(st.sampled_from(sorted(dtypes)))
    unit = 16 // DTYPES[dtype].itemsize  # rows are a multiple of 16 bytes
    per_rank = draw(st.integers(1, MAX_EXPERTS_PER_RANK))
    return dict(
        tokens=draw(st.lists(st.integers(0, MAX_TOKENS), min_size=world, max_size=world)),
        hidden=unit * draw(st.integers(1, MAX_ROW_BYTES // 16)),
        dtype=dtype,
        index_dtype=draw(st.sampled_from(["int64", "int32"])),
        experts_per_rank=per_rank,
        topk=draw(st.integers(1, MAX_TOPK)),
        drop=draw(st.sampled_from([0.0, 0.0, 0.2, 0.6, 1.0])),
        skew=draw(st.booleans()),
        alignment=draw(st.sampled_from(ALIGNMENTS)),
        bound_slack=draw(st.one_of(st.none(), st.integers(0, 40))),
        seed=draw(st.integers(0, 2**31 - 1)))


def check_example(buf, rank: int, world: int, ex: Dict, device: torch.device,
                  exact_combine: bool) -> None:
    """One example on this rank: every Buffer call, then the comparisons (AssertionError)."""
    gen = torch.Generator().manual_seed(ex["seed"])
    dtype, hidden = DTYPES[ex["dtype"]], ex["hidden"]
    num_experts = ex["experts_per_rank"] * world
    xs = [torch.randn(n, hidden, generator=gen).to(dtype) for n in ex["tokens"]]
    idxs = [routing(gen, n, num_experts, ex["topk"], ex["drop"], ex["skew"])
            for n in ex["tokens"]]
    ws = [torch.rand(n, ex["topk"], generator=gen) for n in ex["tokens"]]
    again = [torch.randn(n, hidden, generator=gen).to(dtype) for n in ex["tokens"]]
    expected = oracle_dispatch(xs, idxs, ws, num_experts, ex["alignment"])
    bound = None
    if ex["bound_slack"] is not None:  # the same bound on every rank, >= every rank's rows
        bound = max(e[0].shape[0] for e in expected) + ex["bound_slack"]

    # Every call first (every rank makes the same calls), then the checks.
    idx = idxs[rank].to(getattr(torch, ex["index_dtype"]))
    recv_x, recv_w, handle, _ = buf.dispatch(
        xs[rank].to(device), idx.to(device), ws[rank].to(device), num_experts=num_experts,
        expert_alignment=ex["alignment"], num_max_recv_rows=bound)
    cached, _, _, _ = buf.dispatch(again[rank].to(device), handle=handle)
    exp_x, exp_w, exp_sizes, exp_src = expected[rank]
    used = exp_x.shape[0]
    num_rows = recv_x.shape[0]
    ys = [expert_rows(e[0], e[2]) for e in expected]
    y = ys[rank]
    if num_rows > used:  # rows past the used ones: garbage the combine must ignore
        y = torch.cat([y, torch.randn(num_rows - used, hidden, generator=gen).to(dtype)])
    out, _, _ = buf.combine(y.to(device), handle)
    weighted, _, _ = buf.combine(y.to(device), handle, weighted=True)

    assert num_rows == (used if bound is None else bound), (num_rows, used, bound)
    assert torch.equal(recv_x[:used].cpu(), exp_x), "dispatch rows"
    assert torch.equal(recv_w[:used].cpu(), exp_w), "dispatch weights"
    assert handle.tokens_per_expert.tolist() == exp_sizes, "tokens per expert"
    if bound is None:
        assert handle.tokens_per_expert_list == exp_sizes
    rows = [again[src[0]][src[1]] if src is not None else torch.zeros(hidden, dtype=dtype)
            for src in exp_src]  # padding rows: zeros
    want = torch.stack(rows) if rows else torch.zeros(0, hidden, dtype=dtype)
    assert torch.equal(cached[:used].cpu(), want), "cached dispatch rows"
    sources, counts = [e[3] for e in expected], [x.shape[0] for x in xs]
    for got, weights in ((out, None), (weighted, [e[1] for e in expected])):
        exp_out = oracle_combine(ys, sources, counts, weights)[rank]
        if exact_combine:
            assert torch.equal(got.cpu(), exp_out), f"combine (weighted={weights is not None})"
        else:
            torch.testing.assert_close(got.cpu().float(), exp_out.float(), rtol=1e-2,
                                       atol=1e-2)


def make_buffer(**kwargs):
    """The Buffer every example runs on: room for the largest example (`MAX_TOKENS` tokens,
    rows of `MAX_ROW_BYTES`, top-16); `kwargs` go to `Buffer` (group, transport, ...)."""
    from megatron_deepep.buffer import Buffer

    group = kwargs.pop("group", None)
    return Buffer(group, MAX_TOKENS, MAX_ROW_BYTES // 2, MAX_TOPK, **kwargs)


def run_property(rank: int, world: int, buf, device: torch.device, max_examples: int,
                 exact_combine: bool = True, group=None) -> Dict[str, float]:
    """Runs `max_examples` examples of `buf` (from `make_buffer`) on every rank, in the row
    dtypes its transport takes; returns {"examples", "seconds"}. `group`: the group the ranks
    agree on each verdict over (CPU objects: gloo).

    Raises:
        AssertionError: on every rank, naming the example and each failing rank's message.
    """
    dtypes = [name for name, dtype in DTYPES.items() if dtype in buf._row_dtypes()]
    count = [0]
    start = time.monotonic()

    @settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck),
              print_blob=False)
    @given(examples(world, dtypes))
    def prop(ex):
        count[0] += 1
        try:
            check_example(buf, rank, world, ex, device, exact_combine)
            error: Optional[str] = None
        except AssertionError as exc:
            error = f"{type(exc).__name__}: {exc}"[:2000]
        # One small all-reduce per example; the messages travel only when one failed.
        any_failed = torch.tensor([int(error is not None)])
        dist.all_reduce(any_failed, op=dist.ReduceOp.MAX, group=group)
        if any_failed.item():
            errors: List[Optional[str]] = [None] * world
            dist.all_gather_object(errors, error, group=group)
            failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
            raise AssertionError(f"example {ex}:\n" + "\n".join(failed))

    prop()
    return {"examples": count[0], "seconds": time.monotonic() - start}
