"""eBPF and tracefs probes on GPU driver activity (interface in base.py).

    backend, reason = open_probes("auto")      # at daemon start; log `reason` (one line)
    if backend: backend.start(loop, on_events)  # on_events(list[ProbeEvent]) runs on the loop
    ...; backend.counts(); backend.lost(); backend.stop()

Every backend is a FailureReporting: set `backend.on_failure = fn` before start() and fn(reason)
runs once on the loop if the backend dies at runtime (`backend.failure` then says why); stop() it.

Modes: `off`; `ioctl` (bcc syscall tracepoints); `launches` (ioctl plus launch uprobes on libcuda /
libhsa-runtime64); `tracefs` (no compiler needed); `auto` (bcc ioctl when a BPF program compiles and
loads here, else tracefs, else None; with launch_libs given, launch uprobes too where bcc runs: the
fallbacks take no libraries, and their reason says so). The launch uprobes' scope (`outsiders`, the
default: only processes outside krex's commands, per process; `all`: every process) is
launches.py's; with `outsiders`, CombinedProbe hands the tgids of the ioctl probe's "open" events to
the launch probe, which probes a new outsider as soon as it opens a GPU file.
Events carry tgid and ts_ns on CLOCK_MONOTONIC (compare with time.monotonic_ns()).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from krex_async.probes.base import ProbeBackend, ProbeEvent, ProbeUnavailable
from krex_async.probes.failure import FailureReporting

MODES = ("auto", "ioctl", "launches", "tracefs", "off")


def wall_time(ts_ns: int) -> float:
    """A ProbeEvent's CLOCK_MONOTONIC ts_ns as unix seconds (for trace records and timelines)."""
    import time

    return time.time() - (time.monotonic_ns() - ts_ns) / 1e9


