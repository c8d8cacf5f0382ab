"""The one helper for cgroup file access, the cgroup.events watch, and layout detection.

Every read, write, mkdir and rmdir of a cgroup file goes through `CgroupFS`, rooted at a directory
(a delegated cgroup, or a temporary tree in tests). Failures raise `CgroupFileError` carrying the
operation, path, data and errno; a cgroup that no longer exists raises its subclass `CgroupVanished`,
which callers treat as a state.

`EventsWatcher` is one inotify instance per event loop (IN_MODIFY on cgroup.events, which kernfs
raises on every change of `populated` or `frozen`). A watch is armed before the write whose effect it
waits for, so no change is missed; waiting is bounded and never polls with sleeps.

`detect()` finds the layout: pure v2 (cpuset in the v2 cgroup.controllers) or hybrid (v2 for freezing,
the v1 cpuset hierarchy for cores), and the subtree the daemon may write: a configured path, or its own
cgroup from /proc/self/cgroup.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import struct
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

from krex_async.isolation.base import IsolationError
from krex_async.linux import procfs


class CgroupFileError(IsolationError):
    """A cgroup file operation failed: `op` on `path` (with `data` for writes), errno `errno`."""

    def __init__(self, op: str, path: str, data: str | None, err: OSError) -> None:
        shown = f" {data!r}" if data is not None else ""
        super().__init__(f"{op}{shown} {path}: {err.strerror or err} (errno {err.errno})")
        self.op, self.path, self.data, self.errno = op, path, data, err.errno


class CgroupVanished(CgroupFileError):
    """The cgroup (or the file) is gone: its processes exited and someone removed it."""


def _error(op: str, path: str, data: str | None, err: OSError) -> CgroupFileError:
    cls = CgroupVanished if err.errno in (errno.ENOENT, errno.ENODEV) else CgroupFileError
    return cls(op, path, data, err)


class CgroupFS:
    """Files of one cgroup tree, addressed relative to `root` ("" is the root itself)."""

    #: files read (and cgroup.freeze written) on every region: kept open, a pread/pwrite costs a
    #: fraction of open+read+close (kernfs regenerates at offset 0)
    #: cgroup.procs only with `keep_procs` (v2): a v1 cgroup.procs fd re-serves a cached pid list.
    KEPT = ("cgroup.freeze", "cgroup.events")

    def __init__(self, root: str, *, keep_procs: bool = False) -> None:
        self.root = root.rstrip("/") or "/"
        self._kept: dict[str, int] = {}  # path -> fd of a kept file
        self._paths: dict[tuple[str, str], str] = {}  # (rel, name) -> full path, dropped by release()
        self.kept_names = self.KEPT + (("cgroup.procs",) if keep_procs else ())

    def __repr__(self) -> str:
        return f"CgroupFS({self.root!r})"

    def path(self, rel: str, name: str = "") -> str:
        """The full path (cached: a region asks for the same few files of every sibling)."""
        p = self._paths.get((rel, name))
        if p is None:
            if len(self._paths) > 65536:  # cgroups come and go; release() forgets theirs
                self._paths.clear()
            p = self._paths[(rel, name)] = os.path.join(self.root, rel, name) if (rel or name) else self.root
        return p

    def read(self, rel: str, name: str) -> str:
        p = self.path(rel, name)
        if name in self.kept_names:
            for retry in (False, True):
                try:
                    data = os.pread(self._fd(p), 65536, 0)
                    if len(data) < 65536:  # else: a long pid list, read whole below
                        return data.decode()
                    break
                except OSError as e:
                    self._drop_fd(p)
                    if retry or e.errno != errno.ENODEV:  # ENODEV: the cgroup was removed
                        raise _error("read", p, None, e) from None
        try:
            with open(p) as f:
                return f.read()
        except OSError as e:
            raise _error("read", p, None, e) from None

    def write(self, rel: str, name: str, data: str) -> None:
        """One write(2) of `data` ("" is sent as "\\n": an empty write may never reach the kernel's
        handler); the kernel's verdict (EINVAL, EBUSY...) comes back as CgroupFileError."""
        p = self.path(rel, name)
        raw = (data or "\n").encode()
        if name == "cgroup.freeze":
            for retry in (False, True):
                try:
                    os.pwrite(self._fd(p), raw, 0)
                    return
                except OSError as e:
                    self._drop_fd(p)
                    if retry or e.errno != errno.ENODEV:  # ENODEV: reopen once (recreated?)
                        raise _error("write", p, data, e) from None
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as e:
            raise _error("write", p, data, e) from None
        try:
            os.write(fd, raw)
        except OSError as e:
            raise _error("write", p, data, e) from None
        finally:
            os.close(fd)

    def _fd(self, p: str) -> int:
        fd = self._kept.get(p)
        if fd is None:
            flags = os.O_RDWR if p.endswith("cgroup.freeze") else os.O_RDONLY
            fd = self._kept[p] = os.open(p, flags | os.O_CLOEXEC)
        return fd

    def _drop_fd(self, p: str) -> None:
        fd = self._kept.pop(p, None)
        if fd is not None:
            os.close(fd)

    def release(self, rel: str = "") -> None:
        """Close the kept files of `rel` and below (before its rmdir; all of them for "")."""
        top = self.path(rel).rstrip("/") + "/"
        for p in [p for p in self._kept if p.startswith(top)]:
            self._drop_fd(p)
        if not rel:
            self._paths.clear()
        else:
            for key in [k for k in self._paths if k[0] == rel or k[0].startswith(rel + "/")]:
                del self._paths[key]

    def mkdir(self, rel: str) -> bool:
        """Create the cgroup; False when it already existed."""
        p = self.path(rel)
        try:
            os.mkdir(p)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            raise _error("mkdir", p, None, e) from None

    def rmdir(self, rel: str) -> bool:
        """Remove the (empty) cgroup; False when it was already gone. EBUSY while tasks remain."""
        p = self.path(rel)
        self.release(rel)
        try:
            os.rmdir(p)
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            raise _error("rmdir", p, None, e) from None

    def exists(self, rel: str, name: str = "") -> bool:
        return os.path.exists(self.path(rel, name))

    def children(self, rel: str) -> list[str]:
        """Child cgroups of `rel`, as paths relative to the root; [] when `rel` is gone."""
        try:
            with os.scandir(self.path(rel)) as it:
                return sorted(os.path.join(rel, e.name) for e in it if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise _error("list", self.path(rel), None, e) from None

    def walk(self, rel: str) -> list[str]:
        """`rel` and all its descendants, parents before children; [] when `rel` is gone."""
        if not self.exists(rel):
            return []
        out = [rel]
        for child in self.children(rel):
            out.extend(self.walk(child))
        return out

    def procs(self, rel: str) -> list[int]:
        """Pids in cgroup.procs (v1 or v2); [] when the cgroup is gone."""
        try:
            return [int(x) for x in self.read(rel, "cgroup.procs").split()]
        except CgroupVanished:
            return []

    def events(self, rel: str) -> dict[str, int]:
        """cgroup.events as a dict ({'populated': 1, 'frozen': 0}). Raises CgroupVanished."""
        words = self.read(rel, "cgroup.events").split()
        return {k: int(v) for k, v in zip(words[::2], words[1::2])}


# --- inotify -------------------------------------------------------------------------------------

_IN_MODIFY, _IN_DELETE_SELF, _IN_IGNORED = 0x2, 0x400, 0x8000
_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_libc = ctypes.CDLL(None, use_errno=True)
K = TypeVar("K", bound=Hashable)


class Watch:
    """One armed watch of one cgroup.events file; `until()` waits for a predicate on that cgroup."""

    def __init__(self, owner: EventsWatcher, wd: int) -> None:
        self._owner, self.wd = owner, wd
        self.gone = False
        #: the events of the waiters on this watch (`until_all`), set on every change
        self.listeners: set[asyncio.Event] = set()

    def _notify(self, mask: int) -> None:
        if mask & (_IN_IGNORED | _IN_DELETE_SELF):
            self.gone = True
        for ev in self.listeners:
            ev.set()

    async def until(self, pred: Callable[[], bool], timeout: float, spin: float = 0.0) -> bool:
        """Await `pred()` true, re-checked on each change of the file. False when `timeout` passed.

        `spin`: for this long first, re-check on every loop turn as well (no sleeping: other
        coroutines run in between): the kernel defers and rate-limits cgroup file notifications, so
        the inotify event for `frozen 1` can come milliseconds after the state itself; the watch
        stays armed throughout.
        Exceptions of `pred` (CgroupVanished when the cgroup went away) propagate.
        """
        done = await Watch.until_all({0: (self, pred)}, timeout, spin)
        err = done.get(0)
        if err is not None:
            raise err
        return 0 in done

    def close(self) -> None:
        self._owner._drop(self)

    @staticmethod
    async def until_all(
        items: dict[K, tuple[Watch, Callable[[], bool]]], timeout: float, spin: float = 0.0
    ) -> dict[K, BaseException | None]:
        """One waiter for many watches (`until` is the case of one): await each item's predicate,
        re-checking the pending ones on any change of their files (and on every loop turn for
        `spin` first, yielding the cpu as well).
        Returns, for each key whose predicate came true or raised, None or the exception; keys
        missing from the answer were still false at `timeout`."""
        done: dict[K, BaseException | None] = {}
        changed = asyncio.Event()
        for w, _ in items.values():
            w.listeners.add(changed)
        try:
            now = time.monotonic()
            deadline, spin_until = now + timeout, now + min(spin, timeout)
            while True:
                changed.clear()
                for key, (_, pred) in items.items():
                    if key in done:
                        continue
                    try:
                        if pred():
                            done[key] = None
                    except Exception as e:  # noqa: BLE001 - handed to the caller, per key
                        done[key] = e
                if len(done) == len(items):
                    return done
                now = time.monotonic()
                if now < spin_until:
                    os.sched_yield()  # the tasks being frozen may be waiting for this cpu
                    await asyncio.sleep(0)
                    continue
                if now >= deadline:
                    return done
                try:
                    await asyncio.wait_for(changed.wait(), deadline - now)
                except TimeoutError:
                    pass  # one more look, then out
        finally:
            for w, _ in items.values():
                w.listeners.discard(changed)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventsWatcher:
    """One inotify fd on the running loop, shared by every watch. Create and use inside the loop."""

    def __init__(self) -> None:
        fd = _libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            raise IsolationError(f"inotify_init1: {os.strerror(e)}")
        self.fd = fd
        self._loop = asyncio.get_running_loop()
        self._watches: dict[int, set[Watch]] = {}
        self._loop.add_reader(fd, self._on_ready)

    def watch(self, path: str) -> Watch:
        """Arm a watch on `path` now. Raises CgroupVanished when it does not exist."""
        wd = _libc.inotify_add_watch(self.fd, os.fsencode(path), _IN_MODIFY | _IN_DELETE_SELF)
        if wd < 0:
            e = ctypes.get_errno()
            raise _error("watch", path, None, OSError(e, os.strerror(e)))
        w = Watch(self, wd)
        self._watches.setdefault(wd, set()).add(w)
        return w

    def _drop(self, w: Watch) -> None:
        peers = self._watches.get(w.wd)
        if peers is None:
            return
        peers.discard(w)
        if not peers:
            del self._watches[w.wd]
            if not w.gone:
                _libc.inotify_rm_watch(self.fd, w.wd)

    def _on_ready(self) -> None:
        try:
            buf = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        off = 0
        while off + 16 <= len(buf):
            wd, mask, _cookie, ln = struct.unpack_from("iIII", buf, off)
            off += 16 + ln
            for w in list(self._watches.get(wd, ())):
                w._notify(mask)
            if mask & _IN_IGNORED:
                for w in self._watches.pop(wd, set()):
                    w.gone = True

    def close(self) -> None:
        self._loop.remove_reader(self.fd)
        os.close(self.fd)
        self._watches.clear()


# --- layout --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where krex puts its cgroups. `v2`: the delegated v2 directory (krex/ goes below it);
    `v1_cpuset`: the v1 cpuset directory on hybrid hosts; `cpuset`: "v2", "v1" or "none"."""

    kind: str  # "v2" (unified only) or "hybrid"
    v2: str
    v1_cpuset: str | None
    cpuset: str
    reason: str


def cgroup_mounts(mountinfo: str = procfs.MOUNTINFO) -> tuple[str | None, str | None]:
    """(cgroup2 mount point, v1 cpuset mount point), None where absent."""
    ms = procfs.mounts("cgroup2", "cgroup", mountinfo=mountinfo)
    v2 = next((m.point for m in ms if m.fstype == "cgroup2"), None)
    v1 = next((m.point for m in ms if m.fstype == "cgroup" and "cpuset" in m.options), None)
    return v2, v1


def own_cgroups(pid: str = "self") -> dict[str, str]:
    """The process's cgroup per hierarchy: {'': '/a/b'} for v2, {'cpuset': '/'} for v1 ones.
    Raises ProcessLookupError when the process is gone or unreadable."""
    lines = procfs.cgroups(pid)
    if lines is None:
        raise ProcessLookupError(f"/proc/{pid}/cgroup cannot be read")
    out: dict[str, str] = {}
    for _hid, ctrls, path in lines:
        for c in ctrls.split(",") if ctrls else [""]:
            out[c] = path
    return out


def _v1_twin(path: str) -> str | None:
    """Make (or find) the v1 cpuset directory `path` with its parent's cpus and mems; None if not."""
    try:
        if not os.path.isdir(path):
            os.mkdir(path)
            parent = os.path.dirname(path)
            for name in ("cpuset.cpus", "cpuset.mems"):
                with open(os.path.join(parent, name)) as f:
                    value = f.read().strip()
                with open(os.path.join(path, name), "w") as f:
                    f.write(value)
        return path
    except OSError:
        return None


def detect(root: str | None = None, cpuset_root: str | None = None, cpuset: str = "auto") -> Layout:
    """Find the layout and the delegated directories. Raises IsolationError saying why none is usable.

    `root`: a v2 directory to use instead of our own cgroup. `cpuset_root`: the v1 cpuset directory
    (hybrid). `cpuset`: "auto", or force "v2", "v1" or "none" (tests point the v2 code at a tree
    without controllers this way).
    """
    v2_mount, v1_mount = cgroup_mounts()
    configured = root is not None
    if root is None:
        if v2_mount is None:
            raise IsolationError("no cgroup2 mount (needed for cgroup.freeze)")
        root = os.path.join(v2_mount, own_cgroups().get("", "/").lstrip("/"))
    root = root.rstrip("/")
    if not os.path.exists(os.path.join(root, "cgroup.procs")):
        raise IsolationError(f"{root} is not a cgroup v2 directory")
    if not os.access(root, os.W_OK):
        raise IsolationError(f"{root} is not writable by uid {os.getuid()}")
    try:
        with open(os.path.join(root, "cgroup.controllers")) as f:
            v2_ctrls = f.read().split()
    except OSError as e:
        raise IsolationError(f"{root}/cgroup.controllers: {e.strerror}") from None
    if cpuset_root is None and v1_mount is not None:
        if configured and v2_mount is not None and root.startswith(v2_mount.rstrip("/") + "/"):
            # a configured v2 root gets the same path in the v1 cpuset tree, so it stays private
            cpuset_root = _v1_twin(os.path.join(v1_mount, os.path.relpath(root, v2_mount)))
        else:
            own = own_cgroups().get("cpuset", "/").lstrip("/")
            cpuset_root = os.path.join(v1_mount, own).rstrip("/")
    v1_ok = cpuset_root is not None and os.path.exists(os.path.join(cpuset_root, "cpuset.cpus"))
    if cpuset == "auto":
        cpuset = "v2" if "cpuset" in v2_ctrls else "v1" if v1_ok else "none"
    if cpuset == "v2":
        why = f"pure v2 at {root}: freezer and cpuset in v2"
        return Layout("v2", root, None, "v2", why)
    if cpuset == "v1":
        if not v1_ok:
            raise IsolationError(f"no v1 cpuset hierarchy at {cpuset_root}")
        why = f"hybrid: freezer in v2 at {root}, cpuset in v1 at {cpuset_root}"
        return Layout("hybrid", root, cpuset_root, "v1", why)
    why = f"v2 at {root} without a cpuset controller: cores are fenced with sched_setaffinity"
    return Layout("v2", root, None, "none", why)
