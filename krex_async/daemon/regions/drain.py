"""Quiesce and drain for a region: which siblings' in-command runtimes are asked to stop at a bytecode
boundary and synchronise their device (runtime/quiesce.py), who stayed silent, and whether the
frozen siblings' queued device work is known drained once they are frozen (else the owner
verifies it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

from krex_async import protocol as P
from krex_async.daemon.model.command import Command
from krex_async.daemon.model.core import Core, Region
from krex_async.daemon.regions.gpuholders import GpuHolders, read_holders
from krex_async.isolation.base import Freeze
from krex_async.runtime.quiesce import holds_gpu_file

SILENT_S = 1.0  # how long a runtime that did not answer a quiesce is not asked again

Asked = list[tuple[Command, int, Callable[[P.Msg], bool]]]


class Drain:
    def __init__(self, core: Core, active: Mapping[str, Region]) -> None:
        self.core = core
        self.active = active  # Regions.active: where a runtime's ack belongs
        self.holders = GpuHolders()  # which runtimes' processes hold a GPU device file
        # runtimes that did not answer a quiesce in time: (pid, connection) -> when
        self.silent: dict[tuple[int, Callable[[P.Msg], bool]], float] = {}

    def gpu_pids(self, cmd: Command) -> list[int]:
        """The command's processes holding a GPU device file: its runtimes from memory where known
        (gpuholders.py), the others read from /proc."""
        assert cmd.group is not None
        out = []
        for p in self.core.backend.pids(cmd.group):
            token = cmd.runtimes.get(p)
            if (token is not None and self.holders.known(p, token)) or holds_gpu_file(p):
                out.append(p)
        return out

    def to_ask(
        self,
        r: Region,
        targets: list[Command],
    ) -> Asked:
        """The in-command runtimes asked to stop and synchronise. --quiesce auto: on a GPU device
        those whose process holds a GPU device file, on the cpu device none: the others have no
        device work, freezing them is enough, and their round trip would be most of the entry
        time. --quiesce all: every runtime.
        The owner's other processes are included when the region freezes them."""
        owners = [(c, pid, send) for c in targets for pid, send in c.runtimes.items()]
        if r.request.freeze_own_children:
            idle = r.command.adopters  # they wait for their worker: nothing of theirs to stop
            owners += [
                (r.command, pid, send)
                for pid, send in r.command.runtimes.items()
                if pid != r.pid and pid not in idle
            ]
        now = time.monotonic()
        owners = [o for o in owners if now - self.silent.get((o[1], o[2]), -SILENT_S) >= SILENT_S]
        if self.core.config.quiesce == "all":
            return owners
        if self.core.device(r.device).vendor == "cpu":
            return []
        # gpuholders.py: a holder stays one for its connection; a recent "none" is believed here,
        # and checked again after the freeze (_check_drain)
        return [(c, pid, send) for c, pid, send in owners if self.holders.holds(pid, send)]

    def send(
        self,
        r: Region,
        asked: Asked,
    ) -> None:
        """Send every Quiesce first (no awaiting in between); acks resolve r.acks. Each runtime told
        is told Resume at the release (HoldSet.resume)."""
        loop = asyncio.get_running_loop()
        for _, pid, send in asked:
            fut: asyncio.Future[P.QuiesceAck] = loop.create_future()
            r.acks[pid] = fut
            if send(P.Quiesce(id=0, region=r.id)):
                r.held.quiesced(send)
            else:
                fut.cancel()

    def note_silent(self, r: Region, asked: Asked) -> None:
        """Remember the runtimes that did not answer within --quiesce-timeout: on real jobs they
        sat in long C calls (imports, CUDA initialisation, allocation), which last seconds, and
        asking them again at once would cost the next region the whole timeout for the same
        silence. They are frozen without asking for SILENT_S; the owner verifies the drain."""
        now = time.monotonic()
        if len(self.silent) > 4096:  # runtimes come and go: start over
            self.silent.clear()
        for _, pid, send in asked:
            fut = r.acks.get(pid)
            if fut is not None and fut.done():
                self.silent.pop((pid, send), None)
            else:
                self.silent[(pid, send)] = now

    def check(self, r: Region, targets: list[Command], freezes: list[Freeze]) -> str:
        """The drain state, once the targets are frozen: not-needed (no siblings, or a device
        without queues), synced (no frozen process that did not acknowledge a quiesce holds a GPU
        device file), else pending: the owner verifies. A runtime known to hold a file decides at
        once; the other processes the freeze stopped are read now, on the loop (frozen, they
        cannot open one meanwhile): microseconds a process, cheaper than a worker thread's
        hand-offs beside the loop."""
        if not targets or self.core.device(r.device).vendor == "cpu":
            return "not-needed"
        acked = {pid for pid, f in r.acks.items() if f.done() and not f.cancelled()}
        stopped = {f.group: f.stopped for f in freezes}
        pids = [
            p
            for c in targets
            if c.group is not None
            for p in (stopped[c.group.name] if c.group.name in stopped else self.core.backend.pids(c.group))
            if p not in acked
        ]
        if not pids:
            return "synced"
        tokens = {pid: send for c in targets for pid, send in c.runtimes.items()}
        if any(p in tokens and self.holders.known(p, tokens[p]) for p in pids):
            return "pending"
        held = read_holders(pids)
        for pid in held:
            if pid in tokens:
                self.holders.note(pid, tokens[pid], True)
        return "pending" if held else "synced"

    def ack(self, cmd: Command, pid: int, msg: P.QuiesceAck) -> None:
        r = self.active.get(msg.region)
        fut = r.acks.get(pid) if r else None
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def refresh(self, r: Region) -> None:
        """At release: read the device's runtimes' GPU files afresh (gpuholders.py) while the
        device is between regions."""
        if self.core.device(r.device).vendor == "cpu":
            return
        self.holders.refresh(
            (pid, send)
            for cid in self.core.scheduler.siblings(r.device, "")
            if (c := self.core.commands.get(cid)) is not None
            for pid, send in c.runtimes.items()
        )
