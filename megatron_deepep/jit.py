"""Run-time compilation of `cuda_src/` kernels: NVRTC to a cubin, loaded through CuPy.

This module knows no kernel. It reads a `.cu` file, hashes it together with every `cuda_src/`
header it includes (recursively), compiles the requested template instantiations (name
expressions) with NVRTC from `cuda-bindings` (which needs no GPU, so CI compiles every kernel for
sm_90), caches the cubin on disk under that hash, and loads it as a `cupy.RawModule`.

Environment knobs (all read at first use):

- `MEGATRON_DEEPEP_CACHE_DIR`: cubin cache (default `~/.cache/megatron_deepep`).
- `MEGATRON_DEEPEP_JIT_DEBUG`: 1: log every compile with its options and NVRTC log.
- `MEGATRON_DEEPEP_JIT_LINEINFO`: 1: compile with `-lineinfo` (for profilers).
- `MEGATRON_DEEPEP_JIT_NO_CACHE`: 1: always recompile.
- `MEGATRON_DEEPEP_ARCH`: target, e.g. `sm_90` (default: the current device).
- `MEGATRON_DEEPEP_LAUNCH_VIA_CUPY`: 1: launch through CuPy instead of `cuLaunchKernel`.
- `MEGATRON_DEEPEP_JIT_DEFINES`: extra `-D` macros, comma-separated (tuning knobs such as
  `MDEEP_COPY_UNROLL=16`); part of the cache key.
- `MEGATRON_DEEPEP_PDL`: 0: no programmatic dependent launch (the EP = 1 expand then starts
  only after the layout kernel has finished).
- `MEGATRON_DEEPEP_PDL_FIRST`: 1 (experimental): a call's first kernel is launched
  programmatically too (`pdl_first_enabled`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import re
import struct
import tempfile
import threading
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

logger = logging.getLogger(__name__)

ENV_PREFIX = "MEGATRON_DEEPEP_"
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)


def _env_flag(name: str) -> bool:
    return os.environ.get(ENV_PREFIX + name, "0") not in ("", "0", "false", "False")


def cuda_src_dir() -> Path:
    """The kernel sources: the repo's `cuda_src/`, or the copy installed inside the package."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "cuda_src", here / "cuda_src"):
        if (candidate / "common").is_dir():
            return candidate
    import megatron_deepep.cuda_src as installed  # the wheel maps cuda_src/ here
    return Path(installed.__file__).resolve().parent


class CompileError(RuntimeError):
    """NVRTC rejected a kernel; the message carries everything needed to reproduce it."""


def _read_with_includes(path: Path, root: Path, seen: Tuple[Path, ...] = ()) -> List[Path]:
    """Every file `path` includes from `root`, depth first; rejects cycles and foreign includes."""
    if path in seen:
        raise CompileError(f"include cycle: {' -> '.join(str(p) for p in seen + (path,))}")
    files = [path]
    for name in _INCLUDE_RE.findall(path.read_text()):
        target = root / name
        if not target.is_file():
            raise CompileError(f"{path.name} includes {name!r}, which is not under {root} "
                               "(kernels may include only our own headers)")
        for f in _read_with_includes(target, root, seen + (path,)):
            if f not in files:
                files.append(f)
    return files


