"""CPU tier: kernel argument structs are filled by name into the bytes the kernel reads, and
every launch-path CUDA call's failure is named."""

from __future__ import annotations

import ctypes
import struct
import threading

import pytest

from megatron_deepep.kernels import jit
from tests.helpers import mirrors


class _Args(jit.KernelArgs):
    c_name = "Test"
    _fields_ = [("p", jit.Ptr), ("n", jit.I32), ("e", jit.F32), ("t", jit.U64),
                ("u", jit.U32), ("q", jit.Ptr), ("big", jit.I64)]


def _fill(**overrides):
    values = dict(p=0x1122334455667788, n=-5, e=1.5, t=2**64 - 1, u=7, q=0, big=-(2**40))
    values.update(overrides)
    return _Args.fill(**values)


def test_fill_packs_fields_at_their_ctypes_offsets():
    args = _fill()
    raw = bytes(args)
    assert len(raw) == ctypes.sizeof(_Args) == 48
    assert struct.unpack_from("<Q", raw, _Args.p.offset)[0] == 0x1122334455667788
    assert struct.unpack_from("<i", raw, _Args.n.offset)[0] == -5
    assert struct.unpack_from("<f", raw, _Args.e.offset)[0] == 1.5
    assert struct.unpack_from("<Q", raw, _Args.t.offset)[0] == 2**64 - 1
    assert struct.unpack_from("<I", raw, _Args.u.offset)[0] == 7
    assert struct.unpack_from("<q", raw, _Args.big.offset)[0] == -(2**40)
    assert mirrors.args_dict(args)["q"] == 0 and mirrors.args_dict(args)["n"] == -5
    # kernelParams: a void*[1] whose one entry is the struct's address.
    assert ctypes.c_void_p.from_address(args.kernel_params).value == ctypes.addressof(args)


def test_fill_reuses_one_struct_per_thread():
    first = _fill()
    assert _fill(n=3) is first and first.n == 3
    other = []
    thread = threading.Thread(target=lambda: other.append(_fill(n=4)))
    thread.start()
    thread.join()
    assert other[0] is not first and first.n == 3


def test_missing_unknown_and_out_of_range_fields_are_errors():
    with pytest.raises(TypeError, match="field 'big' not given"):
        _Args.fill(p=1, n=1, e=0.0, t=0, u=0, q=0)
    with pytest.raises(TypeError, match=r"unknown fields \['extra'\]"):
        _fill(extra=1)
    with pytest.raises(TypeError, match=r"_Args.n = 2147483648"):
        _fill(n=2**31)
    with pytest.raises(TypeError, match=r"_Args.u = -1"):
        _fill(u=-1)


def test_cu_check_names_the_call_and_the_error():
    from cuda.bindings import driver, runtime
    assert jit.cu_check((driver.CUresult.CUDA_SUCCESS, 5), "x") == 5
    assert jit.cu_check((runtime.cudaError_t.cudaSuccess,), "x") is None
    with pytest.raises(jit.CudaError, match="cuModuleLoadData.*CUDA_ERROR_INVALID_IMAGE"):
        jit.cu_check((driver.CUresult.CUDA_ERROR_INVALID_IMAGE, None), "cuModuleLoadData(a.cu)")
    with pytest.raises(jit.CudaError, match="cudaMalloc.*cudaErrorMemoryAllocation"):
        jit.cu_check((runtime.cudaError_t.cudaErrorMemoryAllocation, 0), "cudaMalloc(8 bytes)")


def test_cache_writes_are_atomic(tmp_path):
    target = tmp_path / "k.cubin"
    jit.write_atomic(target, b"abc")
    assert target.read_bytes() == b"abc" and [p.name for p in tmp_path.iterdir()] == ["k.cubin"]


def test_knobs_reach_the_compile_options(monkeypatch, tmp_path):
    monkeypatch.setenv("MDEEP_JIT_LINEINFO", "1")
    assert "-lineinfo" in jit._options("sm_90")
    monkeypatch.delenv("MDEEP_JIT_LINEINFO")
    assert "-lineinfo" not in jit._options("sm_90")
    monkeypatch.setenv("MDEEP_CACHE_DIR", str(tmp_path / "kernels"))
    assert jit._cache_dir() == tmp_path / "kernels"
