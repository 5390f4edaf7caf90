"""CPU tier: every struct the Python side mirrors has the CUDA side's size and field offsets.

For each mirror a tiny CUDA source with `static_assert`s on `sizeof` and every field's offset
(taken from the Python side) is compiled with NVRTC (no GPU): a field added, removed, retyped or
moved on one side only fails to compile. Every kernel must take exactly one argument, the struct
`ops.KERNEL_ARGS` names. The ops wrappers' fills run with fake addresses, so a field they miss
raises here.
"""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest
import torch

from megatron_deepep import ops
from megatron_deepep.ops.bench import ceiling, quantize
from megatron_deepep.kernels import jit, nvshmem_link
from megatron_deepep.transport import errors, status
from megatron_deepep.transport import regions as buffer_layout
from megatron_deepep.transport.regions import BufferRegions
from tests.helpers import mirrors

pytest.importorskip("cuda.bindings.nvrtc")

# Further instantiations of templated structs (their layout must not depend on the argument).
_MORE_C_NAMES = {
    ops.LayoutArgs: ["mdeep::LayoutArgs<long long>"],
    ops.DispatchSendArgs: ["mdeep::DispatchSendArgs<int>"],
    ops.DispatchRecvArgs: ["mdeep::DispatchRecvArgs<long long>"],
    ops.DispatchLocalArgs: ["mdeep::DispatchLocalArgs<int>"],
    ops.QuantizeArgs: ["mdeep::QuantizeArgs<mdeep::u8>"],
    ops.DequantizeArgs: ["mdeep::DequantizeArgs<mdeep::u8>"],
}


def _offset(c_name: str, field: str) -> str:
    """The field's offset as a constant expression. `__INTADDR__` is the front end's own
    builtin, in every NVRTC; `__builtin_offsetof` is not in NVRTC 13.0 (the one torch's CUDA
    build pins)."""
    return f"__INTADDR__(&(({c_name} *)0)->{field})"


def _asserts(c_name: str, size: int, offsets: dict) -> str:
    lines = [f'static_assert(sizeof({c_name}) == {size}, "sizeof({c_name})");']
    lines += [f'static_assert({_offset(c_name, field)} == {offset}, '
              f'"offsetof({c_name}, {field})");' for field, offset in offsets.items()]
    return "\n".join(lines)


def _mirror_asserts(cls) -> str:
    offsets = {name: getattr(cls, name).offset for name, _ in cls._fields_}
    return "\n".join(_asserts(c_name, ctypes.sizeof(cls), offsets)
                     for c_name in [cls.c_name] + _MORE_C_NAMES.get(cls, []))


def _compile(body: str) -> None:
    jit.compile_code('#include "common/args.cuh"\n' + body + "\n", "mirror_check.cu")


def _mirrors():
    return sorted(set(ops.KERNEL_ARGS.values()), key=lambda c: c.__name__)


def test_every_argument_struct_matches_its_cuda_struct():
    _compile("\n".join(_mirror_asserts(cls) for cls in _mirrors()))


def test_a_field_on_one_side_only_fails():
    class Extra(ops.CombineLocalArgs):
        _fields_ = [("more", jit.I32)]  # appended after the CUDA struct's fields

    Extra.c_name = ops.CombineLocalArgs.c_name
    with pytest.raises(jit.CompileError, match="sizeof"):
        _compile(_mirror_asserts(Extra))

    class Swapped(jit.KernelArgs):
        c_name = "mdeep::FanInArgs"
        _fields_ = [("src_rows", jit.Ptr), ("src", jit.Ptr), ("dst", jit.Ptr),
                    ("num_rows", jit.I32), ("num_int4", jit.I32)]

    with pytest.raises(jit.CompileError, match="offsetof"):
        _compile(_mirror_asserts(Swapped))


def test_mirrors_are_the_struct_names():
    for cls in _mirrors():
        assert cls.c_name.split("::")[-1].split("<")[0] == cls.__name__


