"""What every kernel wrapper shares: the launch stream, raw pointers, the error sink, and
the row dtypes the kernels move (combine.cu's kDtype)."""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch

from megatron_deepep.kernels import jit

COMM_THREADS = 512


def addr(tensor: Optional[torch.Tensor]) -> int:
    """A tensor's device address as a kernel argument (0 for None)."""
    return 0 if tensor is None else tensor.data_ptr()


def index_type_name(t: torch.Tensor) -> str:
    return "long long" if t.dtype == torch.int64 else "int"


_launch = threading.local()


@contextlib.contextmanager
def launch_on(stream):
    """Kernels launched inside go to `stream`; tensors are still allocated on the current stream
    (so a synchronous call needs no `record_stream`)."""
    previous = getattr(_launch, "stream", None)
    _launch.stream = stream
    try:
        yield
    finally:
        _launch.stream = previous


def on_launch_stream():
    """A context that makes `launch_on`'s stream torch's current one (a no-op outside
    `launch_on`): torch ops the kernels depend on, such as the transports' epoch advance, must
    run on the stream the kernels go to."""
    stream = getattr(_launch, "stream", None)
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def current_raw_stream():
    """torch's current stream as a raw handle (`jit.RawStream`: `cuda_stream`, `device_index`),
    without building a torch Stream object (~5 µs)."""
    return jit.current_raw_stream()


def launch_stream():
    """The stream kernels go to now: `launch_on`'s, else the current one as a raw handle
    (building a torch Stream object per launch costs tens of µs)."""
    stream = getattr(_launch, "stream", None)
    return stream if stream is not None else jit.current_raw_stream()


class ErrorSink:
    """Where kernels record the first error: a device claim word and a host-mapped record."""

    def __init__(self, claim_ptr: int, record_ptr: int):
        self.claim, self.record = int(claim_ptr), int(record_ptr)


def wire_format(fp8) -> tuple:
    """(kFmt, kDequant, amax_epsilon) of an optional `Fp8Dispatch`."""
    if fp8 is None:
        return 0, False, 0.0
    return fp8.wire_code, fp8.dequantize, float(fp8.fmt.amax_epsilon)


# Row dtypes of dispatch and combine: kDtype of combine.cu. Dispatch copies bytes (a row of any
# of them travels as bf16 words of the same bytes: `as_wire_rows`).
ROW_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
ROW_DTYPE_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def row_dtype_code(t: torch.Tensor) -> int:
    """combine.cu's kDtype for rows of `t`'s dtype."""
    code = ROW_DTYPE_CODES.get(t.dtype)
    assert code is not None, f"rows of {t.dtype} (the transports accept {list(ROW_DTYPE_CODES)})"
    return code


def as_wire_rows(x: torch.Tensor) -> torch.Tensor:
    """`x [N, H]` (a `ROW_DTYPE_CODES` dtype, contiguous, rows of 16-byte multiples) as the bf16
    rows `[N, H * x.element_size() / 2]` of the same bytes, which the dispatch kernels copy."""
    return x if x.dtype == torch.bfloat16 else x.view(torch.bfloat16)


def num_int4(rows: torch.Tensor) -> int:
    return rows.shape[1] * rows.element_size() // 16