def source_hash(source_file: str) -> str:
    """sha256 of a `.cu` file and every header it includes (an edited header changes it)."""
    root = cuda_src_dir()
    digest = hashlib.sha256()
    for f in _read_with_includes(root / source_file, root):
        digest.update(str(f.relative_to(root)).encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()


def _options(arch: str) -> List[str]:
    opts = [f"--gpu-architecture={arch}", "-std=c++17", f"-I{cuda_src_dir()}",
            "-default-device", "-DNDEBUG"]
    if _env_flag("JIT_LINEINFO"):
        opts.append("-lineinfo")
    defines = os.environ.get(ENV_PREFIX + "JIT_DEFINES", "")
    opts += [f"-D{d.strip()}" for d in defines.split(",") if d.strip()]
    return opts


def _check(result, what: str):
    err = result[0]
    if int(err) != 0:
        raise CompileError(f"NVRTC {what} failed: {err}")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


def compile_cubin(source_file: str, name_expressions: Sequence[str], arch: str = "sm_90"
                  ) -> Tuple[bytes, Dict[str, str]]:
    """Compiles `cuda_src/<source_file>` for `arch` (no GPU needed).

    Args:
        source_file: path relative to `cuda_src/`, e.g. "dispatch.cu".
        name_expressions: template instantiations, e.g. ["dispatch_send<8>"].
        arch: NVRTC target, e.g. "sm_90".

    Returns:
        The cubin bytes and a map from name expression to lowered (mangled) name.

    Raises:
        CompileError: with the kernel names, options and the NVRTC log.
    """
    from cuda.bindings import nvrtc

    root = cuda_src_dir()
    code = (root / source_file).read_bytes()
    opts = _options(arch)
    prog = _check(nvrtc.nvrtcCreateProgram(code, source_file.encode(), 0, [], []), "create")
    try:
        for expr in name_expressions:
            _check(nvrtc.nvrtcAddNameExpression(prog, expr.encode()), "add name expression")
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])[0]
        log_size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * log_size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log_text = log.decode(errors="replace").rstrip("\x00 \n")
        if int(status) != 0:
            raise CompileError(
                f"compiling {source_file} failed ({status})\n  kernels: {list(name_expressions)}"
                f"\n  options: {opts}\n  NVRTC log:\n{log_text}")
        if _env_flag("JIT_DEBUG"):
            logger.info("compiled %s %s with %s\n%s", source_file, list(name_expressions), opts,
                        log_text)
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        cubin = b" " * size
        _check((nvrtc.nvrtcGetCUBIN(prog, cubin)[0], None), "get cubin")
        lowered = {}
        for expr in name_expressions:
            name = _check(nvrtc.nvrtcGetLoweredName(prog, expr.encode()), "lowered name")
            lowered[expr] = name.decode() if isinstance(name, bytes) else name
        return cubin, lowered
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _cache_dir() -> Path:
    default = Path.home() / ".cache" / "megatron_deepep"
    return Path(os.environ.get(ENV_PREFIX + "CACHE_DIR", default))


def _device_arch() -> str:
    override = os.environ.get(ENV_PREFIX + "ARCH")
    if override:
        return override
    import torch
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _nvrtc_version() -> str:
    from cuda.bindings import nvrtc
    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


@functools.lru_cache(maxsize=64)
def _cupy_stream(stream_ptr: int, device_index: int):
    """A CuPy view of a torch stream, made once per stream (making one per launch costs µs)."""
    import cupy
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        try:
            return from_external(_StreamRef(stream_ptr))
        except Exception:  # older CuPy: the protocol object is not accepted
            pass
    return cupy.cuda.ExternalStream(stream_ptr, device_index)


class _StreamRef:
    """The CUDA stream protocol (`__cuda_stream__`) for a raw stream handle."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


class Signature:
    """A kernel's argument types as letter codes, for `Kernel.launch(..., signature=...)`:
    p (pointer: a Python int address), q (unsigned 64-bit), l (signed 64-bit), i (int32),
    u (uint32), f (float32). Each argument travels in an 8-byte slot of one packed buffer, so
    plain Python numbers go straight in (no numpy scalar per argument).

    Args:
        codes: one letter per argument; spaces are ignored (group them for reading).
    """

    _FORMATS = {"p": "Q", "q": "Q", "l": "q", "i": "i4x", "u": "I4x", "f": "f4x"}
    _NUMPY = {"p": np.uint64, "q": np.uint64, "l": np.int64, "i": np.int32, "u": np.uint32,
              "f": np.float32}

    def __init__(self, codes: str):
        self.codes = codes.replace(" ", "")
        unknown = set(self.codes) - set(self._FORMATS)
        if unknown:
            raise ValueError(f"signature {codes!r}: unknown codes {sorted(unknown)} (use "
                             f"{''.join(self._FORMATS)})")
        self.struct = struct.Struct("=" + "".join(self._FORMATS[c] for c in self.codes))
        self._local = threading.local()  # a packing buffer per thread

    def params(self, args: Sequence):
        """Packs `args` and returns the `void*[]` parameter array for cuLaunchKernel."""
        local = self._local
        params = getattr(local, "params", None)
        if params is None:
            local.buffer = ctypes.create_string_buffer(max(self.struct.size, 8))
            base = ctypes.addressof(local.buffer)
            params = local.params = (ctypes.c_void_p * max(len(self.codes), 1))(
                *[base + 8 * i for i in range(len(self.codes))])
        try:
            self.struct.pack_into(local.buffer, 0, *args)
        except struct.error as exc:
            raise TypeError(f"kernel arguments {list(args)} do not match signature "
                            f"{self.codes!r}: {exc}") from None
        return params

    def as_numpy(self, args: Sequence) -> tuple:
        """The same arguments as numpy scalars (for the CuPy launch path)."""
        return tuple(self._NUMPY[c](a) for c, a in zip(self.codes, args))


# Launches that pass numpy scalars get the signature of their types, made once per type tuple.
_CODE_OF_NUMPY_TYPE = {np.uint64: "q", np.int64: "l", np.int32: "i", np.uint32: "u",
                       np.float32: "f"}
_signatures_of_types: Dict[tuple, Signature] = {}


def _signature_of(args: Sequence) -> Signature:
    types = tuple(map(type, args))
    signature = _signatures_of_types.get(types)
    if signature is None:
        try:
            codes = "".join(_CODE_OF_NUMPY_TYPE[t] for t in types)
        except KeyError as exc:
            raise TypeError(f"kernel arguments must be numpy scalars of "
                            f"{list(_CODE_OF_NUMPY_TYPE)}, got {exc}") from None
        signature = _signatures_of_types[types] = Signature(codes)
    return signature


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, and a 64-byte value union."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig of cuLaunchKernelEx."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_launch_configs = threading.local()


@functools.lru_cache(maxsize=None)
def _launch_ex():
    """cuLaunchKernelEx, for launches that may start before the previous kernel on the stream
    has finished (programmatic dependent launch; the kernel's griddepcontrol.wait orders it)."""
    launch_ex = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    launch_ex.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_void_p]
    launch_ex.restype = ctypes.c_int
    return launch_ex


