"""A warm worker's own cgroups, read once before its first command: where it goes back to after each
command (itself, or moved by a root daemon's pool: procs.home_by_pool), and whether it can.
Imported by the worker between commands, so it stays lean: os and procfs only."""

from __future__ import annotations

import os

from krex_async.linux import procfs


def cgroups(pid: int | str = "self") -> dict[str, str]:
    """A process's cgroup per hierarchy, keyed as /proc/<pid>/cgroup names them ("" is v2)."""
    return {ctrls: path for _hid, ctrls, path in procfs.cgroups(pid) or []}


def cgroup_homes(pid: int | str = "self") -> dict[str, str | None]:
    """Per hierarchy of /proc/<pid>/cgroup, the cgroup.procs file of that process's cgroup there
    (None: that hierarchy is not mounted where we can see it)."""
    mounts: dict[str, str] = {}
    for m in procfs.mounts("cgroup2", "cgroup"):
        if m.fstype == "cgroup2":
            mounts.setdefault("", m.point)
        elif m.root == "/":
            names = [o for o in m.options if o not in ("rw", "ro") and "=" not in o or o.startswith("name=")]
            mounts.setdefault(",".join(sorted(names)), m.point)
    homes: dict[str, str | None] = {}
    for ident, path in cgroups(pid).items():
        mount = mounts.get(",".join(sorted(ident.split(","))) if ident else "")
        homes[ident] = None if mount is None else os.path.join(mount, path.lstrip("/"), "cgroup.procs")
    return homes


def can_go_home(homes: dict[str, str | None]) -> bool:
    """Whether this process may write itself back into each of its cgroups (`homes`, from
    cgroup_homes): each one mounted where it sees it, and its cgroup.procs writable by it. A
    worker that cannot says so at once, so the pool warms its replacement ahead of time."""
    return all(p and os.access(p, os.W_OK) for p in homes.values())


def go_home(own: dict[str, str], homes: dict[str, str | None]) -> str | None:
    """Back into the worker's own cgroups (`own`, its cgroups once warm; `homes`, their
    cgroup.procs files), in every hierarchy where the command (its cgroup_procs, or the daemon's
    hook: v2 and the v1 cpuset on hybrid hosts) moved it; None when home again, else why not."""
    for ident, path in cgroups().items():
        if path == own.get(ident):
            continue
        home = homes.get(ident)
        if not home:
            return f"cannot leave cgroup {path!r} (hierarchy {ident or 'v2'!r}): no way home"
        try:  # written here, not through CgroupFS: a worker between commands keeps its modules lean
            with open(home, "w") as f:
                f.write(str(os.getpid()))
        except OSError as e:
            return f"cannot go back to {home}: {e}"
    return None
