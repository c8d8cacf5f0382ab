"""The driver lock binding (isolation/cudalock.py) on real processes, through a fake libcuda built
here with the driver's observable semantics (fakecuda.py): open and its reasons, parallel locks that
stop a sibling's CUDA calls while its CPU thread runs on, a timeout, a non-CUDA process, the lock
record, and the sweep that unlocks what a dead daemon left."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from krex_async.isolation import cudalock
from krex_async.isolation.cudalock import LockPool, open_driver, release_left
from krex_async.linux.procfs import stat_fields

from .fakecuda import Fake, build


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Fake:
    return build(tmp_path_factory.mktemp("fakecuda"))


def test_open_driver_says_why_not(fake: Fake, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FAKE_CUDA_DIR", str(fake.state))
    drv, why = open_driver(str(tmp_path / "missing.so"))
    assert drv is None and "cannot load" in why
    drv, why = open_driver(fake.old)
    assert drv is None and "cuCheckpointProcessLock" in why and "predates" in why
    monkeypatch.setenv("FAKE_CUDA_INIT_ERROR", "100")
    drv, why = open_driver(fake.lib)
    assert drv is None and "cuInit(0)" in why and "CUDA_ERROR_NO_DEVICE (100)" in why
    monkeypatch.delenv("FAKE_CUDA_INIT_ERROR")
    drv, why = open_driver(fake.lib)
    assert drv is not None and why == "" and drv.version == 13000


def _spawn(fake: Fake, name: str, mode: str) -> tuple[subprocess.Popen[bytes], int]:
    (fake.state / f"{name}.stats").unlink(missing_ok=True)
    p = subprocess.Popen(fake.argv(name, mode, gpu_file=False), env={**os.environ, **fake.env()})
    deadline = time.monotonic() + 10
    while fake.stats(name)[0] == 0 or (mode == "cuda" and fake.stats(name)[1] == 0):
        assert time.monotonic() < deadline, f"sibling {name} did not start"
        time.sleep(0.01)
    return p, fake.stats(name)[0]


async def test_lock_holds_cuda_calls_not_cpu_and_unlocks(
    fake: Fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_DIR", str(fake.state))
    drv, why = open_driver(fake.lib)
    assert drv is not None, why
    pool = LockPool(drv, str(tmp_path))
    procs = [_spawn(fake, n, m) for n, m in (("a", "cuda"), ("b", "cuda"), ("n", "nocuda"))]
    (pa, a), (pb, b), (pn, n) = procs
    try:
        res = await pool.lock_many([a, b, n], timeout=0.5)
        assert res[a].ok and res[b].ok, res
        assert not res[n].ok and "CUDA_ERROR_INVALID_VALUE" in res[n].error
        rec = json.loads((tmp_path / "locks.json").read_text())
        assert {p for p, _ in rec["locked"]} >= {a, b}, "recorded before it was locked"
        assert drv.state(a) == (0, 1)
        g0, c0 = fake.stats("a")[1:]
        await asyncio.sleep(0.3)
        g1, c1 = fake.stats("a")[1:]
        assert g1 - g0 <= 1, f"{g1 - g0} CUDA calls completed while locked"
        assert c1 - c0 >= 50, f"the CPU thread made {c1 - c0} ticks in 0.3 s while locked"
        dt, errors = await pool.unlock_many([a, b])
        assert errors == {} and dt < 1
        assert drv.state(a) == (0, 0)
        assert json.loads((tmp_path / "locks.json").read_text())["locked"] == []
        await asyncio.sleep(0.2)
        assert fake.stats("a")[1] - g1 > 20, "no CUDA calls after the unlock"
    finally:
        for p, _ in procs:
            p.kill()
            p.wait()
        pool.close()


async def test_lock_times_out_on_a_call_in_flight(
    fake: Fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_DIR", str(fake.state))
    drv, _ = open_driver(fake.lib)
    assert drv is not None
    pool = LockPool(drv, str(tmp_path))
    p, pid = _spawn(fake, "slow", "slow")
    try:
        await asyncio.sleep(0.1)  # inside its 3 s call
        t0 = time.monotonic()
        res = await pool.lock_many([pid], timeout=0.05)
        assert time.monotonic() - t0 < 0.3
        assert not res[pid].ok and res[pid].not_ready and "CUDA_ERROR_NOT_READY" in res[pid].error
        assert res[pid].state == "running", res[pid]  # GetState: it has a context, it is in a call
        assert drv.state(pid) == (0, 0), "a lock that timed out leaves the process running"
    finally:
        p.kill()
        p.wait()
        pool.close()


async def test_locked_process_still_dies(fake: Fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_DIR", str(fake.state))
    drv, _ = open_driver(fake.lib)
    assert drv is not None
    pool = LockPool(drv, str(tmp_path))
    p, pid = _spawn(fake, "k", "cuda")
    try:
        assert (await pool.lock_many([pid], 0.5))[pid].ok
        p.terminate()
        assert p.wait(2) == -15
        _, errors = await pool.unlock_many([pid])
        assert pid in errors, "unlocking a dead process is refused, not raised"
        assert json.loads((tmp_path / "locks.json").read_text())["locked"] == []  # gone: forgotten
    finally:
        if p.poll() is None:
            p.kill()
        pool.close()


async def test_an_unlock_the_driver_does_not_answer_is_bounded_and_stays_recorded(
    fake: Fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release must not wait on the driver for ever: an unlock with no answer in its bound is
    reported, and the pid stays in the lock record (the sweep would unlock it should the daemon
    die) until the late unlock takes; the other pids are unlocked and forgotten meanwhile."""
    monkeypatch.setenv("FAKE_CUDA_DIR", str(fake.state))
    monkeypatch.setattr(cudalock, "UNLOCK_BOUND_S", 0.3)
    drv, _ = open_driver(fake.lib)
    assert drv is not None
    procs = [_spawn(fake, n, "cuda") for n in ("u1", "u2")]
    (_, slow), (_, quick) = procs

    class SlowUnlock:  # the driver, but its unlock of `slow` takes 1.5 s
        def __getattr__(self, name: str) -> object:
            return getattr(drv, name)

        def unlock(self, pid: int) -> int:
            if pid == slow:
                time.sleep(1.5)
            return drv.unlock(pid)

    pool = LockPool(SlowUnlock(), str(tmp_path))  # type: ignore[arg-type]
    try:
        res = await pool.lock_many([slow, quick], timeout=0.5)
        assert res[slow].ok and res[quick].ok, res
        t0 = time.monotonic()
        dt, errors = await pool.unlock_many([slow, quick])
        assert time.monotonic() - t0 < 1.0 and list(errors) == [slow], errors
        assert "no answer from the driver" in errors[slow]
        recorded = {p for p, _ in json.loads((tmp_path / "locks.json").read_text())["locked"]}
        assert recorded == {slow}, recorded
        assert drv.state(quick) == (0, 0)
        await asyncio.sleep(1.5)  # the late unlock lands
        assert drv.state(slow) == (0, 0) and slow not in pool.record.held
    finally:
        for p, _ in procs:
            p.kill()
            p.wait()
        pool.close()


