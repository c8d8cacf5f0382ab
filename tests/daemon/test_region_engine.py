"""The region engine in process: real `Regions` (its Entry, Joins, Exits, Drain and each region's
HoldSet) on a real `Core`, with a fake isolation backend and a fake driver lock pool in place of the
cgroups and libcuda. No socket, no daemon process: each test drives a region from its request to its
release and asserts what was held, what was let go on each way out (release, owner death, a failed
step, expiry, cancellation), the outcome, and the order of the fakes' freeze/lock/thaw/unlock calls.
The end-to-end tests (tests/test_regions.py, tests/lifecycle/, tests/isolation/) run the same engine
on real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from krex_async import protocol as P
from krex_async.daemon.config import ServeConfig
from krex_async.daemon.model import events as E
from krex_async.daemon.model.command import Command, CommandState
from krex_async.daemon.model.core import Core, Outcome, Region
from krex_async.daemon.model.holdset import HoldSet
from krex_async.daemon.regions.engine import Regions
from krex_async.devices.base import Device
from krex_async.isolation.base import Backend, Freeze, FreezeError, Group
from krex_async.isolation.cudalock import LockResult
from krex_async.scheduler import Policy, Scheduler

with open("/proc/sys/kernel/pid_max") as _f:
    NO_PID = int(_f.read()) + 1000  # pids above pid_max: no process has them, none ever will
DEV = "nvidia0"


class FakeBackend(Backend):
    """The isolation interface over a dict: each command's pids, freeze and thaw as flags, every
    call logged in order. `hang`: groups whose freeze fails (a thread in uninterruptible sleep);
    `slow`: groups whose freeze waits for the event; `refuse_cores`: set_cores raises."""

    name = "fake"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self.members: dict[str, list[int]] = {}
        self.hang: set[str] = set()
        self.slow: dict[str, asyncio.Event] = {}
        self.refuse_cores = False

    async def create(self, command_id: str) -> Group:
        return Group(command_id)

    async def started(self, group: Group, pid: int) -> None:
        group.pid = pid

    def pids(self, group: Group) -> list[int]:
        return list(self.members.get(group.command_id, []))

    async def freeze(
        self, group: Group, *, keep: frozenset[int] = frozenset(), timeout: float = 1.0
    ) -> Freeze:
        self.calls.append(("freeze", group.command_id))
        if group.command_id in self.slow:
            await self.slow[group.command_id].wait()
        if group.command_id in self.hang:
            raise FreezeError(group.name, "not frozen in time; its threads: 1(fuse_wait)")
        group.frozen = True
        stopped = [p for p in self.pids(group) if p not in keep]
        return Freeze(group=group.name, pids=len(stopped), stopped=stopped)

    async def thaw(self, group: Group) -> float:
        self.calls.append(("thaw", group.command_id))
        group.frozen = False
        return 0.0

    async def set_cores(
        self,
        group: Group,
        cpus: frozenset[int] | None,
        *,
        pids: list[int] | None = None,
        exclusive: bool = False,
    ) -> None:
        if self.refuse_cores:
            raise OSError(13, "cpuset write refused")
        self.calls.append(("cores", group.command_id))

    async def kill(self, group: Group, sig: int = signal.SIGKILL) -> None:
        self.calls.append(("kill", group.command_id))

    async def remove(self, group: Group) -> None:
        self.calls.append(("remove", group.command_id))


class FakeLockPool:
    """LockPool's interface (lock_many, unlock_many, stuck, close): `busy` pids answer NOT_READY
    that many times, `refuse` pids are refused with the error given; every call logged."""

    def __init__(self, calls: list[tuple[str, str]]) -> None:
        self.calls = calls  # shared with the backend: one order for all
        self.stuck = 0
        self.locked: set[int] = set()
        self.busy: dict[int, int] = {}
        self.refuse: dict[int, str] = {}

    async def lock_many(self, pids: list[int], timeout: float) -> dict[int, LockResult]:
        out = {}
        for p in pids:
            self.calls.append(("lock", str(p)))
            if self.busy.get(p, 0) > 0:
                self.busy[p] -= 1
                out[p] = LockResult(
                    p, False, timeout, "CUDA_ERROR_NOT_READY", not_ready=True, state="running"
                )
            elif p in self.refuse:
                out[p] = LockResult(p, False, 0.001, self.refuse[p])
            else:
                self.locked.add(p)
                out[p] = LockResult(p, True, 0.001)
        return out

    async def unlock_many(self, pids: list[int]) -> tuple[float, dict[int, str]]:
        for p in pids:
            self.calls.append(("unlock", str(p)))
            self.locked.discard(p)
        return 0.001, {}

    def close(self) -> None:
        pass


@dataclass(eq=False)
class Runtime:
    """A command's in-process runtime on the daemon's side: what it was sent; a Quiesce is acked."""

    engine: Engine | None = None
    pid: int = 0
    got: list[P.Msg] = field(default_factory=list)
    ack: bool = True

    def __call__(self, msg: P.Msg) -> bool:
        self.got.append(msg)
        if isinstance(msg, P.Quiesce) and self.ack and self.engine is not None:
            ack = P.QuiesceAck(id=0, region=msg.region, synced="cuda")
            asyncio.get_running_loop().call_soon(self.engine.regions.ack, ack, self.pid)
        return True

    def kinds(self) -> list[str]:
        return [type(m).__name__ for m in self.got]


@dataclass
class Engine:
    core: Core
    regions: Regions
    backend: FakeBackend
    pool: FakeLockPool
    n: int = 0

    @property
    def calls(self) -> list[tuple[str, str]]:
        return self.backend.calls

    def command(
        self,
        cid: str,
        pids: list[int],
        gpu: tuple[int, ...] | list[int] = (),
        state: CommandState = CommandState.RUNNING,
    ) -> Command:
        """A command on the device: its pids, those of them holding a GPU file (known through
        their runtimes, as a runtime's QuiesceReady and the holders' reading make them)."""
        cmd = Command(
            id=cid,
            spec=P.Submit(id=0, argv=["true"]),
            uid=os.getuid(),
            gid=os.getgid(),
            device=self.core.device(DEV),
            policy=Policy.REGION,
            tail_limit=1024,
        )
        cmd.state = state
        cmd.group = Group(cid)
        self.backend.members[cid] = list(pids)
        for p in gpu:
            rt = Runtime(self, p)
            cmd.runtimes[p] = rt
            self.regions.drain.holders.note(p, rt, True)
        self.core.commands[cid] = cmd
        self.core.scheduler.add_command(cid, DEV)
        return cmd

    def enter(self, cmd: Command, pid: int, **kw: Any) -> tuple[Region, Runtime]:
        owner = Runtime(self, pid)
        self.n += 1
        req = P.RegionEnter(id=self.n, command=cmd.id, token=cmd.token, pid=pid, **kw)
        return self.regions.create(cmd, req, pid, owner), owner


def make_engine(*, hold: str = "auto", freeze: str = "all", lock: bool = True, **cfg: Any) -> Engine:
    config = ServeConfig(hold=hold, freeze=freeze, region_cores=1, **cfg)  # type: ignore[arg-type]
    backend = FakeBackend()
    cpus = frozenset(os.sched_getaffinity(0))
    tasks: set[asyncio.Task[Any]] = set()

    def track(t: asyncio.Task[Any]) -> asyncio.Task[Any]:
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        return t

    core = Core(
        config=config,
        backend=backend,
        devices=[Device(index=0, key=DEV, vendor="nvidia", name="fake", cpus=cpus)],
        node=None,
        scheduler=Scheduler(Policy.REGION, [DEV]),
        commands={},
        pools={},
        trace=lambda *a, **k: None,
        track=track,
        records=None,
        spool=None,
        all_cpus=cpus,
    )
    regions = Regions(core)
    pool = FakeLockPool(backend.calls)
    if lock:  # the driver lock is available (no libcuda here: the fake serves)
        regions.hold.pool = pool  # type: ignore[assignment]
    return Engine(core, regions, backend, pool)


async def granted(r: Region, owner: Runtime) -> None:
    for _ in range(400):
        answered = any(isinstance(m, (P.RegionGranted, P.Error)) for m in owner.got)
        if answered or r.task is None or r.task.done():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"region {r.id} not granted: {owner.kinds()}")


async def ended(r: Region) -> None:
    assert r.task is not None
    await asyncio.wait_for(asyncio.shield(r.task), 5)


def release(e: Engine, r: Region) -> None:
    e.regions.exit(r, P.RegionExit(id=99, region=r.id, token=r.command.token))


def nothing_held(e: Engine, r: Region) -> None:
    """Every way out ends here: nothing frozen, nothing locked, no region listed."""
    assert not r.held.frozen and not r.held.locked_pids, (r.held.frozen, r.held.locked_pids)
    assert not e.pool.locked, e.pool.locked
    assert not [c for c in e.core.commands.values() if c.group is not None and c.group.frozen]
    assert r.id not in e.regions.active and e.regions.get(r.id) is None
    assert e.core.scheduler.holder(DEV) is None


@pytest.fixture
def live() -> Iterator[int]:
    """A live process's pid, for the lock's "has it exited?" reading."""
    p = subprocess.Popen(["sleep", "60"])
    yield p.pid
    p.kill()
    p.wait()


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    e = make_engine()
    yield e
    e.regions.close()


# ------------------------------------------------------------------------------ freeze and release


async def test_freeze_all_holds_every_sibling_and_the_release_thaws_them(engine: Engine) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    e.command("a", [NO_PID + 1])
    e.command("b", [NO_PID + 2])
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    assert r.outcome is Outcome.HELD and owner.kinds() == ["RegionGranted"]
    assert list(r.held.frozen_ids) == ["a", "b"] and r.report.frozen == ["a", "b"]
    assert e.core.commands["a"].group.frozen and e.core.commands["b"].group.frozen  # type: ignore[union-attr]
    assert e.regions.holding(e.core.commands["a"]) == ("frozen", r)
    assert e.regions.holding(o) is None  # the owner runs
    release(e, r)
    await ended(r)
    assert r.outcome is Outcome.RELEASED and r.report.outcome == "released"
    assert owner.kinds() == ["RegionGranted", "RegionReleased"]
    holds = [c for c in e.calls if c[0] in ("freeze", "thaw")]
    assert holds == [("freeze", "a"), ("freeze", "b"), ("thaw", "a"), ("thaw", "b")], e.calls
    nothing_held(e, r)
    assert e.regions.holding(e.core.commands["a"]) is None


async def test_the_owner_gets_its_cores_and_a_sibling_left_running_is_fenced_then_unfenced(
    engine: Engine,
) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    e.command("a", [NO_PID + 1])
    e.backend.hang.add("a")
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    assert r.report.cores and r.report.fenced == ["a"]
    release(e, r)
    await ended(r)
    cores = [c for c in e.calls if c[0] == "cores"]
    assert cores[0] == ("cores", "o") and ("cores", "a") in cores[1:3], e.calls
    assert cores[-1] == ("cores", "a") and len(cores) >= 4, e.calls  # restored, then unfenced
    nothing_held(e, r)


async def test_a_sibling_that_cannot_be_frozen_is_dropped_and_the_region_tainted(engine: Engine) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    e.command("a", [NO_PID + 1])
    e.command("b", [NO_PID + 2])
    e.backend.hang.add("b")
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    assert r.outcome is Outcome.HELD
    assert list(r.held.frozen_ids) == ["a"] and r.report.frozen == ["a"]
    assert "b" in r.report.unheld and r.report.tainted and "could not be held" in r.report.taint[0]
    assert not e.core.commands["b"].group.frozen and r.report.fenced == ["b"]  # type: ignore[union-attr]
    release(e, r)
    await ended(r)
    # the batch was undone (a thawed) and a frozen again without b; only a thawed at the release
    holds = [c for c in e.calls if c[0] in ("freeze", "thaw")]
    assert holds == [("freeze", "a"), ("freeze", "b"), ("thaw", "a"), ("freeze", "a"), ("thaw", "a")], holds
    nothing_held(e, r)


async def test_a_command_that_still_hangs_is_not_tried_again_by_the_next_region(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from krex_async.daemon.regions import entry

    e = engine
    o = e.command("o", [NO_PID])
    e.command("a", [NO_PID + 1])
    e.backend.hang.add("a")
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    release(e, r)
    await ended(r)
    tried = e.calls.count(("freeze", "a"))
    monkeypatch.setattr(entry, "d_state", lambda pids: [f"{pids[0]}(fuse_wait)"])
    r2, owner2 = e.enter(o, NO_PID)
    await granted(r2, owner2)
    assert e.calls.count(("freeze", "a")) == tried  # left unheld at once
    assert "still in uninterruptible sleep" in r2.report.unheld["a"] and r2.report.tainted
    release(e, r2)
    await ended(r2)
    nothing_held(e, r2)


# ------------------------------------------------------------------------------------- the lock


async def test_siblings_holding_a_gpu_are_locked_told_held_and_unlocked_after_the_thaw(
    engine: Engine,
) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    a = e.command("a", [NO_PID + 1, NO_PID + 11], gpu=[NO_PID + 1])  # one GPU process, one CPU one
    e.command("b", [NO_PID + 2])  # no GPU file: frozen
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    assert r.report.hold == "lock"
    assert list(r.held.locked_ids) == ["a"] and r.report.locked == ["a"]
    assert list(r.held.locked_pids) == [NO_PID + 1] == r.report.locked_pids and e.pool.locked == {NO_PID + 1}
    assert list(r.held.frozen_ids) == ["b"] and not a.group.frozen  # type: ignore[union-attr]
    rt = a.runtimes[NO_PID + 1]
    assert isinstance(rt, Runtime) and rt.kinds() == ["Held"]  # its exit waits for the release
    assert e.regions.holding(a) == ("locked", r)
    release(e, r)
    await ended(r)
    order = [c for c in e.calls if c[0] in ("lock", "freeze", "thaw", "unlock")]
    assert order == [("lock", str(NO_PID + 1)), ("freeze", "b"), ("thaw", "b"), ("unlock", str(NO_PID + 1))]
    assert rt.kinds() == ["Held", "Resume"] and rt.got[1].region == r.id  # type: ignore[attr-defined]
    nothing_held(e, r)


async def test_a_process_the_lock_refuses_is_frozen_instead_saying_why(engine: Engine) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    e.command("a", [NO_PID + 1], gpu=[NO_PID + 1])
    e.pool.refuse[NO_PID + 1] = "CUDA_ERROR_NOT_SUPPORTED"
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    assert not r.held.locked_ids and list(r.held.frozen_ids) == ["a"]
    assert "CUDA_ERROR_NOT_SUPPORTED" in r.report.hold_fallback["a"], r.report.hold_fallback
    release(e, r)
    await ended(r)
    steps = [c[0] for c in e.calls if c[0] in ("lock", "freeze", "thaw", "unlock")]
    assert steps == ["lock", "freeze", "thaw"], e.calls
    nothing_held(e, r)


async def test_a_process_inside_a_cuda_call_is_waited_for_and_locked_before_the_grant(
    engine: Engine, live: int
) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    e.command("a", [live], gpu=[live])
    e.pool.busy[live] = 1  # NOT_READY once, locked as its call ends
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    late = r.report.lock_late
    assert [(x.pid, x.outcome, x.attempts) for x in late] == [(live, "locked", 2)], late
    assert list(r.held.locked_ids) == ["a"] and not r.held.frozen_ids
    release(e, r)
    await ended(r)
    assert [c[0] for c in e.calls if c[0] in ("lock", "unlock")] == ["lock", "lock", "unlock"]
    nothing_held(e, r)


async def test_a_process_still_busy_after_the_lock_wait_is_frozen(engine: Engine, live: int) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    e.command("a", [live], gpu=[live])
    e.pool.busy[live] = 2
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    assert [x.outcome for x in r.report.lock_late] == ["frozen"]
    assert list(r.held.frozen_ids) == ["a"] and "--lock-wait" in r.report.hold_fallback["a"]
    release(e, r)
    await ended(r)
    nothing_held(e, r)


async def test_a_busy_process_that_exited_meanwhile_is_neither_locked_nor_frozen(engine: Engine) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    e.command("a", [NO_PID + 1], gpu=[NO_PID + 1])  # no such process: gone by the second try
    e.pool.busy[NO_PID + 1] = 2
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    assert [x.outcome for x in r.report.lock_late] == ["exited"]
    assert not r.held.holds("a") and r.report.fenced == ["a"] and "a" not in r.report.hold_fallback
    release(e, r)
    await ended(r)
    nothing_held(e, r)


async def test_hold_freeze_never_calls_the_lock() -> None:
    e = make_engine(hold="freeze")
    o = e.command("o", [NO_PID])
    e.command("a", [NO_PID + 1], gpu=[NO_PID + 1])
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    assert r.report.hold == "freeze" and list(r.held.frozen_ids) == ["a"]
    release(e, r)
    await ended(r)
    assert not [c for c in e.calls if c[0] in ("lock", "unlock")]
    nothing_held(e, r)


# ------------------------------------------------------------------------- every other way out


async def test_owner_death_while_held_thaws_unlocks_and_revokes(engine: Engine) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    e.command("a", [NO_PID + 1], gpu=[NO_PID + 1])
    e.command("b", [NO_PID + 2])
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    e.regions.end_owned_by(owner)
    await ended(r)
    assert r.outcome is Outcome.OWNER_DIED and owner.kinds() == ["RegionGranted", "RegionRevoked"]
    assert ("thaw", "b") in e.calls and ("unlock", str(NO_PID + 1)) in e.calls
    nothing_held(e, r)


async def test_a_failed_step_refuses_the_region_and_undoes_what_it_held(engine: Engine) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    e.command("a", [NO_PID + 1], gpu=[NO_PID + 1])
    e.command("b", [NO_PID + 2])
    e.backend.refuse_cores = True  # the owner's cpuset write fails mid-entry
    r, owner = e.enter(o, NO_PID)
    await ended(r)
    assert r.outcome is Outcome.REFUSED and "cpuset write refused" in r.report.error
    err = owner.got[-1]
    assert isinstance(err, P.Error) and err.code == "region_refused", owner.got
    assert ("freeze", "b") in e.calls and ("thaw", "b") in e.calls
    assert ("lock", str(NO_PID + 1)) in e.calls and ("unlock", str(NO_PID + 1)) in e.calls
    nothing_held(e, r)


async def test_a_cancelled_region_task_still_releases_everything(engine: Engine) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    e.command("a", [NO_PID + 1], gpu=[NO_PID + 1])
    e.command("b", [NO_PID + 2])
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    assert r.task is not None
    r.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await r.task
    await asyncio.sleep(0.05)  # the shielded release finishes on its own
    assert r.outcome is Outcome.SHUTDOWN
    assert ("thaw", "b") in e.calls and ("unlock", str(NO_PID + 1)) in e.calls
    nothing_held(e, r)


async def test_an_expired_region_is_revoked_and_released() -> None:
    e = make_engine(region_timeout=0.05)
    o = e.command("o", [NO_PID])
    e.command("a", [NO_PID + 1])
    r, owner = e.enter(o, NO_PID)
    await ended(r)
    assert r.outcome is Outcome.EXPIRED and owner.kinds() == ["RegionGranted", "RegionRevoked"]
    assert e.calls.index(("freeze", "a")) < e.calls.index(("thaw", "a"))
    nothing_held(e, r)


async def test_a_queued_region_withdrawn_holds_nothing_and_the_next_one_runs(engine: Engine) -> None:
    e = engine
    o, p = e.command("o", [NO_PID]), e.command("p", [NO_PID + 1])
    r1, own1 = e.enter(o, NO_PID)
    await granted(r1, own1)
    r2, own2 = e.enter(p, NO_PID + 1)
    await asyncio.sleep(0.02)
    assert r2.outcome is Outcome.OPEN and not own2.got  # queued behind r1
    r3, own3 = e.enter(e.command("q", [NO_PID + 3]), NO_PID + 3)
    e.regions.end_owned_by(own2)
    await ended(r2)
    assert r2.outcome is Outcome.OWNER_DIED and not r2.held.frozen_ids and not own2.got
    release(e, r1)
    await ended(r1)
    await granted(r3, own3)  # r2 gone: the turn passes to r3
    assert r3.outcome is Outcome.HELD and "o" in r3.held.frozen_ids
    release(e, r3)
    await ended(r3)
    nothing_held(e, r3)


async def test_shutdown_ends_every_region(engine: Engine) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    e.command("a", [NO_PID + 1])
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    await e.regions.end_all()
    assert r.outcome is Outcome.SHUTDOWN and ("thaw", "a") in e.calls
    nothing_held(e, r)


async def test_the_end_of_the_owning_command_ends_its_region(engine: Engine) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    e.command("a", [NO_PID + 1])
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    await e.regions.end_of(o)
    assert r.outcome is Outcome.OWNER_DIED
    nothing_held(e, r)


# ------------------------------------------------------------------ commands meeting a region


async def test_a_command_starting_during_a_held_region_lands_frozen_in_it(engine: Engine) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    c = e.command("c", [NO_PID + 5], state=CommandState.STARTING)
    admitted = e.regions.admit_frozen(c)
    assert admitted is r
    c.state = CommandState.RUNNING
    c.group.frozen = True  # type: ignore[union-attr]  # the runner started it frozen
    await e.regions.join(c, admitted)
    assert list(r.held.frozen_ids) == ["c"] and r.report.frozen == ["c"]
    assert ("freeze", "c") not in e.calls  # already frozen by its start
    release(e, r)
    await ended(r)
    assert ("thaw", "c") in e.calls
    nothing_held(e, r)


async def test_a_command_admitted_frozen_for_a_region_since_ended_is_thawed(engine: Engine) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    c = e.command("c", [NO_PID + 5], state=CommandState.STARTING)
    admitted = e.regions.admit_frozen(c)
    release(e, r)
    await ended(r)
    c.state = CommandState.RUNNING
    c.group.frozen = True  # type: ignore[union-attr]
    await e.regions.join(c, admitted)
    assert not c.group.frozen and e.calls[-1] == ("thaw", "c")  # type: ignore[union-attr]
    assert "c" not in r.held.frozen_ids


async def test_a_join_freeze_in_flight_at_the_release_is_waited_for_and_undone(engine: Engine) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    c = e.command("c", [NO_PID + 5])  # began running unfrozen while the region is held
    gate = e.backend.slow["c"] = asyncio.Event()
    joining = asyncio.ensure_future(e.regions.join(c, None))
    await asyncio.sleep(0.01)
    assert len(r.held.freezes) == 1
    release(e, r)
    await asyncio.sleep(0.02)
    assert r.task is not None and not r.task.done()  # the release waits for the freeze in flight
    gate.set()
    await ended(r)
    await joining
    assert not c.group.frozen and "c" not in r.held.frozen_ids  # type: ignore[union-attr]
    assert e.calls.index(("freeze", "c")) < e.calls.index(("thaw", "c"))
    nothing_held(e, r)


async def test_a_worker_locked_at_entry_holds_the_command_it_joins(engine: Engine) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    e.command("a", [NO_PID + 1], gpu=[NO_PID + 1])
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    c = e.command("c", [NO_PID + 1])  # the locked process becomes c's (a warm worker's hand-over)
    e.regions.worker_joined(c, NO_PID + 1)
    assert list(r.held.locked_ids) == ["a", "c"] and r.report.locked == ["a", "c"]
    assert e.regions.holding(c) == ("locked", r)
    e.regions.worker_joined(c, NO_PID + 1)  # once
    assert r.report.locked == ["a", "c"]
    release(e, r)
    await ended(r)
    nothing_held(e, r)


# ------------------------------------------------------------------------- runtimes and exits


async def test_gpu_runtimes_of_frozen_siblings_are_quiesced_and_resumed() -> None:
    e = make_engine(hold="freeze")
    o = e.command("o", [NO_PID])
    a = e.command("a", [NO_PID + 1], gpu=[NO_PID + 1])
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    rt = a.runtimes[NO_PID + 1]
    assert isinstance(rt, Runtime) and rt.kinds() == ["Quiesce"]
    assert r.acks[NO_PID + 1].done()  # its ack reached the region (Regions.ack)
    release(e, r)
    await ended(r)
    assert rt.kinds() == ["Quiesce", "Resume"]
    nothing_held(e, r)


async def test_an_exit_during_a_region_waits_for_its_release_then_the_next_region_waits_for_it(
    engine: Engine,
) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    a = e.command("a", [NO_PID + 1])
    rt = Runtime(e, NO_PID + 7)
    a.runtimes[NO_PID + 7] = rt  # a process of a that is not held (not a GPU holder at the entry)
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    e.regions.exit_held(P.ExitHeld(id=0, region=""), NO_PID + 7, rt)
    assert not rt.got and r.report.exit_deferred == [NO_PID + 7]
    release(e, r)
    await ended(r)
    assert rt.kinds() == ["Resume"] and rt.got[0].region == ""  # type: ignore[attr-defined]
    assert NO_PID + 7 in e.regions.exits.exiting  # the next region on the device waits for it first
    rt2 = Runtime(e, NO_PID + 8)
    a.runtimes[NO_PID + 8] = rt2
    e.regions.exit_held(P.ExitHeld(id=0, region=""), NO_PID + 8, rt2)  # no region: at once
    assert rt2.kinds() == ["Resume"]


async def test_the_exit_of_a_locked_process_is_deferred_to_the_release_once(engine: Engine) -> None:
    e = engine
    o = e.command("o", [NO_PID])
    a = e.command("a", [NO_PID + 1], gpu=[NO_PID + 1])
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    send = a.runtimes[NO_PID + 1]
    for _ in range(2):
        e.regions.exit_held(P.ExitHeld(id=0, region=r.id), NO_PID + 1, send)
    e.regions.exit_held(P.ExitHeld(id=0, region=r.id), NO_PID + 9, send)  # not locked by r: ignored
    assert r.report.exit_deferred == [NO_PID + 1]
    e.regions.ended_held(a)  # it died all the same (a kill): the report says so
    assert r.report.held_exited == ["a"]
    release(e, r)
    await ended(r)
    nothing_held(e, r)


# ----------------------------------------------------------------------------- the HoldSet alone


def test_holdset_is_the_only_writer_its_views_are_read_only() -> None:
    rep = P.RegionReport(region="x.1", name="t", device=DEV, pid=1, policy="region")
    hs = HoldSet("x.1", rep)
    a, b = Group("a"), Group("b")
    hs.mark_frozen([a, b], ["a", "b"])
    hs.drop(a, "not frozen in time; its threads: 3(nfs_wait)")
    assert list(hs.frozen) == [b] and list(hs.frozen_ids) == ["b"]
    assert rep.unheld == {"a": "not frozen in time; its threads: 3(nfs_wait)"} and rep.tainted
    assert rep.taint == [
        "command a could not be held (not frozen in time): it ran on, fenced off the region cores"
    ]
    hs.add_locked("c")
    assert hs.held_ids() == ["b", "c"] and rep.locked == ["c"]


async def test_no_late_freeze_starts_once_the_release_began() -> None:
    hs = HoldSet("x.1", P.RegionReport(region="x.1", name="t", device=DEV, pid=1, policy="region"))
    async with hs.late_freeze("c") as todo:
        assert todo and len(hs.freezes) == 1
        async with hs.late_freeze("c") as again:
            assert not again  # one freeze per command at a time
    assert not hs.freezes
    hs.begin_release()
    async with hs.late_freeze("d") as todo:
        assert not todo and not hs.freezes


def test_the_outcome_is_an_enum_spelled_as_the_wire_says() -> None:
    wire = {"open", "held", "released", "expired", "owner-died", "shutdown", "refused"}
    assert {o.value for o in Outcome} == wire
    rep = P.RegionReport(region="x.1", name="t", device=DEV, pid=1, policy="region")
    r = Region(
        id="x.1",
        command=None,  # type: ignore[arg-type]
        device=DEV,
        pid=1,
        send=lambda m: True,
        req_id=1,
        request=P.RegionEnter(id=1, command="x", token="t"),
        report=rep,
    )
    assert r.outcome is Outcome.OPEN
    r.outcome = Outcome.OWNER_DIED
    assert rep.outcome == "owner-died" and type(rep.outcome) is str and r.held.report is rep


async def test_a_re_run_is_owed_nothing_of_its_failed_runs_share(engine: Engine) -> None:
    """Others' regions held B for 8 of the last 10 s, so a region would wait for B's share; B then
    fails with a co-located out-of-memory and is re-run: a new run, which no region has held.
    The next region does not wait for it (on an H100 one waited 3.6 s for such a re-run)."""
    e = engine
    o = e.command("o", [NO_PID])
    b = e.command("b", [NO_PID + 1])
    now = time.monotonic()
    e.regions.share.end("before", ["b"], now - 8.0, now)
    assert e.regions.share.owed_s("b", time.monotonic()) > 0
    b.reset_for_rerun("co-located OOM")
    e.core.events.emit(E.CommandRequeued(b, "co-located OOM"))
    b.state, b.group = CommandState.RUNNING, Group("b")  # its re-run started
    r, owner = e.enter(o, NO_PID)
    await granted(r, owner)
    assert r.outcome is Outcome.HELD and r.report.share_for == [] and r.report.share_wait_s == 0.0
    release(e, r)
    await ended(r)
    nothing_held(e, r)
