"""Memory-aware admission: a command starts on its device only when it fits beside what runs there.

What a command is taken to need (`need`), most trusted first:

    declared   Submit.mem, reserved as given
    learned    the largest peak the last commands of its key reached (Submit.mem_key, else its
               label, else its program and first argument), or of a specific feature it shares
               with them (Submit.mem_alike), kept across the daemon's life in <state
               dir>/memory.json (footprints.py); a mem_key of parts ("gateway dev / 3f2a") is a
               path: a command teaches every prefix
    typical    the median recent peak of its kind (a mem_key prefix; or its own key where its
               mem_alike features tell nothing yet): a guess for a problem not seen yet
    default    --mem-default, where set
    unknown    none of these: one unknown at a time per device (not under none), footprint learned

The device's commitment (`committed`, commitment.py) is, under --mem-commit now, what the vendor
reported used at the last sample plus the need of each command started since; under auto (the
default), that plus what each command whose need was learned has still to take; under peak, every
running command's max(need, observed peak) plus the warm pool's workers. Under none, memory holds
no first run back (`optimistic`): only a declared need, and a guarded re-run's, must fit; auto is
none for a command that allows a re-run (Submit.rerun_on_oom, as the gateway's) and whose need is a
guess (not learned from its own key or problem). A command fits when its need is at most the
device's total less the commitment and --mem-headroom.

Commands that do not fit wait in a FIFO per device, each with its reason; none is refused for memory
unless its declared need exceeds the device. A head waiting on a device where no command runs starts
whatever the figures say, so a command that fits alone always runs eventually. For --mem-backfill
seconds after a head first waits, later commands that fit start past it; then nothing more starts
there until it does, so none starves. A waiting re-run is never passed.

A re-run after a co-located out-of-memory (reruns.py) whose need is known is *guarded*: it starts
when that need (or what its failure showed it needs at least, learn_floor) fits beside every
running command's peak, and while it runs the device counts peaks for every admission, so nothing
started later can take what it needs; again where its next failure shows a higher floor. Else, or
where its need is unknown, it runs alone (docs/admission.md has why).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

from krex_async import logs
from krex_async import protocol as P
from krex_async.daemon.commands import commitment, memsample, reruns
from krex_async.daemon.commands.devmemory import DeviceMemory, gib
from krex_async.daemon.commands.footprints import Footprints, alike_keys, mem_keys
from krex_async.daemon.model.command import Command, CommandState
from krex_async.daemon.model.core import Core
from krex_async.daemon.model.events import MemoryReserved, MemoryWaiting
from krex_async.devices.base import Device

log = logs.get("krex.daemon")
REGION_GATE_MAX_S = 5.0  # the longest a CUDA start waits for the device's regions to end


class Admission:
    def __init__(self, core: Core) -> None:
        self.core = core
        cfg = core.config
        self.devices = {d.key: DeviceMemory(d) for d in core.devices if self._tracks(d)}
        state = cfg.state_dir
        self.footprints = Footprints(os.path.join(state, "memory.json") if state else None)
        self.wake = asyncio.Event()  # a command started: sample at once, then every SAMPLE_S

    def _tracks(self, d: Device) -> bool:
        mode = self.core.config.admission
        return mode == "memory" or (mode == "auto" and d.vendor != "cpu" and d.memory_total_bytes > 0)

    def tracks(self, key: str | None) -> bool:
        return key is not None and key in self.devices

    # ------------------------------------------------------------------------------ estimates

    def need(self, spec: P.Submit, uid: int) -> tuple[int, str]:
        """(bytes, where the figure comes from) that a command of `spec` run as `uid` is taken to
        need (from that user's commands alone)."""
        return self.footprints.need(spec, uid, self.core.config.mem_default)

    def headroom(self, dm: DeviceMemory) -> int:
        return int(dm.total * self.core.config.mem_headroom)

    def _others(self, dm: DeviceMemory, but: str) -> list[Command]:
        return [self.core.commands[c] for c in dm.running if c != but]

    def committed(self, dm: DeviceMemory, but: str = "") -> int:
        """What the device is taken to hold, by --mem-commit (commitment.py)."""
        cfg = self.core.config
        return commitment.committed(dm, self._others(dm, but), cfg.mem_commit, cfg.mem_guard)

    def free(self, dm: DeviceMemory, but: str = "") -> int:
        """What a new command may still take there."""
        return max(0, dm.total - self.committed(dm, but) - self.headroom(dm))

    def too_large(self, cmd: Command, device: Device) -> str:
        """Why `cmd` can never run on `device` ("" when it can): its declared need exceeds it."""
        if not self.tracks(device.key) or cmd.spec.mem <= device.memory_total_bytes:
            return ""
        total = gib(device.memory_total_bytes)
        return f"needs {gib(cmd.spec.mem)} (Submit.mem), more than {device.key} has in all ({total})"

    def available(self, key: str) -> int:
        """For placement: what a command may take on `key` now (0 where others wait already)."""
        dm = self.devices[key]
        return 0 if dm.waiting or dm.starts else self.free(dm)

    # ------------------------------------------------------------------------------ admitting

    def why_not(self, cmd: Command, dm: DeviceMemory) -> str:
        """Why `cmd` may not start on the device now ("" when it may)."""
        if cmd.gate == "asked" and (region := self._region_on(cmd, dm)):
            return region
        others = self._others(dm, cmd.id)
        if not others:  # alone: whatever the figures say (a command that fits alone always runs)
            return ""
        key = dm.device.key
        if cmd.solo:
            return (
                f"re-run after a co-located CUDA out-of-memory: waits to run alone on {key} "
                f"({len(others)} command(s) there)"
            )
        solo = next((o for o in others if o.solo), None)
        if solo is not None:
            return f"waiting for {solo.id}, a re-run after a co-located out-of-memory, to end on {key}"
        if cmd.guarded:
            return self._guard_wait(cmd, dm, others)
        backlog = self.core.config.region_backlog
        if backlog and self.core.scheduler.isolates():
            queued = len(self.core.scheduler.queued(key))
            if queued >= backlog:  # another command would only wait in that line too
                return f"waiting: {queued} region(s) already queued on {key} (--region-backlog {backlog})"
        if (full := self.optimistic(cmd, dm, others)) is not None:
            return full
        if cmd.mem_source == "unknown":
            guarded = next((o for o in others if o.guarded), None)
            if guarded is not None:  # its need of 0 could take what the re-run's peak needs
                return f"waiting for {guarded.id}, a guarded re-run, to end on {key}: footprint unknown"
            unknown = next((o for o in others if o.mem_source == "unknown"), None)
            if unknown is not None:
                return (
                    f"waiting for memory on {key}: footprint unknown, and {unknown.id} (unknown too) "
                    "runs there while its footprint is learned (declare Submit.mem, or --mem-default)"
                )
        free, held = self.free(dm, cmd.id), sum(commitment.holds(o) for o in others)
        if cmd.mem_need > free:
            return (
                f"waiting for memory on {key}: needs ~{gib(cmd.mem_need)} ({cmd.mem_source}), "
                f"{gib(free)} free of {gib(dm.total)} (commands {gib(held)}, "
                f"pool {gib(dm.pool)}, used {gib(dm.used)}, headroom {gib(self.headroom(dm))})"
            )
        return ""

    def optimistic(self, cmd: Command, dm: DeviceMemory, others: list[Command]) -> str | None:
        """--mem-commit none (auto: for a command whose co-located out-of-memory is re-run and whose
        need is a guess): a first run with no declared need starts ("") whatever its own need,
        unless a guarded re-run runs (None: the other rules decide) or the device is full already
        by the `now` count (why it waits): that bounds a pile-up, e.g. --max-running auto's 64 jobs
        on one device. Under auto, a need learned from the command's own key or problem is counted
        as under `now`: what its problem peaked at before, it will again, and starting it into
        memory it cannot have only buys an out-of-memory, a wasted run and a re-run that holds
        every later command back (on an H100, seven jobs 30-45 s each behind one)."""
        mode = self.core.config.mem_commit
        guess = cmd.mem_source != "learned"
        none = mode == "none" or (mode == "auto" and cmd.spec.rerun_on_oom and guess)
        if not none or cmd.mem_source == "declared" or any(o.guarded for o in others):
            return None
        if self.free(dm, cmd.id) > 0:
            return ""
        used, total = gib(self.committed(dm, cmd.id)), gib(dm.total)
        return f"waiting for memory on {dm.device.key}: full already ({used} of {total} in use or starting)"

    def _region_on(self, cmd: Command, dm: DeviceMemory) -> str:
        """Why a CUDA start waits for the region that holds (or enters on) the device ("": none).
        A context's creation is driver work beside the region's timing: on an H100 it came as
        stray driver calls in 22 of 96 regions (KernelBench, 8 at once), gate or none. Regions
        back to back never leave the device free: after REGION_GATE_MAX_S it goes all the same."""
        key, sched = dm.device.key, self.core.scheduler
        rid = sched.holder(key) if sched.isolates() else None
        if (
            not rid
            or rid in sched.regions_of(cmd.id)
            or time.monotonic() - cmd.gate_asked > REGION_GATE_MAX_S
        ):
            return ""
        return f"waiting for region {rid} on {key} to end: a CUDA start beside it would disturb its timing"

    def _guard_wait(self, cmd: Command, dm: DeviceMemory, others: list[Command]) -> str:
        """Why a guarded re-run may not start yet ("" when it may): it needs its need (or what its
        failed run reached or showed, if more) free beside every running command's peak (--mem-guard
        want: beside the usual count), and none of them of unknown need (an unknown's peak is not
        known to leave it room)."""
        key, why = dm.device.key, "re-run after a co-located CUDA out-of-memory"
        unknown = next((o for o in others if o.mem_source == "unknown"), None)
        if unknown is not None:
            return f"{why}: waits for {unknown.id} (need unknown) on {key}"
        want = max(cmd.mem_need, cmd.mem_guard)  # its need may have been learned since requeue
        by_peaks = self.core.config.mem_guard == "peak"
        held = commitment.peaks(dm, others) if by_peaks else self.committed(dm, cmd.id)
        free = max(0, dm.total - held - self.headroom(dm))
        if want > free:
            source = "what its failed run reached or showed" if want > cmd.mem_need else cmd.mem_source
            by = "peaks" if by_peaks else "use"
            return f"{why}: needs ~{gib(want)} ({source}) beside the others' {by} on {key}, {gib(free)} free"
        cmd.mem_guard = want  # what it is guarded at from its start
        return ""

    def admit(self, cmd: Command) -> bool:
        """The scheduler lets `cmd` start: True if memory does too (it is then counted as running,
        or, gated, it starts and is admitted when its runtime asks), else it waits in its device's
        queue, its reason in `cmd.mem_wait`."""
        cmd.mem_need, cmd.mem_source = self.need(cmd.spec, cmd.uid)
        dm = self.devices.get(cmd.device_key or "")
        if dm is None:
            return True
        if self._gates(cmd):  # co-located from its CUDA start on (_run), not from its start
            if dm.starts or (why := self._ahead_wait(dm)):
                cmd.mem_wait = (
                    f"queued behind {len(dm.starts)} to start on {dm.device.key}" if dm.starts else why
                )
                dm.starts.append(cmd.id)
                return False
            cmd.gate = "open"
            dm.gated.add(cmd.id)
            return True
        return self._enter(cmd, dm)

    def _ahead_wait(self, dm: DeviceMemory) -> str:
        """Why a gated command may not start yet ("" when it may): as many started on the device and
        not admitted yet (importing, or at their gates) as it has CPUs (`--max-running auto`: 64)."""
        ahead = len(dm.gated) + sum(1 for c in dm.waiting if self.core.commands[c].gate == "asked")
        cap = len(dm.device.cpus) or os.cpu_count() or 1
        if ahead < cap:
            return ""
        key = dm.device.key
        return f"waiting to start: {ahead} commands on {key} are ahead of their CUDA start (its {cap} CPUs)"

    def _starts(self, dm: DeviceMemory) -> list[Command]:
        """Gated commands that may start now (ahead of their CUDA start), in order."""
        out = []
        while dm.starts and not self._ahead_wait(dm):
            cmd = self.core.commands.get(dm.starts.popleft())
            if cmd is not None and cmd.state is CommandState.QUEUED:
                cmd.gate, cmd.mem_wait = "open", ""
                dm.gated.add(cmd.id)
                out.append(cmd)
        return out

    def _gates(self, cmd: Command) -> bool:
        """Whether `cmd` starts at once and is admitted at its first CUDA use (--mem-gate on): its
        imports and inputs (most of a KernelBench job's life) then overlap the others' device work.
        Not a re-run (it waits as a re-run does), one on a device with a warm pool (a worker that
        adopts or launches it has CUDA up already) or one under policy command (it runs alone)."""
        return (
            self.core.config.mem_gate == "on"
            and cmd.reruns == 0
            and not cmd.pool_env
            and cmd.device_key not in self.core.pools
            and self.core.scheduler.policy.value != "command"
        )

    def ask(self, cmd: Command, now: bool = False) -> bool:
        """A gated command's runtime asks to use its device: True if it may now (`now`: whatever
        the figures say), else it waits in the device's queue (pump lets it go)."""
        dm = self.devices.get(cmd.device_key or "")
        if dm is not None and cmd.gate == "asked" and now:  # another of its processes waits
            self._unqueue(dm, cmd.id)
            self._run(cmd, dm)
            return True
        if dm is None or cmd.gate != "open":
            return cmd.gate != "asked"  # another of its processes asked first: it waits too
        dm.gated.discard(cmd.id)
        cmd.gate, cmd.gate_asked = "asked", time.monotonic()
        cmd.mem_need, cmd.mem_source = self.need(cmd.spec, cmd.uid)
        if now:
            self._run(cmd, dm)
        if now or self._enter(cmd, dm):
            cmd.gate = "passed"
            return True
        return False

    @staticmethod
    def waits(cmd: Command) -> bool:
        """Whether a command in a device's queue still waits: not started, or waits at its gate."""
        return cmd.state is (CommandState.RUNNING if cmd.gate == "asked" else CommandState.QUEUED)

    def _enter(self, cmd: Command, dm: DeviceMemory) -> bool:
        if dm.waiting and not self._passes(cmd, dm):  # behind a head it may not pass
            cmd.mem_wait = f"queued behind {len(dm.waiting)} on {dm.device.key}"
        elif why := self.why_not(cmd, dm):
            cmd.mem_wait = why
            log.info("command_waits_for_memory", command=cmd.id, reason=why)
        else:
            self._run(cmd, dm)
            return True
        if not dm.waiting:  # it heads the queue: its backfill window opens now
            dm.head_since[cmd.id] = time.monotonic()
        dm.waiting.append(cmd.id)
        self.core.events.emit(MemoryWaiting(dm.device.key, len(dm.waiting)))
        return False

    def _passes(self, cmd: Command, dm: DeviceMemory) -> bool:
        """Whether a new `cmd` may start past the waiting head (--mem-backfill) if it fits."""
        head = self.core.commands.get(dm.waiting[0])
        if head is None or head.solo or head.guarded:
            return False
        since = dm.head_since.get(head.id, time.monotonic())
        return time.monotonic() - since < self.core.config.mem_backfill

    def _run(self, cmd: Command, dm: DeviceMemory) -> None:
        cmd.mem_wait, cmd.mem_admitted = "", time.monotonic()
        if cmd.guarded:  # started alone, past _guard_wait: a need learned since the requeue counts
            cmd.mem_guard = max(cmd.mem_guard, cmd.mem_need)
        if dm.running or dm.pool:  # beside others: an out-of-memory failure may be theirs
            cmd.co_located = True
            for c in dm.running:
                self.core.commands[c].co_located = True
        dm.running.add(cmd.id)
        self.reserved_metric(dm)
        self.wake.set()

    def pump(self, key: str | None) -> list[Command]:
        """Start what now fits on `key`, in order; returns the commands to start."""
        dm = self.devices.get(key or "")
        out: list[Command] = self._starts(dm) if dm is not None else []
        while dm is not None and dm.waiting:
            cmd = self.core.commands.get(dm.waiting[0])
            if cmd is None or not self.waits(cmd):  # ended while it waited
                dm.head_since.pop(dm.waiting.popleft(), None)
                continue
            cmd.mem_need, cmd.mem_source = self.need(cmd.spec, cmd.uid)  # learned meanwhile, maybe
            why = self.why_not(cmd, dm)
            if why:
                cmd.mem_wait = why
                out += self._backfill(cmd, why, dm)
                break
            dm.waiting.popleft()
            dm.head_since.pop(cmd.id, None)
            self._run(cmd, dm)
            out.append(cmd)
        if dm is not None:
            self.core.events.emit(MemoryWaiting(dm.device.key, len(dm.waiting)))
        return out

    def _backfill(self, head: Command, why: str, dm: DeviceMemory) -> list[Command]:
        """While `head` (which does not fit) has headed the queue under --mem-backfill seconds, the
        later commands that fit start past it, in order; after that, and behind a re-run that
        waits, they wait for it. Returns those started."""
        since = dm.head_since.setdefault(head.id, time.monotonic())
        open_ = not (head.solo or head.guarded) and time.monotonic() - since < self.core.config.mem_backfill
        out: list[Command] = []
        for i, other in enumerate(list(dm.waiting)[1:], 2):
            c = self.core.commands.get(other)
            if c is None or not self.waits(c):
                continue
            if open_:
                c.mem_need, c.mem_source = self.need(c.spec, c.uid)
                if not (c_why := self.why_not(c, dm)):
                    dm.waiting.remove(c.id)
                    dm.head_since.pop(c.id, None)  # it may have headed the queue before a re-run
                    self._run(c, dm)
                    out.append(c)
                    continue
                c.mem_wait = c_why
            else:
                c.mem_wait = f"queued behind {i - 1} on {dm.device.key} ({head.id}: {why})"
        return out  # the sample loop pumps again within SAMPLE_S, so a closing window is seen

    def ended(self, cmd: Command, oom: bool) -> list[Command]:
        """`cmd` ended (or left the queue): its memory is free again, and what it peaked at is
        learned (not from an out-of-memory failure: that peak fell short). Returns what may start."""
        dm = self.devices.get(cmd.device_key or "")
        if dm is None:
            return []
        dm.running.discard(cmd.id)
        dm.gated.discard(cmd.id)
        if cmd.id in dm.starts:
            dm.starts.remove(cmd.id)
        self._unqueue(dm, cmd.id)
        for go in cmd.gate_waiters:  # a process that outlived it waits no more
            go()
        cmd.gate_waiters.clear()
        if cmd.mem_peak > 0 and not oom:
            self.footprints.learn(cmd.uid, alike_keys(cmd.spec) + mem_keys(cmd.spec), cmd.mem_peak)
        self.reserved_metric(dm)
        if dm.waiting:  # the last sample still counts its memory: take one now, not in SAMPLE_S
            self.wake.set()
        return self.pump(dm.device.key)

    def learn_floor(self, cmd: Command) -> None:
        """`cmd` ran out of memory: its failure's floor (reruns.floor; fits_alone counts it) is kept,
        and learned for its problem (its features, footprints.floor_key) where above its peak."""
        dm = self.devices.get(cmd.device_key or "")
        floor = reruns.floor(cmd)
        if dm is None or floor <= cmd.mem_floor:
            return
        cmd.mem_floor = floor  # below the sampled peak too: above the guard, a re-run guarded again
        log.info("command_oom_floor", command=cmd.id, floor=floor, need=cmd.mem_need, source=cmd.mem_source)
        if cmd.mem_peak < floor <= dm.total:  # else it says nothing new, or is its own failure
            self.footprints.learn_floor(cmd.uid, cmd.spec, floor)

    def requeue(self, cmd: Command) -> None:
        """A re-run: out of the running set, first in line (it already waited its turn). Guarded
        where its need is known: its first re-run, and its second where the guarded one's
        out-of-memory showed a floor above what that one was guarded at (its need is better known
        now: on an H100 a floor of 18.7 GiB, then 42.7, a job's peak alone); else alone."""
        dm = self.devices[cmd.device_key or ""]
        cmd.mem_need, cmd.mem_source = self.need(cmd.spec, cmd.uid)
        grew = cmd.reruns == 2 and cmd.mem_floor > cmd.mem_guard
        cmd.guarded = (cmd.reruns == 1 or grew) and cmd.mem_source != "unknown"
        cmd.solo = not cmd.guarded
        cmd.mem_guard = max(cmd.mem_need, cmd.mem_peak, cmd.mem_floor) if cmd.guarded else 0
        cmd.mem_now = cmd.mem_peak = 0  # the failed run's, in mem_guard: the re-run's are its own
        dm.running.discard(cmd.id)
        dm.gated.discard(cmd.id)
        self._unqueue(dm, cmd.id)  # it failed while another of its processes waited at the gate
        dm.waiting.appendleft(cmd.id)
        self.reserved_metric(dm)

    @staticmethod
    def _unqueue(dm: DeviceMemory, cid: str) -> None:
        """`cid` leaves the device's memory queue, wherever it stood (and its backfill window)."""
        if cid in dm.waiting:
            dm.waiting.remove(cid)
        dm.head_since.pop(cid, None)

    def reserved_metric(self, dm: DeviceMemory) -> None:
        held = sum(commitment.holds(self.core.commands[c]) for c in dm.running if c in self.core.commands)
        self.core.events.emit(MemoryReserved(dm.device.key, held, dm.used))

    # ------------------------------------------------------------------------------ OOM verdict

    def fits_alone(self, cmd: Command) -> bool:
        """Whether `cmd` could run alone: a command alone starts whatever the figures say."""
        dm = self.devices.get(cmd.device_key or "")
        return dm is not None and max(cmd.mem_need, cmd.mem_floor) <= dm.total

    def bypassed(self, cmd: Command, dm: DeviceMemory) -> None:
        """A gated command seen holding device memory without asking (no torch): counted now."""
        if cmd.id not in dm.gated or cmd.state is not CommandState.RUNNING:
            return  # it ended while the sample was read
        dm.gated.discard(cmd.id)
        cmd.gate = "bypassed"
        self._run(cmd, dm)

    async def sample_loop(self, start: Callable[[Command], None]) -> None:
        """Sample every tracked device's memory while the daemon serves; start what comes to fit."""
        await memsample.loop(self, start)
