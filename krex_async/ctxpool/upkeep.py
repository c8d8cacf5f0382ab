"""A pool's upkeep of its workers, under pool.py's `Pool` (the daemon's API): the state it keeps, and
what keeps the warm workers coming and going. `_refill` starts workers (handle.py's `Workers`) towards
the demand's target (keep.py) and stops for good after MAX_FAILURES warm-up failures in a row. Each
worker's messages are acted on here: "imported" asks the gate for its context (gate.py), "ready" puts
it in the idle queue (lending.py), "exited" settles its command and, when it said why, retires it;
its death is counted (retired, or failed while warming) and it is replaced. One that comes back one too
many is marked surplus and leaves once the demand no longer keeps it (`_trim`), never while a region
holds the device. `on_unsettled` hears of a worker each time it comes to be in no command: started,
back from a command, retired (once each).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import os
from collections.abc import Awaitable, Callable
from typing import Any

from krex_async.ctxpool import forms
from krex_async.ctxpool.base import PoolConfig
from krex_async.ctxpool.gate import ContextGate
from krex_async.ctxpool.handle import Worker, Workers
from krex_async.ctxpool.keep import Demand
from krex_async.ctxpool.lending import Lending
from krex_async.ctxpool.procs import Retirements
from krex_async.ctxpool.procs import identity as _identity
from krex_async.ctxpool.procs import kill as _kill
from krex_async.devices.base import Device
from krex_async.linux.spawn import LaunchSpec

CgroupHook = Callable[[int, LaunchSpec], "None | Awaitable[None]"]
MAX_FAILURES = 3  # consecutive warm-up failures after which the pool stops warming


class Upkeep:
    """A pool's workers and their coming and going; `Pool` adds what the daemon calls. Every method
    runs on the daemon's event loop."""

    def __init__(
        self,
        device: Device,
        config: PoolConfig,
        *,
        cgroup_hook: CgroupHook | None = None,
        env: dict[str, str] | None = None,
        user: tuple[int, int, list[int]] | None = None,
        on_unsettled: Callable[[int], None] = lambda pid: None,
    ) -> None:
        """`env`: the environment workers start with (default: the daemon's), plus device.env; a
        command is taken only when the variables that shape interpreter start-up (forms.INIT_VARS)
        agree with it. `user`: (uid, gid, groups) the workers run as (default: the daemon's).
        `on_unsettled`: told the pid of each worker spawned, retired or back from a command (fence.py)."""
        self.device, self.config, self.cgroup_hook = device, config, cgroup_hook
        self.on_unsettled, self.user = on_unsettled, user
        self._ident = _identity(*(user or (None, None, None)))
        self.python = config.interpreter()
        self.env = {**(os.environ if env is None else env), **device.env}
        self._init_key = forms.init_key(self.env)
        self._workers = Workers(self._on_message, self._on_exit, on_unsettled)  # processes, tasks
        self._lending = Lending()  # the idle workers, and the adopters waiting in take()
        self._gate = ContextGate()  # one context created at a time per node, none while paused
        self._changed = asyncio.Event()
        self._started = self._closed = False
        self.retired = self.failures = self.launched = self.misses = 0
        self._consecutive_failures = 0
        self.last_error: str | None = None
        self._demand = Demand(config.size, config.keep_s)  # workers to warm towards, and to keep
        self.interpreter: dict[str, Any] | None = None  # what a warm worker said of itself
        self.adopted = 0
        self.declined, self.retired_why = collections.Counter[str](), Retirements(device.key)
        self.latencies: dict[str, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=1000)
        )

    # ------------------------------------------------------------------------------------ idle, surplus

    def _serve_waiters(self) -> None:
        """Offer idle workers to take()'s waiters; each offer starts its replacement."""
        self._lending.serve(self._closed, self._workers.warming, self._spawn_missing)

    def _idle(self, w: Worker, first: bool = False, back: bool = True) -> None:
        """`w` waits idle, first in line (given back by take()'s adopter) or last; offered to
        take()'s waiters first. One `back` from a command or an adopter that is one too many (a
        replacement warmed meanwhile, or the demand fell) is marked surplus, for _trim()."""
        w.surplus = back and self._have() > self._demand.target()
        (self._lending.idle.appendleft if first else self._lending.idle.append)(w)
        self._serve_waiters()
        self._trim()

    def _trim(self) -> None:
        """Idle workers marked surplus leave while still one too many, the last in line first; not
        while the demand of the last keep_s seconds keeps them (looked at again once it may have
        fallen), nor while a region holds the device (exiting would tear the context down inside
        the region, unheld: it is in no command; resume() looks again). Those wanted are unmarked."""
        for w in [w for w in reversed(self._lending.idle) if w.surplus and w.state == "warm"]:
            if self._closed or self._lending.waiters or self._have() <= self._demand.target():
                w.surplus = False
            elif not self._gate.paused and self._have() > self._demand.kept():
                w.surplus = False
                self._lending.idle.remove(w)
                self._retire(w, "surplus", kill=False)
        if not self._closed and any(w.surplus and w.state == "warm" for w in self._lending.idle):
            self._demand.when_kept_falls(self._trim)  # none while kept() is target(): resume() then

    # ------------------------------------------------------------------------------------ warming

    def _refill(self) -> None:
        self._spawn_missing()
        self._serve_waiters()  # after the spawns: a waiter gives up only when nothing warms

    def _spawn_missing(self) -> None:
        if not self._started or self._closed or self._consecutive_failures >= MAX_FAILURES:
            return
        for _ in range(self._demand.target() - self._have()):
            try:
                self._workers.start(self.python, self.env, self.device, self.config, self.user)
            except OSError as e:
                self._failed(f"spawn: {e}")
                return

    def _have(self) -> int:
        return self._workers.kept(self.config.max_uses, self.cgroup_hook is not None)

    def _on_message(self, w: Worker, msg: dict[str, Any]) -> None:
        t = msg.get("t")
        if t == "imported":
            if self.config.creates_context(self.device.vendor):
                self._workers.task(self._gate.create(w, lambda: self._closed))
        elif t == "ready" and w.state != "retired":  # not one retired as it said "exited"
            back = w.warmed  # from a command, not warm for the first time
            if (interpreter := w.warm(msg)) is not None:
                self.interpreter = interpreter
            self._consecutive_failures = 0
            self._changed.set()
            self._idle(w, back=back)
        elif t == "failed":
            w.error = msg.get("error", "")
        elif t == "declined":
            w.answer(str(msg.get("reason") or "declined"))
            w.launched = None
            self._retire(w, f"declined an adoption: {msg.get('reason')}", kill=False)
        elif t == "started" and w.launched is not None:
            self.latencies[w.form].append(w.started(msg))
        elif t == "exited" and w.done is not None and not w.done.done():
            if retire := w.finished(msg):
                self._retire(w, retire, kill=False)  # which tells on_unsettled
            else:
                self.on_unsettled(w.pid)  # back from its command: resetting, in none

    def _on_exit(self, w: Worker) -> None:
        was = w.state
        status = w.died(self._on_message)
        if not w.warmed and not self._closed:
            self._failed(w.error or f"worker {w.pid} died while warming: returncode {status.returncode}")
        elif was != "retired":
            self.retired += 1
            used_up = was == "busy" and w.uses >= self.config.max_uses
            self.retired_why.add("used up (--pool-max-uses)" if used_up else f"exited while {was}")
        w.state = "retired"
        self._workers.discard(w)
        self._changed.set()
        self._refill()

    def _retire(self, w: Worker, reason: str, kill: bool = True) -> None:
        if w.state != "retired":
            self.retired += 1
            self.retired_why.add(reason)
        w.state, w.error = "retired", reason
        self.on_unsettled(w.pid)  # it tears down in no command until it is gone
        self._gate.later(functools.partial(_kill, w.pid) if kill else w.sock.close)  # or EOF: it exits
        self._changed.set()
        self._refill()

    def _failed(self, error: str) -> None:
        self.failures += 1
        self._consecutive_failures += 1
        self.last_error = error
        self._changed.set()
