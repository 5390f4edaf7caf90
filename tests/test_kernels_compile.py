"""CPU tier: every kernel variant compiles for sm_90 through NVRTC (no GPU needed)."""

from __future__ import annotations

import pytest

from megatron_deepep import jit, ops

pytest.importorskip("cuda.bindings.nvrtc")


@pytest.mark.parametrize("source", ["layout.cu", "notify.cu", "dispatch.cu", "combine.cu"])
def test_every_topk_variant_compiles(source):
    exprs = sorted({e for k in range(1, 17) for e in ops.kernel_names(k)[source]})
    cubin, lowered = jit.compile_cubin(source, exprs, arch="sm_90")
    assert cubin[:4] == b"\x7fELF"
    assert set(lowered) == set(exprs)


def test_ceiling_kernels_compile():
    exprs = ["fill_kernel", "fan_out_copy", "fan_in_sum"]
    cubin, lowered = jit.compile_cubin("ceiling.cu", exprs, arch="sm_90")
    assert cubin[:4] == b"\x7fELF" and set(lowered) == set(exprs)


def test_fp8_kernels_compile():
    exprs = [f"quantize_blockwise<{w}, {p}>" for w in (4, 8) for p in ("false", "true")]
    exprs += [f"{k}<{w}>" for k in ("quantize_mxfp8", "dequantize_blockwise", "dequantize_mxfp8")
              for w in (4, 8)]
    cubin, lowered = jit.compile_cubin("fp8.cu", exprs, arch="sm_90")
    assert cubin[:4] == b"\x7fELF" and set(lowered) == set(exprs)


@pytest.mark.parametrize("num_topk", [1, 16])
def test_fp8_dispatch_variants_compile(num_topk):
    exprs = ops.kernel_names(num_topk, fp8=True)["dispatch.cu"]
    cubin, lowered = jit.compile_cubin("dispatch.cu", exprs, arch="sm_90")
    assert cubin[:4] == b"\x7fELF"
    assert set(lowered) == set(exprs)


def test_compile_error_names_kernel_options_and_log(tmp_path, monkeypatch):
    (tmp_path / "common").mkdir()
    (tmp_path / "broken.cu").write_text("template <int N> __global__ void k() { undefined_x; }\n")
    monkeypatch.setattr(jit, "cuda_src_dir", lambda: tmp_path)
    with pytest.raises(jit.CompileError) as info:
        jit.compile_cubin("broken.cu", ["k<3>"])
    message = str(info.value)
    assert "k<3>" in message and "--gpu-architecture=sm_90" in message
    assert "undefined_x" in message


def test_include_hash_changes_with_header(tmp_path, monkeypatch):
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "h.cuh").write_text("#define V 1\n")
    (tmp_path / "a.cu").write_text('#include "common/h.cuh"\n')
    monkeypatch.setattr(jit, "cuda_src_dir", lambda: tmp_path)
    before = jit.source_hash("a.cu")
    (tmp_path / "common" / "h.cuh").write_text("#define V 2\n")
    assert jit.source_hash("a.cu") != before


def test_foreign_include_rejected(tmp_path, monkeypatch):
    (tmp_path / "common").mkdir()
    (tmp_path / "a.cu").write_text("#include <cuda_bf16.h>\n")
    monkeypatch.setattr(jit, "cuda_src_dir", lambda: tmp_path)
    with pytest.raises(jit.CompileError, match="only our own headers"):
        jit.source_hash("a.cu")
