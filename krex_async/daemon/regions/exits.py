"""Processes exiting with a GPU file: the next region on their device waits for them to be gone.

A sibling's exit frees its GPU memory through the driver, which neither a lock nor the timing stops:
one deferred to a region's end (ExitHeld), or begun with no region on the device, is noted here, and
the next region there waits for it first (--exit-wait); one still exiting after that is frozen for
the region (entry.py) and noted again at its release. Frozen by region after region, an exit would
run only in the gaps between them, so one begun over --exit-starve ago is waited for as one in the
kernel is.
"""

from __future__ import annotations

import time

from krex_async.daemon.model.core import Core, Exiting, Region
from krex_async.daemon.regions.policy import wait_exits
from krex_async.isolation.cudalock import start_time
from krex_async.linux.procfs import exiting_in_kernel

EXITING_KEPT_S = 60.0  # an exiting process no region waited for (or whose exit never ends) is forgotten


class Exits:
    def __init__(self, core: Core) -> None:
        self.core = core
        # processes exiting with a GPU file (ExitHeld: at once, or at the release of the region
        # their exit waited for): the next region on that device waits for them to be gone, or
        # they would be locked mid-exit and tear their context down beside its timing
        self.exiting: dict[int, Exiting] = {}

    def note_exiting(self, pid: int, device: str) -> None:
        """`pid` is exiting on `device` now: the next region there waits for it (wait). Entries
        no region consumed within EXITING_KEPT_S are dropped."""
        now = time.monotonic()
        self.exiting = {p: v for p, v in self.exiting.items() if now - v.noted < EXITING_KEPT_S}
        self.exiting[pid] = Exiting(device, now, start_time(pid), now)

    @staticmethod
    def still_exiting(pid: int, entry: Exiting, now: float) -> bool:
        """An `exiting` entry still stands: noted less than EXITING_KEPT_S ago, and the pid is
        the same process (its start time), not a reused one."""
        return now - entry.noted < EXITING_KEPT_S and start_time(pid) == entry.start

    def take(self, r: Region) -> dict[int, Exiting]:
        """The exits r waits for (wait): its device's that still stand, no longer noted here."""
        now = time.monotonic()
        mine = {
            p: e for p, e in self.exiting.items() if e.device == r.device and self.still_exiting(p, e, now)
        }
        self.exiting = {
            p: v for p, v in self.exiting.items() if v.device != r.device and now - v.noted < EXITING_KEPT_S
        }
        return mine

    async def wait(self, r: Region, noted: dict[int, Exiting]) -> None:
        """Wait (--exit-wait, default --lock-wait) for the siblings on r's device that are exiting
        (Daemon.exit_held; `noted`, from take(r)): their exit was deferred to an earlier region's
        end, or began with none on the device; they are tearing their GPU state down now. Those
        still in user space after that are left unfinished (frozen for the region, Entry.isolate);
        one already in the kernel's exit cannot be frozen, so it is waited for up to the longer of
        --exit-wait and --exit-kernel-wait, and so is one begun over --exit-starve ago (starved:
        frozen through the regions since)."""
        now = time.monotonic()
        mine = list(noted)
        if mine:
            cfg = self.core.config
            limit = cfg.lock_wait if cfg.exit_wait < 0 else cfg.exit_wait
            t0 = time.perf_counter()
            done = await wait_exits(mine, limit)
            starved = [p for p in mine if p not in done and now - noted[p].began >= cfg.exit_starve]
            past = [p for p in mine if p not in done and (p in starved or exiting_in_kernel(p))]
            if past:
                left = max(limit, cfg.exit_kernel_wait) - (time.perf_counter() - t0)
                done += await wait_exits(past, max(0.0, left))
            r.report.exits_wait_s = time.perf_counter() - t0
            r.report.exits_waited = done
            r.report.exits_unfinished = [p for p in mine if p not in done]
            r.report.exits_starved = starved
            r.exits_left = {p: noted[p] for p in r.report.exits_unfinished}

    def begin(self, pids: list[int]) -> None:
        """The exits a region deferred to its release (ExitHeld from a process it locked), noted
        as they asked: they run from now, as the release resumes them, so their notes start now
        and --exit-starve counts the time an exit could run, not the region's that held it back.
        A pid reused since is left as it was."""
        now = time.monotonic()
        for p in pids:
            e = self.exiting.get(p)
            if e is not None and start_time(p) == e.start:
                self.exiting[p] = e._replace(noted=now, began=now)

    def give_back(self, r: Region) -> None:
        """At r's release: the exits its entry found unfinished are noted again, as of now."""
        # Frozen mid-exit, they go on exiting, and the next region must find them so. Under
        # --exit-wait 0 and back-to-back regions an exit runs only between regions and can outlast
        # EXITING_KEPT_S from its first note: dropped then, it would be locked mid-exit and free its
        # memory beside a timing. So each release renews the note (a pid reused is not renewed; an
        # exit no region froze is still dropped EXITING_KEPT_S after its last note).
        now = time.monotonic()
        # Renewed, not restarted: an exit's first note stays, so --exit-starve counts from its start.
        self.exiting.update(
            {p: e._replace(noted=now) for p, e in r.exits_left.items() if start_time(p) == e.start}
        )
        r.exits_left.clear()
