"""The share charges a sibling held by the driver lock alone only for the time it could not run
(daemon/regions/share.py, docs/fairness.md): the span less the CPU time its threads used in it, read
from the real /proc of real processes. The in-process engine of test_region_engine.py (real Regions,
Entry and HoldSet on a real Core) with its fake lock pool: a lock that leaves a process running is
what the driver lock does to a process busy on its CPU threads; one that stops the process (SIGSTOP
at the lock, SIGCONT at the unlock) is what it does to one whose threads all wait in CUDA calls."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from krex_async.daemon.model.command import LEAVING_S
from krex_async.daemon.model.core import Region
from krex_async.isolation.cudalock import LockResult

from ..conftest import until
from .test_region_engine import NO_PID, Engine, FakeLockPool, make_engine, release

WINDOW = 1.0  # --share-window: a few windows make a run of a few seconds
REGION_S = 0.05  # each region's length, back to back
BURNERS = 3  # the busy sibling's processes: it keeps a CPU's worth even beside two busy cores


class StoppingLockPool(FakeLockPool):
    """The fake lock, which leaves every process running, except `stop`: those are stopped while
    locked, as a process whose threads all wait in CUDA calls is by the driver lock."""

    def __init__(self, calls: list[tuple[str, str]], stop: set[int]) -> None:
        super().__init__(calls)
        self.stop = stop

    async def lock_many(self, pids: list[int], timeout: float) -> dict[int, LockResult]:
        out = await super().lock_many(pids, timeout)
        for p, x in out.items():
            if x.ok and p in self.stop:
                os.kill(p, signal.SIGSTOP)
        return out

    async def unlock_many(self, pids: list[int]) -> tuple[float, dict[int, str]]:
        for p in pids:
            if p in self.stop:
                os.kill(p, signal.SIGCONT)
        return await super().unlock_many(pids)


@pytest.fixture
def burners() -> Iterator[list[int]]:
    """BURNERS + 1 processes spinning on a CPU (python: ps names them)."""
    ps = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(BURNERS + 1)]
    yield [p.pid for p in ps]
    for p in ps:
        p.kill()  # SIGKILL ends a stopped process too
        p.wait()


def engine(stop: set[int]) -> Engine:
    e = make_engine(hold_share=0.5, share_window=WINDOW)
    e.pool = StoppingLockPool(e.backend.calls, stop)
    e.regions.hold.pool = e.pool  # type: ignore[assignment]
    return e


async def region(e: Engine, hold_s: float = REGION_S) -> Region:
    """One region of the owner `o`, granted (after any wait for the share), held `hold_s` (its
    owner's work), released; its report is on the region."""
    r, owner = e.enter(e.core.commands["o"], NO_PID)
    await until(lambda: owner.got, f"region {r.id} answered", timeout=60)
    assert owner.kinds() == ["RegionGranted"], owner.kinds()
    await asyncio.sleep(hold_s)
    release(e, r)
    assert r.task is not None
    await asyncio.wait_for(asyncio.shield(r.task), 30)
    return r


async def test_a_locked_sibling_busy_on_its_cpu_is_not_waited_for_one_stopped_by_the_lock_is(
    burners: list[int],
) -> None:
    """Regions back to back hold two GPU siblings by the lock: `busy` spins on its CPU threads all
    the while (the KernelBench jobs on the H100, importing torch and building inputs), `stopped`
    runs no CPU while locked. `stopped` is charged every held second and owed its share: regions
    wait for it (it spins once unlocked, so it is not idle). `busy` used the time it was held and
    is charged next to nothing: no region waits for it. Before, both were charged the wall time
    and every wait was for both."""
    busy, (stopped,) = burners[:BURNERS], burners[BURNERS:]
    e = engine({stopped})
    try:
        e.command("o", [NO_PID])
        e.command("busy", busy, gpu=busy)
        e.command("stopped", [stopped], gpu=[stopped])
        end = time.monotonic() + 4 * WINDOW
        regions = []
        while time.monotonic() < end:
            regions.append(await region(e))
        now = time.monotonic()
        st = {c: e.regions.share.status(c, now) for c in ("busy", "stopped")}
    finally:
        e.regions.close()
    assert all(sorted(r.held.locked_ids) == ["busy", "stopped"] for r in regions), "both locked"
    waited_for = [(r.id, r.report.share_for, r.report.share_idle) for r in regions if r.report.share_for]
    print(f"{len(regions)} regions, waits {waited_for}, status {st}")
    assert not any("busy" in f for _, f, _ in waited_for), f"a region waited for busy: {waited_for}"
    assert any("stopped" in f and "stopped" not in i for _, f, i in waited_for), waited_for
    assert sum(r.report.share_wait_s for r in regions) > WINDOW / 2, "stopped ran its share"
    # what status reports: the charged seconds (held_s) against the wall seconds held (held_wall_s)
    # (stopped runs from its unlock to the span's end at the release's end: a few ms not charged)
    assert st["stopped"]["held_s"] > 0.95 * st["stopped"]["held_wall_s"], st
    assert st["busy"]["held_s"] < 0.5 * st["busy"]["held_wall_s"], st
    assert st["busy"]["held_wall_s"] == pytest.approx(st["stopped"]["held_wall_s"], abs=0.01), st
    assert not st["busy"]["starved"], st


async def test_a_locked_sibling_frozen_late_is_charged_as_frozen_for_the_whole_region(
    burners: list[int],
) -> None:
    """A locked sibling that a region also freezes (a late freeze: its new process opened the GPU)
    is charged the whole span, its CPU time not read; one locked alone in the same region, busy
    alike, is charged the span less its CPU time."""
    a, b = burners[:2]
    e = engine(set())
    try:
        e.command("o", [NO_PID])
        late = e.command("late", [a], gpu=[a])
        e.command("busy", [b], gpu=[b])
        r, owner = e.enter(e.core.commands["o"], NO_PID)
        await until(lambda: owner.got, "granted", timeout=60)
        assert sorted(r.held.locked_ids) == ["busy", "late"], r.held.locked_ids
        assert late.group is not None
        r.held.add_frozen(late.group, "late")  # as Joins._freeze_into records a late freeze
        base = _cpu_s(b)
        await until(lambda: _cpu_s(b) - base > 0.05, "busy ran 50 ms of CPU in the region", timeout=60)
        release(e, r)
        assert r.task is not None
        await asyncio.wait_for(asyncio.shield(r.task), 30)
        now = time.monotonic()
        st = {c: e.regions.share.status(c, now) for c in ("late", "busy")}
    finally:
        e.regions.close()
    assert st["late"]["held_s"] == st["late"]["held_wall_s"] > 0, st
    assert st["busy"]["held_s"] < st["busy"]["held_wall_s"] - 0.02, st


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


async def test_a_sibling_waiting_for_its_own_region_is_charged_only_until_it_asked() -> None:
    """A sibling that asks for a region of its own while another command's region holds it waits
    for that region, not to run (the FIFO gives it its turn; a region's share wait passes it over
    for the same reason): it is charged only the part of the span before its request. Charged the
    whole span, it came out of its own region owed its share: on the H100 (bench/RESULTS.md,
    session 31) two jobs' regions then waited for each other's share in turn."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
    e = engine(set())  # locked, and asleep: no CPU used, the whole span charged before
    try:
        e.command("o", [NO_PID])
        sib = e.command("sib", [sleeper.pid], gpu=[sleeper.pid])
        t_o = time.monotonic()
        r, owner = e.enter(e.core.commands["o"], NO_PID)
        await until(lambda: owner.got, "o's region granted", timeout=60)
        assert r.held.locked_ids == ["sib"], r.held.locked_ids
        t_ask = time.monotonic()
        mine, sib_owner = e.enter(sib, sleeper.pid)
        await until(lambda: time.monotonic() > t_ask + 0.5, "o's region held 0.5 s past the request")
        release(e, r)
        await until(lambda: sib_owner.got, "sib's region granted", timeout=60)
        assert sib_owner.kinds() == ["RegionGranted"], sib_owner.kinds()
        assert not mine.report.share_for, mine.report  # nobody owed: o held by nothing
        release(e, mine)
        for x in (r, mine):
            assert x.task is not None
            await asyncio.wait_for(asyncio.shield(x.task), 30)
        st = e.regions.share.status("sib", time.monotonic())
    finally:
        e.regions.close()
        sleeper.kill()
        sleeper.wait()
    print(f"asked {t_ask - t_o:.3f} s after o's request; status {st}")
    assert st["held_wall_s"] >= 0.5, st
    assert 0 < st["held_s"] <= t_ask - t_o + 0.002, st  # (the 2 ms: perf_counter against monotonic)
    assert not st["starved"], st


async def test_a_region_does_not_wait_for_the_share_of_a_sibling_whose_adopted_program_ended(
    burners: list[int],
) -> None:
    """A sibling owed its share whose adopted program has just ended (its pool worker answered its
    status), none of its processes holding a GPU file, is leaving: what is left of it is its
    interpreter and shell exiting, and the region does not wait for that. On the H100 (session 31)
    such waits lasted until the sibling's command ended, 0.18-0.24 s. The same sibling not leaving
    (its program not ended, or ended over LEAVING_S ago, or another of its programs adopted), or
    with a process holding a GPU file (a program it runs itself), is waited for."""
    busy = burners[0]  # busy on its CPU: never taken for idle
    e = engine(set())
    try:
        e.command("o", [NO_PID])
        sib = e.command("sib", [busy], gpu=[busy])
        gpu = dict(sib.runtimes)  # its runtime, known to hold a GPU file
        waits = {}
        for case, ended_ago, adopters, holds in (
            ("ended", 0.0, set(), False),
            ("not ended", None, set(), False),
            ("ended long ago", LEAVING_S + 0.1, set(), False),
            ("another adopted", 0.0, {busy}, False),
            ("ended, a GPU file held", 0.0, set(), True),
        ):
            now = time.monotonic()
            e.regions.share.forget("sib")
            e.regions.share.end("before", ["sib"], now - 0.9 * WINDOW, now)  # over the share: owed
            sib.adopted_ended_at = 0.0 if ended_ago is None else now - ended_ago
            sib.adopters, sib.runtimes = adopters, dict(gpu) if holds else {}
            r = await region(e, 0.0)
            waits[case] = (r.report.share_for, r.report.share_wait_s)
    finally:
        e.regions.close()
    print(waits)
    assert waits["ended"] == ([], 0.0), waits
    for case in ("not ended", "ended long ago", "another adopted", "ended, a GPU file held"):
        assert waits[case][0] == ["sib"] and waits[case][1] > 0.1, waits
