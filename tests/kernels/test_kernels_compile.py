"""CPU tier: every kernel variant compiles for sm_90 through NVRTC (no GPU needed).

The compiles themselves are planned in `compile_jobs.py` and run in the background while the
other tests run (`conftest.py` starts them once collected and orders these tests last).
"""

from __future__ import annotations

import pytest

from megatron_deepep import ops
from megatron_deepep.kernels import jit
from tests.helpers import compile_jobs

pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC compile checks need NVRTC: "
                    "pip install -e '.[jit]'")


@pytest.mark.nvrtc_job
@pytest.mark.parametrize("job", sorted(compile_jobs.jobs()))
def test_kernels_compile(job):
    """One NVRTC program of `compile_jobs` (run in the background, collected here)."""
    magic, size, lowered = compile_jobs.result(job)
    assert magic == b"\x7fELF" and size > 0
    assert lowered == sorted(compile_jobs.jobs()[job].exprs)


def test_jobs_cover_every_instantiation():
    """Every instantiation `ops.kernel_names` lists (top-k 1-16, bf16 and FP8; fp16 and fp32
    combine at `compile_jobs.WIDE_ROW_TOPKS`) is in a fast job, every combine row dtype is in the
    -O3 sweep, and every kernel `ops.KERNEL_ARGS` names is compiled in both sweeps (the NVSHMEM
    kernels are linked by tests/kernels/test_nvshmem_link.py instead)."""
    fast = {(j.source, e) for j in compile_jobs.jobs().values() if j.fast for e in j.exprs}
    slow = {(j.source, e) for j in compile_jobs.jobs().values() if not j.fast for e in j.exprs}
    for k in range(1, 17):
        for fp8 in (False, True):
            for source, exprs in ops.kernel_names(k, fp8=fp8).items():
                missing = {(source, e) for e in exprs} - fast
                assert not missing, f"top-k {k}, fp8={fp8}: {sorted(missing)}"
    for k in compile_jobs.WIDE_ROW_TOPKS:
        exprs = ops.kernel_names(k, row_dtypes=compile_jobs.WIDE_ROW_DTYPES)["combine.cu"]
        assert {("combine.cu", e) for e in exprs} <= fast, f"top-k {k}, fp16/fp32 combine"
    slow_codes = {e.rstrip(">").rsplit(", ", 1)[1] for s, e in slow if s == "combine.cu"}
    assert slow_codes == {str(c) for c in ops.ROW_DTYPE_CODES.values()}, slow_codes
    for sweep in (fast, slow):
        kernels = {(source, expr.partition("<")[0]) for source, expr in sweep}
        plain = {k for k in ops.KERNEL_ARGS if k[0] not in ops.NVSHMEM_SOURCES}
        assert plain <= kernels, sorted(plain - kernels)


def test_one_program_holds_several_instantiations():
    exprs = compile_jobs.CEILING_KERNELS
    cubin, lowered = jit.compile_cubin("bench/ceiling.cu", exprs, arch="sm_90",
                                       extra_options=compile_jobs.fast_options())
    assert cubin[:4] == b"\x7fELF" and set(lowered) == set(exprs)
    assert all(name.encode() in cubin for name in lowered.values())


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
