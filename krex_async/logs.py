"""structlog, configured once: JSON when not at a terminal (or when asked), console otherwise.

Ids are bound with contextvars (`bind_contextvars(command=..., region=...)`) per connection and per
command task, so every line of a command's life carries them.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

_dropped = 0


def dropped_lines() -> int:
    """Log lines lost because the log could not be written (full disk, closed pipe)."""
    return _dropped


class _NeverRaises:
    """The log stream, with write errors counted instead of raised: a full disk under the log must
    not fail the request or the command whose handler was logging."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, data: str) -> int:
        try:
            return self.stream.write(data)
        except (OSError, ValueError):  # counted at the flush that ends the line
            return len(data)

    def flush(self) -> None:  # PrintLogger flushes once per line
        global _dropped
        try:
            self.stream.flush()
        except (OSError, ValueError):
            _dropped += 1


def configure(fmt: str = "auto", level: str = "info") -> None:
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=_NeverRaises(sys.stderr)),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )


def get(name: str = "krex") -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)  # type: ignore[no-any-return]
