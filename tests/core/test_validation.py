"""CPU tier: every bad input gets a ValueError that names the argument and the limit."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from megatron_deepep import autograd
from megatron_deepep.buffer import Buffer, get_buffer
from megatron_deepep.fp8 import formats
from megatron_deepep.fp8.dispatch import Fp8Dispatch, names
from tests.helpers.distributed import run_distributed


@pytest.fixture(scope="module")
def buf():
    import torch.distributed as dist
    from tests.helpers.distributed import free_port
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
    return Buffer(None, 16, 64, 4, transport="reference")


def _inputs(n=4, h=64, k=2, e=4):
    return (torch.randn(n, h).to(torch.bfloat16), torch.zeros(n, k, dtype=torch.int64),
            torch.ones(n, k))


@pytest.mark.parametrize("mutate, match", [
    (lambda x, i, w: (x.to(torch.float64), i, w), "x must have dtype"),
    (lambda x, i, w: (torch.zeros(4, 36), i, w), r"x: rows of 36 elements of 4 bytes are 144 "
     r"bytes, more than the Buffer's rows of 128 bytes \(hidden=64, dtype=torch.bfloat16\)"),
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


def _two_ranks(rank, world):
    buf = Buffer(None, 8, 64, 2, transport="reference")
    hidden = 64 if rank == 0 else 32
    x = torch.zeros(4, hidden, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"ranks disagree on hidden: per-rank values \[64, 32\]"):
        buf.dispatch(x, torch.zeros(4, 2).long(), torch.ones(4, 2), num_experts=2)
    # A handle of the 2-rank group given to a Buffer of a 1-rank group.
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    recv_x, _, handle, _ = buf.dispatch(x, torch.zeros(4, 2).long(), torch.ones(4, 2),
                                        num_experts=2)
    singles = [dist.new_group([r]) for r in range(world)]
    solo = Buffer(singles[rank], 8, 64, 2, transport="reference")
    with pytest.raises(ValueError, match="EP group of 2 ranks; this Buffer's group has 1"):
        solo.combine(recv_x, handle)


def test_ranks_disagreeing_and_foreign_group_handles_raise():
    run_distributed(2, _two_ranks)


# ----------------------------------------------------------------------------------------------
# Buffer(...), Buffer.size_hint, get_buffer: each limit named with its argument.

@pytest.mark.parametrize("kwargs, match", [
    (dict(hidden=12), r"hidden=12 gives bf16 rows of 24 bytes.*hidden a multiple of 8"),
    (dict(hidden=True), r"hidden must be an int >= 1, got True"),
    (dict(num_max_tokens_per_rank=-5), r"num_max_tokens_per_rank must be an int >= 1, got -5"),
    (dict(num_topk=0), r"num_topk must be an int >= 1, got 0"),
    (dict(num_topk=17), r"num_topk=17 exceeds the limit 16"),
    (dict(num_sms=0), r"num_sms must be an int >= 1, got 0"),
    (dict(num_sms=True), r"num_sms must be an int >= 1, got True"),
    (dict(timeout_s="5"), r"timeout_s must be a finite number of seconds > 0, got '5'"),
    (dict(timeout_s=math.nan), r"timeout_s must be a finite number of seconds > 0, got nan"),
    (dict(timeout_s=0), r"timeout_s must be a finite number of seconds > 0, got 0"),
    (dict(transport="nvlnk"), r"transport must be one of \('auto', 'local', 'nvlink', "
                              r"'internode', 'reference'\), got 'nvlnk'"),
    (dict(num_ranks_per_node=0), r"num_ranks_per_node must be an int >= 1, got 0"),
    (dict(group="world"), r"group must be a torch.distributed.ProcessGroup .*got str"),
])
def test_bad_buffer_constructor_arguments(buf, kwargs, match):
    args = dict(group=None, num_max_tokens_per_rank=16, hidden=64, num_topk=2,
                transport="reference")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Buffer(**args)


def test_kernel_transports_without_a_gpu_say_so(buf):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for name in ("nvlink", "local"):
        with pytest.raises(ValueError, match=f"transport='{name}' runs CUDA kernels, but torch "
                                             f"sees no CUDA device"):
            Buffer(None, 16, 64, 2, transport=name)


_NO_GROUP = """
from megatron_deepep import Buffer
try:
    Buffer(None, 16, 64, 2)
