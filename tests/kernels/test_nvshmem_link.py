"""CPU tier: NVSHMEM kernels compile and link (NVRTC -rdc + nvJitLink with the wheel's
libnvshmem_device.a) without a GPU, the linked cubin is cached, and missing wheels or a broken
kernel give errors that say what to do."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
from pathlib import Path

import pytest

from megatron_deepep import ops
from megatron_deepep.kernels import nvshmem_link
from megatron_deepep.kernels.jit import compile_program
from tests.helpers import WarningCapture, compile_jobs

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
    for name in (nvshmem_link.THUNK_FILE, "internode/nvshmem_version.cuh"):
        shutil.copy(nvshmem_link.cuda_src_dir() / name, root / name)
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


def _version_header(folder: Path, version: str) -> Path:
    """A stand-in NVSHMEM include folder whose only file is the version header of `version`."""
    major, minor, patch = version.split(".")
    (folder / "non_abi").mkdir(parents=True)
    (folder / nvshmem_link.VERSION_HEADER).write_text(
        f"#pragma once\n#define NVSHMEM_VENDOR_MAJOR_VERSION {major}\n"
        f"#define NVSHMEM_VENDOR_MINOR_VERSION {minor}\n"
        f"#define NVSHMEM_VENDOR_PATCH_VERSION {patch}\n")
    return folder


# The block scope's symbol ({}: the signal's type, m unsigned long or y unsigned long long).
_PUT_SIGNAL_3_4 = ("_Z28nvshmemi_transfer_put_signalIL13threadgroup_t3EEvPvS1_mS1_{}"
                   "14nvshmemi_amo_tib")
_PUT_SIGNAL_3_5 = _PUT_SIGNAL_3_4 + "i"  # + nvshmemx_qp_handle_t qp_index (an int)
_PUT_SIGNAL_3_8 = _PUT_SIGNAL_3_5.replace("28nvshmemi_transfer_put_signal",
                                          "37nvshmemi_transfer_put_signal_dispatch")


@needs_wheel
@pytest.mark.parametrize("version, symbol", [
    ("3.4.5", _PUT_SIGNAL_3_4), ("3.5.21", _PUT_SIGNAL_3_5), ("3.7.2", _PUT_SIGNAL_3_5),
    ("3.8.0", _PUT_SIGNAL_3_8), ("3.9.1", _PUT_SIGNAL_3_8)])
def test_thunk_takes_the_form_of_the_headers_release(tmp_path, version, symbol):
    """The thunk forwards the put with signal of the release NVSHMEM's version header names:
    the NVRTC spelling (`y`, unsigned long long) to the library's (`m`, unsigned long), for the
    block scope and the others; a release newer than any known takes the newest form."""
    include = _version_header(tmp_path, version)
    opts = nvshmem_link._base_options("sm_90") + [f"-I{nvshmem_link.cuda_src_dir()}",
                                                  f"-I{include}"]
    thunk = (nvshmem_link.cuda_src_dir() / nvshmem_link.THUNK_FILE).read_bytes()
    cubin, _ = compile_program(thunk, "thunk", (), opts)
    names = set(re.findall(rb"_Z\d+nvshmemi_transfer_put_signal\w*", cubin))
    expected = {symbol.format(t).replace("t3", f"t{s}").encode()
                for t in "my" for s in (0, 1, 3)}
    assert names == expected


@needs_wheel
def test_thunk_refuses_a_release_older_than_3_4(tmp_path):
    include = _version_header(tmp_path, "3.3.0")
    opts = nvshmem_link._base_options("sm_90") + [f"-I{nvshmem_link.cuda_src_dir()}",
                                                  f"-I{include}"]
    thunk = (nvshmem_link.cuda_src_dir() / nvshmem_link.THUNK_FILE).read_bytes()
    with pytest.raises(nvshmem_link.CompileError, match="older than 3.4"):
        compile_program(thunk, "thunk", (), opts)


@needs_wheel
def test_header_version_is_the_installed_release():
    """The version the link reads from NVSHMEM's headers is the release pip installed (the
    distribution found first, as the headers are)."""
    try:
        installed = importlib.metadata.version("nvidia-nvshmem-cu13")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the NVSHMEM headers do not come from a nvidia-nvshmem-cu13 distribution")
    assert nvshmem_link.version_text(nvshmem_link.nvshmem_version()) == installed


@pytest.fixture
def link_warnings():
    """WARNING messages of nvshmem_link, with check_version's once-per-version memory reset."""
    capture = WarningCapture()
    nvshmem_link.logger.addHandler(capture)
    nvshmem_link.check_version.cache_clear()
    yield capture.messages
    nvshmem_link.logger.removeHandler(capture)
    nvshmem_link.check_version.cache_clear()


def test_tested_releases_pass_quietly(link_warnings):
    for version in nvshmem_link.TESTED_NVSHMEM:
        nvshmem_link.check_version(nvshmem_link._parse_version(version), "device library")
    assert link_warnings == []


@pytest.mark.parametrize("version, words", [
    ((3, 9, 0), ["3.9.0", "newer than the newest tested release, 3.8.0"]),
    ((4, 0, 0), ["4.0.0", "newer than the newest tested release, 3.8.0"]),
    ((3, 7, 3), ["3.7.3", "not a tested release", "3.4.5", "3.8.0"])])
