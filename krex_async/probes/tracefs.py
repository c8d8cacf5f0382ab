"""The tracefs backend: ioctls on GPU device files without a compiler, from syscalls:sys_enter_ioctl.

It works in its own tracefs instance (instances/krex-<pid>), so it never disturbs another reader of
the top-level trace_pipe, and it removes the instance on stop. Set-up, in the instance:
    trace_clock = mono (timestamps comparable with time.monotonic_ns(), at microsecond precision),
    options/record-tgid = 1 (each line carries its tgid), options/event-fork = 1 (threads and
    children of traced tasks are traced too), set_event_pid = the tasks of processes that hold a
    device file, events/syscalls/sys_enter_ioctl/filter = "fd == a || fd == b ...", enable = 1.
The holders come from /proc/*/fd (prefix match on the link target); every `rescan_s` the scan is repeated,
new holders' tasks added to set_event_pid (never written over: see _refresh) and the filter updated. Lines
whose (tgid, fd) is not a known device fd (another holder's fd number) are dropped in user space. A device
fd that a scan no longer finds (its process exited, or closed it) still counts for the lines stamped before
that scan ended: the reader may parse them after it (late under CPU load, or paused), and a process's last
ioctls before it exits are its own. A line read before the kernel saved its thread's tgid (a thread that
began since and has not been switched out yet) shows none: its thread is looked up (the last scan's tasks,
else /proc/<tid>/status), or its ioctls would be dropped as another holder's.

Less precise than the bcc backend: a device opened after a scan is seen from the next scan on; no
"open" events; counts() counts parsed events (not kernel-side: settle() waits until the reader has
parsed every line buffered before the call); lost() is the sum of the instance's per-CPU "overrun"
and "dropped events" counters.

At runtime the reader thread fails (FailureReporting: `failure`, `on_failure`) when reading
trace_pipe errors, when the instance can no longer be written (the rescan's filter update), or when
its check every `rescan_s` finds the event or the instance's tracing turned off from outside (for
instance `echo 0 > .../enable`, `trace-cmd reset`): it closes trace_pipe and exits; stop() removes
the instance.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import select
import threading
import time
from collections.abc import Callable, Iterable

from krex_async.linux import procfs
from krex_async.probes.base import ProbeBackend, ProbeEvent, ProbeUnavailable
from krex_async.probes.bpf_ioctl import DEFAULT_PREFIXES, scan_proc
from krex_async.probes.failure import FailureReporting, name_thread
from krex_async.probes.hold import HOLD
from krex_async.probes.ioctls import ioctl_name

ROOTS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
# A settle reads the lines stamped up to this past its request: a line of another CPU stamped just
# before it may be committed (and so readable) just after a later one was read (a vCPU paused
# between the two steps)
SETTLE_MARGIN_NS = 1_000_000
EVENT = "events/syscalls/sys_enter_ioctl"
# "  python3-7871    (   7830) [000] .....  4553.670455: sys_ioctl(fd: 3, cmd: 0x5401, arg: ...)"
LINE = re.compile(
    r"^\s*(?P<comm>.*)-(?P<tid>\d+)\s+\(\s*(?P<tgid>\d+|-+)\)\s+\[\d+\]\s+\S+\s+"
    r"(?P<ts>\d+\.\d+): sys_ioctl\(fd: (?P<fd>(?:0x)?[0-9a-f]+), "
    r"cmd: (?P<cmd>(?:0x)?[0-9a-f]+)"
)


def tracefs_root() -> str:
    """The mounted tracefs directory; mounts it (root only) when absent. Raises ProbeUnavailable
    saying which: not mounted, or mounted where this user may not look (mode 0700, root's)."""
    for r in ROOTS:
        if os.path.isdir(f"{r}/instances"):
            return r
    mounted = [m.point for m in procfs.mounts("tracefs") if m.point in ROOTS]
    for r in mounted:  # isdir() is False for a directory we may not search, too
        if not os.access(r, os.R_OK | os.X_OK):
            why = "; ".join(w for w in (f"uid {os.geteuid()}", _mode(r)) if w)
            raise ProbeUnavailable(
                f"tracefs is mounted at {r} but not readable by this user ({why}): run the daemon as root"
            )
        raise ProbeUnavailable(f"tracefs at {r} has no instances/ directory (kernel before 4.1?)")
    if os.geteuid() == 0 and os.path.isdir(ROOTS[0]):
        rc = os.system(f"mount -t tracefs nodev {ROOTS[0]} 2>/dev/null")
        if rc == 0 and os.path.isdir(f"{ROOTS[0]}/instances"):
            return ROOTS[0]
    raise ProbeUnavailable("tracefs not mounted (mount -t tracefs nodev /sys/kernel/tracing)")


def _mode(path: str) -> str:
    """'mode 0700, owner uid 0' for an error message; '' where even that cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return f"mode {st.st_mode & 0o7777:04o}, owner uid {st.st_uid}"


def _num(s: str, hex_default: bool) -> int:
    return int(s, 16) if s.startswith("0x") or hex_default else int(s)


def parse_line(line: str, fd_hex: bool = False) -> tuple[int, int, int, int, int, str] | None:
    """(ts_ns, tgid, tid, fd, cmd, comm) from one trace_pipe line, or None for other lines.

    Kernels print syscall arguments either as bare hex or with 0x; `fd_hex` says how a bare fd is
    read (cmd without 0x is always hex).
    """
    m = LINE.match(line)
    if m is None:
        return None
    tid = int(m["tid"])
    tgid = int(m["tgid"]) if m["tgid"][0] != "-" else tid
    sec, _, frac = m["ts"].partition(".")
    ts_ns = int(sec) * 1_000_000_000 + int(frac.ljust(9, "0")[:9])
    return ts_ns, tgid, tid, _num(m["fd"], fd_hex), _num(m["cmd"], True), m["comm"].strip()


class TracefsProbe(FailureReporting, ProbeBackend):
    """See the module docstring. start() raises ProbeUnavailable when tracefs or the
    sys_enter_ioctl event is missing or not writable; stop() disables the event, joins the reader
    thread and removes the instance (also after a runtime failure; a second stop() is a no-op)."""

    name = "tracefs"

    def __init__(
        self, prefixes: Iterable[str] | None = None, rescan_s: float = 1.0, buffer_kb: int = 8192
    ) -> None:
        self.prefixes = tuple(prefixes if prefixes is not None else DEFAULT_PREFIXES)
        self.rescan_s = rescan_s
        self.buffer_kb = buffer_kb
        self.fd_paths: dict[tuple[int, int], str] = {}
        self.instance = ""
        self._counts: dict[int, int] = {}
        self._lost_final = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # batches parsed by the reader, for the loop: settle() hands them over before it returns
        self._pending: collections.deque[list[ProbeEvent]] = collections.deque()
        self._on_events: Callable[[list[ProbeEvent]], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd_hex = False
        self._pids: set[int] = set()
        self._tgids: dict[int, int] = {}  # tid -> tgid: the last scan's tasks, and threads looked up since
        self._fds: set[int] = set()
        # (tgid, fd) -> (path, mono ns of the scan that no longer found it), for the lines stamped before
        self._retired: dict[tuple[int, int], tuple[str, int]] = {}
        self._read_ts = 0  # the newest line's timestamp parsed so far
        self.scans = 0  # /proc scans done (tests wait for one to have happened)
        self.error: BaseException | None = None
        self.paused = threading.Event()  # set: lines wait in the kernel buffer (tests, benchmarks)
        self._stopped = False
        self._settle_req = threading.Event()
        # settle() requests by number: the last asked for (and when: the lines stamped before it
        # are owed), the last the reader has done. A pass for a request that timed out, still
        # running when the next one came, must not answer that one.
        self._settle = threading.Condition()
        self._asked = self._done = 0
        self._gone = False  # the reader has exited: no request will be done
        self._settle_ns = 0
        self._wake: tuple[int, int] | None = None  # a pipe that wakes the reader out of poll()

    def _write(self, rel: str, value: str, append: bool = False) -> None:
        path = f"{self.instance}/{rel}"
        try:  # "a" would seek, which tracefs refuses
            with open(os.open(path, os.O_WRONLY | (os.O_APPEND if append else os.O_TRUNC)), "w") as f:
                f.write(value)
        except OSError as e:
            raise ProbeUnavailable(f"tracefs: writing {value[:60]!r} to {path}: {e}") from e

    def start(self, loop: asyncio.AbstractEventLoop, on_events: Callable[[list[ProbeEvent]], None]) -> None:
        root = tracefs_root()
        if not os.path.isdir(f"{root}/{EVENT}"):
            raise ProbeUnavailable(f"tracefs: no {EVENT} (kernel without syscall tracepoints)")
        self.instance = f"{root}/instances/krex-{os.getpid()}"
        try:
            if os.path.isdir(self.instance):  # left by a previous run of this pid: start clean
                self._remove_instance()
            os.mkdir(self.instance)
        except OSError as e:
            raise ProbeUnavailable(f"tracefs: cannot create {self.instance}: {e}") from e
        try:
            fmt = open(f"{root}/{EVENT}/format").read()
            self._fd_hex = "fd: 0x%" not in fmt and "fd: %lx" in fmt
            self._write("trace_clock", "mono")
            self._write("options/record-tgid", "1")
            self._write("options/event-fork", "1")
            self._write("buffer_size_kb", str(self.buffer_kb))
            self._refresh()
            self._write(f"{EVENT}/enable", "1")
            pipe = os.open(f"{self.instance}/trace_pipe", os.O_RDONLY | os.O_NONBLOCK)
        except BaseException:
            self._remove_instance()
            raise
        self._wake = os.pipe()
        for w in self._wake:
            os.set_blocking(w, False)
        self._loop, self._on_events = loop, on_events
        self._thread = threading.Thread(
            target=self._run, args=(pipe, loop), name="krex-probe-tracefs", daemon=True
        )
        self._thread.start()

    def _refresh(self) -> None:
        """Scan /proc for device holders; add new ones' tasks to set_event_pid, update the fd filter."""
        paths = {(tgid, fd): path for tgid, fd, path in scan_proc(self.prefixes)}
        # Stamped after the scan, not before: a holder may make its ioctls and exit while the scan
        # runs (before it reaches that pid), and those lines are still its own. The cost: a number
        # closed and reused during the scan counts as the device until this stamp, as it did
        # between the close and the scan anyway.
        ended = time.monotonic_ns()
        # Replaced, not merged: an fd a holder closed may name another file by now. The ones gone
        # are kept for the lines stamped before this scan ended, still in the kernel's buffer or in
        # flight (a holder that made its ioctls and exited while the reader lagged); forgotten once
        # the reader has parsed a line stamped after they went (trace_pipe is in timestamp order).
        for key, path in self.fd_paths.items():
            if key not in paths:
                self._retired[key] = (path, ended)
        self._retired = {k: v for k, v in self._retired.items() if k not in paths and v[1] > self._read_ts}
        self.fd_paths = paths
        pids: set[int] = set()
        tgids: dict[int, int] = {}
        for tgid in {t for t, _ in paths}:
            if (tids := procfs.tids(tgid)) is None:
                continue
            pids.update(tids)
            tgids.update(dict.fromkeys(tids, tgid))
        self._tgids = tgids
        fds = {fd for _, fd in paths}
        if new := pids - self._pids:
            # Added to, never written over: O_TRUNC clears the list, and until that write ends (tens of
            # ms) the kernel drops the holders' ioctls uncounted (lost() 0: 6240 of 8440 seen beside 4
            # such writes). An exited task leaves it (event-fork); with no holder the filter passes none.
            self._write("set_event_pid", " ".join(map(str, sorted(new))), append=True)
        self._pids = pids
        if fds != self._fds or not fds:
            expr = " || ".join(f"fd == {fd}" for fd in sorted(fds)) if fds else "common_pid < 0"
            self._write(f"{EVENT}/filter", expr)
            self._fds = fds
        self.scans += 1

    def _check(self) -> None:
        """Raise ProbeUnavailable when the instance no longer traces (changed from outside)."""
        for rel, what in ((f"{EVENT}/enable", "the sys_enter_ioctl event"), ("tracing_on", "tracing")):
            path = f"{self.instance}/{rel}"
            try:
                with open(path) as f:
                    value = f.read().strip()
            except OSError as e:
                raise ProbeUnavailable(f"tracefs: cannot read {path}: {e}") from e
            if not value.startswith("1"):
                raise ProbeUnavailable(
                    f"tracefs: {what} was turned off from outside ({path} reads {value!r})"
                )

    def settle(self, timeout: float = 0.1) -> bool:
        """Block until the reader has parsed every line the kernel buffered before this call,
        so that counts() covers every ioctl made until now (they are not kept kernel-side), and,
        called on the loop, until on_events has had every batch parsed: a region released right
        after a burst had the stream's last batch still queued for the loop, and came back a
        stray short (2999 of 3000 under load). Returns False when it could not within `timeout`
        (the reader is paused, stopped or failed, or starved of CPU): the caller must then treat
        counts() as incomplete."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return False
        with self._settle:  # stop() closes the wake-up pipe under it
            if self._wake is None or self._gone:
                return False
            self._asked += 1
            mine, self._settle_ns = self._asked, time.monotonic_ns()
            self._settle_req.set()
            with contextlib.suppress(BlockingIOError):  # full: a wake-up is pending anyway
                os.write(self._wake[1], b"s")
            self._settle.wait_for(lambda: self._done >= mine or self._gone, timeout)
            settled = self._done >= mine
        with contextlib.suppress(RuntimeError):  # not on a loop: the batches come as scheduled
            if asyncio.get_running_loop() is self._loop:
                self._hand_over()
        return settled

    def _hand_over(self) -> None:
        """On the loop: give on_events every batch the reader parsed, in order (once each)."""
        while self._pending and self._on_events is not None:
            self._on_events(self._pending.popleft())

    def _run(self, pipe: int, loop: asyncio.AbstractEventLoop) -> None:
        name_thread("krex-probe-tfs")
        poller = select.poll()
        poller.register(pipe, select.POLLIN)
        assert self._wake is not None
        wake_r = self._wake[0]
        poller.register(wake_r, select.POLLIN)
        buf = b""
        next_scan = 0.0

        def deliver(lines: list[bytes]) -> bool:
            batch = self._parse(lines)
            if batch:
                self._pending.append(batch)  # handed over by the call, or by a settle() before it
                try:
                    loop.call_soon_threadsafe(self._hand_over)
                except RuntimeError:
                    return False
            return True

        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_scan:
                    HOLD.wait()
                    next_scan = now + self.rescan_s
                    self._check()
                    self._refresh()
                if self.paused.is_set():
                    self._stop.wait(0.01)
                    continue
                ready = dict(poller.poll(100))
                if wake_r in ready:
                    try:
                        os.read(wake_r, 4096)
                    except BlockingIOError:
                        pass
                if self.paused.is_set():  # paused while it polled: a settle asked now waits too
                    continue
                if self._settle_req.is_set():
                    # Read until the buffer is empty, or a line stamped after the request is read
                    # (trace_pipe is in timestamp order): every line committed before the request.
                    # Until empty alone never ended while a holder went on making ioctls, and the
                    # region released then came back tainted.
                    self._settle_req.clear()
                    with self._settle:
                        asked, upto = self._asked, self._settle_ns + SETTLE_MARGIN_NS
                    while self._read_ts < upto:
                        try:
                            chunk = os.read(pipe, 1 << 16)
                        except BlockingIOError:
                            break
                        if not chunk:
                            break
                        buf += chunk
                        *lines, buf = buf.split(b"\n")
                        if not deliver(lines):
                            return
                    with self._settle:
                        self._done = asked
                        self._settle.notify_all()
                    continue
                revents = ready.get(pipe, 0)
                if not revents:
                    continue
                HOLD.wait()  # a region is entering: the lines wait in the kernel's buffer
                if revents & (select.POLLERR | select.POLLNVAL):
                    raise ProbeUnavailable(f"tracefs: trace_pipe poll error (revents {revents:#x})")
                try:
                    chunk = os.read(pipe, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    continue
                buf += chunk
                *lines, buf = buf.split(b"\n")
                if not deliver(lines):
                    return
        except BaseException as e:
            self.error = e
            self._failed(
                loop, str(e) if isinstance(e, ProbeUnavailable) else f"tracefs: reader thread failed: {e!r}"
            )
        finally:
            os.close(pipe)
            with self._settle:  # a settle() waiting for this reader: it will not come, say so now
                self._gone = True
                self._settle.notify_all()

    def _parse(self, lines: list[bytes]) -> list[ProbeEvent]:
        out = []
        for raw in lines:
            rec = parse_line(raw.decode("utf-8", "replace"), self._fd_hex)
            if rec is None:
                continue
            ts, tgid, tid, fd, cmd, comm = rec
            self._read_ts = max(self._read_ts, ts)
            path = self._device(tgid, fd, ts)
            if path is None and tgid == tid:  # a thread the kernel had no tgid for yet, perhaps
                tgid = self._thread_group(tid)
                path = self._device(tgid, fd, ts)
            if path is None:
                continue  # another holder's fd number, not a device fd of this process
            self._counts[tgid] = self._counts.get(tgid, 0) + 1
            out.append(ProbeEvent(ts, tgid, tid, "ioctl", fd, cmd, ioctl_name(cmd, path), comm))
        return out

    def _device(self, tgid: int, fd: int, ts: int) -> str | None:
        """The device file at (tgid, fd) when the line stamped `ts` was made: the last scan's, else
        one a later scan no longer found, for a line from before that scan."""
        path = self.fd_paths.get((tgid, fd))
        if path is None:
            gone = self._retired.get((tgid, fd))
            if gone is not None and ts < gone[1]:
                path = gone[0]
        return path

    def _thread_group(self, tid: int) -> int:
        """The process of thread `tid`: the last scan's, else /proc's (remembered until the next
        scan), else `tid` itself (gone: its line is dropped as before)."""
        found = self._tgids.get(tid)
        if found is None:
            found = self._tgids[tid] = procfs.tgid(tid) or tid
        return found

    def lost(self) -> int:
        if not self.instance or not os.path.isdir(self.instance):
            return self._lost_final
        total = 0
        for cpu in os.listdir(f"{self.instance}/per_cpu"):
            try:
                text = open(f"{self.instance}/per_cpu/{cpu}/stats").read()
            except OSError:
                continue
            for key in ("overrun", "dropped events"):
                m = re.search(rf"^{key}: (\d+)", text, re.M)
                total += int(m.group(1)) if m else 0
        return total

    def counts(self) -> dict[int, int]:
        return dict(self._counts)

    def _remove_instance(self) -> None:
        try:
            with open(f"{self.instance}/{EVENT}/enable", "w") as f:
                f.write("0")
            with open(f"{self.instance}/{EVENT}/filter", "w") as f:
                f.write("0")  # "0" clears a filter
        except OSError:
            pass
        try:
            os.rmdir(self.instance)
        except OSError:
            pass

    def stop(self) -> None:
        if not self.instance or self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._settle:
            if self._wake is not None:
                for w in self._wake:
                    os.close(w)
                self._wake = None
        self._lost_final = self.lost()
        self._remove_instance()
