"""Run-time compilation and launch of `cuda_src/` kernels, on one CUDA binding: cuda.bindings.

This module knows no kernel. It reads a `.cu` file, hashes it together with every `cuda_src/`
header it includes (recursively), compiles the requested template instantiations (name
expressions) with NVRTC (which needs no GPU, so CI compiles every kernel for sm_90), caches the
cubin on disk under that hash (written atomically: concurrent ranks compile too), loads it with
the driver API (`cuModuleLoadData`) into torch's primary context and launches with
`cuLaunchKernel` (`cuLaunchKernelEx` for programmatic dependent launch).

Every kernel takes one by-value argument struct; `KernelArgs` is the base of their Python
mirrors (ctypes structures whose fields are filled by name, every one required).

Knobs (`megatron_deepep/knobs.py`, prefix MDEEP_): CACHE_DIR, ARCH, JIT_DEBUG, JIT_LINEINFO,
JIT_NO_CACHE, PDL.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import operator
import os
import re
import struct
import tempfile
import threading
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from megatron_deepep import knobs
from megatron_deepep.cuda_calls import CudaError, cu_check, ensure_context, error_name  # noqa: F401

logger = logging.getLogger(__name__)

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)


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
    if knobs.get("JIT_LINEINFO"):
        opts.append("-lineinfo")
    return opts


def _nvrtc_check(result, what: str):
    """The values of an NVRTC call's result tuple; raises if its status is not success."""
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
    code = (cuda_src_dir() / source_file).read_bytes()
    return compile_code(code, source_file, name_expressions, arch)


