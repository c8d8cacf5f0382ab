"""The durable intent record, and the sweep that undoes whatever a dead daemon left.

Before the daemon freezes or fences anything it records what it may freeze and the original cpusets
(`Intent.ensure`), written atomically: a temporary file, fsync, rename, fsync of the directory. Entries
are added before the act and dropped lazily, so the record always covers at least what is frozen or
fenced. Concurrent callers in one loop turn coalesce into one write.

`sweep()` is what start-up (CgroupBackend.reconcile) and the watchdog run. It does not depend on the
record: it thaws every cgroup under the daemon's instance directory `krex/<instance>/` (thawing is
always safe; other daemons' instances beside it are never touched), puts every cpuset there back to
its structural original (v2: inherit, member partition; v1: the parent's cpus), removes empty
command cgroups, and then reads the record only to report what the previous daemon had intended.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import threading
from collections.abc import Iterable
from typing import Any

from krex_async.isolation.cgroupfs import CgroupFileError, CgroupFS, CgroupVanished
from krex_async.linux import reserve
from krex_async.linux.fsutil import replace_file

KREX = "krex"


class Intent:
    """The record at `<state_dir>/intent.json`: {'frozen': [paths], 'fenced': {path: original cpus}}.

    `note()` adds entries ahead of need (a command's cgroups when they are made) and writes them in
    the background; `ensure()` adds entries and returns once they are on disk, so a region whose
    targets were noted earlier pays no write. Writes run on a worker thread (an fsync under heavy
    I/O takes milliseconds: it must not stall the event loop), one at a time, each a full
    snapshot; a snapshot older than the one on disk is never renamed over it.
    """

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, "intent.json")
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        self.frozen: set[str] = set()
        self.fenced: dict[str, str] = {}
        self._pending: set[str] = set()  # entries added but not yet durable
        self._written: tuple[frozenset[str], tuple[tuple[str, str], ...]] | None = None
        self._lock = threading.Lock()  # one writer at a time (loop thread or worker)
        self._seq = 0  # snapshots taken
        self._disk_seq = 0  # the snapshot on disk
        self._flush: asyncio.Task[None] | None = None

    def _snapshot(self) -> tuple[int, bytes, tuple[frozenset[str], tuple[tuple[str, str], ...]]]:
        self._seq += 1
        state = (frozenset(self.frozen), tuple(sorted(self.fenced.items())))
        data = json.dumps(
            {"version": 1, "pid": os.getpid(), "frozen": sorted(self.frozen), "fenced": self.fenced}
        ).encode()
        return self._seq, data, state

    def _write(self, seq: int, data: bytes) -> None:
        """Atomically replace the record (tmp, fsync, rename, fsync dir). Any thread. Raises OSError."""
        with self._lock:
            if seq < self._disk_seq:
                return  # a newer snapshot is already there
            # Through the state disk's reserve: a disk filled by others must not refuse regions.
            reserve.guarded(self.path, lambda: replace_file(self.path, data, durable=True))
            self._disk_seq = seq

    def write_now(self) -> None:
        """Write the record synchronously if it changed since the last write. Raises OSError."""
        seq, data, state = self._snapshot()
        if state == self._written and not self._pending:
            return
        done = set(self._pending)
        self._write(seq, data)
        self._written = state
        self._pending -= done

    def _add(self, frozen: Iterable[str], fenced: dict[str, str] | None) -> list[str]:
        keys = list(frozen) + list(fenced or {})
        for p in frozen:
            if p not in self.frozen:
                self.frozen.add(p)
                self._pending.add(p)
        for k, v in (fenced or {}).items():
            if k not in self.fenced:
                self.fenced[k] = v
                self._pending.add(k)
        return keys

    def note(self, frozen: Iterable[str] = (), fenced: dict[str, str] | None = None) -> None:
        """Add entries now and write them soon, in the background (errors surface in `ensure`)."""
        self._add(frozen, fenced)
        if self._pending and self._flush is None:
            self._flush = asyncio.get_running_loop().create_task(self._flush_once())
            self._flush.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def ensure(self, frozen: Iterable[str] = (), fenced: dict[str, str] | None = None) -> None:
        """Add entries and return once they are durable (at once if they already are). Callers in
        the same loop turn share one write. Raises OSError when the record cannot be written."""
        keys = self._add(frozen, fenced)
        while any(k in self._pending for k in keys):
            if self._flush is None:
                self._flush = asyncio.get_running_loop().create_task(self._flush_once())
            await asyncio.shield(self._flush)

    async def _flush_once(self) -> None:
        try:
            await asyncio.sleep(0)  # let the other freezes of this batch add their entries
            done = set(self._pending)
            seq, data, state = self._snapshot()
            await asyncio.get_running_loop().run_in_executor(None, self._write, seq, data)
            self._written = state
            self._pending -= done
        finally:
            self._flush = None

    def forget(self, paths: list[str]) -> None:
        """Drop entries of removed cgroups (written with the next change)."""
        for p in paths:
            self.frozen.discard(p)
            self.fenced.pop(p, None)
            self._pending.discard(p)


def read_record(state_dir: str) -> tuple[dict[str, Any] | None, str]:
    """(record, problem): the previous record, or None and why it could not be used."""
    path = os.path.join(state_dir, "intent.json")
    try:
        with open(path) as f:
            rec = json.load(f)
        if not isinstance(rec, dict):
            return None, f"intent record {path} damaged: not an object"
        # valid JSON of another shape (hand-edited, another version) is damaged too: the sweep
        # that reports it must not fail on it
        frozen, fenced = rec.get("frozen", []), rec.get("fenced", {})
        if not (
            isinstance(frozen, list)
            and all(isinstance(p, str) for p in frozen)
            and isinstance(fenced, dict)
            and all(isinstance(v, str) for v in fenced.values())
            and isinstance(rec.get("pid", 0), int)
        ):
            return None, f"intent record {path} damaged: not {{'pid', 'frozen': [...], 'fenced': {{...}}}}"
        return rec, ""
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as e:
        return None, f"intent record {path} damaged: {e}"


def _try(lines: list[str], what: str, fn: Any, *args: Any) -> bool:
    try:
        fn(*args)
        return True
    except CgroupVanished:
        return False
    except CgroupFileError as e:
        lines.append(f"could not {what}: {e}")
        return False


def thaw_all(v2: CgroupFS, lines: list[str], base: str = KREX) -> None:
    """Write cgroup.freeze=0 wherever it reads 1 under `base` (children first, then parents)."""
    for rel in reversed(v2.walk(base)):
        try:
            if v2.read(rel, "cgroup.freeze").strip() == "1" and _try(
                lines, f"thaw {rel}", v2.write, rel, "cgroup.freeze", "0"
            ):
                lines.append(f"thawed {rel}")
        except CgroupFileError:
            continue


def restore_cpusets(
    v2: CgroupFS, v1: CgroupFS | None, cpuset: str, lines: list[str], base: str = KREX
) -> None:
    """Put cpusets under `base` back to what create() made: v2 inherit/member, v1 the parent's cpus."""
    if cpuset == "v2":
        dirs = v2.walk(base)
        for rel in reversed(dirs):  # partitions off, leaves first
            if v2.exists(rel, "cpuset.cpus.partition"):
                try:
                    part = v2.read(rel, "cpuset.cpus.partition").split()[0]
                except (CgroupFileError, IndexError):
                    continue
                if part != "member" and _try(
                    lines, f"reset partition {rel}", v2.write, rel, "cpuset.cpus.partition", "member"
                ):
                    lines.append(f"partition of {rel} back to member (was {part})")
        for rel in reversed(dirs):  # exclusive cpus: leaves first
            name = "cpuset.cpus.exclusive"
            try:
                if v2.exists(rel, name) and v2.read(rel, name).strip():
                    old = v2.read(rel, name).strip()
                    if _try(lines, f"reset {rel}/{name}", v2.write, rel, name, ""):
                        lines.append(f"{rel}/{name} back to inherited (was {old})")
            except CgroupFileError:
                continue
        for rel in dirs:  # cpus: parents first, so a child can widen to its restored parent
            try:
                old = v2.read(rel, "cpuset.cpus").strip() if v2.exists(rel, "cpuset.cpus") else ""
                if not old:
                    continue
                try:
                    v2.write(rel, "cpuset.cpus", "")
                    lines.append(f"{rel}/cpuset.cpus back to inherited (was {old})")
                except CgroupFileError as e:
                    # A populated cgroup may not be emptied (ENOSPC): give it all its parent has.
                    if e.errno != errno.ENOSPC:
                        raise
                    want = v2.read(os.path.dirname(rel), "cpuset.cpus.effective").strip()
                    if _try(lines, f"reset {rel}/cpuset.cpus", v2.write, rel, "cpuset.cpus", want):
                        lines.append(f"{rel}/cpuset.cpus back to its parent's {want} (was {old})")
            except CgroupVanished:
                continue
            except CgroupFileError as e:
                lines.append(f"could not reset {rel}/cpuset.cpus: {e}")
    elif cpuset == "v1" and v1 is not None:
        for rel in v1.walk(base):  # parents first: a child may only widen up to its parent
            parent = os.path.dirname(rel)
            try:
                want, have = v1.read(parent, "cpuset.cpus").strip(), v1.read(rel, "cpuset.cpus").strip()
            except CgroupFileError:
                continue
            if want != have and _try(lines, f"restore {rel}", v1.write, rel, "cpuset.cpus", want):
                lines.append(f"v1 {rel}/cpuset.cpus back to {want} (was {have})")


def remove_empty(
    v2: CgroupFS, v1: CgroupFS | None, lines: list[str], base: str = KREX
) -> list[tuple[str, list[int]]]:
    """rmdir command cgroups (children of `base`) without tasks; returns (name, pids) of those
    still populated."""
    alive: list[tuple[str, list[int]]] = []
    for top in v2.children(base):
        dirs = v2.walk(top)
        pids = sorted({p for d in dirs for p in v2.procs(d)})
        if pids:
            alive.append((os.path.basename(top), pids))
            lines.append(f"adopted {top}: still running pids {pids}")
            continue
        for d in reversed(dirs):
            _try(lines, f"remove {d}", v2.rmdir, d)
        if v1 is not None:
            for d in reversed(v1.walk(top)):
                _try(lines, f"remove v1 {d}", v1.rmdir, d)
        lines.append(f"ended {top}: empty, removed")
    return alive


def sweep(
    v2: CgroupFS,
    v1: CgroupFS | None,
    cpuset: str,
    state_dir: str | None,
    remove: bool = True,
    base: str = KREX,
) -> tuple[list[str], list[tuple[str, list[int]]]]:
    """Thaw, restore cpusets, remove empty command cgroups under `base` (a daemon's instance
    directory), report the old record.

    Never raises for cgroup trouble (each failure becomes a line). Returns (lines, still-running).
    """
    lines: list[str] = []
    thaw_all(v2, lines, base)
    restore_cpusets(v2, v1, cpuset, lines, base)
    alive = remove_empty(v2, v1, lines, base) if remove else []
    if state_dir is not None:
        rec, problem = read_record(state_dir)
        if problem:
            lines.append(problem + " (thawed and restored regardless)")
        elif rec and (rec.get("frozen") or rec.get("fenced")):
            lines.append(
                f"previous daemon pid {rec.get('pid')} intended to freeze "
                f"{len(rec.get('frozen', []))} and fence {len(rec.get('fenced', {}))} cgroups"
            )
    return lines, alive
