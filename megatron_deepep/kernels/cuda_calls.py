"""Checked calls into the one CUDA binding (`cuda.bindings`): the error type, the result
check every driver / runtime call goes through, and the current context.

The bottom layer: kernels are compiled and launched by `jit`, memory is mapped by
`transport/ipc.py`; both check their calls here.
"""

from __future__ import annotations


class CudaError(RuntimeError):
    """A CUDA driver or runtime call failed; the message names the call and the error."""


def error_name(err) -> str:
    """The enum name of a CUresult or cudaError_t, e.g. CUDA_ERROR_INVALID_VALUE."""
    return getattr(err, "name", None) or f"CUDA error {int(err)}"


def cu_check(result, what: str):
    """The values of a driver or runtime call's result tuple (status first).

    Raises:
        CudaError: the status is not success; the message names `what` and the error.
    """
    err = result[0]
    if int(err) != 0:
        raise CudaError(f"{what} failed: {error_name(err)}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def ensure_context(device_index: int) -> None:
    """Makes sure a context is current in this thread: torch's, else the device's primary
    context (the one torch uses), retained and made current."""
    from cuda.bindings import driver
    ctx = cu_check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(ctx) != 0:
        return
    device = cu_check(driver.cuDeviceGet(device_index), f"cuDeviceGet({device_index})")
    primary = cu_check(driver.cuDevicePrimaryCtxRetain(device),
                       f"cuDevicePrimaryCtxRetain(device {device_index})")
    cu_check(driver.cuCtxSetCurrent(primary), "cuCtxSetCurrent")


def stream_capture_id(cuda_stream: int):
    """The id of the graph capture the stream (a raw handle) is recording, unique in the
    process; None when it is not capturing or the driver does not answer."""
    from cuda.bindings import driver
    result = driver.cuStreamGetCaptureInfo(cuda_stream)
    if int(result[0]) != 0:
        return None
    status, capture_id = result[1], result[2]
    if status != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
        return None
    return int(capture_id)


class RawEvent:
    """A CUDA event (no timing) recorded and waited for on raw stream handles through the
    driver: its callers need no torch Stream object (torch's `Event.record()` builds one for
    the current stream, ~5 µs). Made in the current context at its first record; destroyed with
    the object.

    Streams are anything with `cuda_stream` (a raw handle): a torch Stream or a `jit.RawStream`.
    """

    __slots__ = ("_handle", "_driver")

    def __init__(self):
        from cuda.bindings import driver
        self._handle = None
        self._driver = driver  # bound once: a call records one of these per Buffer call

    def record(self, stream) -> None:
        """Records the work issued so far on `stream`.

        Raises:
            CudaError: the driver refused the event or the record.
        """
        driver = self._driver
        if self._handle is None:
            self._handle = cu_check(
                driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING),
                "cuEventCreate")
        cu_check(driver.cuEventRecord(self._handle, stream.cuda_stream), "cuEventRecord")

    def wait(self, stream) -> None:
        """Makes `stream` wait for the last record (the event must have been recorded).

        Raises:
            CudaError: the driver refused the wait.
        """
        cu_check(self._driver.cuStreamWaitEvent(stream.cuda_stream, self._handle, 0),
                 "cuStreamWaitEvent")

    def __del__(self):
        if self._handle is not None:
            try:
                self._driver.cuEventDestroy(self._handle)
            except Exception:  # interpreter shutdown: the driver may be gone already
                pass
