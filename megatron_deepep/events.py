"""Events returned by asynchronous operations, in DeepEP's `EventOverlap` style."""

from __future__ import annotations

from typing import Optional, Sequence

import torch


class EventHandle:
    """A CUDA event recorded on the communication stream after an operation.

    Args:
        event: the recorded `torch.cuda.Event`, or None where the operation already finished
            in stream order on the current stream (CPU tensors, the reference transport).
        extra_tensors: tensors kept alive until the event has been waited on (graph-safe
            alternative to `record_stream`).
    """

    def __init__(self, event: Optional[torch.cuda.Event] = None,
                 extra_tensors: Sequence[torch.Tensor] = ()):
        self.event = event
        self.extra_tensors = tuple(extra_tensors)

    @staticmethod
    def capture() -> "EventHandle":
        """Records an event on the current stream (use it as a `previous_event`)."""
        if not torch.cuda.is_available():
            return EventHandle(None)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return EventHandle(event)

    def current_stream_wait(self) -> None:
        """Makes the current stream wait for the operation (no host synchronization)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        self.extra_tensors = ()

    def __enter__(self) -> "EventHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.current_stream_wait()
