"""Space kept on the state disk for the records regions need, should something else fill it.

The daemon allocates `<state_dir>/space.reserve` at start. A record write (the cgroup backend's
intent record, the driver-lock record) that fails with ENOSPC releases the reserve and is tried once
more, so regions go on while something other than krex's spool (which stops short of its own margin)
fills the disk; the disk is then reported full (`state_disk_full` in status and metrics) until the
reserve is made again, which each later write and each status read tries once the disk has room for
the reserve and as much again, as the daemon may take it (`_room`): space was freed. Making it back
from the room it gave (all there is while the disk stays full) would report the disk fine while it
is not, and the next write would only spend it again; whether status said so would depend on
whether some other write had taken that room.

A reserve that cannot be made for a reason other than space (a file system without fallocate, a
directory or link at its path) is `unavailable` (why, in status and the log): the disk is not
taken to be full for it, and is full only while a record write meets ENOSPC and until statvfs shows
the room again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable

NAME = "space.reserve"
MOST = 1 << 20  # bytes kept: dozens of record rewrites
LEAST = 16 << 10  # on a tiny file system: a few pages still
SPACE = (errno.ENOSPC, errno.EDQUOT)  # the errors that say the disk (or a quota) is full
_by_dir: dict[str, Reserve] = {}


class Reserve:
    """The reserve file of one state dir; safe from any thread."""

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, NAME)
        self.full = False  # a write met ENOSPC and the reserve is not back yet
        self.unavailable = ""  # why no reserve can be made here at all (not for want of space)
        self._mutex = threading.Lock()
        try:
            st = os.statvfs(state_dir)
            self.size = max(LEAST, min(MOST, st.f_blocks * st.f_frsize // 16))
        except OSError:
            self.size = LEAST

    def make(self) -> bool:
        """Allocate the reserve (again); False where the disk has not the room (nothing kept). One
        that fails otherwise is `unavailable`: True, nothing kept, the disk not taken to be full."""
        with self._mutex:
            try:
                if not _allocate(self.path, self.size):
                    return False
                self.unavailable = ""
            except OSError as e:
                self.unavailable = f"{self.path}: {e.strerror or e}"
            self.full = False
            return True

    def _drop(self) -> None:
        with contextlib.suppress(OSError):  # none there (spent, or unavailable): nothing to give
            os.unlink(self.path)

    def _room(self) -> bool:
        """Whether the disk has room for the reserve and as much again, as this process may take it:
        statvfs only bounds that (a root daemon may use the blocks kept for root, which f_bavail
        leaves out, and ext4 keeps others from everyone, which f_bfree counts), so an allocation of
        that much, given back at once, tells (under the mutex: a write that fails meanwhile waits
        for it to end and tries again)."""
        try:
            st = os.statvfs(os.path.dirname(self.path))
        except OSError:
            return False
        if st.f_bfree * st.f_frsize < 2 * self.size:
            return False
        probe = self.path + ".probe"
        with self._mutex:
            try:
                ok = _allocate(probe, 2 * self.size, fresh=True)
            except OSError:  # no allocation here for another reason: statvfs is all there is
                ok = True
            with contextlib.suppress(OSError):
                os.unlink(probe)
            return ok

    def refresh(self) -> bool:
        """Whether the disk is still full: makes the reserve again once it was spent and space freed."""
        if self.full and self._room():
            self.make()
        return self.full

    def write(self, fn: Callable[[], None]) -> None:
        """Run record write `fn`; on ENOSPC spend the reserve (if any is left) and run it once more
        (OSError if that fails too): a probe (`_room`) that took the room a moment has ended then."""
        try:
            fn()
        except OSError as e:
            if e.errno not in SPACE:
                raise
            self.full = True
            with self._mutex:
                self._drop()
            fn()
            return
        self.refresh()


def _allocate(path: str, size: int, fresh: bool = False) -> bool:
    """Allocate `size` bytes to `path` (created; a link refused; `fresh`: emptied first, so that
    blocks it held already do not count); False, and `path` removed, where the disk has not the room;
    OSError where it fails for another reason (no fallocate there, a directory or link at `path`)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_TRUNC if fresh else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        if e.errno in SPACE:  # no inode left
            return False
        raise
    try:
        os.posix_fallocate(fd, 0, size)
        return True
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(path)
        if e.errno in SPACE:
            return False
        raise
    finally:
        os.close(fd)


def setup(state_dir: str) -> Reserve:
    """The reserve of `state_dir`, allocated now where there is room (see `refresh`)."""
    r = _by_dir.setdefault(os.path.realpath(state_dir), Reserve(state_dir))
    if not r.make():
        r.full = True
    return r


def of(state_dir: str) -> Reserve | None:
    return _by_dir.get(os.path.realpath(state_dir))


def guarded(path: str, fn: Callable[[], None]) -> None:
    """Run `fn`, which writes `path`, through the reserve of the state dir `path` is in, if any."""
    r = _by_dir.get(os.path.realpath(os.path.dirname(path)))
    if r is None:
        fn()
    else:
        r.write(fn)
