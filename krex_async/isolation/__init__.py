"""Isolation backends: freeze, thaw and fence commands' processes (see base.py).

`choose_backend()` implements `--isolation auto|cgroup|signal`: auto takes the cgroup backend when the
daemon can write a cgroup hierarchy here and the signal backend otherwise, and the backend's `reason`
says which and why (shown at start and by `krex status`).
"""

from __future__ import annotations

from krex_async.isolation.base import Backend, Freeze, FreezeError, Group, IsolationError
from krex_async.isolation.signal import SignalBackend

__all__ = ["Backend", "Freeze", "FreezeError", "Group", "IsolationError", "SignalBackend", "choose_backend"]


def choose_backend(isolation: str, *, cgroup_root: str | None, state_dir: str) -> Backend:
    """The backend for `--isolation` (auto, cgroup or signal) under `cgroup_root` (None: the default)."""
    if isolation == "signal":
        b: Backend = SignalBackend()
        b.reason = "signal backend, as asked (--isolation signal)"
        return b
    try:
        from krex_async.isolation.cgroup import CgroupBackend, probe_cgroup
    except ImportError as e:
        why = f"the cgroup backend is not installed ({e})"
        usable = False
    else:
        usable, why = probe_cgroup(cgroup_root or None)
    if usable:
        from krex_async.isolation.intent import InstanceBusy

        try:
            return CgroupBackend(root=cgroup_root or None, state_dir=state_dir)
        except InstanceBusy as e:  # never fall back: a second daemon here is the mistake
            raise SystemExit(f"krex: {e}") from None
    if isolation == "cgroup":
        raise SystemExit(f"krex: --isolation cgroup is not possible here: {why}")
    b = SignalBackend()
    b.reason = f"signal backend: {why}"
    return b
