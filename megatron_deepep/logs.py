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
