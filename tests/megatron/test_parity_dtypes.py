"""CPU tier: bf16, fp16 and fp32 rows through dispatch and combine.

The reference transport against the oracle (fp32 rows: combine bit-exact in fp32, nothing
rounded), the kernel transports' host path with recording kernels (the dispatch kernels copy the
bytes of an fp16 / fp32 row as bf16 words; combine gets the row dtype as kDtype and the row's
16-byte words), and the refusals that name the dtype.
"""

from __future__ import annotations

import pytest
import torch

from megatron_deepep import ops
from megatron_deepep.fp8 import Fp8Dispatch
from megatron_deepep.buffer import Buffer
from tests.helpers.cases import expert_scale, make_inputs
from tests.helpers.distributed import run_distributed
from tests.helpers.oracle import oracle_combine, oracle_dispatch
from tests.core.test_host_path import _transport, recorder  # noqa: F401 (a fixture)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _reference_rank(rank, world_size, dtype):
    from megatron_deepep.autograd import combine as ag_combine
    from megatron_deepep.autograd import dispatch as ag_dispatch

    hidden, experts, topk = 24, 4 * world_size, 3
    xs, idxs, ws = make_inputs(5, world_size, [7, 0, 11][:world_size], hidden, experts, topk,
                               "dropped", dtype=dtype)
    expected = oracle_dispatch(xs, idxs, ws, experts, 4)
    buf = Buffer(None, 16, hidden * 2, topk, transport="reference")
    recv_x, recv_w, handle, _ = buf.dispatch(xs[rank], idxs[rank], ws[rank], num_experts=experts,
                                             expert_alignment=4)
    assert recv_x.dtype == dtype and torch.equal(recv_x, expected[rank][0])
    ys = [expert_scale(e[0], e[2]) * 1.37 for e in expected]  # not exact in 16 bits
    out, _, _ = buf.combine(ys[rank].to(dtype), handle)
    want = oracle_combine([y.to(dtype) for y in ys], [e[3] for e in expected],
                          [x.shape[0] for x in xs])[rank]
    assert out.dtype == dtype and torch.equal(out, want)
    if dtype == torch.float32:  # fp32 rows: the sum of fp32 terms, never rounded to 16 bits
        assert not torch.equal(out, want.to(torch.bfloat16).float()) or out.numel() == 0
    # Autograd: gradients keep the row dtype.
    x = xs[rank].clone().requires_grad_()
    w = ws[rank].clone().requires_grad_()
    rx, rw, h = ag_dispatch(buf, x, idxs[rank], w, num_experts=experts)
    y = ag_combine(buf, (rx.float() * rw.unsqueeze(1)).to(dtype), h)
    y.float().sum().backward()
    assert y.dtype == dtype and x.grad.dtype == dtype and w.grad.dtype == torch.float32


def _reference_ranks(rank, world_size):
    for dtype in DTYPES:
        _reference_rank(rank, world_size, dtype)


def test_reference_dtypes_match_oracle():
    """bf16, fp16 and fp32 on 3 gloo ranks (one with no tokens), in one job."""
    run_distributed(3, _reference_ranks, timeout_s=120)


@pytest.mark.parametrize("num_ranks", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_transports_copy_bytes_and_combine_in_the_row_dtype(recorder, num_ranks, dtype):
    rec = recorder
    hidden, rows = 256, 200
    t = _transport(rec, num_ranks, 64, hidden * 2, 4, lambda: rows)
    assert dtype in t.row_dtypes
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, hidden, generator=g).to(dtype)
    idx = torch.rand(64, 16, generator=g).topk(4, dim=1).indices
    recv_x, _, handle = t.dispatch(x, idx, torch.rand(64, 4, generator=g), 16,
                                   num_max_recv_rows=rows)
    wire = hidden * x.element_size() // 2  # bf16 words of one row
    kernel = "dispatch_local" if num_ranks == 1 else "dispatch_fused"
    (_, expand), = rec.find(kernel)
    assert expand["hidden"] == wire and expand["x"] == x.data_ptr()
    assert recv_x.dtype == dtype and recv_x.shape == (rows, hidden)
    assert handle.hidden == hidden  # the caller's width: combine and cached dispatch check it
    assert expand["recv_x"] == recv_x.data_ptr()
    cached = t.cached_dispatch(x, handle)
    assert cached.dtype == dtype and cached.shape == (rows, hidden)
    rec.events.clear()
    out, _ = t.combine(recv_x, handle)
    assert out.dtype == dtype and out.shape == (64, hidden)
    code = ops.ROW_DTYPE_CODES[dtype]
    kernels = ["combine_local"] if num_ranks == 1 else ["combine_send", "combine_reduce"]
    assert [n for n, _ in rec.events] == kernels
    for name in kernels:
        (template, args), = rec.find(name)
        assert template == [4, False, False, code]
        assert args["num_int4"] == hidden * x.element_size() // 16