_KERNEL_RE = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s+)?"
                        r"(\w+)\s*\(([^)]*)\)")


@pytest.mark.parametrize("source", ["layout.cu", "notify.cu", "dispatch.cu", "combine.cu",
                                    "fp8.cu", "fp8_columnwise.cu", "bench/ceiling.cu",
                                    "bench/quantize.cu"])
def test_every_kernel_takes_its_one_argument_struct(source):
    text = (jit.cuda_src_dir() / source).read_text()
    kernels = dict(_KERNEL_RE.findall(text))
    assert kernels, source
    for kernel, params in kernels.items():
        cls = ops.KERNEL_ARGS.get((source, kernel))
        assert cls is not None, f"{source}: {kernel} has no entry in ops.KERNEL_ARGS"
        match = re.fullmatch(r"\s*const __grid_constant__ (?:mdeep::)?(\w+)(?:<[^>]*>)? args\s*",
                             params)
        assert match, f"{kernel}({params.strip()}): expected one argument struct `args`"
        assert match.group(1) == cls.__name__, kernel
    assert {k for s, k in ops.KERNEL_ARGS if s == source} == set(kernels)


def test_regions_host_info_and_error_record_mirrors():
    # Regions: where BufferRegions.as_device_struct puts each field (found by value).
    regions = BufferRegions(3, 1000, 7168, 5)
    raw = regions.as_device_struct("cpu").numpy().tobytes()
    words64, words32 = np.frombuffer(raw, np.int64), np.frombuffer(raw, np.int32)
    offsets = {}
    for name in ("dispatch_rows", "dispatch_meta", "combine_rows", "combine_weights",
                 "dispatch_flags", "combine_flags", "row_stride", "meta_stride",
                 "weight_stride"):
        (where,) = np.nonzero(words64 == getattr(regions, name))[0]
        offsets[name] = 8 * int(where)
    taken = {o + d for o in offsets.values() for d in (0, 4)}  # the 64-bit fields' halves
    for name in ("max_tokens", "workspace"):
        (where,) = [i for i in range(len(words32))
                    if i * 4 not in taken and words32[i] == getattr(regions, name)]
        offsets[name] = 4 * where
    body = _asserts("mdeep::Regions", len(raw), offsets)
    # HostInfo: the 64-bit words transport/status.py reads (rows, then the per-expert rows).
    body += "\n" + _asserts("mdeep::HostInfo", 4 * status.HOST_INFO_WORDS,
                            {"rows": 0, "tokens_per_expert": 8})
    # Meta: the flags, then notify's two halves of count rows (regions.py sizes the region).
    body += "\n" + _asserts("mdeep::Meta", buffer_layout.META_BYTES,
                            {"notify_flag": 0, "counts": 8 * buffer_layout.MAX_RANKS * 4})
    body += "\n" + "\n".join(
        f'static_assert(mdeep::counts_half({e}u) == {mirrors.counts_half(e)}, "half {e}");'
        for e in (0, 1, 2, 0xFFFFFFFF))
    # ErrorRecord: the words transport/errors.py decodes.
    body += "\n" + _asserts("mdeep::ErrorRecord", 4 * errors.ERROR_RECORD_WORDS,
                            {"code": 0, "rank": 4, "peer": 8, "phase": 12, "detail": 16,
                             "expected": 24, "seen": 32})
    _compile(body)


# (value, epoch) pairs across the sign bit and the epoch's wrap.
HOST_WORD_CASES = [(0, 0), (7, 1), (4096, 0xFFFFFFFF), (-1, 2), (0x7FFFFFFF, 0x80000000),
                   (-(1 << 31), 12345)]