_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


@functools.lru_cache(maxsize=None)
def _set_function_attribute():
    """cuFuncSetAttribute (CUfunction, CUfunction_attribute, int) through ctypes."""
    set_attribute = ctypes.CDLL("libcuda.so.1").cuFuncSetAttribute
    set_attribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    set_attribute.restype = ctypes.c_int
    return set_attribute


def _programmatic_config() -> _LaunchConfig:
    """A per-thread launch config carrying the programmatic-serialization attribute."""
    config = getattr(_launch_configs, "programmatic", None)
    if config is None:
        attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        config = _LaunchConfig(num_attrs=1)
        config.attrs = ctypes.pointer(attr)
        config._attr = attr  # keep it alive
        _launch_configs.programmatic = config
    return config


@functools.lru_cache(maxsize=None)
def pdl_enabled() -> bool:
    """Programmatic dependent launch (Hopper+) for kernels that ask for it; MEGATRON_DEEPEP_PDL=0
    turns it off."""
    return os.environ.get(ENV_PREFIX + "PDL", "1") not in ("0", "false", "False")


@functools.lru_cache(maxsize=None)
def pdl_first_enabled() -> bool:
    """MEGATRON_DEEPEP_PDL_FIRST=1: the first kernel of a call (the layout, a cached EP = 1
    dispatch, the EP = 1 combine) is launched programmatically too, after whatever kernel
    precedes it (it waits for that kernel at its entry): its launch overlaps that kernel's end."""
    return pdl_enabled() and os.environ.get(ENV_PREFIX + "PDL_FIRST", "0") in ("1", "true",
                                                                              "True")


@functools.lru_cache(maxsize=None)
def _driver():
    """libcuda's cuLaunchKernel and cuGetErrorName through ctypes (a call costs ~1 µs, against
    tens of µs through CuPy's generic argument conversion)."""
    lib = ctypes.CDLL("libcuda.so.1")
    launch = lib.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    launch.restype = ctypes.c_int
    error_name = lib.cuGetErrorName
    error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    error_name.restype = ctypes.c_int
    return launch, error_name


def _cuda_error_name(code: int) -> str:
    name = ctypes.c_char_p()
    _driver()[1](code, ctypes.byref(name))
    return name.value.decode() if name.value else f"CUDA error {code}"


@functools.lru_cache(maxsize=None)
def _launch_via_cupy() -> bool:
    return _env_flag("LAUNCH_VIA_CUPY")


def current_raw_stream() -> "RawStream":
    """The current torch stream of the current device as a `RawStream`."""
    import torch
    get_raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get_raw is None:  # not in this torch build: the public (slower) path
        stream = torch.cuda.current_stream()
        return RawStream(stream.cuda_stream, stream.device.index)
    device = torch._C._cuda_getDevice()
    return RawStream(get_raw(device), device)


@dataclasses.dataclass(frozen=True)
class RawStream:
    """A CUDA stream handle and its device, as `Kernel.launch` needs them."""

    cuda_stream: int
    device_index: int