class CombinedProbe(FailureReporting, ProbeBackend):
    """Runs several backends as one: start() starts each (a later one failing with ProbeUnavailable
    leaves the earlier ones running and is recorded in `failed`); stop() stops all; counts and lost
    are summed over the running parts. A part failing at runtime is the whole probe failing
    (`failure`, `on_failure`, with the part's reason): regions can no longer be verified.

    A part with `wants_opens` (the launch probe with scope outsiders) gets, on the loop, the tgids
    of every batch's "open" events through its `opened(tgids)`, before the batch goes on to
    `on_events` (a failure there is recorded in `open_errors` and never costs the batch)."""

    def __init__(self, *parts: ProbeBackend) -> None:
        self.parts = list(parts)
        self.failed: dict[str, str] = {}
        self.name = "+".join(p.name for p in parts)
        self.open_errors = 0

    def _with_opens(
        self, on_events: Callable[[list[ProbeEvent]], None]
    ) -> Callable[[list[ProbeEvent]], None]:
        """on_events, first handing "open" tgids to the parts that want them (none: unchanged)."""
        listeners = [p for p in self.parts if getattr(p, "wants_opens", False)]
        if not listeners:
            return on_events

        def deliver(batch: list[ProbeEvent]) -> None:
            try:
                tgids = {ev.tgid for ev in batch if ev.kind == "open"}
                if tgids:
                    for p in listeners:
                        p.opened(tgids)  # type: ignore[attr-defined]
            except Exception:
                self.open_errors += 1
            on_events(batch)

        return deliver

    def start(self, loop: asyncio.AbstractEventLoop, on_events: Callable[[list[ProbeEvent]], None]) -> None:
        running = []
        deliver = self._with_opens(on_events)
        for i, p in enumerate(self.parts):
            if isinstance(p, FailureReporting):
                p.on_failure = self._part_failed
            try:
                p.start(loop, deliver)
                running.append(p)
            except ProbeUnavailable as e:
                if i == 0:
                    raise
                self.failed[p.name] = str(e)
        self.parts = running
        self.name = "+".join(p.name for p in running)

    def _part_failed(self, reason: str) -> None:
        """A part's on_failure, on the loop: the first one is this probe's failure."""
        if self.failure is None:
            self.failure = reason
            if self.on_failure is not None:
                self.on_failure(reason)

    def stop(self) -> None:
        """Stop every part, even when one fails to (the first error is raised after)."""
        errors = []
        for p in self.parts:
            try:
                p.stop()
            except Exception as e:  # noqa: BLE001 - the next part must stop all the same
                errors.append(e)
        if errors:
            raise errors[0]

    def lost(self) -> int:
        return sum(p.lost() for p in self.parts)

    def counts(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for p in self.parts:
            for tgid, n in p.counts().items():
                out[tgid] = out.get(tgid, 0) + n
        return out

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for p in self.parts:
            out.update(p.describe())
        return out


def bcc_works() -> tuple[bool, str]:
    """Whether a BPF tracepoint program compiles and loads here (about 0.3 s), and why not."""
    from krex_async.probes import _bcc

    try:
        bpf = _bcc.compile_bpf("TRACEPOINT_PROBE(syscalls, sys_enter_ioctl) { return 0; }", "bcc check")
    except ProbeUnavailable as e:
        return False, str(e)
    bpf.cleanup()
    return True, "bcc compiles and loads tracepoint programs"


def tracefs_works() -> tuple[bool, str]:
    """Whether the tracefs backend can run here, and why not."""
    import os

    from krex_async.probes.tracefs import EVENT, tracefs_root

    try:
        root = tracefs_root()
    except ProbeUnavailable as e:
        return False, str(e)
    if not os.path.isdir(f"{root}/{EVENT}"):
        return False, f"no {EVENT} under {root}"
    if not os.access(f"{root}/instances", os.W_OK):
        return False, f"{root}/instances not writable (root needed)"
    return True, f"tracefs at {root}"


def open_probes(
    mode: str = "auto",
    prefixes: list[str] | None = None,
    launch_libs: list[str] | None = None,
    launch_scope: str = "outsiders",
    is_command: Callable[[int], bool] | None = None,
) -> tuple[ProbeBackend | None, str]:
    """Choose a probe backend for `mode` and say which and why, in one line.

    `launch_scope` and `is_command` go to the launch probe (launches.py: with "outsiders",
    is_command(tgid) True keeps a process unprobed; it is called on the loop only).
    Returns (None, reason) when probes are off or nothing can run; never raises for an unavailable
    mechanism (ValueError for an unknown mode, launch scope or bad prefixes). The backend is not
    started.
    """
    from krex_async.probes.bpf_ioctl import DEFAULT_PREFIXES, IoctlProbe, check_prefixes
    from krex_async.probes.launch_scope import SCOPES
    from krex_async.probes.launches import LaunchProbe, find_libraries
    from krex_async.probes.tracefs import TracefsProbe

    if mode not in MODES:
        raise ValueError(f"probe mode {mode!r}: one of {', '.join(MODES)}")
    if launch_scope not in SCOPES:
        raise ValueError(f"launch scope {launch_scope!r}: one of {', '.join(SCOPES)}")
    if mode == "off":
        return None, "probes: off (requested)"
    pre = list(check_prefixes(prefixes if prefixes is not None else DEFAULT_PREFIXES))
    where = ",".join(pre)
    if mode == "tracefs":
        ok, why = tracefs_works()
        return (
            (TracefsProbe(pre), f"probes: tracefs on {where} ({why})")
            if ok
            else (None, f"probes: none (tracefs requested, unavailable: {why})")
        )
    ok, why = bcc_works()
    if ok:
        ioctl = IoctlProbe(pre)
        if mode == "launches" or (mode == "auto" and launch_libs):
            libs = find_libraries(launch_libs)
            found = ("on " + ", ".join(libs)) if libs else "none found yet: /proc/*/maps rescanned every 5 s"
            who = "per process, outside krex's commands" if launch_scope == "outsiders" else "every process"
            launch = LaunchProbe(launch_libs, scope=launch_scope, is_command=is_command)
            return (
                CombinedProbe(ioctl, launch),
                f"probes: bcc ioctl on {where} + launch uprobes (scope {launch_scope}: {who}; "
                f"{found}) ({why})",
            )
        return ioctl, f"probes: bcc ioctl on {where} ({why})"
    if mode != "auto":
        return None, f"probes: none ({mode} requested, bcc unavailable: {why})"
    unused = "; launch libraries unused: the launch uprobes need bcc" if launch_libs else ""
    ok2, why2 = tracefs_works()
    if ok2:
        return TracefsProbe(pre), f"probes: tracefs on {where} (bcc unavailable: {why}; {why2}){unused}"
    return None, f"probes: none (bcc unavailable: {why}; tracefs unavailable: {why2}){unused}"


__all__ = [
    "CombinedProbe",
    "FailureReporting",
    "MODES",
    "ProbeBackend",
    "ProbeEvent",
    "ProbeUnavailable",
    "open_probes",
    "wall_time",
]
