"""Logging helpers shared by the package."""

from __future__ import annotations

import logging

_SEEN = set()


def log_once(log: logging.Logger, message: str, *args) -> None:
    """Logs `message % args` at INFO through `log` the first time this text appears."""
    key = (log.name, message % args)
    if key not in _SEEN:
        _SEEN.add(key)
        log.info(message, *args)


#: Known messages of other libraries that say nothing to a user of our examples, by logger:
#: torch's on a CUDA build without a GPU (every process that imports megatron-core prints it),
#: and megatron-core 0.19's notice for each GPTModel built (the examples choose that model).
KNOWN_NOISE = {
    "torch.utils.cpp_extension": "No CUDA runtime is found",
    "megatron.core.models.gpt.gpt_model": "GPTModel IS DEPRECATED",
}


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_known_noise() -> None:
    """Drops `KNOWN_NOISE` (for the examples' processes; the library itself never calls it).
    Call it before megatron-core is imported; calling it again adds nothing."""
    for name, prefix in KNOWN_NOISE.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefix) and f.prefix == prefix for f in log.filters):
            log.addFilter(_DropPrefix(prefix))
