"""Run-time compilation and launch of `cuda_src/` kernels, on one CUDA binding: cuda.bindings.

This module knows no kernel. It reads a `.cu` file, hashes it together with every `cuda_src/`
header it includes (recursively), compiles the requested template instantiations (name
expressions) with NVRTC (which needs no GPU, so CI compiles every kernel for sm_90), caches the
cubin on disk under that hash (one self-checking file per instantiation, written atomically, so
hundreds of ranks may share a cache directory; `python -m megatron_deepep.tools.precompile` fills it
ahead of a job), logs each kernel's first use (INFO: compiled or loaded, and how long), loads it
with the driver API (`cuModuleLoadData`) into torch's primary context and launches with
`cuLaunchKernel` (`cuLaunchKernelEx` for programmatic dependent launch and for cooperative
launch: kernels whose blocks wait for each other, launched only with every block resident).

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
import json
import logging
import operator
import re
import struct
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_deepep import knobs
from megatron_deepep.kernels.cuda_calls import (  # noqa: F401
    CudaError, cu_check, ensure_context, error_name)
from megatron_deepep.kernels.cache_trust import TEMP_PREFIX, write_atomic  # noqa: F401
from megatron_deepep.kernels.cache_trust import (checked_dir, default_cache_dir, read_checked,
                                                 write_checked)

logger = logging.getLogger(__name__)

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)


def cuda_src_dir() -> Path:
    """The kernel sources: the repo's `cuda_src/`, or the copy installed inside the package."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package.parent / "cuda_src", package / "cuda_src"):
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


def compile_cubin(source_file: str, name_expressions: Sequence[str], arch: str = "sm_90",
                  extra_options: Sequence[str] = ()) -> Tuple[bytes, Dict[str, str]]:
    """Compiles `cuda_src/<source_file>` for `arch` (no GPU needed).

    Several name expressions compile in one NVRTC program (one cubin holding them all).

    Args:
        source_file: path relative to `cuda_src/`, e.g. "dispatch.cu".
        name_expressions: template instantiations, e.g. ["dispatch_send<8>"].
        arch: NVRTC target, e.g. "sm_90".
        extra_options: NVRTC options after the usual ones (the tests' compile checks pass
            `FAST_COMPILE_OPTIONS`).

    Returns:
        The cubin bytes and a map from name expression to lowered (mangled) name.

    Raises:
        CompileError: with the kernel names, options and the NVRTC log.
    """
    code = (cuda_src_dir() / source_file).read_bytes()
    return compile_code(code, source_file, name_expressions, arch, extra_options)


def compile_code(code, name: str, name_expressions: Sequence[str] = (), arch: str = "sm_90",
                 extra_options: Sequence[str] = ()) -> Tuple[bytes, Dict[str, str]]:
    """Compiles CUDA source text (which may include `cuda_src/` headers) like `compile_cubin`.

    Args:
        code: the source, str or bytes.
        name: its file name, for messages.
        name_expressions: template instantiations to keep and lower.
        arch: NVRTC target.
        extra_options: NVRTC options after the usual ones.
    """
    return compile_program(code, name, name_expressions, _options(arch) + list(extra_options))


