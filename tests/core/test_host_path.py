"""CPU tier: the kernel transports' host path (local, NVLink) with the kernels replaced by
recorders.

No GPU: every launch's argument struct is filled by name through the real `KernelArgs.fill`
(a missing or unknown field, or a value that does not fit, fails here) and recorded; the
row count the host polls comes from the test. This checks
what runs in which order (EP = 1: layout then the expand, no notify; the sync call's expand
before or after its host wait), the shapes handed back, and that the handle's arrays are the
ones the kernels were given.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from megatron_deepep import ops
from megatron_deepep.kernels import jit
from megatron_deepep.transport import local, nvlink
from megatron_deepep.transport.epochs import DeviceEpochs
from megatron_deepep.transport.regions import BufferRegions
from tests.helpers import mirrors


class _Recorder:
    """Stands in for `jit.get_kernel`: kernels that pack their arguments and log the launch."""

    def __init__(self):
        self.events = []

    def get_kernel(self, source, name, template_args=()):
        recorder = self

        class _Kernel:
            def launch(self, grid, block, args, stream, shared_mem=0, programmatic=False):
                assert isinstance(args, ops.KERNEL_ARGS[(source, name)]), name
                recorder.events.append(
                    (name, dict(grid=grid, block=block, args=mirrors.args_dict(args),
                                programmatic=programmatic, shared_mem=shared_mem,
                                template_args=list(template_args))))

        return _Kernel()

    def find(self, name):
        """`(template args, argument struct as a dict)` of every launch of kernel `name`."""
        return [(e["template_args"], e["args"]) for n, e in self.events if n == name]


class _FakeStatus:
    """Stands in for `KernelStatus`: mailboxes at a fake device address; the host wait is
    recorded and sees `rows_from_notify()`."""

    host_info_ptr = 0x1000

    def __init__(self, rec, rows_from_notify, num_words=4 + 256):
        self.rec, self.rows_from_notify = rec, rows_from_notify
        self.words = np.zeros(num_words, dtype=np.int32)
        self.errors = ops.ErrorSink(0, 0)

    def check_errors(self):
        pass

    def wait_num_rows(self, epoch):
        self.rec.events.append(("host wait", {}))
        return self.rows_from_notify()

    def tokens_per_expert(self, num_local):
        return self.words[4:4 + num_local].tolist()


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(jit, "get_kernel", rec.get_kernel)
    monkeypatch.setattr(jit, "current_raw_stream", lambda: jit.RawStream(7, 0))

    class _Stream:
        def synchronize(self):
            pass

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    # The layout workspace is zeroed on the launch stream (no CUDA here: the current one).
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return rec


def _transport(rec, num_ranks, max_tokens, hidden, topk, rows_from_notify, kernels="auto"):
    """The transport `auto` picks for `num_ranks` (local or NVLink, with the kernels
    `MDEEP_NVLINK_KERNELS` names), built on the CPU with no GPU memory; its host wait sees
    `rows_from_notify()`."""
    if num_ranks == 1:
        t = local.LocalTransport.__new__(local.LocalTransport)
        t.max_tokens, t.epoch = max_tokens, 0
        t.epochs = DeviceEpochs(torch.device("cpu"))
        t._meta_bases = torch.zeros(1, dtype=torch.int64)
    else:
        t = nvlink.NVLinkTransport.__new__(nvlink.NVLinkTransport)
        t.regions = BufferRegions(num_ranks, max_tokens, hidden, topk)
        t.rank, t.num_ranks = 0, num_ranks
        t.regions_dev = torch.zeros(16, dtype=torch.int64)
        t.sym = type("Sym", (), {})()
        t.sym.peer_bases, t.sym.ptr = torch.zeros(num_ranks, dtype=torch.int64), 0
        t.epochs, t.host_epoch = DeviceEpochs(torch.device("cpu")), 0
        t.kernels, t.fused_combine = kernels, kernels == "fused"
    t.device = torch.device("cpu")
    t.num_sms, t.timeout_ns = 8, 5 * 10**9
    t.status = _FakeStatus(rec, rows_from_notify)
    return t


def _inputs(num_tokens, hidden, num_experts, topk, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)
    idx = torch.rand(num_tokens, num_experts, generator=g).topk(topk, dim=1).indices
    return x, idx, torch.rand(num_tokens, topk, generator=g)


def _names(rec):
    return [name for name, _ in rec.events]


def test_ep1_nosync_runs_layout_then_a_programmatic_expand(recorder):
    t = _transport(recorder, 1, 64, 256, 4, lambda: 0)
    x, idx, w = _inputs(64, 256, 16, 4)
    recv_x, recv_w, handle = t.dispatch(x, idx, w, 16, num_max_recv_rows=300)
    assert _names(recorder) == ["layout_kernel", "dispatch_local"]
    layout_args, expand = recorder.events[0][1]["args"], recorder.events[1][1]
    assert expand["programmatic"] and expand["args"]["max_rows"] == 300  # the bound
    assert not recorder.events[0][1]["programmatic"]
    assert recv_x.shape == (300, 256) and recv_w.shape == (300,)
    assert handle.num_recv_rows == 300 and handle.tokens_per_expert_list is None
    arena = handle.transport_state[1]
    # The layout kernel writes the receive layout (EP = 1) into the handle's arena.
    assert layout_args["recv_tokens_per_expert"] == arena.address("num_recv_tokens_per_expert")
    assert layout_args["recv_padded"] == arena.address("tokens_per_expert")
    assert layout_args["recv_row_start"] == arena.address("expert_row_start")
    assert layout_args["recv_src_offset"] == arena.address("src_expert_offset")
    assert layout_args["recv_tokens_per_rank"] == arena.address("num_recv_tokens_per_rank")
    assert (layout_args["alignment"], layout_args["max_recv_rows"],
            layout_args["host_epoch"]) == (1, 300, 1)
    assert layout_args["topk_idx"] != 0
    assert (layout_args["num_tokens"], layout_args["num_experts"],
            layout_args["num_ranks"], layout_args["rank"]) == (64, 16, 1, 0)
    # No host wait: nobody publishes the receive layout to the host (no system fences).
    assert layout_args["host_info"] == 0 and expand["args"]["host_info"] == 0
    assert handle.address("slot_rows") == arena.address("slot_rows") == expand["args"]["slot_rows"]
    assert handle.layout.address("pos_in_expert") == expand["args"]["pos_in_expert"]
    assert layout_args["pos_in_expert"] == expand["args"]["pos_in_expert"]
    assert handle.layout.address("token_slot_in_rank") == expand["args"]["token_slot_in_rank"]
    assert expand["args"]["num_tokens"] == 64 and expand["args"]["hidden"] == 256
    assert expand["args"]["x"] == x.data_ptr() and expand["args"]["recv_x"] == recv_x.data_ptr()


def test_ep1_sync_launches_the_expand_before_the_wait_and_trims(recorder):
    t = _transport(recorder, 1, 64, 256, 4, lambda: 250)
    x, idx, w = _inputs(64, 256, 16, 4)
    recv_x, recv_w, handle = t.dispatch(x, idx, w, 16, expert_alignment=2)
    assert _names(recorder) == ["layout_kernel", "dispatch_local", "host wait"]
    expand = recorder.events[1][1]["args"]
    assert expand["max_rows"] == 64 * 4 + 16  # entries + padding bound
    # The expand publishes the receive layout to the host, not the layout kernel it follows.
    assert recorder.events[0][1]["args"]["host_info"] == 0
    assert (expand["host_info"], expand["tokens_per_expert"], expand["host_epoch"]) == (
        t.status.host_info_ptr, handle.transport_state[1].address("tokens_per_expert"), 1)
    assert recv_x.shape == (250, 256) and recv_w.shape == (250,)
    assert handle.num_recv_rows == 250 and len(handle.tokens_per_expert_list) == 16


def test_ep1_sync_fp8_quantizing_expand_leaves_the_publish_to_the_layout(recorder):
    """A quantizing expand starts before the wait but quantizes a row per warp first: the
    layout kernel publishes. Pre-quantized rows or bf16 rows out (no quantize): the expand."""
    from megatron_deepep.fp8.dispatch import Fp8Dispatch
    t = _transport(recorder, 1, 64, 256, 4, lambda: 256)
    x, idx, w = _inputs(64, 256, 16, 4)
    fp8 = Fp8Dispatch.named("blockwise", "fp8")
    t.dispatch(x, idx, w, 16, fp8=fp8)
    assert _names(recorder) == ["layout_kernel", "dispatch_local", "host wait"]
    layout, expand = recorder.events[0][1]["args"], recorder.events[1][1]["args"]
    assert (layout["host_info"], expand["host_info"]) == (t.status.host_info_ptr, 0)
    assert layout["host_epoch"] == 1
    recorder.events.clear()
    data, scales = fp8.fmt.quantize(x)
    t.dispatch(data, idx, w, 16, fp8=fp8, x_scales=scales)
    layout, expand = recorder.events[0][1]["args"], recorder.events[1][1]["args"]
    assert (layout["host_info"], expand["host_info"]) == (0, t.status.host_info_ptr)
    recorder.events.clear()
    t.dispatch(x, idx, w, 16, fp8=Fp8Dispatch.named("blockwise", "bf16"))
    layout, expand = recorder.events[0][1]["args"], recorder.events[1][1]["args"]
    assert (layout["host_info"], expand["host_info"]) == (0, t.status.host_info_ptr)


def test_ep1_sync_with_large_padding_waits_first(recorder):
    t = _transport(recorder, 1, 64, 256, 4, lambda: 2048)
    x, idx, w = _inputs(64, 256, 16, 4)
    recv_x, _, handle = t.dispatch(x, idx, w, 16, expert_alignment=128)
    assert _names(recorder) == ["layout_kernel", "host wait", "dispatch_local"]
    assert recorder.events[2][1]["args"]["max_rows"] == 2048 and recv_x.shape == (2048, 256)
    # The host waits before the expand: the layout kernel publishes.
    assert recorder.events[0][1]["args"]["host_info"] == t.status.host_info_ptr
    assert recorder.events[2][1]["args"]["host_info"] == 0


def test_ep1_given_layout_runs_notify_and_a_plain_expand(recorder):
    t = _transport(recorder, 1, 64, 256, 4, lambda: 0)
    x, idx, w = _inputs(64, 256, 16, 4)
    layout = t.get_dispatch_layout(idx, 16)
    recorder.events.clear()
    t.dispatch(x, idx, w, 16, num_max_recv_rows=256, layout=layout)
    assert _names(recorder) == ["notify_kernel", "dispatch_local"]
    assert not recorder.events[1][1]["programmatic"]


def test_ep1_cached_dispatch_and_combine_reuse_the_handle_arrays(recorder):
    t = _transport(recorder, 1, 64, 256, 4, lambda: 0)
    x, idx, w = _inputs(64, 256, 16, 4)
    recv_x, _, handle = t.dispatch(x, idx, w, 16, num_max_recv_rows=256)
    recorder.events.clear()
    cached = t.cached_dispatch(x, handle)
    out, out_w = t.combine(recv_x, handle, grad_row_weights=torch.zeros(256))
    assert _names(recorder) == ["dispatch_local", "combine_local"]
    assert cached.shape == (256, 256) and out.shape == (64, 256) and out_w.shape == (64, 4)
    slot_rows = handle.address("slot_rows")
    assert all(ev["args"]["slot_rows"] == slot_rows for _, ev in recorder.events)
    assert not any(ev["programmatic"] for _, ev in recorder.events)  # x from the caller
    combine = recorder.events[1][1]["args"]
    assert combine["y"] == recv_x.data_ptr() and combine["out"] == out.data_ptr()
    assert combine["out_weights"] == out_w.data_ptr() and combine["num_tokens"] == 64
    assert combine["num_int4"] == 256 * 2 // 16
    assert combine["recv_weights"] == handle.recv_weights.data_ptr()
    assert combine["token_slot_in_rank"] == handle.layout.address("token_slot_in_rank")


def test_ep1_expand_stages_its_first_rows_in_shared_memory(recorder):
    t = _transport(recorder, 1, 64, 7168, 8, lambda: 0)
    x, idx, w = _inputs(64, 7168, 32, 8)
    _, _, handle = t.dispatch(x, idx, w, 32, num_max_recv_rows=512)
    t.cached_dispatch(x, handle)
    expand, cached = recorder.events[1][1], recorder.events[2][1]
    # 32 warps x 14 words per lane x 32 lanes x 16 B: the 7168 - 2048 bf16 of a row past the
    # chunk in registers (640 words) capped at 224 KB; a cached dispatch has no layout to hide.
    assert expand["shared_mem"] == 32 * 14 * 32 * 16 == ops.DISPATCH_STAGE_MAX_BYTES
    assert cached["shared_mem"] == 0


@pytest.mark.parametrize("hidden, words_per_lane", [(2048, 0), (2880, 4), (4096, 8), (4104, 9),
                                                    (7168, 14), (16384, 14)])
def test_dispatch_stage_bytes(hidden, words_per_lane):
    assert ops.dispatch._dispatch_stage_bytes(hidden, 1024) == 32 * words_per_lane * 32 * 16
    assert ops.dispatch._dispatch_stage_bytes(hidden, 1024) <= ops.DISPATCH_STAGE_MAX_BYTES


@pytest.mark.parametrize("fmt, hidden, stride", [
    ("blockwise_1x128", 7168, 7168 + 224), ("mxfp8_1x32", 7168, 7168 + 224),
    ("blockwise_1x128", 2880, 2880 + 96), ("mxfp8_1x32", 2880, 2880 + 96),
    ("blockwise_1x128_fp32_scales", 4096, 4096 + 128)])
def test_fp8_quantize_stage_bytes(fmt, hidden, stride):
    """From row_stage_min_sms() up, one row stage per warp: the e4m3 row, then its scales from
    the next 16-byte boundary; below it (or past the 224 KB cap), the scales alone."""
    from megatron_deepep.fp8.dispatch import Fp8Dispatch
    keep, deq = Fp8Dispatch.named(fmt, "fp8"), Fp8Dispatch.named(fmt, "bf16")
    stage = ops.dispatch._quantize_stage_bytes
    many, few = ops.dispatch.row_stage_min_sms(), ops.dispatch.row_stage_min_sms() - 1
    assert stage(hidden, 512, keep, None, many) == 16 * stride
    assert stage(hidden, 512, keep, None, few) == 16 * (stride - hidden)
    for num_sms in (few, many):
        assert stage(hidden, 512, keep, torch.empty(1), num_sms) == 0  # pre-quantized rows
        assert stage(hidden, 512, deq, None, num_sms) == 0  # the dequantizing expand
    # 16 x 16.9 KB exceeds the 224 KB cap: the scale stages (16 x 512 bytes) instead.
    assert stage(16384, 512, keep, None, many) == 16 * 512


def test_fp8_row_stage_budget_is_a_knob(monkeypatch):
    """MDEEP_FP8_ROW_STAGE_MIN_SMS moves the SM budget of the row stage (0: every budget; a
    huge one: none) and a bad value is refused naming the variable."""
    from megatron_deepep.fp8.dispatch import Fp8Dispatch
    keep = Fp8Dispatch.named("blockwise", "fp8")
    stage = ops.dispatch._quantize_stage_bytes
    cache = ops.dispatch.row_stage_min_sms.cache_clear
    try:
        monkeypatch.setenv("MDEEP_FP8_ROW_STAGE_MIN_SMS", "0")
        cache()
        assert stage(7168, 512, keep, None, 1) == 16 * (7168 + 224)
        monkeypatch.setenv("MDEEP_FP8_ROW_STAGE_MIN_SMS", "100000")
        cache()
        assert stage(7168, 512, keep, None, 132) == 16 * 224
        monkeypatch.setenv("MDEEP_FP8_ROW_STAGE_MIN_SMS", "-1")
        cache()
        with pytest.raises(ValueError, match="MDEEP_FP8_ROW_STAGE_MIN_SMS='-1'"):
            stage(7168, 512, keep, None, 132)
    finally:
        monkeypatch.delenv("MDEEP_FP8_ROW_STAGE_MIN_SMS")
        cache()
    assert ops.dispatch.row_stage_min_sms() == 48


@pytest.mark.parametrize("num_sms, stage_bytes", [(132, 7168 + 224), (24, 224)])
def test_ep1_fp8_expand_stages_by_sm_budget(recorder, num_sms, stage_bytes):
    """Fresh and cached alike, 16 warps: at 132 SMs each stages a 7168-byte e4m3 row and its
    56 fp32 scales; at 24 SMs the scales alone (the warps quantize in registers)."""
    from megatron_deepep.fp8.dispatch import Fp8Dispatch
    t = _transport(recorder, 1, 64, 7168, 8, lambda: 0)
    t.num_sms = num_sms
    x, idx, w = _inputs(64, 7168, 32, 8)
    fp8 = Fp8Dispatch.named("blockwise", "fp8")
    _, _, handle = t.dispatch(x, idx, w, 32, num_max_recv_rows=512, fp8=fp8)
    t.cached_dispatch(x, handle, fp8=fp8)
    expand, cached = recorder.events[1][1], recorder.events[2][1]
    assert expand["shared_mem"] == cached["shared_mem"] == 16 * stage_bytes
    assert expand["programmatic"]


def test_ep2_runs_the_protocol_kernels(recorder):
    """Fused kernels: layout, notify, the host wait, then one launch per operation."""
    t = _transport(recorder, 2, 64, 256, 4, lambda: 200, kernels="fused")
    x, idx, w = _inputs(64, 256, 16, 4)
    recv_x, _, handle = t.dispatch(x, idx, w, 16)
    assert _names(recorder) == ["layout_kernel", "notify_kernel", "host wait", "dispatch_fused"]
    assert recv_x.shape == (200, 256) and handle.slot_rows.shape == (2, 64, 4)
    assert recorder.events[1][1]["args"]["host_info"] == t.status.host_info_ptr  # it publishes
    fused = recorder.events[3][1]["args"]
    assert fused["regions"] == t.regions_dev.data_ptr()
    assert fused["peer_bases"] == t.sym.peer_bases.data_ptr()
    assert (fused["rank"], fused["num_ranks"], fused["num_local"]) == (0, 2, 8)
    assert fused["timeout_ns"] == t.timeout_ns and fused["max_rows"] == 200
    assert fused["token_slot_in_rank"] == handle.layout.address("token_slot_in_rank")
    assert fused["is_token_in_rank"] == handle.layout.address("is_token_in_rank")
    assert fused["slot_rows"] == handle.address("slot_rows")
    assert fused["x"] == x.data_ptr() and fused["recv_x"] == recv_x.data_ptr()
    recorder.events.clear()
    t.dispatch(x, idx, w, 16, num_max_recv_rows=256)
    assert _names(recorder) == ["layout_kernel", "notify_kernel", "dispatch_fused"]
    assert recorder.events[1][1]["args"]["host_info"] == 0  # no host wait
    recorder.events.clear()
    t.cached_dispatch(x, handle)
    out, _ = t.combine(recv_x, handle)
    assert _names(recorder) == ["dispatch_fused", "combine_fused"]
    cached, combine = recorder.events[0][1]["args"], recorder.events[1][1]["args"]
    assert cached["recv_weights"] == 0 and cached["topk_weights"] == 0
    assert combine["out"] == out.data_ptr() and combine["y"] == recv_x.data_ptr()
    assert combine["num_recv_tokens_per_rank"] == handle.address("num_recv_tokens_per_rank")
    assert combine["slot_rows"] == handle.address("slot_rows")


def test_ep2_auto_kernels_fuse_the_dispatch_and_split_the_combine(recorder, monkeypatch):
    """The default, `auto`: the fused dispatch, the send + reduce combine."""
    monkeypatch.delenv("MDEEP_NVLINK_KERNELS", raising=False)
    from megatron_deepep import knobs
    assert knobs.get("NVLINK_KERNELS") == "auto"
    t = _transport(recorder, 2, 64, 256, 4, lambda: 200, kernels="auto")
    x, idx, w = _inputs(64, 256, 16, 4)
    recv_x, _, handle = t.dispatch(x, idx, w, 16)
    t.cached_dispatch(x, handle)
    t.combine(recv_x, handle)
    assert _names(recorder) == ["layout_kernel", "notify_kernel", "host wait", "dispatch_fused",
                                "dispatch_fused", "combine_send", "combine_reduce"]
    # FP8 rows take the split kernels under auto (faster in the H100 MPS run).
    from megatron_deepep.fp8.dispatch import Fp8Dispatch
    recorder.events.clear()
    t.dispatch(x, idx, w, 16, fp8=Fp8Dispatch.named("blockwise", "fp8"))
    assert _names(recorder) == ["layout_kernel", "notify_kernel", "dispatch_send", "host wait",
                                "dispatch_recv"]


def test_ep2_split_kernels_send_before_the_host_wait(recorder):
    """`MDEEP_NVLINK_KERNELS=split`: the send overlaps the host wait, the receive follows."""
    t = _transport(recorder, 2, 64, 256, 4, lambda: 200, kernels="split")
    x, idx, w = _inputs(64, 256, 16, 4)
    recv_x, _, handle = t.dispatch(x, idx, w, 16)
    assert _names(recorder) == ["layout_kernel", "notify_kernel", "dispatch_send",
                                "host wait", "dispatch_recv"]
    send, recv = recorder.events[2][1]["args"], recorder.events[4][1]["args"]
    for args in (send, recv):
        assert args["regions"] == t.regions_dev.data_ptr()
        assert (args["rank"], args["num_ranks"], args["num_local"]) == (0, 2, 8)
    assert send["token_slot_in_rank"] == handle.layout.address("token_slot_in_rank")
    assert recv["slot_token"] == handle.layout.address("slot_token")
    assert recv["slot_rows"] == handle.address("slot_rows")
    recorder.events.clear()
    t.cached_dispatch(x, handle)
    t.combine(recv_x, handle)
    assert _names(recorder) == ["dispatch_send", "dispatch_recv", "combine_send",
                                "combine_reduce"]


def test_rows_before_wait_bound():
    bound = local.LocalTransport._rows_before_wait
    assert bound(100, 8, 256, 1) == 800
    assert bound(100, 8, 16, 4) == 800 + 16 * 3
    assert bound(100, 8, 256, 128) is None  # padding would exceed 1/8
    assert bound(0, 8, 16, 4) == 0


def test_nvlink_adopts_a_handle_of_a_smaller_buffer(recorder):
    """After get_buffer grew (N_max 64 -> 128), a pending handle's slot_rows move into an
    arena of the new N_max (the kernels index them with it), padded with -1."""
    t = _transport(recorder, 2, 64, 256, 4, lambda: 200)
    x, idx, w = _inputs(64, 256, 16, 4)
    _, _, handle = t.dispatch(x, idx, w, 16)
    handle.slot_rows.copy_(torch.arange(handle.slot_rows.numel()).view(2, 64, 4))
    old_slot_rows = handle.slot_rows.clone()
    old_offsets = handle.recv.src_expert_offset.clone()
    t.regions = BufferRegions(2, 128, 256, 4)
    recorder.events.clear()
    t.combine(torch.zeros(200, 256, dtype=torch.bfloat16), handle)
    assert handle.slot_rows.shape == (2, 128, 4)
    assert torch.equal(handle.slot_rows[:, :64], old_slot_rows)
    assert (handle.slot_rows[:, 64:] == -1).all()
    assert torch.equal(handle.recv.src_expert_offset, old_offsets)
    assert recorder.events[0][1]["args"]["slot_rows"] == handle.address("slot_rows")
    assert handle.transport_state[1].address("slot_rows") == handle.address("slot_rows")
    t.cached_dispatch(x, handle)
    assert recorder.events[-1][1]["args"]["slot_rows"] == handle.address("slot_rows")