def test_host_words_pack_as_the_kernels_store_them():
    # host_word of common/host_info.cuh, evaluated by NVRTC, against the tests' mirror; and the
    # host's unpack returns what was packed.
    body = "\n".join(
        f'static_assert(mdeep::host_word({value}, {epoch}u) == {mirrors.host_word(value, epoch)}'
        f'ull, "host_word({value}, {epoch})");' for value, epoch in HOST_WORD_CASES)
    _compile(body)
    for value, epoch in HOST_WORD_CASES:
        assert status.unpack_host_word(mirrors.host_word(value, epoch)) == (value, epoch)
    with pytest.raises(jit.CompileError, match="host_word"):  # the check can fail
        _compile('static_assert(mdeep::host_word(1, 2u) == 0x200000001ull, "host_word swapped");')


class _Recorder:
    def __init__(self):
        self.launches = []

    def get_kernel(self, source, name, template_args=()):
        recorder = self

        class _Kernel:
            def launch(self, grid, block, args, stream, shared_mem=0, programmatic=False):
                assert isinstance(args, ops.KERNEL_ARGS[(source, name)])
                recorder.launches.append((name, grid, block, mirrors.args_dict(args)))

        return _Kernel()


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(jit, "get_kernel", rec.get_kernel)
    monkeypatch.setattr(jit, "current_raw_stream", lambda: jit.RawStream(7, 0))
    return rec


_INCLUDE_RE = re.compile(r'^#include "(internode/[^"]+)"', re.MULTILINE)


def _with_internode_headers(source: str) -> str:
    """`source`'s text and that of every `internode/` header it includes, depth first."""
    seen, texts = set(), []

    def visit(name):
        if name in seen:
            return
        seen.add(name)
        text = (jit.cuda_src_dir() / name).read_text()
        texts.append(text)
        for header in _INCLUDE_RE.findall(text):
            visit(header)

    visit(source)
    return "\n".join(texts)


@pytest.mark.parametrize("staging", sorted(ops.INTERNODE_SOURCES))
def test_each_internode_source_holds_its_stagings_kernels(staging):
    """Each staging's source, with the shared headers it includes, defines exactly the kernels
    `ops` lists for that staging (so its family links from it), each taking `InternodeArgs`."""
    source = ops.INTERNODE_SOURCES[staging]
    kernels = dict(_KERNEL_RE.findall(_with_internode_headers(source)))
    assert set(kernels) == set(ops.INTERNODE_STAGING_KERNELS[staging]), source
    assert {k for s, k in ops.KERNEL_ARGS if s == source} == set(kernels)
    for kernel, params in kernels.items():
        assert re.fullmatch(r"\s*const __grid_constant__ InternodeArgs a\s*", params), kernel
        assert ops.KERNEL_ARGS[(source, kernel)] is ops.InternodeArgs