def test_wire_rows_are_the_same_bytes():
    x = torch.randn(3, 8)
    wire = ops.as_wire_rows(x)
    assert wire.dtype == torch.bfloat16 and wire.shape == (3, 16)
    assert wire.data_ptr() == x.data_ptr() and torch.equal(wire.view(torch.float32), x)
    h = torch.randn(3, 8).half()
    assert torch.equal(ops.as_wire_rows(h).view(torch.float16), h)
    b = torch.randn(3, 8).bfloat16()
    assert ops.as_wire_rows(b) is b


def test_kernel_names_per_row_dtype():
    names = ops.kernel_names(2, row_dtypes=("bf16", "fp16", "fp32"))["combine.cu"]
    assert len(names) == 3 * 2 * 2 * 4  # dtypes x weighted x with weights x kernels
    assert "combine_reduce<2, false, true, 2>" in names
    assert all(e.endswith(", 0>") for e in ops.kernel_names(2)["combine.cu"])
    # Dispatch copies bytes: one set of kernels for every dtype.
    assert ops.kernel_names(2, row_dtypes=("fp32",))["dispatch.cu"] == \
        ops.kernel_names(2)["dispatch.cu"]


@pytest.fixture(scope="module")
def ref_buffer():
    import torch.distributed as dist
    from tests.helpers.distributed import free_port
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
    return Buffer(None, 16, 64, 4, transport="reference")


def test_fp8_dispatch_refuses_non_bf16_rows_by_name(ref_buffer):
    idx, w = torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2)
    for dtype in (torch.float32, torch.float16):
        with pytest.raises(ValueError, match=r"x must have dtype torch.bfloat16 for FP8 "
                                             r"dispatch .*got torch.float"):
            ref_buffer.dispatch(torch.zeros(4, 64, dtype=dtype), idx, w, num_experts=4,
                                fp8=Fp8Dispatch.named("blockwise"))


def test_fp32_rows_count_twice_the_bytes(ref_buffer):
    idx, w = torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2)
    recv_x, _, _, _ = ref_buffer.dispatch(torch.ones(4, 32), idx, w, num_experts=4)
    assert recv_x.dtype == torch.float32  # 128 bytes: the Buffer's hidden=64 of 2 bytes
    with pytest.raises(ValueError, match="rows of 36 elements of 4 bytes are 144 bytes, more "
                                         "than the Buffer's rows of 128 bytes"):
        ref_buffer.dispatch(torch.ones(4, 36), idx, w, num_experts=4)
    with pytest.raises(ValueError, match=r"multiple of 16 bytes \(hidden a multiple of 4\)"):
        ref_buffer.dispatch(torch.ones(4, 30), idx, w, num_experts=4)
    with pytest.raises(ValueError, match=r"multiple of 16 bytes \(hidden a multiple of 8\)"):
        ref_buffer.dispatch(torch.ones(4, 12, dtype=torch.float16), idx, w, num_experts=4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_buffer_takes_rows_of_its_dtype(ref_buffer, dtype):
    """`Buffer(..., hidden=H, dtype=D)` takes rows of H elements of D with no arithmetic by the
    caller; a wider row is refused in bytes (never "hidden=H exceeds ... hidden=H")."""
    import re

    idx, w = torch.zeros(4, 2, dtype=torch.int64), torch.ones(4, 2)
    buf = Buffer(None, 16, 64, 4, transport="reference", dtype=dtype)
    assert (buf.hidden, buf.dtype, buf.row_bytes) == (64, dtype, 64 * dtype.itemsize)
    recv_x, _, handle, _ = buf.dispatch(torch.ones(4, 64, dtype=dtype), idx, w, num_experts=4)
    assert recv_x.dtype == dtype and recv_x.shape[1] == 64
    out, _, _ = buf.combine(recv_x, handle)
    assert out.dtype == dtype and out.shape == (4, 64)
    wide = torch.float32 if dtype != torch.float32 else None
    if wide is not None:  # a bf16/fp16 Buffer of H: fp32 rows of H are twice its bytes
        with pytest.raises(ValueError) as info:
            buf.dispatch(torch.ones(4, 64, dtype=wide), idx, w, num_experts=4)
        message = str(info.value)
        assert f"rows of 64 elements of 4 bytes are 256 bytes, more than the Buffer's rows " \
               f"of 128 bytes (hidden=64, dtype={dtype})" in message
        assert not re.search(r"hidden=(\d+) exceeds.*hidden=\1\b", message)
    else:  # an fp32 Buffer of H also takes bf16 rows of 2 H (the same bytes)
        buf.dispatch(torch.ones(4, 128, dtype=torch.bfloat16), idx, w, num_experts=4)
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        Buffer(None, 16, 64, 4, transport="reference", dtype=torch.float64)


def test_get_buffer_compares_rows_in_bytes(ref_buffer):
    import torch.distributed as dist

    from megatron_deepep.buffer import get_buffer

    group = dist.new_group([0])
    fp32 = get_buffer(group, 16, 64, 2, transport="reference", dtype=torch.float32)
    assert get_buffer(group, 16, 128, 2, transport="reference") is fp32  # bf16, same bytes
    grown = get_buffer(group, 16, 256, 2, transport="reference")  # bf16 rows of 512 bytes
    assert grown is not fp32 and (grown.hidden, grown.dtype, grown.row_bytes) == (
        256, torch.bfloat16, 512)
