"""Replacing a small state file atomically (command records, the isolation intent record); letting
go of a standard output whose reader left."""

from __future__ import annotations

import contextlib
import os


def replace_file(path: str, data: bytes, *, durable: bool = False, mode: int = 0o600) -> None:
    """Replace `path` with `data` through a temporary file beside it, renamed over it: a reader
    sees the old content or the new, never part of either. `durable`: fsync the file before the
    rename and its directory after, so the new content also survives a power loss, not only a
    crash of the daemon. Raises OSError (the temporary file removed); never follows a link."""
    tmp = f"{path}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def quiet_stdout() -> None:
    """After a write to stdout failed (its reader left: `| head`): point fd 1 at /dev/null, so that
    the interpreter's own flush at exit does not print a second error."""
    import sys

    with contextlib.suppress(OSError, ValueError, AttributeError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