def compile_program(code, name: str, name_expressions: Sequence[str], opts: Sequence[str],
                    error: type = None) -> Tuple[bytes, Dict[str, str]]:
    """One NVRTC program with exactly `opts`: its cubin (relocatable with `-rdc=true`) and the
    lowered names of `name_expressions`.

    Raises:
        `error` (default CompileError): with the kernel names, options and the NVRTC log.
    """
    require_nvrtc()
    from cuda.bindings import nvrtc

    error = error or CompileError
    if isinstance(code, str):
        code = code.encode()
    opts = list(opts)
    prog = _nvrtc_check(nvrtc.nvrtcCreateProgram(code, name.encode(), 0, [], []), "create")
    try:
        for expr in name_expressions:
            _nvrtc_check(nvrtc.nvrtcAddNameExpression(prog, expr.encode()),
                         "add name expression")
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])[0]
        log_size = _nvrtc_check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        # NVRTC writes into this buffer: never 1 byte long, since `b" " * 1` is CPython's
        # shared b" " (an empty log would turn it into a NUL byte for the whole process).
        log = b" " * max(log_size, 2)
        _nvrtc_check((nvrtc.nvrtcGetProgramLog(prog, log)[0], None), "get log")
        log_text = log.decode(errors="replace").rstrip("\x00 \n")
        if int(status) != 0:
            raise error(
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


# NVRTC 12.8+: the fastest device code generation (little optimization; ptxas still runs).
# For compile checks: the front end, template instantiation and ptxas see every kernel ~30x
# faster than at the default -O3, which the kernels that run are compiled with.
FAST_COMPILE_OPTIONS = ("--Ofast-compile=max",)


def _cache_dir() -> Path:
    return default_cache_dir()


def device_arch() -> str:
    override = knobs.get("ARCH")
    if override:
        return override
    import torch
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


#: What installs NVRTC: this package's `jit` extra, or the packages themselves (cuda-bindings
#: alone is not enough: it loads `libnvrtc` from the nvidia-cuda-nvrtc wheel or a CUDA toolkit).
INSTALL_HINT = ('pip install "megatron_deepep[jit]" (from a checkout: pip install -e ".[jit]"), '
                'or the packages alone: pip install cuda-bindings nvidia-cuda-nvrtc '
                'nvidia-nvjitlink')


class NvrtcUnavailable(RuntimeError):
    """NVRTC cannot be used here: its Python binding or its library is missing."""


def nvrtc_problem() -> Optional[str]:
    """None when NVRTC loads, else one line saying what is missing and how to install it.

    Loads `libnvrtc` (cuda-bindings loads it lazily, at the first call), so a binding
    installed without the library is caught here, not as a traceback at the first compile.
    """
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        return (f"NVRTC's Python binding is not installed ({exc}); install it with "
                f"{INSTALL_HINT}")
    try:
        err, _, _ = nvrtc.nvrtcVersion()
    except Exception as exc:  # cuda.pathfinder's DynamicLibNotFoundError, or an OSError
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        if "NotFound" in type(exc).__name__:  # "Failure finding "libnvrtc...": <each try>"
            first = first.split(": ")[0]
        return (f"cuda-bindings is installed but the NVRTC library is not ({first[:200]}); "
                f"install it with {INSTALL_HINT}")
    if int(err) != 0:
        return f"NVRTC does not start ({err}); install it with {INSTALL_HINT}"
    return None


def require_nvrtc() -> None:
    """Raises `NvrtcUnavailable` (one line: what is missing, how to install it) unless NVRTC
    loads. Checked once per process; a failure is checked again at the next call."""
    global _NVRTC_OK
    if _NVRTC_OK:
        return
    problem = nvrtc_problem()
    if problem is not None:
        raise NvrtcUnavailable(f"megatron_deepep: {problem}")
    _NVRTC_OK = True


_NVRTC_OK = False


def _nvrtc_version() -> str:
    require_nvrtc()
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


# ---------------------------------------------------------------------------------------------
# Launch.


@functools.lru_cache(maxsize=None)
def _pdl_enabled() -> bool:
    """Programmatic dependent launch (Hopper+) for kernels that ask for it (MDEEP_PDL=0: off;
    read once per process)."""
    return bool(knobs.get("PDL"))


_launch_configs = threading.local()


def _launch_config(programmatic: bool, cooperative: bool):
    """This thread's CUlaunchConfig carrying the programmatic-serialization and/or the
    cooperative attribute."""
    key = ("programmatic" if programmatic else "") + ("cooperative" if cooperative else "")
    config = getattr(_launch_configs, key, None)
    if config is None:
        from cuda.bindings import driver
        attrs = []
        if programmatic:
            attr = driver.CUlaunchAttribute()
            attr.id = (driver.CUlaunchAttributeID
                       .CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        if cooperative:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            attr.value.cooperative = 1
            attrs.append(attr)
        config = driver.CUlaunchConfig()
        config.gridDimY = config.gridDimZ = config.blockDimY = config.blockDimZ = 1
        config.attrs = attrs
        config.numAttrs = len(attrs)
        setattr(_launch_configs, key, config)
    return config


class CoResidencyError(RuntimeError):
    """A cooperative kernel's grid cannot have every block resident at once on this GPU."""


def check_co_resident(name: str, grid: int, blocks_per_sm: int, num_device_sms: int) -> None:
    """Refuses a cooperative grid larger than the GPU holds at once.

    Args:
        name: the kernel, for the message.
        grid: the blocks it launches.
        blocks_per_sm: the driver's occupancy for its block size and shared memory
            (`cuOccupancyMaxActiveBlocksPerMultiprocessor`).
        num_device_sms: the GPU's SMs.

    Raises:
        CoResidencyError: naming the grid, the occupancy and the SM budget to lower.
    """
    limit = blocks_per_sm * num_device_sms
    if grid > limit:
        raise CoResidencyError(
            f"{name}: its {grid} blocks wait for each other, so all must be resident at once, "
            f"but this GPU holds at most {limit} of them ({blocks_per_sm} per SM x "
            f"{num_device_sms} SMs); lower the Buffer's SM budget (num_sms, "
            f"{knobs.PREFIX}NUM_SMS) to at most {limit}")


def current_raw_stream() -> "RawStream":
    """The current torch stream of the current device as a `RawStream`."""
    import torch
    get_raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get_raw is None:  # not in this torch build: the public (slower) path
        stream = torch.cuda.current_stream()
        return RawStream(stream.cuda_stream, stream.device.index)
    device = torch._C._cuda_getDevice()
    handle = get_raw(device)
    # One RawStream per stream, reused: a frozen dataclass costs about a µs to build, twice a
    # dispatch. A handle names one stream of its device while it exists, and a handle reused
    # for a later stream names that one: the cached object is equal to a new one.
    stream = _raw_streams.get((handle, device))
    if stream is None:
        if len(_raw_streams) >= _MAX_RAW_STREAMS:
            _raw_streams.clear()
        stream = _raw_streams[(handle, device)] = RawStream(handle, device)
    return stream


_raw_streams: Dict[Tuple[int, int], "RawStream"] = {}
_MAX_RAW_STREAMS = 1024


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
        self._occupancy: Dict[Tuple[int, int], int] = {}  # (block, shared_mem) -> blocks/SM
        self._device_sms: Optional[int] = None
        from cuda.bindings import driver
        # Bound once: an import statement and two attribute lookups cost ~1 µs per launch.
        self._launch, self._launch_ex = driver.cuLaunchKernel, driver.cuLaunchKernelEx

    def launch(self, grid: int, block: int, args: KernelArgs, stream, shared_mem: int = 0,
               programmatic: bool = False, cooperative: bool = False) -> None:
        """Launches on a torch stream (or a `RawStream`) with `args` (a filled `KernelArgs`).
        `programmatic`: the kernel may start while the previous kernel on the stream still runs
        (it must execute griddepcontrol.wait before reading that kernel's outputs); ignored when
        `MDEEP_PDL` is off. `cooperative`: the kernel's blocks wait for each other, so
        it is launched as a cooperative grid (the driver starts it only with every block
        resident, whatever else runs on the GPU) after a check that the GPU can hold it.

        Raises:
            CoResidencyError: a cooperative grid larger than the GPU holds at once.
            CudaError: the launch failed (the CUDA error name and the kernel).
        """
        if not getattr(_contexts_checked, "done", False):
            ensure_context(self.device_index)
            _contexts_checked.done = True
        if shared_mem > self._max_dynamic_shared:
            self._allow_dynamic_shared(shared_mem)
        grid = max(int(grid), 1)
        if cooperative:
            check_co_resident(self.name, grid, self._blocks_per_sm(int(block), shared_mem),
                              self._num_device_sms())
        programmatic = programmatic and _pdl_enabled()
        if programmatic or cooperative:
            config = _launch_config(programmatic, cooperative)
            config.gridDimX, config.blockDimX = grid, int(block)
            config.sharedMemBytes, config.hStream = shared_mem, stream.cuda_stream
            err, = self._launch_ex(config, self.function, args.kernel_params, 0)
        else:
            err, = self._launch(self.function, grid, 1, 1, int(block), 1, 1, shared_mem,
                                stream.cuda_stream, args.kernel_params, 0)
        if int(err) != 0:
            raise CudaError(f"launching {self.name} (grid {grid}, block {block}, "
                            f"{shared_mem} B shared) failed: {error_name(err)}")

    def _blocks_per_sm(self, block: int, shared_mem: int) -> int:
        """The driver's occupancy of this kernel (blocks per SM), cached per launch shape."""
        key = (block, shared_mem)
        cached = self._occupancy.get(key)
        if cached is None:
            from cuda.bindings import driver
            cached = int(cu_check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                self.function, block, shared_mem),
                f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.name})"))
            self._occupancy[key] = cached
        return cached

    def _num_device_sms(self) -> int:
        from cuda.bindings import driver
        if self._device_sms is None:
            device = cu_check(driver.cuDeviceGet(self.device_index), "cuDeviceGet")
            attribute = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
            self._device_sms = int(cu_check(driver.cuDeviceGetAttribute(attribute, device),
                                            "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)"))
        return self._device_sms

    def _allow_dynamic_shared(self, shared_mem: int) -> None:
        """Raises the kernel's dynamic shared-memory limit (48 KB unless set) to `shared_mem`."""
        from cuda.bindings import driver
        attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        cu_check(driver.cuFuncSetAttribute(self.function, attribute, int(shared_mem)),
                 f"cuFuncSetAttribute({self.name}, max dynamic shared memory {shared_mem} B)")
        self._max_dynamic_shared = int(shared_mem)