def test_internode_wrappers_launch_from_their_stagings_module(monkeypatch):
    """Every internode wrapper, called for a staging, launches its kernel from that staging's
    source, in the very family (module) the transport links for it, with `InternodeArgs`; and
    the wrappers of a staging together launch every kernel its source holds."""
    launches = []

    def get_kernels(source, family, device):
        class _Kernel:
            def __init__(self, expr):
                self.expr = expr

            def launch(self, grid, block, args, stream, cooperative=False):
                assert isinstance(args, ops.KERNEL_ARGS[(source, self.expr.split("<")[0])])
                launches.append((source, family, self.expr))

        return {expr: _Kernel(expr) for expr in family}

    monkeypatch.setattr(nvshmem_link, "get_kernels", get_kernels)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(jit, "current_raw_stream", lambda: jit.RawStream(7, 0))
    topk_idx = torch.zeros(4, 2, dtype=torch.int64)
    y = torch.zeros(4, 64, dtype=torch.bfloat16)
    fields = {**dict.fromkeys(ops.INTERNODE_FIELDS, 0), "ranks_per_node": 2}
    for staging in ("full", "ring", "net"):
        ring, net = staging == "ring", staging == "net"
        launches.clear()
        ops.internode_node_layout(topk_idx, None, 2, fields, ring=ring, net=net)
        ops.internode_notify(topk_idx, None, fields, ring=ring, net=net)
        if staging == "full":
            ops.internode_dispatch_send(topk_idx, False, None, 2, fields)
            ops.internode_forward(topk_idx, None, 2, fields)
            ops.internode_dispatch_recv(topk_idx, False, None, 2, fields)
            ops.internode_combine_send(topk_idx, y, True, False, 2, fields)
            ops.internode_combine_forward(topk_idx, y, False, 2, fields)
            ops.internode_combine_reduce(topk_idx, y, False, 2, fields)
        elif ring:
            ops.internode_dispatch_send(topk_idx, False, None, 2, fields, ring=True)
            ops.internode_ring_count(topk_idx, None, 2, fields)
            ops.internode_ring_dispatch(topk_idx, False, None, 2, fields)
            ops.internode_ring_combine(topk_idx, y, True, False, 2, fields)
            ops.internode_combine_reduce(topk_idx, y, False, 2, fields, ring=True)
        else:
            ops.internode_net_dispatch(topk_idx, False, None, 2, fields)
            ops.internode_net_combine(topk_idx, y, True, False, 2, fields)
        dispatch, combine = ops.internode_families(staging)
        families = {dispatch(2, "long long", None), combine(2, ops.row_dtype_code(y))}
        for source, family, expr in launches:
            assert source == ops.INTERNODE_SOURCES[staging], (staging, expr)
            assert family in families and expr in family, (staging, expr)
        assert ({expr.split("<")[0] for _, _, expr in launches}
                == set(ops.INTERNODE_STAGING_KERNELS[staging])), staging


