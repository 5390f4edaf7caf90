"""CPU tier: FP8 dispatch on the reference transport, its errors, autograd and the example.

The oracle is the single-process one of `tests/helpers/oracle.py` applied to each rank's quantized
tokens (`formats.quantize`, TE's rules): an FP8 dispatch must move exactly those bytes, in the
bf16 dispatch's row order, with all-zero data and scales in the padding rows.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from megatron_deepep.autograd import combine, dispatch, resolve_fp8_output
from megatron_deepep.buffer import Buffer
from megatron_deepep.fp8 import FORMATS, dequantize, quantize, te_bridge
from megatron_deepep.fp8.dispatch import Fp8Dispatch, pack_rows, unpack_rows
from tests.helpers.cases import make_inputs
from tests.helpers.distributed import run_distributed
from tests.helpers.oracle import oracle_combine, oracle_dispatch
from tests.helpers import REPO_ROOT

ROOT = REPO_ROOT

CASES = [
    # kind, tokens per rank (None: uneven, rank 0 empty), hidden, experts per rank, top-k, align
    ("random", 11, 144, 2, 2, 1),    # hidden 144: a partial last block in both formats
    ("skewed", 7, 256, 3, 3, 16),
    ("uneven", None, 64, 2, 2, 4),
    ("empty", 4, 32, 1, 1, 1),
]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _check_case(rank, world, seed, case, fmt_name):
    kind, num_tokens, hidden, local, topk, align = case
    if kind == "uneven":
        num_tokens = [0] + [3 + 4 * r for r in range(1, world)]
        kind = "dropped"
    num_experts = local * world
    fmt = FORMATS[fmt_name]
    xs, idxs, ws = make_inputs(seed, world, num_tokens, hidden, num_experts, topk, kind)
    quantized = [quantize(x, fmt) for x in xs]
    exp_data = oracle_dispatch([q[0].view(torch.uint8) for q in quantized], idxs, ws,
                               num_experts, align)
    exp_scales = oracle_dispatch([q[1] for q in quantized], idxs, ws, num_experts, align)
    exp_bf16 = oracle_dispatch([dequantize(q[0], q[1], fmt) for q in quantized], idxs, ws,
                               num_experts, align)
    want_data, want_w, want_sizes, sources = exp_data[rank]
    want_scales = exp_scales[rank][0]
    n_max = max(x.shape[0] for x in xs) or 1
    buf = Buffer(None, n_max, 256, 3, transport="reference")
    for x_in in (xs[rank], quantized[rank]):
        (got_fp8, got_scales), got_w, handle, _ = buf.dispatch(
            x_in, idxs[rank], ws[rank], num_experts=num_experts, expert_alignment=align,
            fp8=Fp8Dispatch.named(fmt_name))
        assert got_fp8.dtype == torch.float8_e4m3fn and got_scales.dtype == fmt.scale_dtype
        assert torch.equal(got_fp8.view(torch.uint8), want_data), (case, fmt_name)
        assert torch.equal(_bytes(got_scales).view(torch.uint8),
                           want_scales.contiguous().view(torch.uint8)), (case, fmt_name)
        assert torch.equal(got_w, want_w)
        assert handle.tokens_per_expert_list == want_sizes
        pad = torch.tensor([s is None for s in sources], dtype=torch.bool)
        assert not got_fp8.view(torch.uint8)[pad].any() and not got_scales[pad].any()

        got_bf16, _, _, _ = buf.dispatch(x_in, idxs[rank], ws[rank], num_experts=num_experts,
                                         expert_alignment=align,
                                         fp8=Fp8Dispatch(fmt, output="bf16"))
        assert got_bf16.dtype == torch.bfloat16
        assert torch.equal(got_bf16, exp_bf16[rank][0]), (case, fmt_name)

    # Cached dispatch with FP8 replays the routing for new rows; combine stays bf16.
    again = [quantize(x * 3, fmt) for x in xs]
    exp_again = oracle_dispatch([a[0].view(torch.uint8) for a in again], idxs, ws, num_experts,
                                align)[rank][0]
    (cached, cached_scales), _, _, _ = buf.dispatch(
        xs[rank] * 3, handle=handle, fp8=Fp8Dispatch(fmt, "fp8"))
    assert torch.equal(cached.view(torch.uint8), exp_again)
    assert cached_scales.shape == (handle.num_recv_rows, fmt.num_blocks(hidden))
    cached_bf16, _, _, _ = buf.dispatch(again[rank], handle=handle, fp8=Fp8Dispatch(fmt, "bf16"))
    assert torch.equal(cached_bf16, dequantize(cached, cached_scales, fmt))
    ys = [e[0] for e in exp_bf16]
    out, _, _ = buf.combine(got_bf16, handle)
    assert torch.equal(out, oracle_combine(ys, [e[3] for e in exp_bf16],
                                           [x.shape[0] for x in xs])[rank])


def _autograd_case(rank, world, seed, fmt_name):
    """FP8 autograd dispatch == bf16 autograd dispatch of dequantize(quantize(x)), bit for bit."""
    fmt = FORMATS[fmt_name]
    xs, idxs, ws = make_inputs(seed, world, [6, 0, 9, 4][:world], 64, 4 * world, 3, "dropped")
    buf = Buffer(None, 16, 64, 3, transport="reference")
    g = torch.randn(xs[rank].shape[0], 64, generator=torch.Generator().manual_seed(rank))
    x_deq = dequantize(*quantize(xs[rank], fmt), fmt)

    def loss(x, w, **fp8):
        recv_x, recv_w, handle = dispatch(buf, x, idxs[rank], w, num_experts=4 * world, **fp8)
        y = (recv_x.float() * recv_w.unsqueeze(1) * 1.5).to(torch.bfloat16)
        out = combine(buf, y, handle)
        return (out.float() * g).sum(), recv_x

    grads = []
    for x0, fp8 in ((x_deq, {}), (xs[rank], dict(fp8=Fp8Dispatch(fmt, "bf16"))),
                    (xs[rank], dict(fp8=Fp8Dispatch(fmt)))):  # "fp8" without TE: bf16
        x, w = x0.clone().requires_grad_(), ws[rank].clone().requires_grad_()
        value, recv_x = loss(x, w, **fp8)
        value.backward()
        assert recv_x.dtype == torch.bfloat16 and recv_x.requires_grad
        grads.append((recv_x.detach(), x.grad, w.grad))
    for got in grads[1:]:
        for a, b in zip(got, grads[0]):
            assert torch.equal(a, b)
    # A pre-quantized pair gets no gradient; the routing weights still do.
    w = ws[rank].clone().requires_grad_()
    value, _ = loss(quantize(xs[rank], fmt), w, fp8=Fp8Dispatch(fmt, "bf16"))
    value.backward()
    assert torch.equal(w.grad, grads[0][2])


def _worker(rank, world, seed):
    for i, case in enumerate(CASES):
        for fmt_name in sorted(FORMATS):
            _check_case(rank, world, seed + i, case, fmt_name)
    _autograd_case(rank, world, seed, "blockwise_1x128")
    _autograd_case(rank, world, seed, "mxfp8_1x32")
    if world == 2:
        buf = Buffer(None, 8, 64, 2, transport="reference")
        fmt = "blockwise_1x128" if rank == 0 else "mxfp8_1x32"
        with pytest.raises(ValueError, match="ranks disagree on fp8 wire format"):
            buf.dispatch(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(4, 2).long(),
                         torch.ones(4, 2), num_experts=2, fp8=Fp8Dispatch.named(fmt))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_fp8_reference_matches_oracle(world_size):
    """Every format x (bf16 input, pre-quantized pair) x (fp8, bf16 output), all routings."""
    run_distributed(world_size, _worker, 4321 + world_size, timeout_s=300)


# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def buf():
    import torch.distributed as dist
    from tests.helpers.distributed import free_port
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
    return Buffer(None, 16, 256, 2, transport="reference")


def _routing(n=4):
    return torch.zeros(n, 2, dtype=torch.int64), torch.ones(n, 2)


_Q = quantize(torch.randn(4, 64).to(torch.bfloat16), FORMATS["blockwise_1x128"])
_M = quantize(torch.randn(4, 64).to(torch.bfloat16), FORMATS["mxfp8_1x32"])
_BLOCKWISE = Fp8Dispatch(FORMATS["blockwise_1x128"])
_MXFP8 = Fp8Dispatch(FORMATS["mxfp8_1x32"])


@pytest.mark.parametrize("x, kwargs, match", [
    (torch.zeros(4, 24, dtype=torch.bfloat16), dict(fp8=_BLOCKWISE),
     r"hidden % 16 == 0.*hidden=24"),
    (torch.zeros(4, 512, dtype=torch.bfloat16), dict(fp8=_MXFP8),
     "rows of 512 elements; the Buffer's rows hold 256 bf16 elements"),
    (torch.zeros(4, 64), dict(fp8=_BLOCKWISE), "x must have dtype"),
    ((_Q[0].view(torch.uint8), _Q[1]), dict(fp8=_BLOCKWISE), "x_fp8 must have dtype"),
    ((_Q[0], _Q[1][:, :0]), dict(fp8=_BLOCKWISE), r"x_scales must have shape.*\[4, 1\]"),
    ((_Q[0], _Q[1][:3]), dict(fp8=_BLOCKWISE), r"x_scales must have shape"),
    ((_Q[0], _Q[1]), dict(fp8=_MXFP8), r"x_scales must have shape .*\[4, 2\]"),
    ((_M[0], _M[1].float()), dict(fp8=_MXFP8), "x_scales must have dtype"),
    ((_Q[0], _Q[1].to(torch.uint8)), dict(fp8=_BLOCKWISE), "x_scales must have dtype"),
    ((_Q[0], _Q[1], _Q[1]), dict(fp8=_BLOCKWISE), "must be a pair"),
    ((_Q[0], _Q[1]), {}, "pass fp8="),
    (_Q[0], dict(fp8=_BLOCKWISE), "without its scales"),
])
def test_bad_fp8_input(buf, x, kwargs, match):
    idx, w = _routing()
    with pytest.raises(ValueError, match=match):
        buf.dispatch(x, idx, w, num_experts=4, **kwargs)


@pytest.mark.parametrize("fp8, match", [
    ("blockwise_1x128", r"fp8 must be None or an Fp8Dispatch \(from a name: "
                        r"fp8=Fp8Dispatch.named\('blockwise_1x128'\)\); got str"),
    (FORMATS["mxfp8_1x32"], r"\(from a format: fp8=Fp8Dispatch\(fmt\)\); got Fp8Format"),
    (7, r"fp8 must be None or an Fp8Dispatch; got int 7"),
])
def test_fp8_takes_one_type(buf, fp8, match):
    """`fp8=` is None or an `Fp8Dispatch`; a name or a format is refused with the way to build
    one, by `Buffer.dispatch`, `Buffer.cached_dispatch` and `autograd.dispatch` alike."""
    idx, w = _routing()
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=match):
        buf.dispatch(x, idx, w, num_experts=4, fp8=fp8)
    with pytest.raises(TypeError, match=match):
        dispatch(buf, x, idx, w, num_experts=4, fp8=fp8)
    _, _, handle, _ = buf.dispatch(x, idx, w, num_experts=4)
    with pytest.raises(TypeError, match=match):
        buf.cached_dispatch(x, handle, fp8=fp8)


def test_fp8_dispatch_from_names():
    assert Fp8Dispatch.named("blockwise") == Fp8Dispatch(FORMATS["blockwise_1x128"])
    assert Fp8Dispatch.named("mxfp8", "bf16") == Fp8Dispatch(FORMATS["mxfp8_1x32"], "bf16")
    assert Fp8Dispatch.named("off") is None
    with pytest.raises(ValueError, match="FP8 format 'fp8_e5m2' is unknown; use one of 'off'"):
        Fp8Dispatch.named("fp8_e5m2")
    with pytest.raises(ValueError, match=r"fp8 output must be one of \('fp8', 'bf16'\)"):
        Fp8Dispatch.named("mxfp8_1x32", "fp16")
    with pytest.raises(ValueError, match="fp8 output must be one of"):
        Fp8Dispatch(FORMATS["mxfp8_1x32"], "fp16")


def test_bad_fp8_cached_input(buf):
    idx, w = _routing()
    _, _, handle, _ = buf.dispatch(_Q, idx, w, num_experts=4, fp8=_BLOCKWISE)
    with pytest.raises(ValueError, match="cached dispatch: x has shape"):
        buf.dispatch((_Q[0][:2], _Q[1][:2]), handle=handle, fp8=_BLOCKWISE)
    with pytest.raises(ValueError, match="pass fp8="):
        buf.dispatch(_Q, handle=handle)
    with pytest.raises(ValueError, match="pass fp8="):
        dispatch(buf, _Q, idx, w, num_experts=4)


def test_pack_rows_round_trip():
    for name, fmt in FORMATS.items():
        for hidden in (16, 48, 144):
            x = torch.randn(5, hidden).to(torch.bfloat16)
            x_fp8, scales = quantize(x, fmt)
            packed = pack_rows(x_fp8, scales)
            assert packed.dtype == torch.int32
            assert packed.shape[1] * 4 >= fmt.bytes_per_token(hidden) > packed.shape[1] * 4 - 4
            back_fp8, back_scales = unpack_rows(packed, hidden, fmt)
            assert torch.equal(back_fp8.view(torch.uint8), x_fp8.view(torch.uint8)), name
            assert torch.equal(back_scales, scales), name


def test_fp8_output_falls_back_without_te():
    spec = Fp8Dispatch.named("blockwise_1x128")
    assert spec.output == "fp8"
    assert resolve_fp8_output(None) == (None, False)
    bf16 = Fp8Dispatch(FORMATS["mxfp8_1x32"], "bf16")
    assert resolve_fp8_output(bf16) == (bf16, False)
    resolved, wrap = resolve_fp8_output(spec)
    if te_bridge.te_available()[0] and te_bridge.recipe_matches(spec.fmt)[0]:
        assert (resolved, wrap) == (spec, True)
    else:
        assert resolved.output == "bf16" and resolved.fmt == spec.fmt and not wrap


def test_te_handoff_wraps_received_rows():
    ok, reason = te_bridge.te_available()
    if not ok:
        pytest.skip(f"TE handoff needs Transformer Engine: {reason}")
    if not torch.cuda.is_available():
        pytest.skip("TE quantized tensors need a CUDA device")
    fmt = FORMATS["blockwise_1x128"]
    x = torch.randn(8, 256, device="cuda").to(torch.bfloat16)
    x_fp8, scales = quantize(x, fmt)
    tensor = te_bridge.to_te_tensor(x_fp8, scales, fmt)
    assert torch.equal(tensor.dequantize(), dequantize(x_fp8, scales, fmt))


# ----------------------------------------------------------------------------------------------
def _example():
    path = os.path.join(ROOT, "examples", "compare_dispatchers.py")
    spec = importlib.util.spec_from_file_location("compare_dispatchers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_fp8_arguments_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    example = _example()
    args = example.parse_args(["--fp8-dispatch", "blockwise_1x128", "--steps", "200"])
    assert args.steps == 200
    assert example.run_names(args) == ["deepep", "deepep+fp8:blockwise_1x128"]
    with pytest.raises(SystemExit):
        example.parse_args(["--fp8-dispatch", "fp4"])
    results = {"deepep": ([4.0, 3.0, 2.0], [0.02, 0.01, 0.03]),
               "deepep+fp8:blockwise_1x128": ([4.0, 3.3, 1.9], [0.01, 0.01, 0.02])}
    summary = example.summarize(results, 3, 1, 2, "fake")
    assert summary["median_step_time_ms"] == pytest.approx(
        {"deepep": 20.0, "deepep+fp8:blockwise_1x128": 15.0})
    assert summary["max_rel_loss_diff"] == pytest.approx(0.1)
    assert summary["mean_rel_loss_diff"] == pytest.approx((0.1 + 0.05) / 3)
    assert summary["max_abs_loss_diff"] == pytest.approx(0.3)
    fake = tmp_path / "step_times.json"
    fake.write_text(json.dumps(summary))
    assert example.main(["--plot-only", str(fake)]) == 0
    png = tmp_path / "loss_curves.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_example_profile_tables_written(tmp_path):
    example = _example()
    args = example.parse_args(["--profile-steps", "2", "--out", str(tmp_path)])

    class _Averages:
        def table(self, sort_by, **kwargs):
            return f"table by {sort_by}"

    class _Profiler:
        def key_averages(self):
            return _Averages()

    import cProfile

    host = cProfile.Profile()
    host.enable()
    sorted(range(1000), key=lambda v: -v)
    host.disable()
    example.write_profile(args, "deepep+fp8:mxfp8", _Profiler(), host)
    text = (tmp_path / "profile_deepep_fp8_mxfp8.txt").read_text()
    assert "2 profiled steps" in text
    assert "table by self_cpu_time_total" in text and "table by self_cuda_time_total" in text
    assert "<lambda>" in text and "cumulative" in text


def test_example_child_rendezvous_names_the_ranks_still_running(monkeypatch):
    """Rank 0's parent keeps a launch's store until every rank's child has ended, and past the
    timeout says whose children still run instead of waiting on."""
    import datetime

    import torch.distributed as dist

    example = _example()
    parents = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(parents.port))
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    rendezvous = example.ChildRendezvous(timeout_s=0.3)
    env = rendezvous.open(1)
    assert parents.get("mdeep_compare/child_port/1").decode() == env["MASTER_PORT"]
    parents.set("mdeep_compare/ended/1/2", "1")  # rank 2's child ended, rank 1's did not
    with pytest.raises(SystemExit, match=r"launch 1: the children of rank\(s\) \[1\] still"):
        rendezvous.close(1, child_failed=False)
    rendezvous.close(1, child_failed=True)  # rank 0's child failed: no wait
    parents.set("mdeep_compare/ended/1/1", "1")
    rendezvous.close(1, child_failed=False)


def test_example_runs_each_dispatcher_in_a_fresh_process(tmp_path, monkeypatch):
    """Each run gets its own child process and a rendezvous store already listening on a port
    of its own (not MASTER_PORT's neighbours); the parent reads the children's files."""
    import socket
    import subprocess

    example = _example()
    argv = ["--steps", "3", "--out", str(tmp_path), "--dispatchers", "deepep,alltoall"]
    args = example.parse_args(argv)
    monkeypatch.setenv("MASTER_PORT", "30000")
    monkeypatch.delenv("RANK", raising=False)
    seen = []

    def fake_run(cmd, env):
        name = cmd[cmd.index("--only-run") + 1]
        seen.append((name, env["MASTER_PORT"], cmd[2:cmd.index("--only-run")]))
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # every child is a client
        with socket.socket() as probe, pytest.raises(OSError):
            probe.bind(("", int(env["MASTER_PORT"])))  # the store holds its port
        with open(example._run_file(args, name), "w") as f:
            json.dump({"losses": [float(len(seen))] * 3, "times": [0.01] * 3}, f)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    results = example.train_in_fresh_processes(args, argv)
    assert [name for name, _, _ in seen] == ["deepep", "alltoall"]
    assert len({port for _, port, _ in seen}) == 2
    assert all(rest == argv for _, _, rest in seen)
    assert results == {"deepep": ([1.0] * 3, [0.01] * 3), "alltoall": ([2.0] * 3, [0.01] * 3)}

    def failing_run(cmd, env):
        return subprocess.CompletedProcess(cmd, 3)

    monkeypatch.setattr(subprocess, "run", failing_run)
    with pytest.raises(SystemExit, match="run 'deepep' failed"):
        example.train_in_fresh_processes(args, argv)
