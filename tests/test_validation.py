"""CPU tier: every bad input gets a ValueError that names the argument and the limit."""

from __future__ import annotations

import pytest
import torch

from megatron_deepep.buffer import Buffer
from tests.distributed import run_distributed


@pytest.fixture(scope="module")
def buf():
    import torch.distributed as dist
    from tests.distributed import _free_port
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                world_size=1)
    return Buffer(None, 16, 64, 4, transport="reference")


def _inputs(n=4, h=64, k=2, e=4):
    return (torch.randn(n, h).to(torch.bfloat16), torch.zeros(n, k, dtype=torch.int64),
            torch.ones(n, k))


@pytest.mark.parametrize("mutate, match", [
    (lambda x, i, w: (x.to(torch.float16), i, w), "x must have dtype"),
    (lambda x, i, w: (x[:, :12], i, w), "contiguous|multiple of 16 bytes"),
    (lambda x, i, w: (x.view(-1), i, w), "x must be 2-D"),
    (lambda x, i, w: (x, i.float(), w), "topk_idx must have dtype"),
    (lambda x, i, w: (x, i, w.double()), "topk_weights must have dtype"),
    (lambda x, i, w: (x, i[:3], w[:3]), "topk_idx has 3 rows but x has 4 tokens"),
    (lambda x, i, w: (x, i, w[:, :1].contiguous()), "topk_weights shape"),
    (lambda x, i, w: (x, i.fill_(7), w), r"outside \[-1, num_experts=4\)"),
    (lambda x, i, w: (x, i.fill_(-2), w), r"outside \[-1, num_experts=4\)"),
    (lambda x, i, w: (torch.zeros(17, 64, dtype=torch.bfloat16), torch.zeros(17, 2).long(),
                      torch.ones(17, 2)), "num_max_tokens_per_rank=16"),
    (lambda x, i, w: (torch.zeros(4, 72, dtype=torch.bfloat16), i, w), "hidden=64"),
    (lambda x, i, w: (x, torch.zeros(4, 5).long(), torch.ones(4, 5)),
     "top-k=5; the limit is 4"),
])
def test_bad_dispatch_input(buf, mutate, match):
    x, i, w = mutate(*_inputs())
    with pytest.raises(ValueError, match=match):
        buf.dispatch(x, i, w, num_experts=4)


def test_bad_num_experts_and_alignment(buf):
    x, i, w = _inputs()
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        buf.dispatch(x, i, w, num_experts=0)
    with pytest.raises(ValueError, match="256"):
        buf.dispatch(x, i, w, num_experts=257)
    with pytest.raises(ValueError, match="expert_alignment"):
        buf.dispatch(x, i, w, num_experts=4, expert_alignment=0)


def test_bad_combine_and_cached_input(buf):
    x, i, w = _inputs()
    recv_x, _, handle, _ = buf.dispatch(x, i, w, num_experts=4)
    with pytest.raises(ValueError, match="y has shape"):
        buf.combine(recv_x[:-1], handle)
    with pytest.raises(ValueError, match="cached dispatch: x has shape"):
        buf.dispatch(x[:2], handle=handle)
    with pytest.raises(ValueError, match="takes no topk_idx"):
        buf.dispatch(x, i, handle=handle)
    with pytest.raises(ValueError, match="num_max_recv_rows=1 is too small"):
        buf.dispatch(x, i, w, num_experts=4, num_max_recv_rows=1)


def test_bad_buffer_arguments():
    with pytest.raises(ValueError, match="num_topk=17 exceeds the limit 16"):
        Buffer(None, 16, 64, 17, transport="reference")
    with pytest.raises(ValueError, match="transport must be one of"):
        Buffer(None, 16, 64, 2, transport="tcp")
    with pytest.raises(ValueError, match="num_max_tokens_per_rank must be an int >= 1"):
        Buffer(None, 0, 64, 2, transport="reference")


def _mismatch(rank, world):
    buf = Buffer(None, 8, 64, 2, transport="reference")
    hidden = 64 if rank == 0 else 32
    x = torch.zeros(4, hidden, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"ranks disagree on hidden: per-rank values \[64, 32\]"):
        buf.dispatch(x, torch.zeros(4, 2).long(), torch.ones(4, 2), num_experts=2)


def test_ranks_disagreeing_raise():
    run_distributed(2, _mismatch)
