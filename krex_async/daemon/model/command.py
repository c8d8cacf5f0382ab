"""A command as the daemon holds it: its spec, state and device, its subscribers and the tails of
its output, the environment its processes get, and what it publishes to its agents.

`CommandRunner` (runner.py) spawns and watches its processes, report.py says how it ended, and
lifecycle.py decides when each happens. The last `output_tail` bytes of each stream stay with the
command, so an agent that re-attaches after a disconnect still gets them with the report.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import msgspec

from krex_async import protocol as P
from krex_async.daemon.model.stdinpipe import StdinPipe
from krex_async.daemon.persist.spool import SpoolFile
from krex_async.devices.base import VISIBILITY_VARS, Device
from krex_async.isolation.base import Group
from krex_async.linux.spawn import Handoff, Launched
from krex_async.scheduler import Policy

# How long after its adopted program's end a command counts as leaving (Command.leaving): on the
# H100 a KernelBench job's command ended 0.19-0.23 s after its region's release (session 31).
LEAVING_S = 1.0

# krex_async/runtime: put on a command's PYTHONPATH (its sitecustomize loads the in-command runtime)
RUNTIME_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "runtime"
)


class SpecError(Exception):
    """The command cannot be started as asked; the message says which field and why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def with_runtime(env: dict[str, str]) -> dict[str, str]:
    """env with krex's in-command runtime (runtime/sitecustomize.py) first on PYTHONPATH."""
    if os.path.exists(os.path.join(RUNTIME_DIR, "sitecustomize.py")):
        env["PYTHONPATH"] = RUNTIME_DIR + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def user_groups(uid: int, gid: int) -> list[int]:
    """The supplementary groups of the submitting user, as a login would give them."""
    try:
        return os.getgrouplist(pwd.getpwuid(uid).pw_name, gid)
    except KeyError:  # a uid without a passwd entry: its primary group only
        return [gid]


@dataclass
class Subscriber:
    send: Callable[[P.Msg], bool]  # False once the connection is gone
    req_id: int
    stream: bool = True