def compile_code(code, name: str, name_expressions: Sequence[str] = (), arch: str = "sm_90"
                 ) -> Tuple[bytes, Dict[str, str]]:
    """Compiles CUDA source text (which may include `cuda_src/` headers) like `compile_cubin`.

    Args:
        code: the source, str or bytes.
        name: its file name, for messages.
        name_expressions: template instantiations to keep and lower.
        arch: NVRTC target.
    """
    from cuda.bindings import nvrtc

    if isinstance(code, str):
        code = code.encode()
    opts = _options(arch)
    prog = _nvrtc_check(nvrtc.nvrtcCreateProgram(code, name.encode(), 0, [], []), "create")
    try:
        for expr in name_expressions:
            _nvrtc_check(nvrtc.nvrtcAddNameExpression(prog, expr.encode()),
                         "add name expression")
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])[0]
        log_size = _nvrtc_check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * log_size
        _nvrtc_check((nvrtc.nvrtcGetProgramLog(prog, log)[0], None), "get log")
        log_text = log.decode(errors="replace").rstrip("\x00 \n")
        if int(status) != 0:
            raise CompileError(
                f"compiling {name} failed ({status})\n  kernels: {list(name_expressions)}"
                f"\n  options: {opts}\n  NVRTC log:\n{log_text}")
        if knobs.get("JIT_DEBUG"):
            logger.info("compiled %s %s with %s\n%s", name, list(name_expressions), opts,
                        log_text)
        size = _nvrtc_check(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        cubin = b" " * size
        _nvrtc_check((nvrtc.nvrtcGetCUBIN(prog, cubin)[0], None), "get cubin")
        lowered = {}
        for expr in name_expressions:
            low = _nvrtc_check(nvrtc.nvrtcGetLoweredName(prog, expr.encode()), "lowered name")
            lowered[expr] = low.decode() if isinstance(low, bytes) else low
        return cubin, lowered
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _cache_dir() -> Path:
    return Path(knobs.get("CACHE_DIR") or Path.home() / ".cache" / "megatron_deepep")


def device_arch() -> str:
    override = knobs.get("ARCH")
    if override:
        return override
    import torch
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _nvrtc_version() -> str:
    from cuda.bindings import nvrtc
    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


# ---------------------------------------------------------------------------------------------
# Driver API: every call's status checked, the error named with the call.


# ---------------------------------------------------------------------------------------------
# Kernel argument structs.

_PACK_CODES = {ctypes.c_void_p: "Q", ctypes.c_uint64: "Q", ctypes.c_int64: "q",
               ctypes.c_int32: "i", ctypes.c_uint32: "I", ctypes.c_float: "f"}

Ptr = ctypes.c_void_p  # a device or mapped-host address (a Python int; 0 for null)
I32, U32, I64, U64, F32 = (ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64,
                           ctypes.c_float)


class _Packer:
    """A struct's fields packed with one `struct.pack_into` call (ctypes' own per-field setters
    cost several times more), into one buffer per thread that the launch then passes."""

    def __init__(self, cls):
        self.names = tuple(name for name, _ in cls._fields_)
        fmt, end = "<", 0
        for name, ctype in cls._fields_:
            if ctype not in _PACK_CODES:
                raise TypeError(f"{cls.__name__}.{name}: unsupported field type {ctype}")
            offset = getattr(cls, name).offset
            fmt += "x" * (offset - end) + _PACK_CODES[ctype]
            end = offset + ctypes.sizeof(ctype)
        fmt += "x" * (ctypes.sizeof(cls) - end)
        self.struct = struct.Struct(fmt)
        assert self.struct.size == ctypes.sizeof(cls), cls.__name__
        getter = operator.itemgetter(*self.names)  # the values in field order
        self.values_of = getter if len(self.names) > 1 else lambda values: (getter(values),)
        self.local = threading.local()


class KernelArgs(ctypes.Structure):
    """Base of a kernel's argument struct mirror: subclasses list `_fields_` exactly as the CUDA
    struct (same names, same order, types Ptr/I32/U32/I64/U64/F32) and set `c_name`, the CUDA
    type the mirror check compiles against (e.g. "mdeep::LayoutArgs<int>")."""

    c_name = ""

    @classmethod
    def fill(cls, **values) -> "KernelArgs":
        """The struct with every field set from `values`, by name: this thread's one instance
        of `cls` (valid until its next `fill`; pass it straight to `Kernel.launch`).

        Raises:
            TypeError: a field is missing, unknown, or its value does not fit its type.
        """
        packer = cls.__dict__.get("_packer")
        if packer is None:
            packer = _Packer(cls)
            cls._packer = packer
        names = packer.names
        try:
            ordered = packer.values_of(values)
        except KeyError as missing:
            raise TypeError(f"{cls.__name__}: field {missing.args[0]!r} not given") from None
        if len(values) != len(names):
            unknown = sorted(set(values) - set(names))
            raise TypeError(f"{cls.__name__}: unknown fields {unknown}")
        local = packer.local
        instance = getattr(local, "instance", None)
        if instance is None:
            instance = local.instance = cls()
            params = (ctypes.c_void_p * 1)(ctypes.addressof(instance))
            instance._kernel_params = params  # keeps it alive with the struct
            instance.kernel_params = ctypes.addressof(params)
        try:
            packer.struct.pack_into(instance, 0, *ordered)
        except struct.error:
            for (name, ctype), value in zip(cls._fields_, ordered):
                try:
                    struct.pack("<" + _PACK_CODES[ctype], value)
                except struct.error as exc:
                    raise TypeError(f"{cls.__name__}.{name} = {value!r}: {exc}") from None
            raise
        return instance

    def as_dict(self) -> dict:
        """Field name -> value (pointers as ints, 0 for null)."""
        return {name: (getattr(self, name) or 0) if ctype is Ptr else getattr(self, name)
                for name, ctype in self._fields_}


# ---------------------------------------------------------------------------------------------
# Launch.


def pdl_enabled() -> bool:
    """Programmatic dependent launch (Hopper+) for kernels that ask for it (MDEEP_PDL=0: off)."""
    return _pdl_enabled()


@functools.lru_cache(maxsize=None)
def _pdl_enabled() -> bool:
    return bool(knobs.get("PDL"))


_launch_configs = threading.local()


def _programmatic_config():
    """This thread's CUlaunchConfig carrying the programmatic-serialization attribute."""
    config = getattr(_launch_configs, "programmatic", None)
    if config is None:
        from cuda.bindings import driver
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config = driver.CUlaunchConfig()
        config.gridDimY = config.gridDimZ = config.blockDimY = config.blockDimZ = 1
        config.attrs = [attr]
        config.numAttrs = 1
        _launch_configs.programmatic = config
    return config


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


_contexts_checked = threading.local()


class Kernel:
    """A loaded kernel: `launch(grid, block, args, stream, shared_mem, programmatic)`.

    Args:
        name: the name expression, for messages.
        function: the CUfunction.
        device_index: the device whose context holds it.
    """

    def __init__(self, name: str, function, device_index: int):
        self.name = name
        self.function = function
        self.device_index = device_index
        self._max_dynamic_shared = 48 * 1024  # what a launch may ask for without an attribute

    def launch(self, grid: int, block: int, args: KernelArgs, stream, shared_mem: int = 0,
               programmatic: bool = False) -> None:
        """Launches on a torch stream (or a `RawStream`) with `args` (a filled `KernelArgs`).
        `programmatic`: the kernel may start while the previous kernel on the stream still runs
        (it must execute griddepcontrol.wait before reading that kernel's outputs); ignored when
        `pdl_enabled()` is false.

        Raises:
            CudaError: the launch failed (the CUDA error name and the kernel).
        """
        from cuda.bindings import driver
        if not getattr(_contexts_checked, "done", False):
            ensure_context(self.device_index)
            _contexts_checked.done = True
        if shared_mem > self._max_dynamic_shared:
            self._allow_dynamic_shared(shared_mem)
        grid = max(int(grid), 1)
        if programmatic and _pdl_enabled():
            config = _programmatic_config()
            config.gridDimX, config.blockDimX = grid, int(block)
            config.sharedMemBytes, config.hStream = shared_mem, stream.cuda_stream
            err, = driver.cuLaunchKernelEx(config, self.function, args.kernel_params, 0)
        else:
            err, = driver.cuLaunchKernel(self.function, grid, 1, 1, int(block), 1, 1,
                                         shared_mem, stream.cuda_stream, args.kernel_params, 0)
        if int(err) != 0:
            raise CudaError(f"launching {self.name} (grid {grid}, block {block}, "
                            f"{shared_mem} B shared) failed: {error_name(err)}")

    def _allow_dynamic_shared(self, shared_mem: int) -> None:
        """Raises the kernel's dynamic shared-memory limit (48 KB unless set) to `shared_mem`."""
        from cuda.bindings import driver
        attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        cu_check(driver.cuFuncSetAttribute(self.function, attribute, int(shared_mem)),
                 f"cuFuncSetAttribute({self.name}, max dynamic shared memory {shared_mem} B)")
        self._max_dynamic_shared = int(shared_mem)


def _write_atomic(path: Path, data: bytes) -> None:
    """Writes `path` through a temporary file and a rename: concurrent ranks compile too."""
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _cached_cubin(source_file: str, name_expr: str, arch: str) -> Tuple[bytes, str]:
    """(cubin, lowered name) of one instantiation, from the disk cache or compiled into it."""
    key = hashlib.sha256(f"{source_hash(source_file)}|{name_expr}|{arch}|{_nvrtc_version()}|"
                         f"{_options(arch)}".encode()).hexdigest()[:32]
    cache = _cache_dir()
    cubin_path = cache / f"{key}.cubin"
    name_path = cache / f"{key}.name"
    if knobs.get("JIT_NO_CACHE") or not (cubin_path.exists() and name_path.exists()):
        cubin, lowered = compile_cubin(source_file, [name_expr], arch)
        cache.mkdir(parents=True, exist_ok=True)
        _write_atomic(cubin_path, cubin)
        _write_atomic(name_path, lowered[name_expr].encode())
        return cubin, lowered[name_expr]
    return cubin_path.read_bytes(), name_path.read_text()


@functools.lru_cache(maxsize=None)
def _load(source_file: str, name_expr: str, arch: str, device_index: int) -> Kernel:
    from cuda.bindings import driver
    cubin, lowered = _cached_cubin(source_file, name_expr, arch)
    ensure_context(device_index)
    image = ctypes.create_string_buffer(cubin, len(cubin))
    module = cu_check(driver.cuModuleLoadData(ctypes.addressof(image)),
                      f"cuModuleLoadData({source_file}: {name_expr})")
    function = cu_check(driver.cuModuleGetFunction(module, lowered.encode()),
                        f"cuModuleGetFunction({name_expr})")
    kernel = Kernel(name_expr, function, device_index)
    kernel.module = module  # loaded for the process's lifetime
    return kernel


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
    args = ", ".join(render_template_arg(a) for a in template_args)
    expr = f"{name}<{args}>" if template_args else name
    return _load(source_file, expr, device_arch(), device_index)


def render_template_arg(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
