"""A daemon's instance of the krex cgroup tree (`krex/<instance>/`, one per state dir) and who owns it.

The owner is whoever holds `<state_dir>/cgroup.owner` locked: a live daemon holds it exclusively
for its life (claim_instance); `krex cleanup` holds it shared while it sweeps a dead daemon's
instance (pin_instance), so that a daemon starting meanwhile waits for the sweep instead of being
refused by it or having its directory swept from under it. The instance directory names its state
dir (an xattr), which is how a sweep that knows only the cgroup tree finds the lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import time
from collections.abc import Iterable, Iterator

from krex_async.isolation.base import IsolationError
from krex_async.isolation.cgroupfs import CgroupFileError, CgroupFS
from krex_async.linux import procfs
from krex_async.linux.trust import dir_problem

OWNER_FILE = "cgroup.owner"  # in the state dir: locked (flock) by the live daemon of the instance
STATE_XATTR = "user.krex.state_dir"  # on the instance directory: whose state dir it belongs to
#: how long a starting daemon waits for `krex cleanup` to finish sweeping its instance
CLAIM_WAIT_S = 10.0
#: how long either side waits at the gate of a `krex` tree (held for a listing, or one mkdir)
GATE_WAIT_S = 5.0
GATE_DIR = "/run/krex-gate"  # root's gate files (gate_file): a directory only root can enter


class InstanceBusy(IsolationError):
    """Another live daemon owns this daemon's instance directory (same state dir and root)."""


def instance_name(state_dir: str) -> str:
    """The instance directory's name: the same for every daemon on `state_dir`, and only them."""
    return "d-" + hashlib.sha256(os.path.realpath(state_dir).encode()).hexdigest()[:12]