def test_ceiling_and_fp8_wrappers_fill_every_field(recorder, monkeypatch):
    from megatron_deepep.fp8 import BLOCKWISE_1x128, MXFP8_1x32

    src = torch.zeros(4, 64, dtype=torch.bfloat16)
    rows = torch.zeros(4 * 8, dtype=torch.int32)
    dst = torch.zeros(32, 64, dtype=torch.bfloat16)
    ceiling.fill(dst, 3)
    ceiling.fan_out_copy(src, rows, dst, 8, 2)
    ceiling.fan_in_sum(dst, rows.view(4, 8), src, 2)
    fp8_rows = torch.zeros(32, 64, dtype=torch.uint8)
    fp8_scales = torch.zeros(32, 32, dtype=torch.uint8)
    ceiling.fan_out_fp8_bytes(src, rows, fp8_rows, fp8_scales, 8, 24)
    slots = torch.zeros(3, 64, dtype=torch.uint8)
    bases = torch.zeros(3, dtype=torch.int64)
    ceiling.peer_copy(slots, bases, 1, 24)
    monkeypatch.setattr(quantize, "_check_bf16_rows", lambda x: None)
    for fmt in (BLOCKWISE_1x128, MXFP8_1x32):
        q, scales = quantize.quantize_rows(src, fmt)
        ops.dequantize_rows(q, scales, fmt)
    by_name = {name: (grid, block, fields) for name, grid, block, fields in recorder.launches}
    assert by_name["fill_kernel"] == (3, 256, dict(dst=dst.data_ptr(), num_int4=32 * 64 * 2 // 16))
    assert by_name["fan_out_copy"][2] == dict(src=src.data_ptr(), dst_rows=rows.data_ptr(),
                                              dst=dst.data_ptr(), num_rows=4, num_int4=8,
                                              fan_out=8)
    assert by_name["fan_out_fp8_bytes"] == (24, 512, dict(
        src=src.data_ptr(), dst_rows=rows.data_ptr(), dst=fp8_rows.data_ptr(),
        dst_scales=fp8_scales.data_ptr(), num_rows=4, num_int4=8, fan_out=8, scale_int4=2,
        narrow_stores=0))
    assert by_name["fan_in_sum"][2] == dict(src=dst.data_ptr(), src_rows=rows.data_ptr(),
                                            dst=src.data_ptr(), num_rows=4, num_int4=8)
    assert by_name["peer_copy"] == (24, ceiling.PEER_COPY_THREADS, dict(
        src=slots.data_ptr(), peer_bases=bases.data_ptr(), num_int4_per_peer=4, rank=1,
        num_ranks=3))
    mxfp8 = by_name["quantize_mxfp8"][2]
    assert mxfp8["x"] == src.data_ptr() and mxfp8["num_tokens"] == 4
    assert mxfp8["hidden"] == 64 and mxfp8["q"] != 0 and mxfp8["scales"] != 0
    assert by_name["dequantize_blockwise"][2]["num_tokens"] == 4


def test_fp8_bytes_fan_out_names_what_it_refuses():
    rows = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="src must be bf16 with a multiple of 16 columns"):
        ceiling.fan_out_fp8_bytes(torch.zeros(1, 24, dtype=torch.bfloat16), rows,
                                  torch.zeros(8, 24, dtype=torch.uint8),
                                  torch.zeros(8, 16, dtype=torch.uint8), 8, 1)
    with pytest.raises(ValueError, match=r"dst_scales' row \(8 bytes\)"):
        ceiling.fan_out_fp8_bytes(torch.zeros(1, 32, dtype=torch.bfloat16), rows,
                                  torch.zeros(8, 32, dtype=torch.uint8),
                                  torch.zeros(8, 8, dtype=torch.uint8), 8, 1)


def test_columnwise_wrapper_fills_every_field(recorder, monkeypatch):
    """`ops.columnwise_from_rowwise`: the scales' strides, the grid (token blocks x column
    tiles), the packed outputs and the epsilon."""
    monkeypatch.setattr(ops.fp8_columnwise, "_check_columnwise_args", lambda *args: None)
    q = torch.zeros(272, 384, dtype=torch.uint8)
    scales = torch.zeros(3, 276).t()[:272]  # TE's GEMM-ready buffer, seen as [rows, blocks]
    offsets = torch.tensor([0, 16, 16, 272], dtype=torch.int32)
    data, scale_inv = ops.columnwise_from_rowwise(q, scales, offsets, 4, power_2_scale=False,
                                                  amax_epsilon=0.5)
    assert data.shape == (384 * 272,) and scale_inv.shape == (4, 384)
    ((name, grid, block, fields),) = recorder.launches
    assert (name, grid, block) == ("columnwise_from_rowwise", 4 * 3, ops.COLUMNWISE_THREADS)
    assert fields == dict(q=q.data_ptr(), scales=scales.data_ptr(), token_stride=1,
                          block_stride=276, row_offsets=offsets.data_ptr(),
                          col_data=data.data_ptr(), col_scales=scale_inv.data_ptr(),
                          num_experts=3, num_rows=272, hidden=384, scale_cols=384, num_blocks=4,
                          amax_epsilon=0.5)


def test_current_raw_stream_is_the_current_stream_of_the_current_device(monkeypatch):
    """`jit.current_raw_stream` reuses one `RawStream` per (handle, device): equal to a new one
    whichever stream and device are current."""
    current = {"device": 0, "handles": {0: 11, 1: 22}}
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream",
                        lambda device: current["handles"][device], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current["device"], raising=False)
    first = jit.current_raw_stream()
    assert first == jit.RawStream(11, 0) and jit.current_raw_stream() is first
    current["device"] = 1
    assert jit.current_raw_stream() == jit.RawStream(22, 1)
    current["handles"][1] = 0  # the legacy default stream: handle 0 on every device
    current["handles"][0] = 0
    assert jit.current_raw_stream() == jit.RawStream(0, 1)
    current["device"] = 0
    assert jit.current_raw_stream() == jit.RawStream(0, 0)