class Tail:
    """The last `limit` bytes written to a stream, and how many were written in all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buf = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        self.buf += data
        if len(self.buf) > self.limit:
            del self.buf[: len(self.buf) - self.limit]


class CommandState(StrEnum):
    """Where a command is in its life (its report's `state` says how it ended)."""

    QUEUED = "queued"  # waiting for its device (policy command) or its start
    STARTING = "starting"  # its group made, its leader being spawned
    RUNNING = "running"
    ENDED = "ended"  # its report is set


@dataclass
class Command:
    id: str
    spec: P.Submit
    uid: int
    gid: int
    device: Device | None
    policy: Policy | None  # None: recovered from a record that did not name it
    tail_limit: int
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    state: CommandState = CommandState.QUEUED
    group: Group | None = None
    launched: Launched | None = None
    report: P.CommandReport | None = None
    subscribers: list[Subscriber] = field(default_factory=list)
    runtimes: dict[int, Callable[[P.Msg], bool]] = field(default_factory=dict)  # pid -> send
    # interpreters whose program a pool worker runs: each waits, idle, for the worker's status
    adopters: set[int] = field(default_factory=set)
    # when an adopted program last ran to its end (time.monotonic(); 0: none since the last
    # adoption began): for LEAVING_S after, with no other adopted, the command is leaving
    adopted_ended_at: float = 0.0
    # (time.monotonic(), signal) of every signal sent to the whole tree: an interpreter waiting for
    # a worker has them blocked, and its worker, not yet in the tree, must get them (WarmPools.adopt)
    signalled: list[tuple[float, int]] = field(default_factory=list)
    regions: list[P.RegionReport] = field(default_factory=list)
    submitted: float = field(default_factory=time.monotonic)
    age_known: bool = True  # False: recovered from a record with no start time (`krex status`: ?)
    started: float = 0.0
    ended_at: float = 0.0
    end_reason: str = ""
    end_note: str = ""  # how the daemon ended it, where that is not what was asked (the report's error)
    start_error: str = ""  # why the applier could not start it (state "failed")
    # A cancel (or shutdown) that came while the command was starting: (reason, signal), acted
    # on as soon as the leader runs (Lifecycle._start).
    kill_pending: tuple[str, int] | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    watch_task: asyncio.Task[None] | None = None
    pipe_closers: list[Callable[[], None]] = field(default_factory=list)
    spools: dict[str, SpoolFile] = field(default_factory=dict)  # stream -> its spool file
    handoff: Handoff | None = None  # another user's command: its cwd and env, applied after the drop
    stdin_pipe: StdinPipe | None = None  # Submit.stdin_stream: fed by StdinData until it ends
    pool_env: dict[str, str] = field(default_factory=dict)  # KREX_POOL, where its interpreters may be adopted
    # memory-aware admission (admission.py): what it is taken to need and where that figure came
    # from (declared, learned, typical, default, unknown), what its tree holds now and at most, why it waits
    mem_need: int = 0
    mem_source: str = ""
    mem_now: int = 0
    mem_peak: int = 0
    mem_floor: int = 0  # what an out-of-memory failure of it showed it needs at least (reruns.floor)
    mem_guard: int = 0  # what its guarded re-run was guarded at (admission.requeue)
    mem_wait: str = ""
    mem_admitted: float = 0.0  # monotonic time memory admission let it start
    co_located: bool = False  # other commands (or pool workers) held device memory while it ran
    # a re-run after a co-located out-of-memory (admission.py): guarded (its need known: starts
    # where it fits beside the others' peaks) or solo (runs alone on its device)
    solo: bool = False
    guarded: bool = False
    reruns: int = 0
    rerun_reason: str = ""
    # --mem-gate (admission.py, runtime/cudagate.py): "" not gated; "open" started, its admission
    # waits for its first CUDA initialisation; "asked" its runtime waits at the gate (queued for
    # memory); "passed"; "bypassed" seen holding device memory without asking
    gate: str = ""
    gate_asked: float = 0.0  # monotonic time its runtime first asked
    gate_s: float = 0.0  # seconds it waited at the gate
    gate_waiters: list[Callable[[], None]] = field(default_factory=list)  # open them at admission

    def __post_init__(self) -> None:
        self.out = Tail(self.tail_limit)
        self.err = Tail(self.tail_limit)

    @property
    def policy_name(self) -> str:
        """The policy as the wire, the records and the metrics spell it ("" where unknown)."""
        return self.policy.value if self.policy is not None else ""

    @property
    def device_key(self) -> str | None:
        return self.device.key if self.device else None

    @property
    def pid(self) -> int | None:
        return self.launched.pid if self.launched else None

    def leaving(self, now: float) -> bool:
        """Whether its adopted program ended under LEAVING_S ago and no other is adopted: what is
        left of it is likely its interpreter and wrappers exiting (a region does not wait for its
        share if, as well, none of its processes holds a GPU file: Regions.owed)."""
        return not self.adopters and 0.0 < now - self.adopted_ended_at < LEAVING_S

    def reset_for_rerun(self, reason: str) -> None:
        """Ended, to run again (a re-run after a co-located out-of-memory, admission.py): queued
        (guarded or alone: admission.requeue), with nothing of the first run's processes, output
        or regions left."""
        self.reruns += 1
        self.rerun_reason, self.co_located = reason, False
        self.gate, self.gate_asked, self.gate_s = "", 0.0, 0.0  # a re-run is admitted at its start
        self.gate_waiters.clear()
        self.state, self.report, self.launched, self.group, self.watch_task = (
            CommandState.QUEUED,
            None,
            None,
            None,
            None,
        )
        self.end_reason = self.end_note = self.start_error = ""
        self.kill_pending, self.handoff, self.spools, self.regions = None, None, {}, []
        self.adopted_ended_at = 0.0
        for held in (self.pipe_closers, self.runtimes, self.adopters, self.signalled):
            held.clear()
        self.out, self.err = Tail(self.tail_limit), Tail(self.tail_limit)

    def publish(self, make: Callable[[int], P.Msg], *, output: bool = False) -> None:
        """Send make(request id) to every subscriber (output only to those that stream)."""
        for sub in list(self.subscribers):
            if output and not sub.stream:
                continue
            if not sub.send(make(sub.req_id)):
                self.subscribers.remove(sub)

    def publish_exit(self, report: P.CommandReport) -> None:
        """The end, to every subscriber: one that did not stream (Submit.stream=False) gets the
        output with it, as the kept tails."""
        for sub in list(self.subscribers):
            tails = (
                {} if sub.stream else {"stdout_tail": bytes(self.out.buf), "stderr_tail": bytes(self.err.buf)}
            )
            if not sub.send(P.Exited(id=sub.req_id, report=report, **tails)):
                self.subscribers.remove(sub)

    def slim(self) -> None:
        """Ended: keep what its report and an attach need. The spec's stdin (up to 8 MiB) and env
        go, argv becomes the report's own list, and the pipes' closers and runtimes' senders
        (closures over connections that may be long gone) are dropped."""
        argv = self.report.argv if self.report is not None else list(self.spec.argv)
        self.spec = msgspec.structs.replace(self.spec, stdin=None, env=None, argv=argv)
        self.pipe_closers.clear()
        self.runtimes.clear()

    def environment(self, socket: str) -> dict[str, str]:
        env = (
            dict(self.spec.env)
            if self.spec.env is not None
            else {"PATH": os.environ.get("PATH", os.defpath), "LANG": os.environ.get("LANG", "C.UTF-8")}
        )
        env.update(
            KREX_SOCKET=socket,
            KREX_COMMAND=self.id,
            KREX_TOKEN=self.token,
            KREX_DEVICE=self.device_key or "none",
        )
        if self.device is not None:
            if self.device.vendor != "cpu":
                for name in VISIBILITY_VARS:
                    env.pop(name, None)
            env.update(self.device.env)
        env.update(self.pool_env)
        if self.gate:
            env["KREX_CUDA_GATE"] = "1"  # its runtime asks for memory admission before CUDA starts
        return with_runtime(env)
