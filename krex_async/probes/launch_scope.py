"""Per-process launch uprobes: the bookkeeping behind the launch probe's scope `outsiders`.

A uprobe attached with a target process (bcc `attach_uprobe(..., pid=PID)`: a perf event with a
target task) is installed by the kernel only in that process's address space (the uprobe's filter
compares each mm mapping the library with the target's), so no other process takes its int3 trap.
`ProcessUprobes` keeps such uprobes per process:

    loop thread (Outsiders)                  poll thread (Outsiders.tick, every 10 ms)
    ───────────────────────                  ─────────────────────────────────────────
    opened(tgids) ◄── "open" events          every rescan_s: ProcessUprobes.gone() -> forget;
    _classify({tgid: (start, libs)}) ◄────── scan_processes(): /proc/*/maps -> {tgid: libs}
       │ is_command(tgid) on the loop only     (handed over with call_soon_threadsafe)
       │ ("attach", tgid, libs, start) ("forget", tgid, ...)
       └──────── SimpleQueue ──────────────► ProcessUprobes.attach(tgid, libs): one perf event per
                                             symbol and library; forget(tgid): its events go to a
                                             backlog; detach_one(): one backlog event per idle tick

ProcessUprobes runs on the poll thread (and in Outsiders.start(), before that thread exists),
except `watched()`, which any thread may call (it copies under a lock). Closing a uprobe's perf event
waits for an RCU grace period inside the kernel, serialised kernel-wide (about 0.1 s each; an
attach made meanwhile waits for it in the kernel), so the uprobes of processes
let go are closed one per tick, and only in a tick with no attach to make: a new outsider waits for
at most the one close in progress, never behind a batch of them.

A process is matched by the files it maps: a basename starting with one of `names` (libcuda.so,
libhsa-runtime64.so) or a file whose (device, inode) was configured. Paths are the process's own (its
mount namespace): bcc resolves them through /proc/<pid>/root, and the symbol tables are read there
too, so a process in a container is probed on the library it really maps. A mapping of a file
deleted since (a driver upgraded under a running process) is skipped.
"""

from __future__ import annotations

import asyncio
import collections
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from krex_async.linux import procfs
from krex_async.probes import _bcc
from krex_async.probes.hold import HOLD

SCOPES = ("outsiders", "all")

Inodes = frozenset[tuple[str, int]]  # ("maj:min" as /proc/<pid>/maps prints it, inode)