# ---------------------------------------------------------------------------------------------
# Disk cache: one file per kernel instantiation, safe for many ranks on a shared filesystem.
#
# An entry is ONE file, `<key>.kernel`: a magic line, a JSON line (the lowered names, the
# cubin's size and sha256), then the cubin. It is written to a temporary file in the same
# directory, flushed to disk and renamed into place (`os.replace` is atomic on local and
# network filesystems), so a reader sees a whole entry or none, and the names always belong to
# the cubin beside them. A reader that finds a short, corrupt or foreign entry recompiles and
# replaces it. Concurrent writers of one key write the same bytes; the last rename wins.
# The checksum proves an entry whole, not who wrote it: `cache_trust` decides whether a folder
# and an entry are used at all (owner and mode), before they are read.

_ENTRY_MAGIC = b"MDEEP-KERNEL 1\n"
_ENTRY_SUFFIX = ".kernel"
def pack_entry(cubin: bytes, lowered: Dict[str, str]) -> bytes:
    """A cache entry: the cubin and its lowered names in one self-checking blob."""
    header = json.dumps({"names": lowered, "size": len(cubin),
                         "sha256": hashlib.sha256(cubin).hexdigest()}, sort_keys=True)
    return _ENTRY_MAGIC + header.encode() + b"\n" + cubin


