"""CPU tier: `python -m megatron_deepep.tools.precompile` builds the kernels a model shape needs
into
the cache, under the very keys a job's first dispatch looks up (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_deepep import ops
from megatron_deepep.kernels import jit
from megatron_deepep.tools import precompile

from tests.helpers import REPO_ROOT as ROOT

CHEAP = [("notify.cu", "notify_kernel"), ("bench/ceiling.cu", "fill_kernel"),
         ("bench/ceiling.cu", "fan_out_copy")]


def _listed(capsys, *argv):
    assert precompile.main(["--list", *argv]) == 0
    return [tuple(line.split(" ", 1)) for line in capsys.readouterr().out.splitlines()]


def test_help_documents_every_argument():
    done = subprocess.run([sys.executable, "-m", "megatron_deepep.tools.precompile", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for action in precompile._parser()._actions:
        assert action.help, action.dest
        assert action.option_strings[0] in done.stdout
    assert "no GPU" in done.stdout and "MDEEP_CACHE_DIR" in done.stdout


def test_list_is_every_kernel_the_shape_needs(capsys):
    listed = _listed(capsys, "--topk", "8")
    expected = [(s, e) for s, exprs in ops.kernel_names(8).items() for e in exprs]
    assert sorted(listed) == sorted(expected)
    # What a first dispatch compiles (ops.kernel_names) is what precompile builds.
    assert {s for s, _ in listed} == {"layout.cu", "notify.cu", "dispatch.cu", "combine.cu"}


def test_list_narrows_by_index_dtype_fp8_format_and_output(capsys):
    int64_only = _listed(capsys, "--topk", "4", "--index-dtype", "int64")
    assert int64_only and all(", int," not in e and "<int," not in e for _, e in int64_only)
    fp8 = _listed(capsys, "--topk", "4", "--fp8", "mxfp8_1x32", "--fp8-output", "bf16",
                  "--no-bf16")
    dispatch = [e for s, e in fp8 if s == "dispatch.cu"]
    # kFmt 3 (MXFP8) only, dequantized on receive; 2 index types x 2 cached x 4 kernels.
    assert len(dispatch) == 16 and all(", 3" in e for e in dispatch)
    assert all(e.endswith("true>") for e in dispatch if not e.startswith("dispatch_send"))
    wide = _listed(capsys, "--topk", "4", "--row-dtype", "fp16", "fp32")
    combine = [e for s, e in wide if s == "combine.cu"]
    # 2 weighted x 2 with-weights x 4 kernels, each for kDtype 1 (fp16) and 2 (fp32).
    assert sorted(combine) == sorted(ops.kernel_names(4, row_dtypes=("fp16", "fp32"))
                                     ["combine.cu"]) and len(combine) == 32
    blockwise = _listed(capsys, "--topk", "4", "--fp8", "blockwise", "blockwise_1x128_fp32_scales",
                        "--no-bf16")
    # The FP8 experts' columnwise copy, once per power-of-two setting; not for bf16 output.
    assert sorted(e for s, e in blockwise if s == "fp8_columnwise.cu") == [
        "columnwise_from_rowwise<false>", "columnwise_from_rowwise<true>"]
    assert not [s for s, _ in _listed(capsys, "--topk", "4", "--fp8", "blockwise",
                                      "--fp8-output", "bf16") if s == "fp8_columnwise.cu"]
    several = _listed(capsys, "--topk", "2", "8", "--bench")
    assert ("bench/ceiling.cu", "fill_kernel") in several
    assert ("bench/quantize.cu", "quantize_mxfp8<8>") in several
    # The benchmark- and test-only kernels (cuda_src/bench/) only with --bench.
    assert not [s for s, _ in _listed(capsys, "--topk", "2", "8", "--fp8", "blockwise",
                                      "mxfp8") if s.startswith("bench/")]
    assert {e for _, e in several} >= set(ops.kernel_names(2)["combine.cu"])


@pytest.mark.parametrize("argv, message", [
    (["--topk", "17"], "topk: 17 is out of range (1-16)"),
    (["--topk", "8", "--fp8", "fp9"], "FP8 format 'fp9' is unknown"),
])
def test_bad_arguments_name_the_argument(argv, message, capsys):
    assert precompile.main(argv) == 2
    assert message in capsys.readouterr().err


def test_expressions_render_as_the_runtime_renders_them():
    """The cache key is the name expression: precompile's must equal `jit.get_kernel`'s."""
    for source, expr in precompile.kernels_for(list(range(1, 17)), ["mxfp8_1x32"],
                                               bench=True):
        name, _, _ = expr.partition("<")
        args = ", ".join(jit.render_template_arg(a) for a in precompile._template_args(expr))
        assert (f"{name}<{args}>" if args else name) == expr


def test_builds_into_the_cache_a_job_then_loads(tmp_path, monkeypatch, capsys):
    pytest.importorskip("cuda.bindings.nvrtc", reason="precompile needs NVRTC: pip install "
                        "-e '.[jit]'")
    monkeypatch.setattr(precompile, "kernels_for", lambda *args, **kwargs: list(CHEAP))
    monkeypatch.delenv("MDEEP_JIT_NO_CACHE", raising=False)
    cache = tmp_path / "shared"
    argv = ["--topk", "8", "--cache-dir", str(cache), "--arch", "sm_90", "-j", "2"]
    assert precompile.main(argv) == 0
    out = capsys.readouterr().out
    assert "3 kernels for sm_90 in" in out and "3 compiled, 0 already cached, 0 failed" in out
    assert str(cache) in out and "fill_kernel" in out
    assert len(list(cache.glob("*.kernel"))) == 3
    assert not [p for p in cache.iterdir() if p.name.startswith(jit.TEMP_PREFIX)]
    assert precompile.main(argv + ["--quiet"]) == 0
    out = capsys.readouterr().out
    assert "0 compiled, 3 already cached" in out and "fill_kernel" not in out
    # A job pointed at the cache loads, it does not compile.
    monkeypatch.setenv("MDEEP_CACHE_DIR", str(cache))
    for source, expr in CHEAP:
        assert jit.build(source, expr, "sm_90").from_cache, expr


def test_a_failed_kernel_fails_the_command(tmp_path, monkeypatch, capsys):
    pytest.importorskip("cuda.bindings.nvrtc", reason="precompile needs NVRTC: pip install "
                        "-e '.[jit]'")
    monkeypatch.setattr(precompile, "kernels_for",
                        lambda *args, **kwargs: [("notify.cu", "no_such_kernel<1>")])
    argv = ["--topk", "8", "--cache-dir", str(tmp_path), "-j", "1"]
    assert precompile.main(argv) == 1
    captured = capsys.readouterr()
    assert "FAILED notify.cu no_such_kernel<1>" in captured.err
    assert "1 failed" in captured.out


def test_internode_modules_are_the_ones_the_transport_links(capsys, monkeypatch):
    """--internode lists one module per (top-k, index type, wire format) for dispatch and per
    (top-k, row dtype) for combine, with exactly the name expressions (in the order) the
    transport links them at run time, so the cache keys agree; with the staging on `auto` (the
    default) those of every staging it may pick."""
    from megatron_deepep.fp8.dispatch import Fp8Dispatch
    argv = ("--topk", "2", "8", "--internode", "--fp8", "blockwise", "--fp8-output", "bf16",
            "--index-dtype", "int64", "--row-dtype", "bf16", "fp32")
    monkeypatch.delenv("MDEEP_INTERNODE_NET_RING_CHUNKS", raising=False)
    monkeypatch.delenv("MDEEP_INTERNODE_STAGING", raising=False)
    sources = set(ops.INTERNODE_SOURCES.values())
    every_staging = [s for s, _ in _listed(capsys, *argv) if s in sources]
    monkeypatch.setenv("MDEEP_INTERNODE_STAGING", "full")
    listed = _listed(capsys, *argv)
    # One source per staging: auto lists each of the three sources' modules.
    assert sorted(set(every_staging)) == sorted(sources)
    assert len(every_staging) == 3 * len([s for s, _ in listed if s in sources])
    assert {s for s, _ in listed if s in sources} == {"internode/full.cu"}
    modules = [tuple(expr.split(" internode")) for source, expr in listed
               if source == "internode/full.cu"]
    modules = [tuple(m[0:1] + tuple("internode" + part for part in m[1:])) for m in modules]
    expected = []
    for k in (2, 8):
        expected += [ops.internode_expressions(k, "long long", None),
                     ops.internode_expressions(k, "long long",
                                               Fp8Dispatch.named("blockwise", "bf16")),
                     ops.internode_combine_expressions(k, 0),
                     ops.internode_combine_expressions(k, 2)]
    assert sorted(modules) == sorted(expected)
    assert not [s for s, _ in _listed(capsys, "--topk", "8") if s in sources]


class _FakeNvrtcNoLibrary:
    """cuda.bindings' nvrtc as installed without the nvidia-cuda-nvrtc wheel: the module
    imports, its first call fails to load the library (cuda.pathfinder's error)."""

    class DynamicLibNotFoundError(RuntimeError):
        pass

    @classmethod
    def nvrtcVersion(cls):
        raise cls.DynamicLibNotFoundError(
            'Failure finding "libnvrtc.so.13 or libnvrtc.so.12": No such file: '
            'libnvrtc.so.13 or libnvrtc.so.12\nsearched: site-packages/nvidia/cu13/lib')


def _hide_cuda_bindings(monkeypatch):
    """Makes `from cuda.bindings import nvrtc` raise ImportError, as without cuda-bindings."""
    for name in ("cuda", "cuda.bindings", "cuda.bindings.nvrtc"):
        monkeypatch.setitem(sys.modules, name, None)


def _fake_nvrtc_without_library(monkeypatch):
    import types

    bindings = types.ModuleType("cuda.bindings")
    bindings.nvrtc = _FakeNvrtcNoLibrary
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", _FakeNvrtcNoLibrary)


@pytest.mark.parametrize("missing", ["module", "library"])
def test_missing_nvrtc_is_one_line_naming_the_install_that_works(missing, monkeypatch, capsys):
    """Without cuda-bindings, and with cuda-bindings but no libnvrtc (what `pip install
    cuda-bindings` alone gives): one line naming the jit extra and the exact packages, exit 2,
    no traceback; the library call at run time raises the same line."""
    if missing == "module":
        _hide_cuda_bindings(monkeypatch)
    else:
        _fake_nvrtc_without_library(monkeypatch)
    monkeypatch.setattr(jit, "_NVRTC_OK", False)
    problem = jit.nvrtc_problem()
    assert problem is not None and "\n" not in problem
    assert 'pip install "megatron_deepep[jit]"' in problem
    assert "pip install cuda-bindings nvidia-cuda-nvrtc" in problem
    if missing == "module":
        assert "Python binding is not installed" in problem
    else:
        assert "NVRTC library is not" in problem and 'libnvrtc.so.13 or libnvrtc.so.12"' in problem
        assert "searched" not in problem  # the search log stays out of the one line
    assert precompile.main(["--topk", "8", "--cache-dir", "unused"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"precompile: {problem}" and "Traceback" not in err
    with pytest.raises(jit.NvrtcUnavailable, match=r"pip install \"megatron_deepep\[jit\]\""):
        jit.compile_code("__global__ void k() {}", "k.cu")


def test_every_nvrtc_install_hint_names_packages_the_jit_extra_installs():
    """The hint's packages are the ones setup.py's jit extra lists (so it installs NVRTC)."""
    import re

    setup = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    extra = re.search(r"JIT_PACKAGES = \[(.*?)\]", setup, re.S).group(1)
    packages = {re.split(r"[<>=]", p.strip().strip('"'))[0] for p in extra.split(",")
                if p.strip()}
    named = jit.INSTALL_HINT.split("pip install cuda-bindings ")[1].split()
    assert {"cuda-bindings", *named} <= packages