except ValueError as e:
    print(e)
"""


def test_buffer_without_process_group_says_how_to_make_one():
    done = subprocess.run([sys.executable, "-c", _NO_GROUP], capture_output=True, text=True,
                          timeout=120)
    assert "group: torch.distributed is not initialized" in done.stdout, done.stderr
    assert "init_process_group('gloo'" in done.stdout


@pytest.mark.parametrize("args, match", [
    ((-1, 64, 2, 2), r"num_max_tokens_per_rank must be an int >= 1, got -1"),
    ((16, 12, 2, 2), r"hidden=12 gives bf16 rows of 24 bytes"),
    ((16, 64, 2, 17), r"num_topk=17 exceeds the limit 16"),
    ((16, 64, 0, 2), r"num_ranks must be an int >= 1, got 0"),
    ((16, 64, True, 2), r"num_ranks must be an int >= 1, got True"),
    ((16, 64, 9, 2, "nvlink"), r"the EP group has 9 ranks, more than 8"),
    ((16, 64, 2, 2, "local"), r"transport='local' serves an EP group of 1 rank, this one has 2"),
    ((16, 64, 2, 2, "tcp"), r"transport must be one of"),
])
def test_bad_size_hint_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        Buffer.size_hint(*args)


def test_size_hint_needs_no_gpu():
    assert Buffer.size_hint(4096, 7168, 8, 8, transport="nvlink") > 0
    assert Buffer.size_hint(4096, 7168, 1, 8, transport="local") == 0


def test_bad_get_buffer_arguments(buf):
    group = dist.new_group([0])
    good = get_buffer(group, 16, 64, 2, transport="reference")
    # Checked before the cache: an existing Buffer does not hide a bad argument.
    with pytest.raises(ValueError, match=r"hidden must be an int >= 1, got -1"):
        get_buffer(group, 16, -1, 2, transport="reference")
    with pytest.raises(ValueError, match=r"hidden=12 gives bf16 rows of 24 bytes"):
        get_buffer(group, 16, 12, 2, transport="reference")
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['nums_sms'\]"):
        get_buffer(group, 16, 64, 2, transport="reference", nums_sms=8)
    with pytest.raises(ValueError, match=r"group must be a torch.distributed.ProcessGroup"):
        get_buffer("ep", 16, 64, 2, transport="reference")
    assert get_buffer(group, 8, 64, 2, transport="reference") is good


# ----------------------------------------------------------------------------------------------
# dispatch / combine / get_dispatch_layout

@pytest.mark.parametrize("x, kwargs, match", [
    (lambda x: [x], {}, r"x must be a torch.Tensor \[N, H\] or, with fp8=.*got a list of 1 "
                        r"items \(Tensor\)"),
    (lambda x: [1, 2], {}, r"x must be a torch.Tensor .*got a list of 2 items \(int, int\)"),
    (lambda x: (x, x, x), dict(fp8=Fp8Dispatch.named("blockwise")),
     r"must be a pair .*got a tuple of 3 items"),
    (lambda x: [x, x], {}, r"x is a pair of tensors, i.e. a pre-quantized \(x_fp8, x_scales\): "
                           r"pass fp8="),
    (lambda x: "rows", {}, r"x must be a torch.Tensor, got str"),
])
def test_x_that_is_not_a_tensor(buf, x, kwargs, match):
    rows, i, w = _inputs()
    with pytest.raises(ValueError, match=match):
        buf.dispatch(x(rows), i, w, num_experts=4, **kwargs)


def test_a_list_is_called_a_pair_only_when_it_is_two_tensors(buf):
    rows, i, w = _inputs()
    for bad in ([rows], [1, 2], [rows, rows, rows], [rows, "scales"]):
        with pytest.raises(ValueError) as info:
            buf.dispatch(bad, i, w, num_experts=4)
        assert "is a pair" not in str(info.value) and "got a list of" in str(info.value)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_experts=True), r"num_experts must be a positive int, got True"),
    (dict(num_experts=512), r"num_experts=512 gives 512 experts per rank; the limit is 256"),
    (dict(expert_alignment=True), r"expert_alignment must be an int in \[1, 1024\], got True"),
    (dict(expert_alignment=1025), r"expert_alignment must be an int in \[1, 1024\], got 1025"),
    (dict(num_max_recv_rows=-1), r"num_max_recv_rows must be an int >= 0, got -1"),
    (dict(num_max_recv_rows=True), r"num_max_recv_rows must be an int >= 0, got True"),
    (dict(layout="layout"), r"layout must be the DispatchLayout get_dispatch_layout returned, "
                            r"got str"),
    (dict(previous_event="e"), r"previous_event must be an EventHandle .*got str"),
    (dict(async_finish="yes"), r"async_finish must be True or False, got 'yes'"),
])
def test_bad_dispatch_options(buf, kwargs, match):
    x, i, w = _inputs()
    kwargs = dict(dict(num_experts=4), **kwargs)
    with pytest.raises(ValueError, match=match):
        buf.dispatch(x, i, w, **kwargs)


def test_layout_of_another_dispatch(buf):
    x, i, w = _inputs()
    layout, _ = buf.get_dispatch_layout(i, 8)
    with pytest.raises(ValueError, match=r"layout was computed for \(tokens, num_experts, ranks\)"
                                         r" = \(4, 8, 1\), this dispatch has \(4, 4, 1\)"):
        buf.dispatch(x, i, w, num_experts=4, layout=layout)


def test_bad_get_dispatch_layout_input(buf):
    i = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="topk_idx must be a torch.Tensor, got list"):
        buf.get_dispatch_layout([[0, 1]], 4)
    with pytest.raises(ValueError, match=r"topk_idx holds expert id 9, outside \[-1, "
                                         r"num_experts=4\)"):
        buf.get_dispatch_layout(i + 9, 4)
    with pytest.raises(ValueError, match="num_max_tokens_per_rank=16"):
        buf.get_dispatch_layout(torch.zeros(17, 2, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match=r"top-k=5; the limit is 4"):
        buf.get_dispatch_layout(torch.zeros(4, 5, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="num_experts must be a positive int, got '4'"):
        buf.get_dispatch_layout(i, "4")


def test_bad_handles(buf):
    x, i, w = _inputs()
    recv_x, _, handle, _ = buf.dispatch(x, i, w, num_experts=4)
    for bad in (None, "handle"):
        with pytest.raises(ValueError, match="handle must be the DispatchHandle a dispatch "
                                             "returned, got"):
            buf.combine(recv_x, bad)
    with pytest.raises(ValueError, match="handle must be the DispatchHandle"):
        buf.dispatch(x, handle="handle")
    narrow = Buffer(None, 16, 32, 4, transport="reference")
    with pytest.raises(ValueError, match=r"handle was made for hidden=64, more than this "
                                         r"Buffer's hidden=32"):
        narrow.combine(recv_x, handle)
    small = Buffer(None, 16, 64, 1, transport="reference")
    with pytest.raises(ValueError, match=r"handle was made for num_topk=2, more than this "
                                         r"Buffer's num_topk=1"):
        small.combine(recv_x, handle)
    twin = Buffer(None, 16, 64, 4, transport="reference")
    with pytest.raises(ValueError, match="handle was made by another Buffer"):
        twin.combine(recv_x, handle)
    with pytest.raises(ValueError, match="handle was made by another Buffer"):
        twin.dispatch(x, handle=handle)
    with pytest.raises(ValueError, match="weighted must be True or False, got 'yes'"):
        buf.combine(recv_x, handle, weighted="yes")


def test_handles_of_a_grown_buffer_stay_valid(buf):
    group = dist.new_group([0])
    small = get_buffer(group, 8, 64, 2, transport="reference")
    x, i, w = _inputs()
    recv_x, _, handle, _ = small.dispatch(x, i, w, num_experts=4)
    grown = get_buffer(group, 32, 64, 2, transport="reference")
    assert grown is not small
    out, _, _ = grown.combine(recv_x, handle)
    assert out.shape == x.shape
    assert torch.equal(small.dispatch(x, handle=handle)[0], recv_x)


# ----------------------------------------------------------------------------------------------
# Fp8Dispatch.named: the names of Megatron's --moe-mdeep-fp8-dispatch flag everywhere

def test_fp8_takes_the_flag_names(buf):
    from megatron_deepep.megatron.options import FP8_DISPATCH_CHOICES

    assert set(FP8_DISPATCH_CHOICES) <= set(names())
    assert Fp8Dispatch.named("blockwise").fmt is formats.BLOCKWISE_1x128
    assert Fp8Dispatch.named("mxfp8").fmt is formats.MXFP8_1x32
    assert Fp8Dispatch.named("off") is None
    x, i, w = _inputs(h=256)
    for alias, name in (("blockwise", "blockwise_1x128"), ("mxfp8", "mxfp8_1x32")):
        got = buf.dispatch(x[:, :64].contiguous(), i, w, num_experts=4,
                           fp8=Fp8Dispatch.named(alias, "bf16"))[0]
        want = buf.dispatch(x[:, :64].contiguous(), i, w, num_experts=4,
                            fp8=Fp8Dispatch.named(name, "bf16"))[0]
        assert torch.equal(got, want)
        recv_x, _, _ = autograd.dispatch(buf, x[:, :64].contiguous(), i, w, num_experts=4,
                                         fp8=Fp8Dispatch.named(alias, "bf16"))
        assert torch.equal(recv_x, want)
    plain = buf.dispatch(x[:, :64].contiguous(), i, w, num_experts=4)[0]
    assert torch.equal(buf.dispatch(x[:, :64].contiguous(), i, w, num_experts=4,
                                    fp8=Fp8Dispatch.named("off"))[0], plain)


def test_fp8_auto_without_a_te_recipe_is_bf16(buf):
    x, i, w = _inputs()
    plain = buf.dispatch(x, i, w, num_experts=4)[0]
    assert Fp8Dispatch.named("auto") is None
    assert torch.equal(buf.dispatch(x, i, w, num_experts=4, fp8=Fp8Dispatch.named("auto"))[0],
                       plain)


# ----------------------------------------------------------------------------------------------
# autograd

def test_bad_autograd_arguments(buf):
    x, i, w = _inputs()
    with pytest.raises(ValueError, match="buffer must be a megatron_deepep.Buffer, got NoneType"):
        autograd.dispatch(None, x, i, w, num_experts=4)
    with pytest.raises(ValueError, match=r"x must be a torch.Tensor \[N, H\] or, with fp8=.*"
                                         r"got a list of 1 items"):
        autograd.dispatch(buf, [x], i, w, num_experts=4)
    with pytest.raises(ValueError, match="x is a pair of tensors"):
        autograd.dispatch(buf, [x, x], i, w, num_experts=4)
    with pytest.raises(TypeError, match=r"fp8 must be None or an Fp8Dispatch \(from a name: "
                                        r"fp8=Fp8Dispatch.named\('fp16'\)\); got str"):
        autograd.dispatch(buf, x, i, w, num_experts=4, fp8="fp16")
    with pytest.raises(ValueError, match="FP8 format 'fp16' is unknown; use one of 'off', "
                                         "'blockwise', 'mxfp8', 'auto'"):
        Fp8Dispatch.named("fp16")
    recv_x, _, handle = autograd.dispatch(buf, x, i, w, num_experts=4)
    with pytest.raises(ValueError, match="buffer must be a megatron_deepep.Buffer, got str"):
        autograd.combine("buffer", recv_x, handle)
    with pytest.raises(ValueError, match="handle must be the DispatchHandle a dispatch returned"):
        autograd.combine(buf, recv_x, None)


def test_cached_dispatch_method_replays_the_handle(buf):
    """`Buffer.cached_dispatch(x, handle)` returns what `dispatch(x, handle=handle)` does."""
    x, idx, w = _inputs()
    idx[:, 1] = 3
    recv_x, _, handle, _ = buf.dispatch(x, idx, w, num_experts=4)
    again, event = buf.cached_dispatch(2 * x, handle)
    assert event is not None
    assert torch.equal(again, 2 * recv_x)
    with pytest.raises(ValueError, match="handle was made for"):
        buf.cached_dispatch(torch.zeros(3, 64, dtype=torch.bfloat16), handle)


def test_repr_names_transport_ranks_nodes_and_bytes(buf):
    text = repr(buf)
    for part in ("transport='reference'", "rank=0", "num_ranks=1", "num_nodes=1",
                 "num_max_tokens_per_rank=16", "hidden=64", "num_topk=4", "num_bytes=0"):
        assert part in text, text


@pytest.mark.parametrize("call", ["dispatch", "get_dispatch_layout"])
def test_too_many_tokens_names_get_buffer(buf, call):
    x, i, w = (torch.zeros(17, 64, dtype=torch.bfloat16), torch.zeros(17, 2).long(),
               torch.ones(17, 2))
    with pytest.raises(ValueError) as info:
        if call == "dispatch":
            buf.dispatch(x, i, w, num_experts=4)
        else:
            buf.get_dispatch_layout(i, 4)
    message = str(info.value)
    assert "17 tokens, more than the Buffer's num_max_tokens_per_rank=16" in message
    assert "get_buffer(group, num_tokens, hidden, num_topk)" in message, message


def _repeated_ids(rank, world):
    """Every token names expert 1 at each of its k = 4 (on 2 ranks: rank 0's experts)."""
    torch.manual_seed(rank)
    num_tokens, hidden, num_topk = 5, 32, 4
    buf = Buffer(None, 8, hidden, num_topk, transport="reference", dtype=torch.float32)
    x = torch.randn(num_tokens, hidden)
    idx = torch.ones(num_tokens, num_topk, dtype=torch.int64)
    weights = torch.tensor([[0.5, 0.25, 0.125, 0.0625]]).expand(num_tokens, -1).contiguous()
    recv_x, recv_w, handle, _ = buf.dispatch(x, idx, weights, num_experts=2 * world)
    expected_rows = num_topk * num_tokens * world if rank == 0 else 0
    assert recv_x.shape[0] == expected_rows  # one row per k, not one per token
    out, _, _ = buf.combine(recv_x, handle)
    torch.testing.assert_close(out, num_topk * x)  # every k's row summed
    weighted, _, _ = buf.combine(recv_x, handle, weighted=True)
    torch.testing.assert_close(weighted, 0.9375 * x)


@pytest.mark.parametrize("world", [1, 2])
def test_an_expert_named_at_several_k_gets_one_row_per_k_and_combine_sums_them(world):
    """What the dispatch docstring promises for repeated ids (nothing refuses them)."""
    run_distributed(world, _repeated_ids)


def test_the_dispatch_docstring_says_what_repeated_ids_give():
    doc = " ".join(Buffer.dispatch.__doc__.split())
    assert "An id a token names at several k is kept, not merged" in doc
    assert "`combine` sums them all" in doc
