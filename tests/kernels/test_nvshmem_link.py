"""CPU tier: NVSHMEM kernels compile and link (NVRTC -rdc + nvJitLink with the wheel's
libnvshmem_device.a) without a GPU, the linked cubin is cached, and missing wheels or a broken
kernel give errors that say what to do."""

from __future__ import annotations

import shutil

import pytest

from megatron_deepep import ops
from megatron_deepep.kernels import nvshmem_link
from tests.helpers import compile_jobs

LEG_KERNELS = ["internode_leg_send", "internode_leg_wait"]


def _wheel_missing_reason():
    try:
        nvshmem_link.nvshmem_paths()
        nvshmem_link._bindings()
    except nvshmem_link.NvshmemUnavailable as exc:
        return str(exc)
    return None


_MISSING = _wheel_missing_reason()
needs_wheel = pytest.mark.skipif(_MISSING is not None,
                                 reason=f"NVSHMEM link wheels not installed: {_MISSING}")


@pytest.fixture(scope="module")
def leg_link(tmp_path_factory):
    """One link of internode_leg.cu for sm_90 into a fresh cache, shared by the tests."""
    cache = tmp_path_factory.mktemp("nvshmem_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MDEEP_CACHE_DIR", str(cache))
        mp.delenv("MDEEP_JIT_NO_CACHE", raising=False)
        cubin, lowered = nvshmem_link.link_cubin("bench/internode_leg.cu", LEG_KERNELS, "sm_90")
    return cache, cubin, lowered


@needs_wheel
def test_leg_links_against_device_library(leg_link):
    _, cubin, lowered = leg_link
    assert cubin[:4] == b"\x7fELF"
    assert set(lowered) == set(LEG_KERNELS)
    for name in lowered.values():
        assert name.encode() in cubin, name
    # The device state nvshmemx_cumodule_init fills: present only once the library is linked in.
    assert b"nvshmemi_device_state_d" in cubin


@needs_wheel
def test_linked_cubin_is_cached(leg_link, monkeypatch):
    cache, cubin, lowered = leg_link
    assert len(list((cache / "nvshmem").glob("*.kernel"))) == 1
    monkeypatch.setenv("MDEEP_CACHE_DIR", str(cache))

    def no_compile(*args, **kwargs):
        raise AssertionError("a cached link must not recompile")

    monkeypatch.setattr(nvshmem_link, "_nvrtc_compile", no_compile)
    linked = nvshmem_link.link_cubin("bench/internode_leg.cu", LEG_KERNELS, "sm_90")
    assert linked == (cubin, lowered)


def test_missing_wheel_names_pip_packages(monkeypatch, tmp_path):
    monkeypatch.setattr(nvshmem_link, "_nvidia_roots", lambda: [tmp_path])
    monkeypatch.setattr(nvshmem_link, "_CUDA_HOME_INCLUDE", tmp_path / "no_cuda")
    nvshmem_link.nvshmem_paths.cache_clear()
    try:
        with pytest.raises(nvshmem_link.NvshmemUnavailable) as info:
            nvshmem_link.link_cubin("bench/internode_leg.cu", LEG_KERNELS, "sm_90")
    finally:
        nvshmem_link.nvshmem_paths.cache_clear()
    message = str(info.value)
    assert "pip install nvidia-nvshmem-cu13 nvidia-cuda-runtime nvidia-cuda-cccl " \
           "nvidia-nvjitlink" in message
    assert "transport='reference'" in message
    assert "nvshmem.h" in message


@needs_wheel
def test_compile_error_carries_source_kernels_options_and_log(monkeypatch, tmp_path):
    root = tmp_path / "cuda_src"
    (root / "internode").mkdir(parents=True)
    shutil.copy(nvshmem_link.cuda_src_dir() / nvshmem_link.THUNK_FILE,
                root / nvshmem_link.THUNK_FILE)
    (root / "broken.cu").write_text("__global__ void broken_kernel() { not_declared(); }\n")
    monkeypatch.setattr(nvshmem_link, "cuda_src_dir", lambda: root)
    monkeypatch.setenv("MDEEP_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(nvshmem_link.LinkError) as info:
        nvshmem_link.link_cubin("broken.cu", ["broken_kernel"], "sm_90")
    message = str(info.value)
    assert "broken.cu" in message and "broken_kernel" in message
    assert "-rdc=true" in message and "--gpu-architecture=sm_90" in message
    assert "not_declared" in message  # the NVRTC log


@needs_wheel
def test_foreign_include_is_refused(monkeypatch, tmp_path):
    root = tmp_path / "cuda_src"
    root.mkdir()
    (root / "foreign.cu").write_text('#include "somewhere/else.h"\n')
    monkeypatch.setattr(nvshmem_link, "cuda_src_dir", lambda: root)
    with pytest.raises(nvshmem_link.CompileError, match="somewhere/else.h"):
        nvshmem_link.link_cubin("foreign.cu", [], "sm_90")


def test_every_nvshmem_kernel_is_linked_here():
    """The kernels of ops.NVSHMEM_SOURCES are the ones this file links (the plain compile
    sweep of tests/kernels/test_kernels_compile.py leaves them out)."""
    nvshmem_kernels = {k for k in ops.KERNEL_ARGS if k[0] in ops.NVSHMEM_SOURCES}
    assert nvshmem_kernels == ({("bench/internode_leg.cu", name) for name in LEG_KERNELS}
                               | {(ops.INTERNODE_SOURCES[job.rsplit("-", 1)[1]], name)
                                  for job in compile_jobs.link_jobs()
                                  for name in compile_jobs.link_kernels(job)})
    # One source per staging, each holding its staging's kernels and no other's.
    assert sorted(ops.NVSHMEM_SOURCES) == sorted(["bench/internode_leg.cu", "internode/full.cu",
                                                  "internode/ring.cu", "internode/net_ring.cu"])


@needs_wheel
@pytest.mark.nvrtc_job
@pytest.mark.parametrize("job", sorted(compile_jobs.link_jobs()))
def test_internode_kernels_link(job):
    """Every instantiation kind the internode transport launches (dispatch for bf16 rows and two
    FP8 wire formats, both index types; combine for the three row dtypes), with full and with
    ring staging and with the network ring, compiles and links against the wheel's device
    library for sm_90 without a GPU, into a fresh cache: one compile, one link per staging (run
    in the background by `compile_jobs`, collected here)."""
    expressions = compile_jobs.link_jobs()[job].exprs
    magic, size, lowered = compile_jobs.result(job)
    assert compile_jobs.link_jobs()[job].source == ops.INTERNODE_SOURCES[job.rsplit("-", 1)[1]]
    assert lowered == sorted(expressions)
    assert magic == b"\x7fELF" and size > 0
    assert {expr.split("<")[0] for expr in expressions} == set(compile_jobs.link_kernels(job))
