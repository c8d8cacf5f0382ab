"""Isolation backends: freeze, thaw and fence commands' processes (see base.py).

`choose_backend()` implements `--isolation auto|cgroup|signal`: auto takes the cgroup backend when the
daemon can write a cgroup hierarchy here and the signal backend otherwise, and the backend's `reason`
says which and why (shown at start and by `krex status`). A cgroup root given on purpose
(`--cgroup-root`) is used or refused (RootUnusable), never fallen back from: only the root krex
finds itself is.
"""

from __future__ import annotations

import os

from krex_async.isolation.base import Backend, Freeze, FreezeError, Group, IsolationError
from krex_async.isolation.signal import SignalBackend

__all__ = [
    "Backend",
    "Freeze",
    "FreezeError",
    "Group",
    "IsolationError",
    "RootUnusable",
    "SignalBackend",
    "choose_backend",
    "root_problem",
]


class RootUnusable(IsolationError):
    """A cgroup root given on purpose that the cgroup backend cannot use (`why`)."""

    HINT = "name a delegated cgroup v2 directory, or leave cgroup_root unset to let krex find one"

    def __init__(self, root: str, why: str) -> None:
        super().__init__(f"--cgroup-root {root}: {why}")
        self.root, self.why = root, why


def root_problem(root: str) -> str | None:
    """Why the cgroup backend cannot use `root` (a v2 directory given on purpose); None when it can.
    Probing makes `<root>/krex` once the root is a cgroup v2 directory, never in another one."""
    if not os.path.isdir(root):
        return f"no directory {root}"
    if not os.path.exists(os.path.join(root, "cgroup.controllers")):
        return f"{root} is not a cgroup v2 directory (it has no cgroup.controllers)"
    usable, why = _probe(root)
    return None if usable else why


def _probe(root: str | None) -> tuple[bool, str]:
    """cgroup.probe_cgroup(root), or why not where the cgroup backend is not installed."""
    try:
        from krex_async.isolation.cgroup import probe_cgroup
    except ImportError as e:
        return False, f"the cgroup backend is not installed ({e})"
    return probe_cgroup(root)


def choose_backend(isolation: str, *, cgroup_root: str | None, state_dir: str) -> Backend:
    """The backend for `--isolation` (auto, cgroup or signal) under `cgroup_root` (None or "": the
    root krex finds itself, which auto falls back from to signals when it cannot be used). Raises
    RootUnusable for a given root it cannot use (any isolation but signal, which uses none), and
    SystemExit for --isolation cgroup where no cgroup backend can run or for a second daemon on
    the same instance."""
    if isolation == "signal":
        b: Backend = SignalBackend()
        b.reason = "signal backend, as asked (--isolation signal)"
        return b
    if cgroup_root:
        if (problem := root_problem(cgroup_root)) is not None:
            raise RootUnusable(cgroup_root, problem)
        usable, why = True, ""
    else:
        usable, why = _probe(None)
    if usable:
        from krex_async.isolation.cgroup import CgroupBackend
        from krex_async.isolation.instance import InstanceBusy

        try:
            return CgroupBackend(root=cgroup_root or None, state_dir=state_dir)
        except InstanceBusy as e:  # never fall back: a second daemon here is the mistake
            raise SystemExit(f"krex: {e}") from None
    if isolation == "cgroup":
        raise SystemExit(f"krex: --isolation cgroup is not possible here: {why}")
    b = SignalBackend()
    b.reason = f"signal backend: {why}"
    return b