def unpack_entry(data: bytes, name_expressions: Sequence[str]) -> Tuple[bytes, Dict[str, str]]:
    """The (cubin, lowered names) of an entry that holds `name_expressions`.

    Raises:
        ValueError: the entry is short, corrupt or holds other kernels (the reason).
    """
    if not data.startswith(_ENTRY_MAGIC):
        raise ValueError("no entry header")
    end = data.find(b"\n", len(_ENTRY_MAGIC))
    if end < 0:
        raise ValueError("truncated header")
    try:
        header = json.loads(data[len(_ENTRY_MAGIC):end])
        lowered, size, digest = header["names"], header["size"], header["sha256"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"unreadable header ({exc})") from None
    cubin = data[end + 1:]
    if len(cubin) != size:
        raise ValueError(f"cubin is {len(cubin)} bytes, the header says {size}")
    if hashlib.sha256(cubin).hexdigest() != digest:
        raise ValueError("cubin checksum mismatch")
    missing = [e for e in name_expressions if e not in lowered]
    if missing:
        raise ValueError(f"holds other kernels (missing {missing})")
    return cubin, lowered


def read_entry(path: Path, name_expressions: Sequence[str]
               ) -> Optional[Tuple[bytes, Dict[str, str]]]:
    """The entry at `path`, or None when it is absent, not trusted (`cache_trust`: owner and
    mode) or unusable (logged; the caller rebuilds and replaces it)."""
    data = read_checked(path, "cache entry")
    if data is None:
        return None
    try:
        return unpack_entry(data, name_expressions)
    except ValueError as exc:
        logger.warning("megatron_deepep: cache entry %s is unusable (%s); recompiling", path,
                       exc)
        return None


