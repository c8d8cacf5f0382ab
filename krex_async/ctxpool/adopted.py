"""Adoption, the worker's side: take over an interpreter that asked the daemon to be run warm.

The pool sends "run" with the adopter's world (spec["adopt"]: sys.path, flags, signals, umask) and,
as its only fd, a pidfd of the adopting process. `take_stdio` copies that process's fds 0/1/2 with
pidfd_getfd(2): the same open file descriptions (offsets, O_APPEND, pipes, terminals) a fresh
process would have inherited, and the user's descriptors never pass through the daemon. `shadowed`
says when a module the worker imported while warming would have come from elsewhere on the
adopter's sys.path (a PYTHONPATH entry, a file beside the script): that program must start fresh.

Imported by the worker: standard library only.
"""

from __future__ import annotations

import ctypes
import os
import sys
import zipfile
from importlib.machinery import PathFinder
from typing import Any

from krex_async.linux.procfs import stat_fields

_SYS_PIDFD_GETFD = 438  # the same number on every architecture (the unified syscall table)
_libc: Any = None


def pidfd_getfd(pidfd: int, fd: int) -> int:
    """A copy of `fd` of the process behind `pidfd` (close-on-exec). Raises OSError (EPERM:
    no ptrace access; EBADF: that fd is closed; ESRCH: the process is gone)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    got = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pidfd_getfd(fd {fd}): {os.strerror(err)}")
    return int(got)


def take_stdio(pidfd: int) -> list[int]:
    """fds 0, 1, 2 of the adopter; closes `pidfd`. Raises OSError with nothing left open."""
    got: list[int] = []
    try:
        for fd in (0, 1, 2):
            got.append(pidfd_getfd(pidfd, fd))
    except OSError:
        for fd in got:
            os.close(fd)
        raise
    finally:
        os.close(pidfd)
    return got


def top_modules() -> dict[str, str]:
    """Top-level modules imported now that were loaded from a file: name -> realpath of it."""
    out = {}
    for name, mod in list(sys.modules.items()):
        spec = getattr(mod, "__spec__", None)
        if "." in name or spec is None or not spec.has_location or not spec.origin:
            continue
        out[name] = os.path.realpath(spec.origin)
    return out


def shadowed(path: list[str], worker_path: list[str], tops: dict[str, str]) -> str | None:
    """The first module of `tops` that a fresh interpreter with sys.path `path` would load from
    another file than the worker did, as "module NAME"; None when all agree.

    Only names that an entry of `path` not on `worker_path` provides are looked up (a directory
    listing per such entry), unless the common entries are in another order.
    """
    known = set(worker_path)
    new = [e for e in path if e not in known]
    common = [e for e in path if e in known]
    if common != [e for e in worker_path if e in set(common)]:
        names = set(tops)
    else:
        names = set()
        for entry in new:
            names |= _provides(entry or os.getcwd()) & tops.keys()
    for name in sorted(names):
        spec = PathFinder.find_spec(name, path)
        origin = getattr(spec, "origin", None)
        if spec is not None and origin and os.path.realpath(origin) != tops[name]:
            return f"module {name}"
    return None


def _provides(entry: str, limit: int = 20000) -> set[str]:
    """Top-level module names a sys.path directory or zip archive (a zipapp, an egg) offers
    (modules, packages, extensions)."""
    try:
        items = os.listdir(entry)
    except NotADirectoryError:
        try:
            with zipfile.ZipFile(entry) as z:
                items = list({n.partition("/")[0] for n in z.namelist()})
        except (OSError, zipfile.BadZipFile):
            return set()
    except OSError:
        return set()
    if len(items) > limit:
        items = items[:limit]
    return {i.partition(".")[0] for i in items if i and not i.startswith(".")}


_worker_getppid = os.getppid


def seen_parent(adopter: int) -> None:
    """Make os.getppid() what the program would see: its waiting interpreter's parent (the shell,
    the runner, the caller of subprocess), not the daemon that started the worker, so that
    `os.kill(os.getppid(), sig)` reaches that parent rather than the daemon. Only in the worker
    itself: a child it forks has the worker as its real parent and sees it. 0: the worker's own
    (a command the worker started as its argv, or the next command of a reused worker)."""
    if not adopter:
        os.getppid = _worker_getppid
        return
    worker = os.getpid()

    def getppid() -> int:
        if os.getpid() == worker and (f := stat_fields(adopter)) is not None:
            return int(f[1])
        return _worker_getppid()

    getppid.__doc__ = _worker_getppid.__doc__
    os.getppid = getppid


def apply(adopt: dict[str, Any]) -> None:
    """The adopter's settable interpreter state: umask and bytecode writing (sys.path, signals,
    stdio buffering and sys.executable are set by fresh.enter)."""
    os.umask(int(adopt.get("umask", 0o022)))
    sys.dont_write_bytecode = bool(adopt.get("dont_write_bytecode"))
    sys.pycache_prefix = adopt.get("pycache_prefix")
