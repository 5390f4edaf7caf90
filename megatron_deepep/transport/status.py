"""What the kernels of one transport report to the host: errors and the receive layout.

Both live in mapped pinned memory, so the host reads them without a device synchronization:
the error record (`common/error.cuh`, written once by the first failing thread, claimed through
a device word) and `HostInfo` (`common/host_info.cuh`: the row count of the last published
receive layout and its padded rows per local expert, each a 64-bit word that also carries the
epoch it belongs to: `host_word`).

The host reads each such word with one aligned 64-bit load (single-copy atomic on x86-64 and
AArch64) and trusts a value only next to its own epoch, so it needs no load ordering between
words: a host whose loads may reorder (Arm: GH200, GB200) reads no stale row count or expert
size.
"""

from __future__ import annotations

import ctypes
import time
from typing import Callable, List, Optional, Tuple

import numpy as np

from megatron_deepep import ops
from megatron_deepep.transport.errors import ERROR_RECORD_WORDS, error_from_record
from megatron_deepep.transport.ipc import MappedHostArray
from megatron_deepep.transport.regions import MAX_LOCAL_EXPERTS

HOST_INFO_U64 = 1 + MAX_LOCAL_EXPERTS  # struct HostInfo of common/host_info.cuh: rows, experts
HOST_INFO_WORDS = 2 * HOST_INFO_U64  # in 32-bit words
# The host wait outlasts the kernels' own timeout, so a stalled peer is reported by the kernel.
HOST_WAIT_SLACK_S = 5.0
_NO_BITS = np.uint64(0)  # or-ed into the words: a vectorized copy of them
_VALUE_SHIFT = np.uint64(32)  # a host_word's value sits above its epoch


def unpack_host_word(word: int) -> Tuple[int, int]:
    """(value as int32, epoch as uint32) of a `host_word`."""
    word = int(word) & 0xFFFFFFFFFFFFFFFF
    value = word >> 32
    return value - (1 << 32) if value >= 1 << 31 else value, word & 0xFFFFFFFF


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
        # One aligned uint64 per HostInfo word: each read below is one 64-bit load.
        self._host_words = np.ctypeslib.as_array(
            (ctypes.c_uint64 * HOST_INFO_U64).from_address(self._host_info.host_ptr))
        self._broken: Optional[BaseException] = None
        self._published_epoch: Optional[int] = None

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
        words = self._host_words
        deadline = time.monotonic() + self.timeout_s + HOST_WAIT_SLACK_S
        target = epoch & 0xFFFFFFFF
        spins = 0
        while True:
            num_rows, seen = unpack_host_word(words[0])  # one load: the count with its epoch
            if seen == target:
                break
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
        self.check_errors()
        self._published_epoch = target
        return num_rows

    def tokens_per_expert(self, num_local: int) -> List[int]:
        """The padded rows per local expert of the layout `wait_num_rows` last returned.

        Each word carries its epoch; one read before the published epoch's stores reached this
        host (a load satisfied early) is read again.

        Raises:
            RuntimeError: no layout was waited for, or its words never showed its epoch.
        """
        if self._published_epoch is None:
            raise RuntimeError("tokens_per_expert: no receive layout was waited for")
        published = self._published_epoch
        deadline = None  # set at the first stale read
        while True:
            # One ufunc pass copies the words: each aligned uint64 element is read once, as one
            # 64-bit load, so a value and its epoch always come from the same load.
            words = np.bitwise_or(self._host_words[1:1 + num_local], _NO_BITS)
            epochs = words.astype(np.uint32)  # the low halves (the cast keeps them)
            stale = epochs != published
            if not stale.any():
                return (words >> _VALUE_SHIFT).astype(np.uint32).view(np.int32).tolist()
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s + HOST_WAIT_SLACK_S
            elif time.monotonic() > deadline:
                first = int(np.flatnonzero(stale)[0])
                raise RuntimeError(
                    f"megatron_deepep: rank {self.rank}: local expert {first}'s row count "
                    f"carries epoch {int(epochs[first])}, the published layout {published}")

    def destroy(self) -> None:
        self._host_info.destroy()
        self._error_record.destroy()
