"""A command's stdin fed by its agent (`Submit.stdin_stream`, `krex run`'s default), like a shell's pipe.

The daemon makes the pipe when it accepts the command: the read end becomes the command's fd 0 at
spawn, the write end stays here and `StdinData` requests fill it. A write waits while the pipe is
full, so the agent's next chunk waits for its Ok: a command that never reads costs the daemon one
pipe buffer, never memory. `close()` (the command ended, or the agent sent eof) wakes a waiting
write with StdinClosed.
"""

from __future__ import annotations

import asyncio
import os


class StdinClosed(Exception):
    """The command's stdin is closed: it ended, closed its end, or the agent sent eof."""


class StdinBusy(Exception):
    """A write is already waiting: an agent sends its next chunk after the Ok of the last, so a
    peer cannot park any number of 1 MiB chunks in the daemon."""


class StdinPipe:
    """Owns both ends until spawn takes the read end (`reader()`); `close()` is idempotent."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self.w, False)
        self._lock = asyncio.Lock()
        self._waiter: asyncio.Future[None] | None = None
        self._watching: asyncio.AbstractEventLoop | None = None  # the loop with a writer on self.w

    def reader(self) -> int:
        """The read end, handed over: the caller (the spawn) closes it once the child has it."""
        fd, self.r = self.r, -1
        if fd < 0:
            raise OSError("the stdin pipe's read end was already taken or closed")
        return fd

    async def write(self, data: bytes, eof: bool = False) -> None:
        """Write all of `data`, waiting while the pipe is full; then close it if `eof`.
        Raises StdinClosed once nobody reads it any more (or it was closed), StdinBusy while
        another write waits."""
        if self._lock.locked():
            raise StdinBusy("a previous chunk is still being written; send the next after its Ok")
        async with self._lock:
            view = memoryview(data)
            while view:
                if self.w < 0:
                    raise StdinClosed("the command's stdin is closed")
                try:
                    view = view[os.write(self.w, view) :]
                except BlockingIOError:
                    await self._writable()
                except BrokenPipeError:
                    self.close()
                    raise StdinClosed("the command closed its stdin") from None
            if eof:
                self.close_writer()

    async def _writable(self) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiter = fut
        loop.add_writer(self.w, _wake, fut)
        self._watching = loop
        try:
            await fut
        finally:
            self._unwatch()
            self._waiter = None

    def _unwatch(self) -> None:
        if self._watching is not None:  # before the fd closes: its number may be reused
            self._watching.remove_writer(self.w)
            self._watching = None

    def close_writer(self) -> None:
        """The agent's eof: the command reads what is in the pipe, then EOF. The read end stays
        (a command still queued takes it at its spawn)."""
        self._unwatch()
        if self._waiter is not None:
            _wake(self._waiter)
        if self.w >= 0:
            os.close(self.w)
        self.w = -1

    def close(self) -> None:
        """Close what is still open (the command sees EOF) and wake a waiting write."""
        self.close_writer()
        if self.r >= 0:
            os.close(self.r)
        self.r = -1


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
