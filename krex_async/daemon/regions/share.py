"""A held command's share of its device (--hold-share, --share-window): regions of other commands
may hold a command for at most --hold-share of any --share-window seconds (plus one region).

Each region's wait for its turn is bounded by --region-timeout, but nothing bounded their sum: back
to back, one user's regions left another user's command 2% of its progress. So each command keeps
the spans in which others' regions held it (from the region's entry to its release), each charged
for the part of it the command could not run: a frozen command all of it; a locked one (the driver
lock stops its CUDA calls, its CPU threads run on) the span less the CPU time its threads used in
it (capped at the span). A region whose turn has come first looks at the siblings it would hold:
one charged for --hold-share of the last --share-window is owed the time until that is no longer so.
The region waits that long with its turn kept (queued, never refused, no sibling held), so the
sibling runs; then it isolates as ever, so a grant still never comes while a sibling runs.

Not owed a share, nor charged from its request on: a sibling whose own region is requested (it
waits for that, not to run: the FIFO, not the share, gives it its turn). Not owed a share: one
leaving (its pool-run program ended, no process of it holds a GPU file: Command.leaving); one
that did not use the time it was given (on a CPU or in a run queue waiting for one under 1% of its
last IDLE_PROBE_S and under 5% of the whole wait, and no thread runnable at its end: blocked,
sleeping, idle; IdleProbes), whose spans are then forgotten; and a command put back in line to run
again (a re-run: a new run, which no region has held). Regions of a command never hold that
command. --hold-share 0 or 1 turns this off.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Mapping

from krex_async.linux import procfs

CpuReading = Mapping[str, Mapping[int, int]]  # command -> pid -> CPU ns (cpu_by_pid)

# A sibling given IDLE_PROBE_S that spends under IDLE_BUSY of it on a CPU or waiting in a run queue
# for one, with no thread runnable at its end, is not waited for. A busy sibling on a loaded host,
# kept off the CPUs for the whole probe, has its threads runnable (state R): the kernel adds a
# thread's wait to its schedstat only once it runs. 0.1 s of CPU time alone until 2026-12-07, when the
# probe (0.2 s at times, below) was most of the p95 of region entry on the H100's steady run
# (150.7 ms; 71.8 ms without it: bench/RESULTS.md, session 26).
IDLE_PROBE_S = 0.02
IDLE_BUSY = 0.01
# ... and that over the whole wait so far spent under IDLE_WAIT_BUSY of it so: its first moments,
# thawed by the region before, are its catch-up on what waited meanwhile. By IDLE_BUSY of the whole
# wait alone (the rule until session 28), 2 ms of catch-up kept a sibling that then blocked "busy"
# for 0.2 s, the length of most share waits that found a sibling idle on the H100's steady runs
# (session 27). A sibling busy IDLE_WAIT_BUSY of the time or more is waited for as before.
IDLE_WAIT_BUSY = 0.05
TICKS = os.sysconf("SC_CLK_TCK")  # /proc's clock ticks a second (a process's start time)
# uvloop's timers run on a millisecond clock read at the loop's turn, so a wait of IDLE_PROBE_S
# can end a little before time.monotonic() says it has passed; without this slack the probe then
# took a second round (0.2 s instead of 0.1 in half the idle probes of session 24's steady run)
PROBE_SLACK_S = 0.002
EPSILON_S = 0.001  # past the exact instant, so the fraction is below the share when the wait ends


class Share:
    """Per command, the spans others' regions held it, each charged for the part of it the command
    could not run; what a region owes its siblings."""

    def __init__(self, share: float, window: float) -> None:
        self.share = share
        self.window = window
        self.on = 0.0 < share < 1.0
        # command -> (start, end, charged part of the span 0..1), monotonic; the charge is taken as
        # spread evenly over the span (a CPU reading at each end says how much, not when)
        self.spans: dict[str, deque[tuple[float, float, float]]] = {}
        self.sums: dict[str, float] = {}  # command -> its spans' charged seconds: held_s in O(1)
        # commands at or over the share when last held: the only ones that can be owed time (the
        # held part of the window grows only at a release), so a region's turn looks at these alone
        self.over: set[str] = set()
        # region -> (commands it holds, since, CPU ns of its locked ones' processes at the grant)
        self.open: dict[str, tuple[list[str], float, dict[str, dict[int, int]]]] = {}
        self.total: dict[str, float] = {}  # command -> charged seconds held by others' regions in all
        self.wall: dict[str, float] = {}  # command -> wall seconds held (frozen or locked) in all

    @property
    def budget(self) -> float:
        return self.share * self.window

    def begin(self, region: str, held: list[str], since: float, cpu: CpuReading | None = None) -> None:
        """A region was granted holding `held` since `since` (its entry began); `cpu`: the CPU ns
        of each process (cpu_by_pid) of those of them locked, read now: their CPU time from now to
        the release is credited at `end`; what they used from `since` to the grant is not
        (charged, as if stopped: at most the entry's length, docs/fairness.md)."""
        if held:
            self.open[region] = (held, since, {c: dict(x) for c, x in (cpu or {}).items()})

    def end(
        self,
        region: str,
        held: list[str],
        since: float,
        now: float,
        cpu: CpuReading | None = None,
        asked: Mapping[str, float] | None = None,
    ) -> dict[str, float]:
        """A granted region released: each of `held` (as it ended) was held from `since` to `now`.
        `cpu`: the CPU ns of each process of those still locked alone (not frozen), read now; one
        read at begin too is charged the span less the CPU time its processes read both times used
        in between (one started or gone meanwhile: not credited), the others the whole span.
        `asked`: when those of them waiting for a region of their own on the device asked for it
        (monotonic): from then on each waits for that, not to run, and is charged only the part of
        the span before, at most what the span charges it. Returns the seconds charged to each."""
        base = self.open.pop(region, ([], since, {}))[2]
        span = max(0.0, now - since)
        out = {}
        for cid in held:
            used = 0.0
            if cpu and cid in cpu and cid in base:
                was, now_ns = base[cid], cpu[cid]
                used = sum(max(0, ns - was[p]) for p, ns in now_ns.items() if p in was) / 1e9
            end = min(now, max(since, asked.get(cid, now))) if asked else now
            charged = out[cid] = max(0.0, min(end - since, span - min(span, used)))
            self.total[cid] = self.total.get(cid, 0.0) + charged
            self.wall[cid] = self.wall.get(cid, 0.0) + span
            q = self.spans.setdefault(cid, deque())
            if charged > 0:
                q.append((since, end, charged / (end - since)))
                self.sums[cid] = self.sums.get(cid, 0.0) + charged
            self._prune(cid, q, now)
            if self.on and self.held_s(cid, now) >= self.budget:
                self.over.add(cid)
        return out

    def forget(self, cid: str) -> None:
        """`cid` ended, or did not want the time it was given: it is owed nothing from its past."""
        self.spans.pop(cid, None)
        self.sums.pop(cid, None)
        self.over.discard(cid)

    def drop(self, cid: str) -> None:
        self.forget(cid)
        self.total.pop(cid, None)
        self.wall.pop(cid, None)

    def _prune(self, cid: str, q: deque[tuple[float, float, float]], now: float) -> None:
        while q and q[0][1] <= now - self.window:
            s, e, d = q.popleft()
            self.sums[cid] -= (e - s) * d

    def held_s(self, cid: str, now: float) -> float:
        """Charged seconds of the last --share-window that others' regions held `cid` (one holding
        it now counts in full up to now: its locked siblings' CPU is credited at its release)."""
        left = now - self.window
        q = self.spans.get(cid)
        out = 0.0
        if q:
            self._prune(cid, q, now)
            # the spans are disjoint and in order: only the first can reach past the left edge
            out = max(0.0, self.sums[cid] - max(0.0, left - q[0][0]) * q[0][2]) if q else 0.0
        for held, since, _cpu in self.open.values():
            if cid in held:
                out += now - max(since, left)
        return out

    def owed_s(self, cid: str, now: float) -> float:
        """How long `cid` must now run unheld before its held part of the window is under the share
        (0: it is not over it). The window's left edge passes its oldest spans as it runs."""
        if not self.on or cid not in self.spans:
            return 0.0
        q = self.spans[cid]
        excess = self.held_s(cid, now) - self.budget
        if excess < 0:
            self.over.discard(cid)
            return 0.0
        left = now - self.window
        gone = 0.0
        for s, e, d in q:
            s = max(s, left)
            if gone + (e - s) * d > excess:
                return s + (excess - gone) / d - left + EPSILON_S
            gone += (e - s) * d
        return self.window  # held now (an open span): not reached by sliding; not asked while held

    def status(self, cid: str, now: float) -> dict[str, float | bool]:
        """For `krex status`: charged seconds held in all, wall seconds held in all, the charged
        fraction of the window, and what it is owed now (`starved`: a region would wait for it)."""
        owed = self.owed_s(cid, now)
        return {
            "held_s": round(self.total.get(cid, 0.0), 3),
            "held_wall_s": round(self.wall.get(cid, 0.0), 3),
            "held_fraction": round(self.held_s(cid, now) / self.window, 3),
            "owed_s": round(owed, 3),
            "starved": owed > 0,
        }


class IdleProbes:
    """The idle probes of one region's share wait. Per sibling owed: when it was first probed, its
    last probe, each of its threads' busy ns then (busy_by_thread), and what its threads have been
    busy since the first. Idle: under IDLE_BUSY of its last probe (at least IDLE_PROBE_S) and under
    IDLE_WAIT_BUSY of the whole wait on a CPU or in a run queue, and no thread runnable.

    Counted thread by thread, between two readings of it: a thread or process that ends takes
    nothing back from what the sibling was busy (a sum over its processes dropped by a finished
    worker's whole past); a new thread of a process read before, and a process started since the
    last reading (a child), count all their time; a process started before it that joins since (a
    warm worker) counts from its first reading, not its past."""

    def __init__(self) -> None:
        self.since: dict[str, float] = {}  # command -> monotonic at its first probe
        self.at: dict[str, float] = {}  # ... at its last probe
        self.booted: dict[str, int] = {}  # ... clock ticks since boot at its last probe
        self.seen: dict[str, dict[tuple[int, str], int]] = {}  # ... its threads' busy ns then
        self.busy: dict[str, int] = {}  # ... busy ns since its first probe

    def start(self, cid: str, pids: list[int]) -> None:
        """Probe `cid` (its processes `pids`) from now, unless it is probed already."""
        if cid not in self.since:
            self.since[cid] = self.at[cid] = time.monotonic()
            self.booted[cid] = boot_ticks()
            self.seen[cid], self.busy[cid] = busy_by_thread(pids), 0

    def started(self) -> list[str]:
        return list(self.since)

    def idle(self, cid: str, pids: list[int]) -> bool:
        """Whether `cid` did not use the time it was given (the class docstring); a probe of at
        least IDLE_PROBE_S that finds it busy starts the next."""
        now, at = time.monotonic(), self.at[cid]
        if not pids or now - at < IDLE_PROBE_S - PROBE_SLACK_S:
            return False
        ticks = boot_ticks()  # before the reading: a child started after it is in the next one's
        was, booted, cur = self.seen[cid], self.booted[cid], busy_by_thread(pids)
        new = {pid for pid, _tid in cur} - {pid for pid, _tid in was}
        # started since the last reading, or gone already (its time cannot be told from a past)
        born = {p for p in new if (started := procfs.start_time(p)) is None or started >= booted}
        step = sum(
            max(0, ns - was[t]) if t in was else ns if t[0] not in new or t[0] in born else 0
            for t, ns in cur.items()
        )
        self.busy[cid] += step
        whole = self.busy[cid] < IDLE_WAIT_BUSY * (now - self.since[cid]) * 1e9
        if step < IDLE_BUSY * (now - at) * 1e9 and whole and not runnable(pids):
            return True
        self.at[cid], self.booted[cid], self.seen[cid] = now, ticks, cur
        return False


def boot_ticks() -> int:
    """Clock ticks since boot now, less one (a process's start time in /proc is in whole ticks:
    one started within the tick of a reading counts as started after it)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * TICKS) - 1


def cpu_by_pid(pids: list[int]) -> dict[int, int]:
    """CPU ns each of `pids` has had, its threads summed (schedstat); one gone is left out. Keyed
    by pid, so that a process that joins or leaves a command between two readings adds nothing
    (a warm worker that joins brings its whole past)."""
    out: dict[int, int] = {}
    for pid, _tid, text in procfs.thread_files(pids, "schedstat"):
        with contextlib.suppress(ValueError, IndexError):
            out[pid] = out.get(pid, 0) + int(text.split()[0])
    return out


def runnable(pids: list[int]) -> bool:
    """Whether a thread of the processes `pids` is running or waiting in a run queue (state R)."""
    return any(
        text.rsplit(b")", 1)[-1].split()[:1] == [b"R"] for _p, _t, text in procfs.thread_files(pids, "stat")
    )


def busy_by_thread(pids: list[int]) -> dict[tuple[int, str], int]:
    """The time each thread of the processes `pids` has spent on a CPU or waiting in a run queue
    for one, in ns (schedstat's first two fields: precise, where /proc/PID/stat counts in ticks),
    by (pid, tid): a blocked thread adds to neither. One gone is left out."""
    out = {}
    for pid, tid, text in procfs.thread_files(pids, "schedstat"):
        with contextlib.suppress(ValueError, IndexError):
            on_cpu, waiting = text.split()[:2]
            out[pid, tid] = int(on_cpu) + int(waiting)
    return out
