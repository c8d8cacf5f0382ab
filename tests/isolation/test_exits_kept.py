"""daemon/regions/exits.py: an exit a region froze is still an exit at the next region, however many
regions it has been frozen through (under --exit-wait 0 an exit runs only between regions), and
one begun over --exit-starve ago is waited for instead of frozen again."""

from __future__ import annotations

import asyncio
import subprocess
import time
from types import SimpleNamespace
from typing import Any

from krex_async.daemon.model.core import Exiting
from krex_async.daemon.regions import exits as E
from krex_async.isolation.cudalock import start_time


def test_an_exit_frozen_through_regions_is_kept_past_its_first_notes_age() -> None:
    proc = subprocess.Popen(["sleep", "30"])  # a live process stands in for one exiting
    try:
        ex = E.Exits(SimpleNamespace())  # type: ignore[arg-type]
        old = time.monotonic() - E.EXITING_KEPT_S + 0.5  # first noted just under the limit ago
        r: Any = SimpleNamespace(exits_left={proc.pid: Exiting("nvidia0", old, start_time(proc.pid), old)})
        ex.give_back(r)  # a region froze it and ends: the exit is renewed, not left to age out
        assert r.exits_left == {} and ex.exiting[proc.pid].began == old  # when it began is kept
        time.sleep(1.0)
        assert ex.still_exiting(proc.pid, ex.exiting[proc.pid], time.monotonic())
        reused: Any = SimpleNamespace(exits_left={proc.pid: Exiting("nvidia0", old, 12345, old)})
        ex2 = E.Exits(SimpleNamespace())  # type: ignore[arg-type]
        ex2.give_back(reused)  # another process under that pid: not an exit
        assert proc.pid not in ex2.exiting
    finally:
        proc.kill()
        proc.wait()


def _region() -> Any:
    from krex_async.protocol import RegionReport

    return SimpleNamespace(
        device="nvidia0", report=RegionReport("r", "t", "nvidia0", 1, "region"), exits_left={}
    )


async def test_an_exit_begun_over_exit_starve_ago_is_waited_for_not_frozen_again() -> None:
    # --exit-kernel-wait bounds the wait for a starved exit, not --lock-wait (short, for entry latency)
    config = SimpleNamespace(exit_wait=0.0, lock_wait=0.05, exit_kernel_wait=0.5, exit_starve=2.0)
    ex = E.Exits(SimpleNamespace(config=config))  # type: ignore[arg-type]
    young = subprocess.Popen(["sleep", "30"])  # exiting in user space, noted just now
    starved = subprocess.Popen(["sleep", "30"])  # noted 3 s ago; ends 0.2 s into the wait (below)
    stuck = subprocess.Popen(["sleep", "30"])  # noted 3 s ago; never ends in time
    try:
        for p in (young, starved, stuck):
            ex.note_exiting(p.pid, "nvidia0")
        for p in (starved, stuck):
            ex.exiting[p.pid] = ex.exiting[p.pid]._replace(began=time.monotonic() - 3.0)
        r = _region()
        t0 = time.monotonic()
        # killed once the wait began: a loaded host may take longer than any fixed lifetime to get
        # there, and an exit already over is simply waited for (done), never starved
        asyncio.get_running_loop().call_later(0.2, starved.kill)
        await ex.wait(r, ex.take(r))
        took = time.monotonic() - t0
        rep = r.report
        assert sorted(rep.exits_starved) == sorted([starved.pid, stuck.pid])
        assert rep.exits_waited == [starved.pid]  # waited for, as one in the kernel would be
        assert sorted(rep.exits_unfinished) == sorted([young.pid, stuck.pid])  # frozen for the region
        assert 0.45 <= took < 1.5, (
            took
        )  # up to --exit-kernel-wait for the stuck one; the young one not at all
        ex.give_back(r)
        assert set(ex.exiting) == {young.pid, stuck.pid}
        config.exit_starve = 600.0  # the bound off in practice: every exit in user space frozen at once
        r = _region()
        t0 = time.monotonic()
        await ex.wait(r, ex.take(r))
        assert r.report.exits_starved == [] and time.monotonic() - t0 < 0.2
        assert sorted(r.report.exits_unfinished) == sorted([young.pid, stuck.pid])
    finally:
        for p in (young, starved, stuck):
            p.kill()
            p.wait()


def test_a_bad_exit_starve_is_refused_naming_it() -> None:
    import msgspec

    from krex_async.daemon.config import ServeConfig

    assert ServeConfig().exit_starve == 2.0
    try:
        msgspec.convert({"exit_starve": -1}, ServeConfig)
    except msgspec.ValidationError as e:
        assert "exit_starve" in str(e)
    else:
        raise AssertionError("a negative exit_starve was taken")
