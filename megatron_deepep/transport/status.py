"""What the kernels of one transport report to the host: errors and the receive layout.

Both live in mapped pinned memory, so the host reads them without a device synchronization:
the error record (`common/error.cuh`, written once by the first failing thread, claimed through
a device word) and `HostInfo` (`common/host_info.cuh`: the epoch of the last published receive
layout, its row count and padded rows per local expert).
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional

from megatron_deepep import ops
from megatron_deepep.transport.errors import ERROR_RECORD_WORDS, error_from_record
from megatron_deepep.transport.ipc import MappedHostArray
from megatron_deepep.transport.regions import MAX_LOCAL_EXPERTS

HOST_INFO_WORDS = 4 + MAX_LOCAL_EXPERTS  # struct HostInfo of common/host_info.cuh
# The host wait outlasts the kernels' own timeout, so a stalled peer is reported by the kernel.
HOST_WAIT_SLACK_S = 5.0


class BrokenBufferError(RuntimeError):
    """The transport saw a kernel error earlier; its flags are no longer consistent."""


class KernelStatus:
    """The error record and receive-layout mailbox of one transport.

    Args:
        claim_ptr: device address of the int32 word the first failing thread claims (zero at
            start).
        rank: this rank (for messages).
        timeout_s: the kernels' timeout.
        locate: where an EP rank sits, for timeout messages (`errors.error_from_record`).

    Attributes:
        errors: the `ops.ErrorSink` every kernel launch takes.
        host_info_ptr: device address of the `HostInfo` mailbox.
    """

    def __init__(self, claim_ptr: int, rank: int, timeout_s: float,
                 locate: Optional[Callable[[int], str]] = None):
        self.rank = rank
        self.locate = locate
        self.timeout_s = timeout_s
        self._host_info = MappedHostArray(HOST_INFO_WORDS)
        self._error_record = MappedHostArray(ERROR_RECORD_WORDS)
        self.errors = ops.ErrorSink(claim_ptr, self._error_record.device_ptr)
        self.host_info_ptr = self._host_info.device_ptr
        self._broken: Optional[BaseException] = None

    def check_errors(self) -> None:
        """Raises the first error any kernel recorded (reads host memory; no device sync).

        Raises:
            BrokenBufferError: an error was raised before; the transport is unusable.
        """
        if self._broken is not None:
            raise BrokenBufferError(
                f"this Buffer failed earlier ({self._broken}); destroy it and build a new one")
        exc = error_from_record(self._error_record.words, self.timeout_s, self.locate)
        if exc is not None:
            self._broken = exc
            raise exc

    def wait_num_rows(self, epoch: int) -> int:
        """Polls the mailbox until it holds the receive layout of `epoch`; returns its row
        count. Its per-expert rows stay readable (`tokens_per_expert`) until the next epoch.

        Raises:
            RuntimeError: a kernel recorded an error, or the GPU never published the epoch.
        """
        words = self._host_info.words
        deadline = time.monotonic() + self.timeout_s + HOST_WAIT_SLACK_S
        target = epoch & 0xFFFFFFFF
        spins = 0
        while (int(words[0]) & 0xFFFFFFFF) != target:
            spins += 1
            if spins % 64 == 0:
                self.check_errors()
                if time.monotonic() > deadline:
                    self._broken = RuntimeError("host wait for the receive layout timed out")
                    raise RuntimeError(
                        f"megatron_deepep: rank {self.rank} waited "
                        f"{self.timeout_s + HOST_WAIT_SLACK_S:g}s for the receive layout of "
                        "its dispatch, which the GPU never published (the kernel did not run)")
                if spins > 4096:
                    time.sleep(1e-5)
        num_rows = int(words[1])
        self.check_errors()
        return num_rows

    def tokens_per_expert(self, num_local: int) -> List[int]:
        """The last published padded rows per local expert."""
        return self._host_info.words[4:4 + num_local].tolist()

    def destroy(self) -> None:
        self._host_info.destroy()
        self._error_record.destroy()
