"""Cubins for `cuda_src/` kernels that call NVSHMEM's device API: NVRTC, then nvJitLink.

Layer 1, beside `jit` (knows no kernel). A kernel that uses the device API (put with signal,
signal wait, quiet; `cuda_src/internode/net.cuh`) cannot be a plain NVRTC cubin: it calls into
NVSHMEM's device library. So `link_cubin` compiles the kernel source with `-rdc=true`, compiles
our ABI thunk (`cuda_src/internode/nvshmem_abi_thunk.cu`: the library mangles uint64_t as
`unsigned long`, NVRTC as `unsigned long long`), and links both with the `nvidia-nvshmem-cu13`
wheel's `lib/libnvshmem_device.a` through nvJitLink into one cubin. None of it needs a GPU, so CI
links every internode kernel for sm_90. `get_kernel` loads the cubin, fills its NVSHMEM state
(`nvshmemx_cumodule_init`, through torch) and hands back a `jit.Kernel`.

Releases: the thunk names NVSHMEM's internal put with signal in the form of the release its
headers say (`cuda_src/internode/nvshmem_version.cuh`). A device library or host library of a
release not in `TESTED_NVSHMEM` is logged as a warning naming it and the tested ones; one older
than the oldest tested is an error, and so is a host library older than the device library the
kernels were linked against (NVSHMEM's own rule: same major release, host minor >= device's).

Headers come from pip wheels (no NVSHMEM or CUDA toolkit install): NVSHMEM's from
`nvidia-nvshmem-cu13`, the CUDA runtime's from `nvidia-cuda-runtime` (else /usr/local/cuda), and
CCCL's `cuda/std` from `nvidia-cuda-cccl` (else the toolkit's). NVSHMEM 3.4.5's headers use
`std::is_integral / is_signed / is_unsigned`, which NVRTC lacks: a pre-included shim maps them to
`cuda::std` (written into the cache directory, since the package may be read-only; used only
when `cache_trust` trusts its owner and mode and its bytes are exactly ours, else rewritten).

The linked cubin is cached on disk (knob CACHE_DIR, default `~/.cache/megatron_deepep`), keyed
by the source and every `cuda_src/` header it includes, the thunk, the options, the arch, the
NVRTC and nvJitLink versions and the device library's content hash. Knobs (`knobs.py`, prefix
MDEEP_): CACHE_DIR, CACHE_TRUST, JIT_DEBUG, JIT_LINEINFO, JIT_NO_CACHE.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_deepep import knobs
from megatron_deepep.kernels import cache_trust
from megatron_deepep.kernels.cuda_calls import cu_check, ensure_context
from megatron_deepep.kernels.jit import (CompileError, Kernel, compile_program, cuda_src_dir,
                                         device_arch, pack_entry, read_entry,
                                         render_template_arg)

logger = logging.getLogger(__name__)

PIP_PACKAGES = "nvidia-nvshmem-cu13 nvidia-cuda-runtime nvidia-cuda-cccl nvidia-nvjitlink"
THUNK_FILE = "internode/nvshmem_abi_thunk.cu"
_FALLBACK = "or use transport='reference', which works without NVSHMEM"
# The NVSHMEM releases the link tests passed against (tests/kernels/test_nvshmem_link.py, each
# release by dev/nvshmem_releases.sh), oldest first; setup.py's `jit` extra admits this range
# (a test checks). A new release is taken up as docs/internode.md says ("New NVSHMEM or torch
# releases").
TESTED_NVSHMEM = ("3.4.5", "3.5.21", "3.6.5", "3.7.2", "3.8.0")
VERSION_HEADER = "non_abi/nvshmem_version.h"
_VERSION_RE = re.compile(r"^\s*#\s*define\s+NVSHMEM_VENDOR_(MAJOR|MINOR|PATCH)_VERSION\s+(\d+)",
                         re.MULTILINE)
_CUDA_HOME_INCLUDE = Path("/usr/local/cuda/include")
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)
# NVSHMEM 3.4.5's headers name these std traits; NVRTC has no <type_traits> of its own.
_SHIM = ("// megatron_deepep/kernels/nvshmem_link.py: std traits NVSHMEM's headers use, from "
         "CCCL.\n"
         "#pragma once\n"
         "#include <cuda/std/type_traits>\n"
         "namespace std {\n"
         "using cuda::std::is_integral;\n"
         "using cuda::std::is_signed;\n"
         "using cuda::std::is_unsigned;\n"
         "}  // namespace std\n")


class NvshmemUnavailable(RuntimeError):
    """NVSHMEM's device library or a header set it needs is not installed; the message says
    what to pip install and how to fall back."""


class LinkError(CompileError):
    """NVRTC or nvJitLink rejected an NVSHMEM kernel; the message carries the source, kernel
    names, options and the compiler's or linker's log."""


def _unavailable(what: str, looked_in: Sequence[object]) -> NvshmemUnavailable:
    places = ", ".join(str(p) for p in looked_in) or "nowhere (no `nvidia` package on sys.path)"
    return NvshmemUnavailable(
        f"megatron_deepep: the internode transport needs {what}, which was not found (looked "
        f"in: {places}). Install the CUDA 13 wheels with `pip install {PIP_PACKAGES}` (or "
        "`pip install \"megatron_deepep[jit]\"`), or use transport='reference', which works "
        "without NVSHMEM.")


@dataclasses.dataclass(frozen=True)
class NvshmemPaths:
    """Where the pieces of an NVSHMEM link come from.

    Attributes:
        nvshmem_include: holds nvshmem.h and nvshmemx.h.
        device_library: libnvshmem_device.a.
        cuda_include: holds cuda_runtime.h.
        cccl_include: holds cuda/std/type_traits.
    """

    nvshmem_include: Path
    device_library: Path
    cuda_include: Path
    cccl_include: Path


def _nvidia_roots() -> List[Path]:
    """Every directory of the `nvidia` namespace package (pip's NVIDIA wheels install there)."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def _first(candidates: Sequence[Path], relative: str) -> Optional[Path]:
    for base in candidates:
        if (base / relative).is_file():
            return base
    return None


@functools.lru_cache(maxsize=None)
def nvshmem_paths() -> NvshmemPaths:
    """The NVSHMEM headers and device library, CUDA runtime headers and CCCL, as found.

    Raises:
        NvshmemUnavailable: one is missing; the message names it, where it looked, and the
            pip packages to install.
    """
    roots = _nvidia_roots()
    nvshmem_dirs = [root / "nvshmem" for root in roots]
    nvshmem = _first([d / "include" for d in nvshmem_dirs], "nvshmem.h")
    if nvshmem is None or not (nvshmem / "nvshmemx.h").is_file():
        raise _unavailable("NVSHMEM's headers (wheel nvidia-nvshmem-cu13: "
                           "nvidia/nvshmem/include/nvshmem.h)", nvshmem_dirs)
    library = nvshmem.parent / "lib" / "libnvshmem_device.a"
    if not library.is_file():
        raise _unavailable("NVSHMEM's device library (wheel nvidia-nvshmem-cu13: "
                           "nvidia/nvshmem/lib/libnvshmem_device.a)", [library.parent])
    cuda_candidates = [root / "cu13" / "include" for root in roots] + [_CUDA_HOME_INCLUDE]
    cuda = _first(cuda_candidates, "cuda_runtime.h")
    if cuda is None:
        raise _unavailable("the CUDA runtime headers (wheel nvidia-cuda-runtime: "
                           "nvidia/cu13/include/cuda_runtime.h)", cuda_candidates)
    cccl_candidates = ([root / "cu13" / "include" / "cccl" for root in roots]
                       + [root / "cu13" / "include" for root in roots]
                       + [_CUDA_HOME_INCLUDE / "cccl", _CUDA_HOME_INCLUDE])
    cccl = _first(cccl_candidates, "cuda/std/type_traits")
    if cccl is None:
        raise _unavailable("CCCL's headers (wheel nvidia-cuda-cccl: cuda/std/type_traits)",
                           cccl_candidates)
    return NvshmemPaths(nvshmem, library, cuda, cccl)


Version = Tuple[int, int, int]


def version_text(version: Version) -> str:
    """"3.8.0" for (3, 8, 0)."""
    return ".".join(str(part) for part in version)


def _parse_version(text: str) -> Version:
    major, minor, patch = (int(part) for part in text.split("."))
    return major, minor, patch


def _tested() -> List[Version]:
    """TESTED_NVSHMEM as (major, minor, patch), oldest first."""
    return [_parse_version(v) for v in TESTED_NVSHMEM]


def header_version(nvshmem_include: Path) -> Version:
    """The NVSHMEM release of a header set, from its `non_abi/nvshmem_version.h`.

    Raises:
        NvshmemUnavailable: the header is missing or names no major, minor and patch release.
    """
    path = Path(nvshmem_include) / VERSION_HEADER
    try:
        found = dict(_VERSION_RE.findall(path.read_text()))
    except OSError:
        found = {}
    if set(found) != {"MAJOR", "MINOR", "PATCH"}:
        raise _unavailable(f"NVSHMEM's version header with NVSHMEM_VENDOR_MAJOR/MINOR/PATCH_"
                           f"VERSION (wheel nvidia-nvshmem-cu13: include/{VERSION_HEADER})",
                           [path])
    return int(found["MAJOR"]), int(found["MINOR"]), int(found["PATCH"])


def nvshmem_version() -> Version:
    """The release of the NVSHMEM headers and device library the kernels link against."""
    return header_version(nvshmem_paths().nvshmem_include)


@functools.lru_cache(maxsize=None)
def check_version(version: Version, what: str) -> None:
    """Accepts a tested NVSHMEM release, warns (once) about an untested one, refuses one older
    than the oldest tested.

    Args:
        version: (major, minor, patch).
        what: which library, with its path, for the messages (e.g. "device library at ...").

    Raises:
        NvshmemUnavailable: `version` is older than the oldest tested release.
    """
    tested = _tested()
    if version in tested:
        return
    found, oldest, newest = version_text(version), TESTED_NVSHMEM[0], TESTED_NVSHMEM[-1]
    if version < tested[0]:
        raise NvshmemUnavailable(
            f"megatron_deepep: NVSHMEM {found} ({what}) is older than the oldest tested "
            f"release, {oldest}; install `pip install \"nvidia-nvshmem-cu13>={oldest},"
            f"<={newest}\"` (torch pins its own), {_FALLBACK}.")
    where = ("newer than the newest tested release, " + newest if version > tested[-1]
             else "not a tested release (tested: " + ", ".join(TESTED_NVSHMEM) + ")")
    logger.warning("megatron_deepep: NVSHMEM %s (%s) is %s; the internode kernels use its "
                   "internal put with signal in %s's form and may fail to link or run "
                   "(docs/internode.md, \"New NVSHMEM or torch releases\").", found, what, where,
                   newest if version > tested[-1] else "the nearest tested release")


def check_device_library(paths: NvshmemPaths) -> Version:
    """`check_version` of the device library the kernels link against; returns its release."""
    version = header_version(paths.nvshmem_include)
    check_version(version, f"device library {paths.device_library}")
    return version


def _loaded_host_library() -> Optional[Path]:
    """The libnvshmem_host.so this process has loaded (torch loads it with NVSHMEM), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, dev, inode, path
        if len(fields) == 6 and Path(fields[5]).name.startswith("libnvshmem_host.so"):
            return Path(fields[5])
    return None


def host_library_version(path: Path) -> Version:
    """The release of an NVSHMEM host library (`nvshmemx_vendor_get_version_info`, callable
    before NVSHMEM starts)."""
    parts = [ctypes.c_int(0) for _ in range(3)]
    ctypes.CDLL(str(path)).nvshmemx_vendor_get_version_info(*(ctypes.byref(p) for p in parts))
    return parts[0].value, parts[1].value, parts[2].value


@functools.lru_cache(maxsize=None)
def check_host_library() -> Optional[Version]:
    """Checks the NVSHMEM host library of this process (which bootstraps NVSHMEM, holds the heap
    and runs `nvshmemx_cumodule_init`) against the device library the kernels link against,
    once per process: `check_version` of it, then NVSHMEM's rule for a device library in a
    host's process (same major release, host minor >= device minor).

    Returns:
        The host library's release, or None when none is loaded in this process (warned).

    Raises:
        NvshmemUnavailable: the host library is older than the oldest tested release, or too
            old for the device library; the message names both releases and both paths.
    """
    paths = nvshmem_paths()
    device = check_device_library(paths)
    path = _loaded_host_library()
    if path is None:
        logger.warning("megatron_deepep: no libnvshmem_host.so is loaded in this process, so "
                       "its release cannot be checked against the device library's, %s (%s).",
                       version_text(device), paths.device_library)
        return None
    host = host_library_version(path)
    check_version(host, f"host library {path}")
    if host[0] != device[0] or host[1] < device[1]:
        raise NvshmemUnavailable(
            f"megatron_deepep: this process's NVSHMEM host library is {version_text(host)} "
            f"({path}), but the internode kernels link against device library "
            f"{version_text(device)} ({paths.device_library}); NVSHMEM needs the same major "
            f"release and a host minor release >= the device library's. Install one "
            f"nvidia-nvshmem-cu13 for both (torch's pin), or have torch load the newer host "
            f"library (its wheel's folder first on sys.path before `import torch`, or "
            f"LD_PRELOAD; not LD_LIBRARY_PATH: torch finds it by RPATH), {_FALLBACK}.")
    if host != device:
        logger.info("megatron_deepep: NVSHMEM host library %s (%s), device library %s (%s)",
                    version_text(host), path, version_text(device), paths.device_library)
    return host


def _bindings():
    """cuda.bindings' nvrtc and nvjitlink (the latter loads libnvJitLink from its wheel)."""
    try:
        from cuda.bindings import nvjitlink, nvrtc
        nvjitlink.version()
    except Exception as exc:  # ImportError, or the shared library failed to load
        raise NvshmemUnavailable(
            f"megatron_deepep: linking NVSHMEM kernels needs cuda-bindings with nvJitLink "
            f"({type(exc).__name__}: {exc}). Install `pip install \"megatron_deepep[jit]\"` "
            f"(or `pip install cuda-bindings nvidia-cuda-nvrtc {PIP_PACKAGES}`), or use "
            "transport='reference', which works without NVSHMEM.") from exc
    return nvrtc, nvjitlink


def link_cache_dir(cache_dir: Optional[Path] = None) -> Path:
    """Where linked modules are kept: `nvshmem/` under the kernel cache (`cache_dir`, default
    the knob CACHE_DIR's)."""
    base = Path(cache_dir) if cache_dir is not None else cache_trust.default_cache_dir()
    return base / "nvshmem"


_private_shim_dir: List[Path] = []  # this process's own folder, when the cache's is not trusted


def _shim_path() -> Path:
    """The pre-included std-traits shim: in the cache directory (by content) when that folder
    is trusted and the file there is ours byte for byte (else rewritten, warned once), in a
    private temporary folder of this process when the cache folder is not trusted."""
    data = _SHIM.encode()
    name = f"std_traits_shim_{hashlib.sha256(data).hexdigest()[:16]}.h"
    folder = link_cache_dir()
    if not (cache_trust.checked_dir(folder.parent) and cache_trust.checked_dir(folder)):
        if not _private_shim_dir:
            _private_shim_dir.append(Path(tempfile.mkdtemp(prefix="mdeep-shim-")))
            atexit.register(shutil.rmtree, _private_shim_dir[0], True)
        folder = _private_shim_dir[0]
    path = folder / name
    found = cache_trust.read_checked(path, "NVSHMEM shim header")
    if found is not None and found != data:
        cache_trust.warn_once(path, "its content differs from the shim this version writes",
                              "rewriting it")
    if found != data:
        cache_trust.write_atomic(path, data, cache_trust.policy().file_mode,
                                 cache_trust.policy().gid)
    return path


def _source_files(source_file: str, paths: NvshmemPaths) -> List[Path]:
    """`cuda_src/<source_file>` and every `cuda_src/` header it includes, depth first.

    Includes that resolve in NVSHMEM's include directory are allowed (the device library's hash
    covers the wheel); any other include outside `cuda_src/` is refused, like `jit`'s.
    """
    root = cuda_src_dir()
    files: List[Path] = []

    def visit(path: Path, stack: Tuple[Path, ...]) -> None:
        if path in stack:
            raise CompileError(f"include cycle: {' -> '.join(str(p) for p in stack + (path,))}")
        if path in files:
            return
        files.append(path)
        for name in _INCLUDE_RE.findall(path.read_text()):
            target = root / name
            if target.is_file():
                visit(target, stack + (path,))
            elif not (paths.nvshmem_include / name).is_file():
                raise CompileError(f"{path.name} includes {name!r}, which is neither under "
                                   f"{root} nor NVSHMEM's {paths.nvshmem_include}")

    visit(root / source_file, ())
    return files


@functools.lru_cache(maxsize=8)
def _file_digest(path: Path, size: int, mtime_ns: int) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _library_digest(path: Path) -> str:
    stat = path.stat()
    return _file_digest(path, stat.st_size, stat.st_mtime_ns)


def _base_options(arch: str) -> List[str]:
    """Options both units (kernel and thunk) compile with."""
    opts = [f"--gpu-architecture={arch}", "-rdc=true", "-std=c++17", "-default-device",
            "-DNDEBUG"]
    if knobs.get("JIT_LINEINFO"):
        opts.append("-lineinfo")
    return opts


def _kernel_options(arch: str, paths: NvshmemPaths) -> List[str]:
    return _base_options(arch) + [
        f"-I{cuda_src_dir()}", f"-I{paths.nvshmem_include}", f"-I{paths.cuda_include}",
        f"-I{paths.cccl_include}", f"--pre-include={_shim_path()}"]


def _nvrtc_compile(nvrtc, code: bytes, name: str, name_expressions: Sequence[str],
                   opts: List[str]) -> Tuple[bytes, Dict[str, str]]:
    """One NVRTC unit to a relocatable cubin, and the lowered names of `name_expressions`
    (`nvrtc`: checked available by the caller)."""
    return compile_program(code, name, name_expressions, opts, error=LinkError)


def _nvjitlink(nvjitlink, units: Sequence[Tuple[str, bytes]], library: Path, arch: str,
               context: str) -> bytes:
    """Links relocatable cubins with NVSHMEM's device library into one executable cubin."""
    opts = [f"-arch={arch}"]
    handle = nvjitlink.create(len(opts), opts)
    try:
        try:
            for name, cubin in units:
                nvjitlink.add_data(handle, nvjitlink.InputType.CUBIN, cubin, len(cubin), name)
            nvjitlink.add_file(handle, nvjitlink.InputType.LIBRARY, str(library))
            nvjitlink.complete(handle)
        except Exception as exc:  # nvJitLinkError: the log says which symbol or input
            log = bytearray(nvjitlink.get_error_log_size(handle))
            nvjitlink.get_error_log(handle, log)
            raise LinkError(f"nvJitLink failed linking {context}: {exc}\n  inputs: "
                            f"{[n for n, _ in units]} + {library}\n  options: {opts}\n"
                            f"  nvJitLink log:\n{log.decode(errors='replace').rstrip(chr(0))}"
                            ) from None
        cubin = bytearray(nvjitlink.get_linked_cubin_size(handle))
        nvjitlink.get_linked_cubin(handle, cubin)
        return bytes(cubin)
    finally:
        nvjitlink.destroy(handle)


def _thunk_options(arch: str, paths: NvshmemPaths) -> List[str]:
    """The thunk sees our version switch and NVSHMEM's version header, nothing else."""
    return _base_options(arch) + [f"-I{cuda_src_dir()}", f"-I{paths.nvshmem_include}"]


def _cache_key(files: Sequence[Path], thunk_files: Sequence[Path],
               name_expressions: Sequence[str], kernel_opts: List[str], thunk_opts: List[str],
               arch: str, paths: NvshmemPaths, nvrtc, nvjitlink) -> str:
    root = cuda_src_dir()
    digest = hashlib.sha256()
    for f in list(files) + list(thunk_files):
        digest.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    # The shim by its name (which carries its content hash), not the folder it was written to.
    kernel_opts = [f"--pre-include={Path(o.split('=', 1)[1]).name}"
                   if o.startswith("--pre-include=") else o for o in kernel_opts]
    digest.update(json.dumps({
        "names": sorted(name_expressions), "kernel_options": kernel_opts,
        "thunk_options": thunk_opts, "arch": arch, "nvrtc": list(nvrtc.nvrtcVersion()[1:]),
        "nvjitlink": list(nvjitlink.version()),
        "device_library": _library_digest(paths.device_library)}).encode())
    return digest.hexdigest()[:32]


def link_cubin(source_file: str, name_expressions: Sequence[str], arch: str = "sm_90",
               cache_dir: Optional[Path] = None) -> Tuple[bytes, Dict[str, str]]:
    """Compiles `cuda_src/<source_file>` and links it with NVSHMEM's device library (no GPU).

    Args:
        source_file: path relative to `cuda_src/`, e.g. "bench/internode_leg.cu".
        name_expressions: kernels to keep, e.g. ["internode_leg_send"] or template
            instantiations like ["net_dispatch<8, 448>"].
        arch: target, e.g. "sm_90".
        cache_dir: the kernel cache (default: knob CACHE_DIR, else ~/.cache/megatron_deepep).

    Returns:
        The linked cubin (load it with cuModuleLoadData, then `nvshmemx_cumodule_init`) and a
        map from name expression to lowered (mangled) name for cuModuleGetFunction.

    Raises:
        NvshmemUnavailable: the wheels are missing (the message says what to pip install and
            that transport='reference' works without them).
        LinkError: NVRTC or nvJitLink failed; the message has the source, kernel names,
            options and the log.
    """
    paths = nvshmem_paths()
    version = check_device_library(paths)
    nvrtc, nvjitlink = _bindings()
    files = _source_files(source_file, paths)
    thunk_files = _source_files(THUNK_FILE, paths)
    kernel_opts, thunk_opts = _kernel_options(arch, paths), _thunk_options(arch, paths)
    key = _cache_key(files, thunk_files, name_expressions, kernel_opts, thunk_opts, arch, paths,
                     nvrtc, nvjitlink)
    entry_path = link_cache_dir(cache_dir) / f"{key}.kernel"  # one file: names and cubin
    use_cache = not knobs.get("JIT_NO_CACHE") and (
        cache_trust.checked_dir(entry_path.parent.parent)
        and cache_trust.checked_dir(entry_path.parent))
    if use_cache:
        entry = read_entry(entry_path, name_expressions)  # None: absent, untrusted or unusable
        if entry is not None:
            return entry
    start = time.perf_counter()
    try:
        kernel, lowered = _nvrtc_compile(nvrtc, files[0].read_bytes(), source_file,
                                         name_expressions, kernel_opts)
        thunk_cubin, _ = _nvrtc_compile(nvrtc, thunk_files[0].read_bytes(), THUNK_FILE, (),
                                        thunk_opts)
        linked = _nvjitlink(nvjitlink, [(source_file, kernel), (THUNK_FILE, thunk_cubin)],
                            paths.device_library, arch,
                            f"{source_file} {list(name_expressions)}")
    except LinkError as exc:
        if version in _tested():
            raise
        raise LinkError(f"{exc}\n  NVSHMEM {version_text(version)} is not a tested release "
                        f"(tested: {', '.join(TESTED_NVSHMEM)}): see docs/internode.md, \"New "
                        f"NVSHMEM or torch releases\".") from None
    logger.info("megatron_deepep: linked %s %s for %s against NVSHMEM's device library in "
                "%.1f s", source_file, list(name_expressions), arch,
                time.perf_counter() - start)
    if use_cache:
        cache_trust.write_checked(entry_path, pack_entry(linked, lowered))
    return linked, lowered



def cumodule_init():
    """torch's binding of nvshmemx_cumodule_init (only in builds with NVSHMEM).

    Raises:
        NvshmemUnavailable: this torch was built without NVSHMEM.
    """
    import torch
    init = getattr(torch._C._distributed_c10d, "_nvshmemx_cumodule_init", None)
    if init is None:
        raise NvshmemUnavailable(
            f"megatron_deepep: torch {torch.__version__} was built without NVSHMEM (no "
            f"torch._C._distributed_c10d._nvshmemx_cumodule_init); the internode transport "
            f"needs torch >= 2.11 built for CUDA 13 with NVSHMEM, {_FALLBACK}.")
    return init


def init_module(module) -> None:
    """Fills a loaded module's NVSHMEM device state (`nvshmemx_cumodule_init`); call it once per
    module, after NVSHMEM has started (after this process's first `SymmetricHeap.empty`) and
    before launching any of its kernels.

    Args:
        module: the CUmodule (a `cuda.bindings.driver.CUmodule` or its address as an int).

    Raises:
        NvshmemUnavailable: this torch cannot do it, or its NVSHMEM host library does not
            suit the device library (`check_host_library`).
        RuntimeError: NVSHMEM refused (not started yet, or the cubin lacks its device state).
    """
    init = cumodule_init()
    check_host_library()
    try:
        init(int(module))
    except Exception as exc:
        raise RuntimeError(
            f"megatron_deepep: nvshmemx_cumodule_init failed: {exc}. It needs NVSHMEM started "
            "(a symmetric allocation first) and a cubin linked by nvshmem_link.link_cubin."
            ) from exc


def load_module(cubin: bytes):
    """Loads a linked cubin into the current device's context and inits its NVSHMEM state.

    Returns:
        The `cuda.bindings.driver.CUmodule`.
    """
    import torch
    from cuda.bindings import driver
    ensure_context(torch.cuda.current_device())
    module = cu_check(driver.cuModuleLoadData(cubin), "cuModuleLoadData(NVSHMEM cubin)")
    init_module(module)
    return module


def get_kernel(source_file: str, name: str, template_args: Sequence = ()) -> Kernel:
    """`name<template_args...>` of an NVSHMEM-linked `cuda_src/<source_file>`, linked, loaded
    and initialized for the current device once; launched like any `jit.Kernel`. NVSHMEM must
    have started in this process (a symmetric allocation) before the first call."""
    import torch
    return _get_kernel(source_file, name, tuple(template_args), torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _get_kernel(source_file: str, name: str, template_args: tuple,
                device_index: int) -> Kernel:
    args = ", ".join(render_template_arg(a) for a in template_args)
    expr = f"{name}<{args}>" if template_args else name
    return get_kernels(source_file, (expr,), device_index)[expr]


@functools.lru_cache(maxsize=None)
def get_kernels(source_file: str, name_expressions: Tuple[str, ...],
                device_index: int) -> Dict[str, Kernel]:
    """Several kernels of `cuda_src/<source_file>` linked into one module (one NVRTC compile,
    one link, one NVSHMEM module init): name expression -> `jit.Kernel`."""
    from cuda.bindings import driver
    start = time.perf_counter()
    cubin, lowered = link_cubin(source_file, list(name_expressions), device_arch())
    module = load_module(cubin)
    kernels = {}
    for expr in name_expressions:
        function = cu_check(driver.cuModuleGetFunction(module, lowered[expr].encode()),
                            f"cuModuleGetFunction({expr})")
        kernels[expr] = Kernel(expr, function, device_index)
    logger.info("loaded %d kernels from %s (NVSHMEM-linked) in %.1f s", len(kernels),
                source_file, time.perf_counter() - start)
    return kernels