def claim_instance(state_dir: str, subtree: str, wait_s: float = CLAIM_WAIT_S) -> int:
    """Lock `<state_dir>/cgroup.owner` for this process's life (the fd is the lock; the kernel
    drops it when the daemon dies, SIGKILL included) and write our pid into it. A live daemon's lock
    is exclusive and refuses us at once; a shared one is `krex cleanup` checking or sweeping this
    instance (pin_instance), waited for up to `wait_s`. Raises InstanceBusy naming the holder, or
    OSError."""
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    path = os.path.join(state_dir, OWNER_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        holder = _lock_owner(fd, wait_s)
    except BaseException:
        os.close(fd)
        raise
    if holder is not None:
        try:
            owner = _written_pid(fd)
            sweepers = _sweepers(fd) if holder == "sweep" else ""
        finally:
            os.close(fd)
        if holder == "sweep":
            raise InstanceBusy(
                f"a sweep of cgroup subtree {subtree} (state dir {state_dir}) has held its owner lock "
                f"{path} for over {wait_s:g} s ({sweepers}): refusing to start under it; try again "
                "once it is done, or end it"
            )
        raise InstanceBusy(
            f"another krex daemon (pid {owner}) is live on cgroup subtree {subtree} "
            f"(state dir {state_dir}): refusing to start, since its start-up sweep "
            "would thaw that daemon's regions; stop it first, or give this daemon "
            "its own --state-dir"
        )
    try:  # the pid is for the message only: a full disk must not stop the start
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass
    return fd


def _written_pid(fd: int) -> str:
    """The pid the owner file says (its claimant's, for messages), "?" when it says none."""
    return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"


def _lock_owner(fd: int, wait_s: float) -> str | None:
    """Take the owner lock exclusively: None once held, "daemon" when another daemon holds it,
    "sweep" when shared holders (sweeps) kept it past `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            pass
        try:  # granted shared: every holder is a sweep (a daemon's lock is exclusive)
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return "daemon"
        fcntl.flock(fd, fcntl.LOCK_UN)  # so that two daemons starting at once never wait on each other
        if time.monotonic() >= deadline:
            return "sweep"
        time.sleep(0.002)


def _sweepers(fd: int) -> str:
    """Who holds the file of `fd` flocked (/proc/locks), for the message of a start that waited
    on them: a stuck `krex cleanup` or a dead daemon's watchdog is not the same fix."""
    who = []
    for pid in procfs.flock_holders(os.fstat(fd).st_ino):
        raw = procfs.cmdline(pid, limit=200)
        cmd = "?" if raw is None else raw.replace(b"\0", b" ").decode(errors="replace").strip()
        who.append(f"pid {pid}: {cmd}")
    return "; ".join(who) or "`krex cleanup`, or the watchdog of a daemon that died"


def mark_instance(path: str, state_dir: str) -> None:
    """Name the state dir on the instance directory (an xattr), so that `krex cleanup`, which
    knows only the cgroup tree, can find its owner lock (Pin). Best effort:
    kernels before 5.7 have no user xattrs on cgroupfs."""
    try:
        os.setxattr(path, STATE_XATTR, os.fsencode(os.path.realpath(state_dir)))
    except OSError:
        pass


def gate_file(krex_dir: str) -> str | None:
    """The lock file that stands for `krex_dir` at the gate: in a directory only the owner of the
    `krex` tree can enter (/run/krex-gate for root's, /tmp/krex-gate-UID for a delegated tree), so
    no other user can open it, let alone hold it locked (any user could flock the cgroup directory
    itself, and made every start wait GATE_WAIT_S). None where that directory is not safe."""
    try:
        owner = os.stat(krex_dir).st_uid
    except OSError:
        return None
    where = GATE_DIR if owner == 0 else f"/tmp/krex-gate-{owner}"
    if owner == os.geteuid():
        try:
            os.mkdir(where, 0o700)
        except FileExistsError:
            pass  # judged below like any other
        except OSError:
            return None
    if dir_problem(where, frozenset({owner})):
        return None  # squatted or loosened: no gate rather than one another user can hold
    digest = hashlib.sha256(os.path.realpath(krex_dir).encode()).hexdigest()[:12]
    return os.path.join(where, f"gate-{digest}")


@contextlib.contextmanager
def gate(krex_dirs: list[str], exclusive: bool, wait_s: float = GATE_WAIT_S) -> Iterator[None]:
    """flock the `krex` directories' gate files (gate_file): shared by a daemon while it makes and
    names its instance directory, exclusive by a sweep while it lists and reads the names, so that a
    sweep never sees a directory that is made but not yet named (and would take it for a dead
    daemon's). Waits up to `wait_s` for each, then goes on without it (a stuck holder must not stop
    a start or a thaw)."""
    fds = []
    try:
        for d in sorted(set(krex_dirs)):
            path = gate_file(d)
            if path is None:
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError:
                continue
            fds.append(fd)
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(0.001)
        yield
    finally:
        for fd in fds:
            os.close(fd)


def remove_instance(fss: Iterable[CgroupFS], base: str) -> list[str]:
    """rmdir the instance directory `base` in each tree (v2, the v1 cpuset twin) if it is empty, so
    that a cleanly stopped daemon leaves no directory per state dir behind; never recursive. One
    line per directory that stays (children or tasks left: EBUSY or ENOTEMPTY)."""
    lines = []
    for fs in fss:
        try:
            fs.rmdir(base)
        except CgroupFileError as e:
            why = "not empty" if e.errno in (errno.EBUSY, errno.ENOTEMPTY) else "could not remove it"
            lines.append(f"kept instance directory {fs.path(base)}: {why} ({e})")
    return lines


def state_dir_of(instance_dir: str) -> str | None:
    """The state dir an instance directory names (mark_instance), or None (unnamed, or gone)."""
    try:
        return os.fsdecode(os.getxattr(instance_dir, STATE_XATTR))
    except OSError:
        return None


def pin_instance(state_dir: str) -> tuple[int, str | None]:
    """For a sweep of the instance of `state_dir`: a shared lock on its owner file, which keeps
    its daemon from starting (claim_instance waits for it) until the returned fd is closed.
    (fd, None) when pinned; (-1, pid as written) when its daemon is alive; (-1, None) when no
    daemon ever claimed it (no owner file). Never blocks."""
    try:
        fd = os.open(os.path.join(state_dir, OWNER_FILE), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return -1, None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _written_pid(fd)
        os.close(fd)
        return -1, pid
    except OSError:
        os.close(fd)
        return -1, None
    return fd, None


def owner_of(state_dir: str) -> str | None:
    """The pid the owner file names (its last claimant, alive or not), or None (none yet)."""
    try:
        with open(os.path.join(state_dir, OWNER_FILE), "rb") as f:
            return f.read(32).decode(errors="replace").strip() or None
    except OSError:
        return None


class Pin:
    """Whether an instance (one name: its directories in every tree) may be swept, asked through
    its owner lock: `live` is its daemon's pid when that daemon is alive; otherwise `fds` hold the
    lock shared until release(), so that a daemon of that state dir starting meanwhile waits."""

    def __init__(self, dirs: list[str], state_dirs: Iterable[str | None] = ()) -> None:
        self.dirs = dirs
        #: read at the listing (under the gate), or known by name where no directory says whose
        self.state_dirs = set(state_dirs)
        self.fds: list[int] = []
        self.live: str | None = None

    def ask(self) -> bool:
        """Pin every state dir the directories name; True when the instance may be swept."""
        named = {state_dir_of(d) for d in self.dirs} | self.state_dirs
        for state_dir in sorted(s for s in named if s):
            fd, pid = pin_instance(state_dir)
            if pid is not None:
                self.live = pid
                self.release()
                return False
            if fd >= 0:
                self.fds.append(fd)
        return True

    def release(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