@dataclasses.dataclass
class Kernel:
    """A loaded kernel: call it with `launch(grid, block, args, stream, shared_mem)`."""

    name: str
    function: object
    _max_dynamic_shared: int = 48 * 1024  # what a launch may ask for without an attribute

    @functools.cached_property
    def function_ptr(self) -> int:
        """The CUfunction handle (CuPy's RawKernel wraps a Function that holds it)."""
        inner = getattr(self.function, "kernel", self.function)
        return int(getattr(inner, "ptr"))

    def launch(self, grid: int, block: int, args: Sequence, stream, shared_mem: int = 0,
               signature: Optional[Signature] = None, programmatic: bool = False) -> None:
        """Launches on a torch stream (or a `RawStream`); `args` are numpy scalars (pointers
        as np.uint64), or plain Python numbers typed by `signature`. `programmatic`: the kernel
        may start while the previous kernel on the stream still runs (it must execute
        griddepcontrol.wait before reading that kernel's outputs); off when `pdl_enabled()` is.

        Raises:
            RuntimeError: the launch failed (the CUDA error name and the kernel).
            TypeError: `args` do not match `signature`.
        """
        if shared_mem > self._max_dynamic_shared:
            self._allow_dynamic_shared(shared_mem)
        if _launch_via_cupy():
            if signature is not None:
                args = signature.as_numpy(args)
            self._launch_cupy(grid, block, args, stream, shared_mem)
            return
        params = (signature or _signature_of(args)).params(args)
        if programmatic and pdl_enabled():
            config = _programmatic_config()
            config.grid[0], config.grid[1], config.grid[2] = max(int(grid), 1), 1, 1
            config.block[0], config.block[1], config.block[2] = int(block), 1, 1
            config.shared_mem, config.stream = shared_mem, stream.cuda_stream
            code = _launch_ex()(ctypes.byref(config), self.function_ptr, params, None)
        else:
            code = _driver()[0](self.function_ptr, max(int(grid), 1), 1, 1, int(block), 1, 1,
                                shared_mem, stream.cuda_stream, params, None)
        if code != 0:
            raise RuntimeError(f"launching {self.name} (grid {grid}, block {block}) failed: "
                               f"{_cuda_error_name(code)}")

    def _allow_dynamic_shared(self, shared_mem: int) -> None:
        """Raises the kernel's dynamic shared-memory limit (48 KB unless set) to `shared_mem`.

        Raises:
            RuntimeError: the device refuses that size (the CUDA error name and the kernel).
        """
        code = _set_function_attribute()(self.function_ptr, _MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                         int(shared_mem))
        if code != 0:
            raise RuntimeError(f"allowing {self.name} {shared_mem} bytes of dynamic shared "
                               f"memory failed: {_cuda_error_name(code)}")
        self._max_dynamic_shared = int(shared_mem)

    def _launch_cupy(self, grid, block, args, stream, shared_mem) -> None:
        index = stream.device_index if isinstance(stream, RawStream) else stream.device.index
        with _cupy_stream(stream.cuda_stream, index):
            self.function((max(int(grid), 1),), (int(block),), tuple(args),
                          shared_mem=shared_mem)


@functools.lru_cache(maxsize=None)
def _load(source_file: str, name_expr: str, arch: str, device_index: int) -> Kernel:
    import cupy
    key = hashlib.sha256(f"{source_hash(source_file)}|{name_expr}|{arch}|{_nvrtc_version()}|"
                         f"{_options(arch)}".encode()).hexdigest()[:32]
    cache = _cache_dir()
    cubin_path = cache / f"{key}.cubin"
    name_path = cache / f"{key}.name"
    if _env_flag("JIT_NO_CACHE") or not (cubin_path.exists() and name_path.exists()):
        cubin, lowered = compile_cubin(source_file, [name_expr], arch)
        cache.mkdir(parents=True, exist_ok=True)
        for path, data in ((cubin_path, cubin), (name_path, lowered[name_expr].encode())):
            fd, tmp = tempfile.mkstemp(dir=cache)  # atomic: concurrent ranks compile too
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(path=str(cubin_path))
        function = module.get_function(name_path.read_text())
    return Kernel(name_expr, function)


def get_kernel(source_file: str, name: str, template_args: Sequence = ()) -> Kernel:
    """Returns `name<template_args...>` from `cuda_src/<source_file>`, compiled for this GPU.

    Args:
        source_file: e.g. "dispatch.cu".
        name: the kernel template's name.
        template_args: values rendered into the name expression (ints, bools, type names).
    """
    import torch
    return _get_kernel(source_file, name, tuple(template_args), torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _get_kernel(source_file: str, name: str, template_args: tuple, device_index: int) -> Kernel:
    args = ", ".join(_render(a) for a in template_args)
    expr = f"{name}<{args}>" if template_args else name
    return _load(source_file, expr, _device_arch(), device_index)


def _render(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def ptr(tensor) -> np.uint64:
    """A tensor's device address as a kernel argument (0 for None)."""
    return np.uint64(0 if tensor is None else tensor.data_ptr())
