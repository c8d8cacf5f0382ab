"""structlog, configured once: JSON when not at a terminal (or when asked), console otherwise.

Ids are bound with contextvars (`bind_contextvars(command=..., region=...)`) per connection and per
command task, so every line of a command's life carries them.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure(fmt: str = "auto", level: str = "info") -> None:
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get(name: str = "krex") -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)  # type: ignore[no-any-return]