def inode_key(path: str) -> tuple[str, int] | None:
    """The (device, inode) of a file in /proc/<pid>/maps' notation, or None when it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", st.st_ino


def _mapped(text: str, names: tuple[str, ...], inodes: Inodes) -> list[str]:
    found: set[str] = set()
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5]
        if not path.startswith("/") or path.endswith(" (deleted)"):
            continue
        if (names and os.path.basename(path).startswith(names)) or (
            inodes and (parts[3], int(parts[4])) in inodes
        ):
            found.add(path)
    return sorted(found)


def maps_libraries(
    tgid: int, names: Iterable[str], inodes: Inodes = frozenset(), proc: str = procfs.PROC
) -> list[str]:
    """The launch libraries process `tgid` maps now (paths as it sees them); [] when it maps none
    or is gone."""
    text = procfs.maps(tgid, proc)
    return [] if text is None else _mapped(text, tuple(names), inodes)


def scan_processes(
    names: Iterable[str], inodes: Inodes = frozenset(), proc: str = procfs.PROC
) -> dict[int, list[str]]:
    """Every process that maps a launch library: {tgid: libraries}. Reads each /proc/<pid>/maps
    once (tens of ms on a busy host); processes that vanish meanwhile are left out."""
    names = tuple(names)
    out: dict[int, list[str]] = {}
    for pid in procfs.pids(proc):
        HOLD.wait()  # on the poll thread: a region entering goes first (probes/hold.py)
        libs = maps_libraries(pid, names, inodes, proc)
        if libs:
            out[pid] = libs
    return out


def identity(tgid: int) -> int | None:
    """The start time of a live process (tells a reused pid apart), or None when it is gone or a
    zombie (its address space, and with it every breakpoint, is gone)."""
    st = procfs.stat(tgid)
    return None if st is None or st.state in ("Z", "X") else st.start


def exported(path: str, symbols: tuple[str, ...]) -> list[tuple[str, int]]:
    """The launch symbols the ELF file `path` exports, as (name, address), one per address: an
    alias (cuLaunchKernelEx = cuLaunchKernel in some builds) probed twice would count each call
    twice. [] when the file is unreadable or not an ELF object."""
    bcc = _bcc.import_bcc()
    pattern = "^(" + "|".join(re.escape(s) for s in symbols) + ")$"
    try:
        found = bcc.BPF.get_user_functions_and_addresses(path.encode(), pattern.encode())
    except Exception:
        return []
    out: list[tuple[str, int]] = []
    addrs: set[int] = set()
    for sym, addr in sorted(found, key=lambda t: (len(t[0]), t[0])):
        name = sym.decode() if isinstance(sym, bytes) else sym
        if addr in addrs or name not in symbols:
            continue
        addrs.add(addr)
        out.append((name, addr))
    return out


@dataclass
class Watched:
    start: int | None
    since_ns: int = 0  # CLOCK_MONOTONIC of its first attach (comparable with ProbeEvent.ts_ns)
    libs: dict[str, list[str]] = field(default_factory=dict)  # path -> symbols probed there
    events: list[bytes] = field(default_factory=list)  # bcc's uprobe event names


class ProcessUprobes:
    """Launch uprobes of one loaded BPF object, attached process by process (see the module
    docstring). `symbols[i]` is counted by the BPF function `on_sym_<i>`."""

    def __init__(self, bpf: Any, symbols: tuple[str, ...]) -> None:
        self.bpf = bpf
        self.symbols = symbols
        self._watched: dict[int, Watched] = {}
        self._lock = threading.Lock()  # guards _watched against watched() from other threads
        self._backlog: collections.deque[tuple[int, bytes]] = collections.deque()
        self._tables: dict[tuple[int, int], list[tuple[str, int]]] = {}  # file -> (symbol, addr)
        self.attach_failures = 0
        self.last_error = ""

    def watched(self) -> dict[int, list[str]]:
        """{tgid: libraries probed in it}, a copy (safe from any thread)."""
        with self._lock:
            return {t: sorted(w.libs) for t, w in self._watched.items()}

    def since_ns(self, tgid: int) -> int | None:
        """When process `tgid` was first probed (CLOCK_MONOTONIC ns), None when it is not."""
        w = self._watched.get(tgid)
        return w.since_ns if w is not None else None

    def __contains__(self, tgid: int) -> bool:
        return tgid in self._watched

    def libraries(self) -> dict[str, list[str]]:
        """Every library path probed in some process, with its symbols."""
        with self._lock:
            out: dict[str, list[str]] = {}
            for w in self._watched.values():
                for path, syms in w.libs.items():
                    out.setdefault(path, syms)
            return out

    def _table(self, tgid: int, path: str) -> list[tuple[str, int]]:
        """The launch symbols of the file `path` names in process `tgid`, one per address (an
        alias would count each call twice), read once per file."""
        real = procfs.in_root(tgid, path)
        try:
            st = os.stat(real)
        except OSError:
            return []
        key = (st.st_dev, st.st_ino)
        if key not in self._tables:
            self._tables[key] = exported(real, self.symbols)
        return self._tables[key]

    def attach(self, tgid: int, libs: Iterable[str]) -> dict[str, list[str]]:
        """Probe process `tgid` on the launch symbols of each library in `libs` it is not yet
        probed on; returns {library: symbols} newly probed. A pid now naming another process than the
        one probed is detached first (same event names). A process that exits meanwhile, or an
        attach the kernel or bcc refuses (bcc's quota: BCC_PROBE_LIMIT, default 1000 uprobes per
        process), is counted in `attach_failures` with `last_error`; nothing raises."""
        start = identity(tgid)
        if start is None:
            return {}
        w = self._watched.get(tgid)
        if w is not None and w.start != start:
            self.forget(tgid)
            w = None
        self._flush(tgid)  # a detach still pending for this pid would close the new events
        if w is None:
            w = Watched(start, time.monotonic_ns())
        done: dict[str, list[str]] = {}
        events: list[bytes] = []
        for path in libs:
            if path in w.libs or path in done:
                continue
            syms: list[str] = []
            for name, addr in self._table(tgid, path):
                before = set(self.bpf.uprobe_fds)
                try:
                    self.bpf.attach_uprobe(
                        name=path.encode(),
                        addr=addr,
                        pid=tgid,
                        fn_name=f"on_sym_{self.symbols.index(name)}".encode(),
                    )
                except Exception as e:
                    self.attach_failures += 1
                    self.last_error = f"pid {tgid} {path} {name}: {e}"
                    continue
                events.extend(k for k in self.bpf.uprobe_fds if k not in before)
                syms.append(name)
            if syms:
                done[path] = syms
        if done:
            with self._lock:
                w.libs.update(done)
                w.events.extend(events)
                self._watched[tgid] = w
        return done

    def forget(self, tgid: int) -> None:
        """Stop watching `tgid`: its uprobes join the detach backlog (detach_one)."""
        with self._lock:
            w = self._watched.pop(tgid, None)
        if w is not None:
            self._backlog.extend((tgid, ev) for ev in w.events)

    def gone(self) -> list[int]:
        """Watched processes that exited (or whose pid now names another process)."""
        with self._lock:
            items = list(self._watched.items())
        return [t for t, w in items if identity(t) != w.start]

    def detach_one(self) -> bool:
        """Close one uprobe of the backlog; False when there was none."""
        if not self._backlog:
            return False
        _, ev = self._backlog.popleft()
        self._detach(ev)
        return True

    def _flush(self, tgid: int) -> None:
        mine = [ev for t, ev in self._backlog if t == tgid]
        if mine:
            self._backlog = collections.deque((t, ev) for t, ev in self._backlog if t != tgid)
            for ev in mine:
                self._detach(ev)

    def _detach(self, ev: bytes) -> None:
        try:
            self.bpf.detach_uprobe_event(ev)
        except Exception as e:  # already gone: nothing left to close
            self.last_error = f"detach {ev!r}: {e}"

    def pending_detaches(self) -> int:
        return len(self._backlog)

    def clear(self) -> None:
        """Forget everything (after the BPF object was released, which closed every event)."""
        with self._lock:
            self._watched.clear()
        self._backlog.clear()


class Outsiders:
    """Scope outsiders for one LaunchProbe: who is probed, and when (see the module docstring).

    `start()`, `opened()` and the rescans' classification run on the loop (`is_command` is only
    ever called there); `tick()` on the poll thread; `watched()` and `describe()` anywhere.
    `attached` ({library: symbols}, the LaunchProbe's) is filled with what gets probed.
    """

    def __init__(
        self,
        bpf: Any,
        symbols: tuple[str, ...],
        names: tuple[str, ...],
        inodes: Inodes,
        is_command: Callable[[int], bool] | None,
        rescan_s: float,
        attached: dict[str, list[str]],
    ) -> None:
        self.procs = ProcessUprobes(bpf, symbols)
        self.names, self.inodes = names, inodes
        self.is_command = is_command
        self.rescan_s = rescan_s
        self.attached = attached
        self.is_command_error: BaseException | None = None  # the last one it raised
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        # (op, tgid, libraries or None: read its maps, its start time or None: not checked)
        self._requests: queue.SimpleQueue[tuple[str, int, list[str] | None, int | None]] = queue.SimpleQueue()
        self._asked: dict[int, float] = {}  # tgid -> when an attach was last requested (loop)
        self._next_scan = 0.0

    def _inside(self, tgid: int) -> bool:
        """On the loop: whether `tgid` is inside krex (never probed). The daemon itself is. A
        predicate that raises says no: the process is probed (a bug there may cost launch rate,
        never a missed stray)."""
        if tgid == os.getpid():
            return True
        if self.is_command is None:
            return False
        try:
            return bool(self.is_command(tgid))
        except Exception as e:
            self.is_command_error = e
            return False

    def _attach(self, tgid: int, libs: list[str]) -> None:
        for path, syms in self.procs.attach(tgid, libs).items():
            self.attached.setdefault(path, syms)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop's thread: probe every outsider that maps a launch library now."""
        self._loop = loop
        for tgid, libs in scan_processes(self.names, self.inodes).items():
            if not self._inside(tgid):
                self._attach(tgid, libs)
        self._next_scan = time.monotonic() + self.rescan_s

    def opened(self, tgids: Iterable[int]) -> None:
        """On the loop: these processes just opened a GPU device file. Each outsider not yet
        probed is handed to the poll thread, which probes it on the libraries it maps."""
        if self._closed:
            return
        now = time.monotonic()
        for tgid in tgids:
            if tgid in self.procs or now - self._asked.get(tgid, -1e9) < 1.0:
                continue  # CUDA init opens a dozen files: one request is enough
            if self._inside(tgid):
                continue
            self._asked[tgid] = now
            self._requests.put(("attach", tgid, None, None))
        if len(self._asked) > 4096:
            self._asked = {t: at for t, at in self._asked.items() if now - at < 1.0}

    def _classify(self, found: dict[int, tuple[int, list[str]]]) -> None:
        """On the loop, with a rescan's {tgid: (start time, libraries)}: outsiders are (still)
        probed, watched processes now inside krex are let go."""
        if self._closed:
            return
        for tgid, (start, libs) in found.items():
            if self._inside(tgid):
                if tgid in self.procs:
                    self._requests.put(("forget", tgid, None, start))
            else:
                self._requests.put(("attach", tgid, libs, start))

    def tick(self) -> None:
        """Poll thread, every tick: attach and forget what the loop asked, rescan when due; when
        there was nothing else to do, close one uprobe of a process let go (slow: see above)."""
        busy = False
        while True:
            try:
                op, tgid, libs, start = self._requests.get_nowait()
            except queue.Empty:
                break
            busy = True
            if start is not None and identity(tgid) != start:
                continue  # asked about a process that is gone (its pid may name another now)
            if op == "forget":
                self.procs.forget(tgid)
            else:
                self._attach(
                    tgid, libs if libs is not None else maps_libraries(tgid, self.names, self.inodes)
                )
        if self.rescan_s > 0 and time.monotonic() >= self._next_scan:
            self._next_scan = time.monotonic() + self.rescan_s
            for tgid in self.procs.gone():
                self.procs.forget(tgid)
            found = {
                t: (start, libs)
                for t, libs in scan_processes(self.names, self.inodes).items()
                if (start := identity(t)) is not None
            }
            if found and self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(self._classify, found)
                except RuntimeError:  # the loop closed: the daemon is exiting
                    pass
            busy = True
        if not busy:
            self.procs.detach_one()

    def describe(self) -> dict[str, Any]:
        w = self.procs.watched()
        return {
            "watched": len(w),
            "watched_pids": sorted(w)[:32],
            "attach_failures": self.procs.attach_failures,
            "detaches_pending": self.procs.pending_detaches(),
        }

    def close(self) -> None:
        """After the BPF object was released (every event closed): forget everything."""
        self._closed = True
        self.procs.clear()
