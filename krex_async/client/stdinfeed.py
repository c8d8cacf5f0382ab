"""`krex run`'s side of a command's stdin: read fd 0 (a pipe, a file or a terminal) and send it on.

A thread reads, because a terminal or a regular file cannot be watched by the event loop, and it
reads the next chunk only once the daemon wrote the previous one into the command's pipe: a command
that does not read holds `krex run` back, and nothing piles up in memory. On a terminal SIGTTIN is
ignored, so a `krex run ... &` in the background gets EIO from its read (retried until it is in the
foreground) instead of being stopped.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import stat
import threading
import time
from typing import Any

CHUNK = 1 << 16


def stdin_usable() -> bool:
    """Whether fd 0 is open and readable (a closed stdin gives the command /dev/null)."""
    try:
        mode = os.fstat(0).st_mode
    except OSError:
        return False
    return not stat.S_ISDIR(mode)


async def feed_stdin(handle: Any, fd: int = 0) -> None:
    """Send `fd` to the command of `handle` (a CommandHandle) until EOF, then close its stdin.
    Returns early, quietly, once the command no longer reads it (stdin_closed) or has ended."""
    from krex_async.client.submit import KrexError

    loop = asyncio.get_running_loop()
    q: asyncio.Queue[bytes] = asyncio.Queue(maxsize=1)
    tty = os.isatty(fd)
    if tty:
        signal.signal(signal.SIGTTIN, signal.SIG_IGN)
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                data = os.read(fd, CHUNK)
            except InterruptedError:
                continue
            except OSError as e:
                if tty and e.errno == errno.EIO:  # a background job: wait for the foreground
                    time.sleep(0.2)
                    continue
                data = b""
            try:
                asyncio.run_coroutine_threadsafe(q.put(data), loop).result()
            except BaseException:  # the loop is gone (or cancelled the put): krex run is exiting
                return
            if not data:
                return

    threading.Thread(target=reader, name="krex-stdin", daemon=True).start()
    try:
        while True:
            data = await q.get()
            try:
                await handle.write_stdin(data, eof=not data)
            except KrexError:  # stdin_closed, or the command ended and was forgotten
                return
            if not data:
                return
    finally:
        stop.set()