def test_an_untested_release_warns_naming_both(link_warnings, version, words):
    nvshmem_link.check_version(version, "device library at X")
    nvshmem_link.check_version(version, "device library at X")  # once per release and library
    assert len(link_warnings) == 1
    assert all(word in link_warnings[0] for word in words + ["device library at X"])


def test_an_older_release_is_refused_naming_both(link_warnings):
    with pytest.raises(nvshmem_link.NvshmemUnavailable) as info:
        nvshmem_link.check_version((3, 3, 1), "host library at Y")
    assert "3.3.1" in str(info.value) and "oldest tested release, 3.4.5" in str(info.value)
    assert "host library at Y" in str(info.value)


@needs_wheel
def test_a_failed_link_of_an_untested_release_names_it(monkeypatch, tmp_path, link_warnings):
    monkeypatch.setattr(nvshmem_link, "check_device_library", lambda paths: (3, 9, 1))
    monkeypatch.setenv("MDEEP_CACHE_DIR", str(tmp_path))

    def undefined(*args):
        raise nvshmem_link.LinkError("nvJitLink failed: undefined reference to a symbol")

    monkeypatch.setattr(nvshmem_link, "_nvjitlink", undefined)
    with pytest.raises(nvshmem_link.LinkError) as info:
        nvshmem_link.link_cubin("bench/internode_leg.cu", LEG_KERNELS, "sm_90")
    assert "undefined reference" in str(info.value)
    assert "NVSHMEM 3.9.1 is not a tested release" in str(info.value)
    assert "3.8.0" in str(info.value)


def test_jit_extra_admits_exactly_the_tested_range():
    from packaging.requirements import Requirement
    setup = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    spec, = re.findall(r'"(nvidia-nvshmem-cu13[^"]*)"', setup)
    specifier = Requirement(spec).specifier
    assert all(specifier.contains(v) for v in nvshmem_link.TESTED_NVSHMEM)
    newest = nvshmem_link._parse_version(nvshmem_link.TESTED_NVSHMEM[-1])
    oldest = nvshmem_link._parse_version(nvshmem_link.TESTED_NVSHMEM[0])
    assert not specifier.contains(f"{newest[0]}.{newest[1] + 1}.0")  # a new minor: untested
    assert not specifier.contains(f"{oldest[0]}.{oldest[1]}.{oldest[2] - 1}")


@pytest.fixture
def host_check(monkeypatch, tmp_path, link_warnings):
    """check_host_library with a stand-in device library of release `device` and a loaded host
    library of release `host`: call it as host_check(device, host)."""
    def check(device, host):
        include = _version_header(tmp_path / device, device)
        paths = nvshmem_link.NvshmemPaths(include, tmp_path / "libnvshmem_device.a", tmp_path,
                                          tmp_path)
        monkeypatch.setattr(nvshmem_link, "nvshmem_paths", lambda: paths)
        host_path = None if host is None else tmp_path / "libnvshmem_host.so.3"
        monkeypatch.setattr(nvshmem_link, "_loaded_host_library", lambda: host_path)
        monkeypatch.setattr(nvshmem_link, "host_library_version",
                            lambda path: nvshmem_link._parse_version(host))
        nvshmem_link.check_host_library.cache_clear()
        try:
            return nvshmem_link.check_host_library()
        finally:
            nvshmem_link.check_host_library.cache_clear()
    return check


def test_a_host_library_older_than_the_device_library_is_refused(host_check):
    with pytest.raises(nvshmem_link.NvshmemUnavailable) as info:
        host_check("3.8.0", "3.4.5")
    message = str(info.value)
    assert "host library is 3.4.5" in message and "device library 3.8.0" in message
    assert "LD_PRELOAD" in message


def test_a_newer_host_library_of_the_same_major_is_accepted(host_check, link_warnings):
    assert host_check("3.4.5", "3.8.0") == (3, 8, 0)  # NVSHMEM's rule: host minor >= device's
    assert host_check("3.7.2", "3.7.2") == (3, 7, 2)
    assert link_warnings == []


def test_an_untested_host_library_warns(host_check, link_warnings):
    assert host_check("3.8.0", "3.9.0") == (3, 9, 0)
    assert len(link_warnings) == 1 and "3.9.0 (host library" in link_warnings[0]


def test_no_host_library_in_the_process_warns(host_check, link_warnings):
    assert host_check("3.8.0", None) is None
    assert len(link_warnings) == 1 and "no libnvshmem_host.so" in link_warnings[0]


def test_loaded_host_library_release_is_read_from_the_library():
    """Where this torch loaded NVSHMEM's host library (CUDA builds do at import), its release
    is read through nvshmemx_vendor_get_version_info and is a tested one."""
    import torch  # noqa: F401  (loads libnvshmem_host.so.3 in CUDA builds)
    path = nvshmem_link._loaded_host_library()
    if path is None:
        pytest.skip("this torch loads no NVSHMEM host library (a CPU build)")
    version = nvshmem_link.host_library_version(path)
    assert nvshmem_link.version_text(version) in nvshmem_link.TESTED_NVSHMEM