def test_release_left_unlocks_only_recorded_live_processes(
    fake: Fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_DIR", str(fake.state))
    monkeypatch.setenv("KREX_LIBCUDA", fake.lib)  # the sweep opens its own library, not the record's
    drv, _ = open_driver(fake.lib)
    assert drv is not None
    procs = [_spawn(fake, n, "cuda") for n in ("r1", "r2")]
    (p1, a), (p2, b) = procs
    try:
        for pid in (a, b):
            assert drv.lock(pid, 500) == 0
        st = {pid: int(stat_fields(pid)[19]) for pid in (a, b)}  # type: ignore[index]
        # b's entry carries another start time: a reused pid, which must not be touched
        (tmp_path / "locks.json").write_text(
            json.dumps(
                {
                    "version": 1,
                    "pid": 1,
                    "library": fake.lib,
                    "locked": [[a, st[a]], [b, st[b] + 1], [999999999, 1]],
                }
            )
        )
        lines = release_left(str(tmp_path))
        assert f"unlocked pid {a}" in lines, lines
        assert drv.state(a) == (0, 0) and drv.state(b) == (0, 1)
        assert json.loads((tmp_path / "locks.json").read_text())["locked"] == []
        assert release_left(str(tmp_path)) == []
        (tmp_path / "locks.json").write_text("{not json")
        assert "unreadable" in release_left(str(tmp_path))[0]
    finally:
        drv.unlock(b)
        for p, _ in procs:
            p.kill()
            p.wait()


def test_doctor_says_whether_the_driver_lock_serves(
    fake: Fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from krex_async.ops.doctor_kernel import check_driver_lock

    monkeypatch.setenv("FAKE_CUDA_DIR", str(fake.state))
    monkeypatch.setenv("KREX_LIBCUDA", fake.lib)
    c = check_driver_lock()
    assert c.verdict == "ok" and "driver API 13000" in c.detail, c
    monkeypatch.setenv("KREX_LIBCUDA", fake.old)
    c = check_driver_lock()
    assert c.verdict == "warn" and "predates" in c.detail and "update the NVIDIA driver" in c.fix
    monkeypatch.setenv("KREX_LIBCUDA", str(tmp_path / "nowhere.so"))
    c = check_driver_lock()
    assert c.verdict == "warn" and "cannot load" in c.detail and "none needed" in c.fix


@pytest.mark.parametrize(
    "mode,freeze,lock,vendor,probes,how,who",
    [
        ("auto", "auto", True, "nvidia", True, "lock", "device-holders"),
        ("auto", "auto", True, "nvidia", False, "lock", "all"),  # no probes: nobody sees a late open
        ("auto", "auto", False, "nvidia", True, "freeze", "all"),  # no driver lock: as before
        ("auto", "auto", True, "amd", True, "freeze", "all"),
        ("freeze", "auto", True, "nvidia", True, "freeze", "all"),
        ("lock", "all", True, "nvidia", True, "lock", "all"),
        ("freeze", "device-holders", False, "nvidia", False, "freeze", "device-holders"),
    ],
)
def test_hold_chooses_how_and_whom(
    fake: Fake,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    freeze: str,
    lock: bool,
    vendor: str,
    probes: bool,
    how: str,
    who: str,
) -> None:
    from krex_async.daemon.regions.policy import HoldPolicy

    monkeypatch.setenv("FAKE_CUDA_DIR", str(fake.state))
    h = HoldPolicy(
        mode, freeze, str(tmp_path), 0.005, opener=lambda: open_driver(fake.lib if lock else fake.old)
    )
    try:
        assert h.how(vendor)[0] == how
        assert h.who(vendor, probes) == who
        plan = h.plan(vendor, {"a": [11], "b": []})
        assert plan.to_lock == ({"a": [11]} if how == "lock" else {})
        assert plan.to_freeze == (["b"] if how == "lock" else ["a", "b"])
        if how == "freeze" and mode != "freeze":
            assert plan.why, "a lock asked for and not used says why"
        st = h.status()
        assert st["mode"] == mode and st["lock_available"] == (lock and mode != "freeze")
    finally:
        h.close()


async def test_an_unwritable_record_on_the_wait_leaves_nothing_locked_unknown(
    fake: Fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock step's second call (the wait for a sibling inside a CUDA call) cannot record its
    intent (a full disk): the sibling locked by the first call is still in the region's
    locked_pids (so the release unlocks it), the busy one is frozen instead, saying why."""
    from types import SimpleNamespace

    from krex_async import protocol as P
    from krex_async.daemon.model.holdset import HoldSet
    from krex_async.daemon.regions.policy import HoldPolicy

    monkeypatch.setenv("FAKE_CUDA_DIR", str(fake.state))
    h = HoldPolicy("lock", "all", str(tmp_path), 0.05, 0.5, opener=lambda: open_driver(fake.lib))
    assert h.pool is not None
    p1, quick = _spawn(fake, "quick", "cuda")
    p2, busy = _spawn(fake, "busy", "slow")
    deadline = time.monotonic() + 10
    while fake.lock_state(busy) is None:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # inside its 3 s call
    add = h.pool.record.add
    calls = []

    def add_once(pids):  # type: ignore[no-untyped-def]
        calls.append(list(pids))
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return add(pids)

    monkeypatch.setattr(h.pool.record, "add", add_once)
    r = HoldSet("x.1", P.RegionReport(region="x.1", name="t", device="nvidia0", pid=1, policy="region"))
    a, b = SimpleNamespace(id="a"), SimpleNamespace(id="b")
    try:
        fallback = await r.lock(h.pool, h.timeout, h.wait, [a, b], {"a": [quick], "b": [busy]})  # type: ignore[list-item]
        assert [c.id for c in fallback] == ["b"]
        assert r.locked_pids == [quick] and fake.lock_state(quick) == 1
        assert r.locked_ids == ["a"] and fake.lock_state(busy) == 0
        assert "lock record unwritable" in r.report.hold_fallback["b"], r.report.hold_fallback
        assert r.report.lock_late[0].outcome == "frozen", r.report.lock_late
    finally:
        await h.pool.unlock_many([quick])
        h.close()
        for p in (p1, p2):
            p.kill()
            p.wait()
