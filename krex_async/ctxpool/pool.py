"""A pool of warm worker processes per device that run Python commands as if they were fresh processes.

Data flow (one Pool per device, all on the daemon's event loop):

    daemon ── pool.launch(spec) ──► idle deque ──► worker (warm) ──"run" + fds 0/1/2 (SCM_RIGHTS)──┐
      ▲                                                                                          ▼
      │ Launched.wait()  ◄── pidfd of the worker (spawn.watch_pid) ◄── exit status ◄── command runs
      │                  ◄── "exited" (max_uses > 1)  ◄────────────────────────────── in the worker
      │
    _refill ── Popen(python -m krex_async.ctxpool.worker) ──► "imported" ──► node lock (one context
               at a time per node, none while the device is paused) ──"init"──► "ready" ──► idle deque

`Pool` is what the daemon calls (this module); upkeep.py keeps its workers coming and going (warming,
their messages and deaths, retiring). Its parts carry out: handle.py is each worker process (a fresh
interpreter, its channel, its death) and `Workers` the set of them, gate.py says when a worker may
create its context, lending.py keeps the idle queue and the adopters waiting in take().

A worker that dies while warming is a WorkerStartError, one that dies idle is retired and replaced,
one that dies running a command resolves that command's Launched with the real exit status
(os._exit(n): n; killed by a signal: -sig). Replacements are started as soon as a worker is taken, so
warming runs ahead of demand; `launch()` never waits for warming and returns None when no worker is
warm. A region entering on the device calls `quiesce()`: no creation starts, and one in flight ends
first.

`adopt()` hands a worker an interpreter that is already running somewhere in a command's tree
(ctxpool/adoption.py): the worker gets the adopter's pidfd instead of fds, takes fds 0/1/2 itself,
and answers "started" (it runs the program) or "declined" (it cannot, and leaves the pool). The
daemon's `set_demand()` sets how many workers to warm towards: one per command running on the
device, at least one, at most config.size. Shrinking lags (keep.py): a worker that comes back one too
many stays while the demand of the last config.keep_s seconds would keep it, and leaves at that
window's end (a timer) if still one too many; never while a region holds the device (at resume()).
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import os
from collections.abc import Awaitable
from typing import Any

from krex_async.ctxpool import forms
from krex_async.ctxpool.gate import CONTEXT_TIMEOUT_S
from krex_async.ctxpool.gate import node_lock as node_lock  # re-exported: it was defined here
from krex_async.ctxpool.handle import BrokenWorker as BrokenWorker  # re-exported: it was defined here
from krex_async.ctxpool.handle import Worker, WorkerStartError
from krex_async.ctxpool.procs import identity as _identity
from krex_async.ctxpool.procs import summary as _summary
from krex_async.ctxpool.upkeep import MAX_FAILURES, Upkeep
from krex_async.linux.spawn import Launched, LaunchSpec


class Pool(Upkeep):
    """Warm workers for one device: what the daemon calls (their upkeep is Upkeep's). Every method runs
    on the daemon's event loop."""

    @property
    def identity(self) -> tuple[int, int, list[int]]:
        """(uid, gid, sorted groups) the workers run as."""
        return self._ident

    async def start(self) -> None:
        """Begin warming toward config.size workers; returns at once (warming goes on behind)."""
        self._started = True
        self._refill()

    def accepts(self, spec: LaunchSpec) -> bool:
        """Whether `spec` is a python command line of this pool's interpreter that a worker can run."""
        if self.config.size <= 0 or self._closed:
            return False
        form = forms.parse(spec.argv)
        exe = forms.which(spec.argv[0], spec.env, spec.cwd) if form else None
        if exe is None or not forms.same_interpreter(exe, self.python):
            return False
        if form.kind == "script" and form.target.endswith((".pyc", ".pyo")):  # type: ignore[union-attr]
            return False
        if _identity(spec.uid, spec.gid, spec.groups) != self._ident:
            return False
        if spec.frozen and not (spec.cgroup_procs or self.cgroup_hook):
            return False  # only a cgroup can hold a worker frozen at its first instruction
        return forms.init_key(spec.env) == self._init_key

    async def launch(self, spec: LaunchSpec) -> Launched | None:
        """Hand `spec` to a warm worker; None when none is warm or the pool does not take it.

        Never waits for warming. The fds in `spec` are duplicated into the worker by the send: the
        caller closes its own copies as it does after spawn(). Errors of the cgroup hook (sync or
        async) propagate, with the worker put back (and offered to an adopter waiting meanwhile).
        """
        while (w := self._take(spec)) is not None:
            try:
                if inspect.isawaitable(r := self._hook(w, spec)):
                    await r
            except BaseException:
                self.untake(w)
                raise
            if (launched := self._hand(w, spec)) is not None:
                return launched
        return None

    def launch_nowait(self, spec: LaunchSpec) -> Launched | None:
        """launch() for a synchronous caller (the daemon's CommandRunner.launcher); the hook must be sync."""
        while (w := self._take(spec)) is not None:
            try:
                if inspect.isawaitable(r := self._hook(w, spec)):
                    if inspect.iscoroutine(r):
                        r.close()  # never awaited: say so without a "never awaited" warning
                    raise TypeError("launch_nowait() needs a synchronous cgroup_hook")
            except BaseException:
                self.untake(w)
                raise
            if (launched := self._hand(w, spec)) is not None:
                return launched
        return None

    def _hook(self, w: Worker, spec: LaunchSpec) -> None | Awaitable[None]:
        return None if self.cgroup_hook is None else self.cgroup_hook(w.pid, spec)

    def _take(self, spec: LaunchSpec) -> Worker | None:
        if not self.accepts(spec) or not os.path.isdir(spec.cwd):
            return None
        return self._pop_warm()

    def _pop_warm(self) -> Worker | None:
        """The next idle warm worker, out of the idle queue; None (a miss) when there is none, or
        when adopters wait for one (take()): they came first."""
        w = self._lending.pop()
        self.misses += w is None
        return w

    async def take(self, timeout: float) -> Worker | None:
        """Reserve an idle warm worker for one adoption: now, or within `timeout` s while others
        are warming (a fresh interpreter pays the whole import and context that a warming worker
        is already part way through, so a short wait beats falling back). Waiters are served in
        arrival order, and a worker offered to one is out of the idle queue, so nothing takes it
        between the wait and the hand-over (the region hold may await in between). None when
        nothing is warm or warming, or at the timeout. Give the worker to adopt(), or untake() it."""
        if self._closed:
            return None
        w = await self._lending.wait(timeout, self._refill, self.untake)  # refill: what is due warms
        self.misses += w is None
        return w

    def untake(self, w: Worker) -> None:
        """A worker from take() that was not handed over: first in line again, unless its
        replacement (started when it was reserved) made it one too many: then it is surplus."""
        w.reserved = False
        if w.state != "warm" or w.exited.done() or w in self._lending.idle:
            self._serve_waiters()
            return
        self._idle(w, first=True)

    def adopt(
        self, spec: LaunchSpec, pidfd: int, adopt: dict[str, Any], worker: Worker | None = None
    ) -> asyncio.Future[Launched | str]:
        """Hand an adopting interpreter to `worker` (from take(); "reserved worker gone" if it
        died since) or else the next warm one, now (the cgroup hook runs before this returns).
        `spec.argv` is its command line without the flags the worker applies itself, `adopt` its
        world (adopted.py, fresh.enter); `pidfd` is the adopter's, duplicated into the worker (the
        caller closes its own). The future resolves to the worker's Launched once it runs the
        program, or to why not: "no warm worker", the worker's own reason, its death."""
        fut: asyncio.Future[Launched | str] = asyncio.get_running_loop().create_future()
        if worker is not None and (worker.state != "warm" or worker.exited.done()):
            # It died or retired since take(). Not another one instead: the region hold was
            # checked for this one (Joins.hold_arrival), and the adopter starts fresh at once.
            fut.set_result("reserved worker gone")
            return fut
        w = None if self._closed else worker or self._pop_warm()
        if w is None:
            fut.set_result("no warm worker")
            return fut
        if self.cgroup_hook is not None:
            try:
                r = self.cgroup_hook(w.pid, spec)
                if inspect.isawaitable(r):
                    raise TypeError("adopt() needs a synchronous cgroup_hook")
            except BaseException:
                self.untake(w)  # back first in line, for whoever waits
                raise
        if self._hand(w, spec, adopt, [pidfd]) is None:
            fut.set_result("worker channel closed")
        else:
            w.accepted = fut
        return fut

    @property
    def demand(self) -> int | None:
        """Commands running on the device (set_demand(); None: keep config.size)."""
        return self._demand.now

    def set_demand(self, running: int) -> None:
        """The number of commands running on the device: warm workers are kept towards it."""
        self._demand.set(running)
        self._refill()

    def _hand(
        self, w: Worker, spec: LaunchSpec, adopt: dict[str, Any] | None = None, fds: list[int] | None = None
    ) -> Launched | None:
        """Send the command to `w`; None (and `w` retired) when its channel is gone."""
        try:
            launched = w.run(spec, self.config.max_uses, self.cgroup_hook is not None, adopt, fds)
        except OSError as e:
            self._retire(w, f"channel: {e}")
            return None
        self.launched += 1
        asyncio.get_running_loop().call_soon(self._refill)  # fork/exec after the caller's burst
        return launched

    def pause(self) -> None:
        """No new device context is created until resume(); one being created finishes."""
        self._gate.pause()

    async def quiesce(self, timeout: float = CONTEXT_TIMEOUT_S) -> float:
        """pause(), then wait for a context creation already in flight on this device to end (at
        most one: the node lock; bounded by `timeout`, and a creation that hangs is killed at
        CONTEXT_TIMEOUT_S). Returns the seconds waited; never raises for the worker's failure."""
        return await self._gate.quiesce(timeout)

    def resume(self) -> None:
        self._gate.resume()
        self._trim()

    def pids(self) -> set[int]:
        """The pids of this pool's workers now (starting, warm or running a command)."""
        return {w.pid for w in self._workers}

    def outside(self) -> list[tuple[int, bool]]:
        """(pid, has a device context for sure) of the workers in no command: warming, idle, or retired and
        not yet gone. A region must hold those with a context itself (no command's hold reaches them); a
        worker not known to have one may still hold a GPU file (ask /proc). Less the worker creating its
        context: the region waits for that creation to end (quiesce()) and holds the worker after. Locked in
        the middle of it, the worker's next CUDA call would block the very creation the region waits for (on
        the H200: every region entry 60 s, CONTEXT_TIMEOUT_S, while its siblings stayed locked)."""
        ctx = self.config.init_context and self.device.vendor != "cpu"
        return sorted(
            (w.pid, ctx and w.warmed)
            for w in self._workers
            if w.state != "busy" and not w.exited.done() and w is not self._gate.creator
        )

    def creator_pid(self) -> int | None:
        """The worker whose context creation is in flight, if any (outside() leaves it out)."""
        return self._gate.creator.pid if self._gate.creator is not None else None

    def idle_pids(self) -> list[int]:
        """The warm workers an adoption or a launch may take next."""
        return self._lending.idle_pids()

    def status(self) -> dict[str, Any]:
        """Sizes, counts and latencies; each worker's host memory (RSS, PSS from smaps_rollup)."""
        counts = collections.Counter(w.state for w in self._workers)
        lat = {k: _summary(v) for k, v in self.latencies.items()}
        everything = [x for v in self.latencies.values() for x in v]
        return {
            "device": self.device.key,
            "size": self.config.size,
            "max_uses": self.config.max_uses,
            "keep_s": self.config.keep_s,
            "warm": counts["warm"],
            "busy": counts["busy"],
            "starting": counts["starting"],
            "retired": self.retired,
            "retired_why": dict(self.retired_why),
            "retired_last": dict(self.retired_why.last),  # each class's last reason in full
            "failures": self.failures,
            "launched": self.launched,
            "misses": self.misses,
            "paused": self._gate.paused,
            "last_error": self.last_error,
            "start_latency_s": _summary(everything),
            "by_form": lat,
            "demand": self.demand,
            "target": self._demand.target(),
            "kept": self._demand.kept(),  # the largest demand within keep_s: retiring's target
            "adopted": self.adopted,
            "declined": dict(self.declined),
            "waiting": self._lending.waiting(),  # adopters in take()
            "reserved": sum(w.reserved for w in self._workers),
            "workers": self._workers.describe(),
        }

    async def wait_warm(self, n: int | None = None, timeout: float = 60.0) -> int:
        """Wait until `n` (default config.size) workers are warm; returns the count. For benches/tests."""
        n = self.config.size if n is None else n
        async with asyncio.timeout(timeout):
            while sum(w.state == "warm" for w in self._workers) < n:
                if self.last_error and self._consecutive_failures >= MAX_FAILURES:
                    raise WorkerStartError(self.last_error)
                self._changed.clear()
                await self._changed.wait()
        return n

    async def close(self, timeout: float = 2.0) -> None:
        """Stop warming; idle and starting workers get EOF, then SIGKILL after `timeout`.

        Busy workers keep running their commands (their Launched still resolves); a reused one exits
        after its command, on EOF.
        """
        self._closed = True
        self._demand.cancel()
        self._serve_waiters()
        await self._workers.close(timeout)
