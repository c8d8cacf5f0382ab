"""The tests' own cgroups: named after the pytest process that made them, and swept at the start of a
test session once that process is gone.

A run killed mid-way (Ctrl-C, a timeout, SIGKILL) leaves its `krex-test-*` cgroups at the v2 root and
in the v1 cpuset and freezer hierarchies; nothing else removes them, and they pile up. Each name
carries its creator as `<pid>.<start time in ticks>` (the pair survives pid reuse), so a session can
tell a dead run's leftovers from those of a run still going in another worktree, and removes only
the former, and only when no process is in them and no krex daemon holds an instance there.
Older names without a creator are removed only when they have not changed for LEGACY_AGE_S.
"""

from __future__ import annotations

import os
import re
import time
import uuid

from krex_async.isolation.instance import Pin
from krex_async.linux.procfs import stat_fields
from krex_async.ops.cleanup import v1_mount, v2_mount

PREFIX = "krex-test-"
_CREATOR = re.compile(r"krex-test-(\d+)\.(\d+)-")
LEGACY_AGE_S = 6 * 3600  # no test keeps one cgroup unchanged for hours
#: a session's start leaves a dead maker's cgroups younger than this: a run going on elsewhere may
#: have made them as a dead run's on purpose (test_leftover_cgroups.py), and is still using them
SESSION_MIN_AGE_S = 120


def _start_ticks(pid: int) -> int | None:
    fields = stat_fields(pid)
    return None if fields is None else int(fields[19])


def prefix() -> str:
    """`krex-test-<pid>.<start>-`: the start of every test cgroup name this process makes."""
    return f"{PREFIX}{os.getpid()}.{_start_ticks(os.getpid())}-"


def new_name(what: str = "") -> str:
    """A fresh test cgroup name of this process; `what` says which test it is for."""
    return f"{prefix()}{what + '-' if what else ''}{uuid.uuid4().hex[:8]}"


def creator(name: str) -> tuple[int, int] | None:
    """(pid, start ticks) of the process that made the test cgroup `name`; None for an old name."""
    m = _CREATOR.match(name)
    return (int(m[1]), int(m[2])) if m else None


def creator_alive(name: str) -> bool | None:
    """Whether the process that made `name` still runs (None: the name does not say who did)."""
    who = creator(name)
    return None if who is None else _start_ticks(who[0]) == who[1]


def mounts() -> list[str]:
    """The hierarchies test cgroups are made in: the v2 mount, the v1 cpuset and freezer ones."""
    return [m for m in (v2_mount(), v1_mount("cpuset"), v1_mount("freezer")) if m]


def _in_use(tree: str) -> bool:
    """Whether a process is in the tree, or a live krex daemon owns an instance directory there."""
    for dirpath, dirnames, _ in os.walk(tree):
        try:
            with open(os.path.join(dirpath, "cgroup.procs")) as f:
                if f.read().strip():
                    return True
        except FileNotFoundError:
            pass
        except OSError:
            return True  # unreadable: not ours to judge
        if os.path.basename(dirpath) == "krex":
            pin = Pin([os.path.join(dirpath, d) for d in dirnames])
            if not pin.ask():
                return True
            pin.release()
    return False


def _changed_within(tree: str, seconds: float) -> bool:
    now = time.time()
    for dirpath, _, _ in os.walk(tree):
        try:
            st = os.stat(dirpath)
        except OSError:
            continue
        if now - st.st_mtime < seconds:  # when it was made: kernfs leaves a parent's on mkdir/rmdir
            return True
    return False


def _remove(tree: str) -> bool:
    """rmdir the tree bottom-up; False when some of it stays (a process came, say)."""
    for dirpath, _, _ in sorted(os.walk(tree), key=lambda t: -t[0].count("/")):
        try:
            os.rmdir(dirpath)
        except FileNotFoundError:
            pass
        except OSError:
            return False
    return True


def sweep_leftovers(
    where: list[str] | None = None, names: set[str] | None = None, min_age_s: float = 0
) -> list[str]:
    """Remove the test cgroups (under `where`, default mounts()) whose creator is gone, that
    nothing uses and that were all made over `min_age_s` ago, in every hierarchy at once (a name in
    use in one keeps its twins); `names` limits the sweep to those. Returns the paths removed."""
    trees: dict[str, list[str]] = {}
    for m in where if where is not None else mounts():
        try:
            found = [e.name for e in os.scandir(m) if e.is_dir() and e.name.startswith(PREFIX)]
        except OSError:
            continue
        for n in found:
            if names is None or n in names:
                trees.setdefault(n, []).append(os.path.join(m, n))
    removed = []
    for name, paths in sorted(trees.items()):
        alive = creator_alive(name)
        young = LEGACY_AGE_S if alive is None else min_age_s
        if alive or (young and any(_changed_within(p, young) for p in paths)):
            continue
        if any(_in_use(p) for p in paths):
            continue
        removed += [p for p in paths if _remove(p)]
    return removed
