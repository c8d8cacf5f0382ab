"""Where krex's cgroup trees may be on this node, for `krex cleanup` and the doctor: the cgroup
mounts (v2, the v1 freezer and cpuset hierarchies), the layout they make, and this process's own
cgroup in each. Reads /proc only (linux/procfs.py): nothing but the standard library."""

from __future__ import annotations

import os

from krex_async.linux import procfs
from krex_async.linux.procfs import Mount


def mounts() -> list[Mount]:
    """cgroup and cgroup2 mounts of this mount namespace, in mountinfo order."""
    return procfs.mounts("cgroup", "cgroup2")


def _controllers(m: Mount) -> frozenset[str]:
    return frozenset(m.options) if m.fstype == "cgroup" else frozenset()


def v2_mount(ms: list[Mount] | None = None) -> str | None:
    ms = mounts() if ms is None else ms
    return next((m.point for m in ms if m.fstype == "cgroup2"), None)


def v1_mount(controller: str, ms: list[Mount] | None = None) -> str | None:
    ms = mounts() if ms is None else ms
    return next((m.point for m in ms if controller in _controllers(m)), None)


def layout(ms: list[Mount] | None = None) -> str:
    """'v2' (unified only), 'hybrid' (v2 beside v1 controllers), 'v1', or 'none'."""
    ms = mounts() if ms is None else ms
    has2 = any(m.fstype == "cgroup2" for m in ms)
    has1 = any(_controllers(m) - {"name=systemd"} for m in ms)
    return "hybrid" if has2 and has1 else "v2" if has2 else "v1" if has1 else "none"


def own_cgroup(controller: str = "", pid: str = "self") -> str | None:
    """This process's cgroup path ('/system.slice/krex.service') in v2 (controller '') or in the v1
    hierarchy of `controller`; systemd's `.control` leaf (ExecStopPost under Delegate=yes) stripped."""
    for hid, ctrls, path in procfs.cgroups(pid) or []:
        if (not controller and hid == "0" and ctrls == "") or (controller and controller in ctrls.split(",")):
            while os.path.basename(path) in (".control", "daemon"):
                path = os.path.dirname(path)
            return path
    return None


def default_roots(cgroup_root: str = "") -> list[str]:
    """Where krex trees may be: the configured root, own cgroups, the mounts (see module doc)."""
    ms = mounts()
    roots = [cgroup_root] if cgroup_root else []
    m2 = v2_mount(ms)
    if m2:
        own = own_cgroup("")
        if own:
            roots.append(os.path.join(m2, own.lstrip("/")))
        roots.append(m2)
    for ctrl in ("freezer", "cpuset"):
        m1 = v1_mount(ctrl, ms)
        if m1:
            own = own_cgroup(ctrl)
            if own:
                roots.append(os.path.join(m1, own.lstrip("/")))
            roots.append(m1)
    return roots
