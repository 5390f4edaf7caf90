"""The protocol's epochs, kept in device memory so that CUDA graphs can replay the calls.

Every flag and signal of the EP > 1 transports carries the epoch of the call that wrote it, and
every writer first waits for its reader's flag of the previous epoch. An epoch passed as a
launch argument would be frozen into a captured graph: its replays would reuse the captured
values and race with the flags they left. So each transport keeps three words on the device
(notify, dispatch, combine), advances them in stream order before each call (one small torch
kernel on the stream the call's kernels go to, captured with them), and the kernels read their
epoch from the word
(`epoch_word` in `cuda_src/common/args.cuh`). Eager calls and graph replays then share one
sequence per buffer.
"""

from __future__ import annotations

import torch

from megatron_deepep import ops

_NOTIFY, _DISPATCH, _COMBINE = 0, 1, 2


class DeviceEpochs:
    """Notify, dispatch and combine epoch words of one transport (int32 on `device`, zero at
    start; the kernels read them as u32 and compare wrap-safely).

    Attributes:
        notify, dispatch, combine: device addresses of the three words (`epoch_word` of the
            kernels of that step).
    """

    def __init__(self, device: torch.device):
        self.words = torch.zeros(4, dtype=torch.int32, device=device)
        if self.words.is_cuda:
            torch.cuda.current_stream(device).synchronize()  # zeros visible to any stream
        base = self.words.data_ptr()
        self.notify, self.dispatch, self.combine = (base + 4 * i
                                                    for i in (_NOTIFY, _DISPATCH, _COMBINE))
        # Views made once: advancing costs one kernel launch and no slicing.
        self._notify_and_dispatch = self.words[_NOTIFY:_DISPATCH + 1]
        self._dispatch = self.words[_DISPATCH:_DISPATCH + 1]
        self._combine = self.words[_COMBINE:_COMBINE + 1]

    def advance_dispatch(self) -> None:
        """Before a dispatch (notify and dispatch kernels), on the stream they run on."""
        with ops.on_launch_stream():
            self._notify_and_dispatch.add_(1)

    def advance_cached_dispatch(self) -> None:
        """Before a cached dispatch (no notify), on the stream its kernels run on."""
        with ops.on_launch_stream():
            self._dispatch.add_(1)

    def advance_combine(self) -> None:
        """Before a combine, on the stream its kernels run on."""
        with ops.on_launch_stream():
            self._combine.add_(1)

    def read(self) -> dict:
        """The current epochs (synchronizes with the device; for tests and debugging)."""
        notify, dispatch, combine, _ = self.words.tolist()
        return dict(notify=notify, dispatch=dispatch, combine=combine)


__all__ = ["DeviceEpochs"]