def _cache_key(source_file: str, name_expr: str, arch: str) -> str:
    # The -I path is left out (the source hash covers every included header), so a cache
    # built from one install (say, on a login node) serves another install of the same code.
    options = [o for o in _options(arch) if not o.startswith("-I")]
    text = f"{source_hash(source_file)}|{name_expr}|{arch}|{_nvrtc_version()}|{options}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cache_path(source_file: str, name_expr: str, arch: str,
               cache_dir: Optional[Path] = None) -> Path:
    """The cache entry of one instantiation (it may not exist yet), in `cache_dir` (default:
    knob CACHE_DIR, else `~/.cache/megatron_deepep`)."""
    return (Path(cache_dir) if cache_dir else _cache_dir()) / (
        _cache_key(source_file, name_expr, arch) + _ENTRY_SUFFIX)


@dataclasses.dataclass(frozen=True)
class Build:
    """One instantiation, compiled or found in the disk cache.

    Attributes:
        cubin: the cubin bytes.
        lowered: the mangled name of `name_expr` (for cuModuleGetFunction).
        seconds: the time it took (compile, or read).
        from_cache: found in the disk cache (no compile).
        path: its cache entry (None with MDEEP_JIT_NO_CACHE or an untrusted cache folder).
    """

    source_file: str
    name_expr: str
    arch: str
    cubin: bytes
    lowered: str
    seconds: float
    from_cache: bool
    path: Optional[Path]


def build(source_file: str, name_expr: str, arch: str, cache_dir: Optional[Path] = None
          ) -> Build:
    """Compiles one instantiation into the disk cache, or reads it from there (no GPU needed).

    Args:
        source_file: e.g. "dispatch.cu".
        name_expr: the instantiation, e.g. "dispatch_send<8, false, int, 0>".
        arch: NVRTC target, e.g. "sm_90".
        cache_dir: the cache (default: knob CACHE_DIR, else `~/.cache/megatron_deepep`).
    """
    start = time.perf_counter()
    if knobs.get("JIT_NO_CACHE"):
        cubin, lowered = compile_cubin(source_file, [name_expr], arch)
        return Build(source_file, name_expr, arch, cubin, lowered[name_expr],
                     time.perf_counter() - start, False, None)
    path = cache_path(source_file, name_expr, arch, cache_dir)
    if not checked_dir(path.parent):  # not trusted: neither read nor written (warned once)
        cubin, lowered = compile_cubin(source_file, [name_expr], arch)
        return Build(source_file, name_expr, arch, cubin, lowered[name_expr],
                     time.perf_counter() - start, False, None)
    entry = read_entry(path, [name_expr])
    if entry is not None:
        cubin, lowered = entry
        return Build(source_file, name_expr, arch, cubin, lowered[name_expr],
                     time.perf_counter() - start, True, path)
    cubin, lowered = compile_cubin(source_file, [name_expr], arch)
    write_checked(path, pack_entry(cubin, {name_expr: lowered[name_expr]}))
    return Build(source_file, name_expr, arch, cubin, lowered[name_expr],
                 time.perf_counter() - start, False, path)


_logged_builds = set()  # (source, name expression, arch) already logged by this process


def _cached_cubin(source_file: str, name_expr: str, arch: str) -> Tuple[bytes, str]:
    """(cubin, lowered name) of one instantiation, from the disk cache or compiled into it;
    logs (INFO, once per kernel and process) which it was and how long it took."""
    result = build(source_file, name_expr, arch)
    if (source_file, name_expr, arch) not in _logged_builds:
        _logged_builds.add((source_file, name_expr, arch))
        where = f"cache {result.path.parent}" if result.path else "disk cache off"
        if result.from_cache:
            logger.info("megatron_deepep: loaded %s %s (%s) from the disk cache in %.2f s (%s)",
                        source_file, name_expr, arch, result.seconds, where)
        else:
            logger.info("megatron_deepep: compiled %s %s for %s in %.1f s (%s; `python -m "
                        "megatron_deepep.tools.precompile` builds them ahead of a job)",
                        source_file, name_expr, arch, result.seconds, where)
    return result.cubin, result.lowered


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
