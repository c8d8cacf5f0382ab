"""Warm pool workers under a region's hold (--hold lock, --freeze auto, probes on): a worker outside
any command (idle, warming, retiring) with a GPU context is locked into the region like a sibling,
an interpreter a worker adopts mid-region starts no GPU work until the region ends, and a region
owner that is an adopted worker is not its own region's stray.

The workers get a "GPU" through --pool-init: a module that, in the worker's own mount namespace,
opens a stand-in /dev/nvidia0 and creates a context through the fake libcuda (fakecuda.py)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from krex_async import Client

from ..conftest import PY, py_env, run_daemon, until, v2_mount
from .fakecuda import Fake, build
from .test_hold_lock import OWNER, SLOW, granted

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or v2_mount() is None,
        reason="needs root and cgroup v2: adoption joins a worker to a command's "
        "cgroup, and the workers' stand-in GPU file needs a mount namespace",
    ),
    pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc missing: no fake libcuda"),
]

# Imported by each worker once warm (--pool-init): a stand-in GPU file and a fake context.
GPU_INIT = """
import ctypes, os
_libc = ctypes.CDLL(None, use_errno=True)
assert _libc.unshare(0x00020000) == 0, ctypes.get_errno()  # CLONE_NEWNS
assert _libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) == 0  # MS_REC | MS_PRIVATE
assert _libc.mount(b"krex-fake", b"/dev", b"tmpfs", 0, None) == 0
for _name, _minor in (("null", 3), ("zero", 5), ("random", 8), ("urandom", 9)):
    os.mknod(f"/dev/{_name}", 0o20666, os.makedev(1, _minor))
    os.chmod(f"/dev/{_name}", 0o666)
open("/dev/nvidia0", "w").close()
GPU = os.open("/dev/nvidia0", os.O_RDONLY)
_lib = ctypes.CDLL(os.environ["KREX_LIBCUDA"])
_ctx = ctypes.c_void_p()
assert _lib.cuInit(0) == 0 and _lib.cuCtxCreate_v2(ctypes.byref(_ctx), 0, 0) == 0
"""

# The job a worker adopts: writes its pid, then counts completed CUDA calls into argv[1].
JOB = """
import ctypes, os, sys, time
lib = ctypes.CDLL(os.environ["KREX_LIBCUDA"])
out = sys.argv[1]
n = 0
open(out, "w").write(f"{os.getpid()} 0")
while True:
    lib.cuLaunchKernel(None)
    n += 1
    open(out + ".tmp", "w").write(f"{os.getpid()} {n}")
    os.replace(out + ".tmp", out)
    time.sleep(0.002)
"""

# A region owner adopted by a worker: ioctls on the worker's GPU file inside its own region.
OWNER_IOCTL = """
import fcntl, sys, time, msgspec, krex_gpuinit
from krex_async import region
with region("timing") as r:
    for _ in range(20):
        try:
            fcntl.ioctl(krex_gpuinit.GPU, 0x5401)
        except OSError:
            pass
        time.sleep(0.005)
sys.stdout.write(msgspec.json.encode(r.report).decode())
"""


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Fake:
    return build(tmp_path_factory.mktemp("fakecuda"))


def env(fake: Fake, mods: Path) -> dict[str, str]:
    base = py_env(**fake.env())
    base["PYTHONPATH"] = f"{base['PYTHONPATH']}{os.pathsep}{mods}"
    return base


def pool_daemon(fake: Fake, mods: Path, *extra: str, init: str = GPU_INIT, **fake_env: str) -> Any:
    (mods / "krex_gpuinit.py").write_text(init)
    return run_daemon(
        *SLOW,
        "--hold",
        "lock",
        "--freeze",
        "auto",
        "--probes",
        "ioctl",
        "--isolation",
        "cgroup",
        "--pool-size",
        "1",
        "--pool-preload",
        "colorsys",
        "--pool-init",
        "krex_gpuinit",
        *extra,
        env={**env(fake, mods), **fake_env},
    )


async def warm(c: Client, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        st = (await c.status())["pools"]["cpu"]
        if st["warm"] >= 1:
            return [w["pid"] for w in st["workers"] if w["state"] == "warm"]
        assert time.monotonic() < deadline, st
        await asyncio.sleep(0.05)


def _probes_or_skip() -> None:
    from krex_async.probes import bcc_works

    ok, why = bcc_works()
    if not ok:
        pytest.skip(f"bcc unavailable: {why} (--freeze auto holds GPU holders only with probes)")


def _plain_owner(
    c: Client, owner: str, marker: Path, hold_s: str, env: dict[str, str]
) -> asyncio.Future[Any]:
    """The region's owner, run plainly (a start-up variable the warm workers lack), so that the
    worker stays idle for the region to lock; writes `marker` once granted, holds `hold_s`."""
    return asyncio.ensure_future(c.run([PY, owner, str(marker), hold_s], env={**env, "PYTHONHASHSEED": "7"}))


def _count(path: Path) -> tuple[int, int]:
    try:
        pid, n = path.read_text().split()
    except (FileNotFoundError, ValueError):
        return 0, 0
    return int(pid), int(n)


async def test_idle_worker_is_locked_and_a_job_it_adopts_mid_region_waits(
    fake: Fake, script, tmp_path: Path
) -> None:
    """The idle warm worker (a context, in no command) is locked at region entry; a job adopted
    by it during the region starts at once (no wait for the region, no deadlock) and runs its
    Python, but no CUDA call of it completes until the region ends; then it runs on."""
    _probes_or_skip()
    mods = tmp_path / "mods"
    mods.mkdir()
    job = script("job.py", JOB)
    counts = tmp_path / "counts"
    marker = tmp_path / "granted"
    async with pool_daemon(fake, mods) as d:
        async with await d.client() as c:
            [worker] = await warm(c)
            run = _plain_owner(c, script("owner.py", OWNER), marker, "1.5", env(fake, mods))
            await granted(marker)
            assert fake.lock_state(worker) == 1, "the idle pool worker was not locked"
            hj = await c.submit(["/bin/sh", "-c", f"{PY} {job} {counts}"], env=env(fake, mods))
            await until(lambda: _count(counts)[0] != 0, "the adopted job did not start in the region", 10)
            assert _count(counts)[0] == worker, "not adopted by the warm worker"
            await asyncio.sleep(0.3)
            assert not run.done()
            assert _count(counts)[1] == 0, "the adopted job's CUDA calls ran during the region"
            res = await run
            await until(lambda: _count(counts)[1] != 0, "the adopted job did not run after the region", 5)
            assert fake.lock_state(worker) == 0
            await hj.cancel(9)
    rep = json.loads(res.stdout)
    assert rep["pool_locked"] == [worker] and worker in rep["locked_pids"], rep
    assert "pool_unheld" not in rep


@pytest.mark.parametrize("via", ["adopted", "launched"])
async def test_a_command_held_through_its_locked_worker_is_held_once_for_cancel_status_and_report(
    fake: Fake, script, tmp_path: Path, via: str
) -> None:
    """A job adopted mid-region by the idle worker the region locked (or launched in it, python
    being the command's own argv) is held through that worker alone (no freeze, no GPU file of
    its own when the region began): the region counts it locked, once, in `krex status` and in
    its report, and a Ctrl-C of it ends it at once by SIGKILL, as any held command, instead of a
    SIGINT its blocked CUDA call would hold until the release."""
    _probes_or_skip()
    mods = tmp_path / "mods"
    mods.mkdir()
    job = script("job.py", JOB)
    counts = tmp_path / "counts"
    marker = tmp_path / "granted"
    async with pool_daemon(fake, mods) as d:
        async with await d.client() as c:
            [worker] = await warm(c)
            run = _plain_owner(c, script("owner.py", OWNER), marker, "6", env(fake, mods))
            await granted(marker)
            argv = ["/bin/sh", "-c", f"{PY} {job} {counts}"] if via == "adopted" else [PY, job, str(counts)]
            hj = await c.submit(argv, env=env(fake, mods))
            await until(
                lambda: _count(counts)[0] == worker, f"the job was not {via} by the locked worker", 10
            )
            st = await c.status()
            assert st["devices"][0]["region"]["locked"] == [hj.command], st["devices"][0]["region"]
            [mine] = [x for x in st["commands"] if x["command"] == hj.command]
            assert mine["held"] == "locked" and not mine["frozen"], mine
            t0 = time.monotonic()
            await hj.cancel(2)  # SIGINT, as `krex run` passes a Ctrl-C on
            end = await asyncio.wait_for(hj.wait(), 10)
            took = time.monotonic() - t0
            assert took < 3 and end.report.signal == 9, (took, end.report)
            assert not run.done(), "the region ended first: nothing was shown"
            assert "locked by region 'timing'" in end.report.error, end.report.error
            res = await run
    rep = json.loads(res.stdout)
    assert rep["locked"] == [hj.command] and rep["held_exited"] == [hj.command], rep
    assert rep["pool_locked"] == [worker], rep


async def test_adopted_owner_is_not_its_own_stray(fake: Fake, script, tmp_path: Path) -> None:
    """A region owner run by a pool worker (its parent the daemon, moved to its group's keep/ leaf
    for the region cores) touching its GPU file is the owner, not a stray of its own region."""
    _probes_or_skip()
    mods = tmp_path / "mods"
    mods.mkdir()
    owner = script("owner_ioctl.py", OWNER_IOCTL)
    async with pool_daemon(fake, mods, "--region-cores", "1") as d:
        async with await d.client() as c:
            [worker] = await warm(c)
            await asyncio.sleep(0.3)  # the probes have seen its GPU file
            res = await c.run(["/bin/sh", "-c", f"{PY} {owner}"], env=env(fake, mods))
    assert res.returncode == 0, res.stderr
    assert res.report.pool_adopted == 1, res.report
    rep = json.loads(res.stdout)
    assert rep["pid"] == worker, rep
    assert worker not in rep.get("stray_pids", []), rep


async def test_adoption_while_a_worker_is_unheld_freezes_the_adopting_command(
    fake: Fake, script, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle worker the region could not lock (here: someone else holds its lock) is named in
    pool_unheld, and a command adopting it mid-region is frozen into the region first (under
    --freeze auto, as under device-holders): its program starts only after the region."""
    import ctypes

    _probes_or_skip()
    mods = tmp_path / "mods"
    mods.mkdir()
    job = script("job.py", JOB)
    counts = tmp_path / "counts"
    marker = tmp_path / "granted"
    monkeypatch.setenv("FAKE_CUDA_DIR", str(fake.state))  # where the fake keeps lock states
    lib = ctypes.CDLL(fake.lib)
    async with pool_daemon(fake, mods) as d:
        async with await d.client() as c:
            [worker] = await warm(c)
            args = (ctypes.c_uint64 * 8)()
            assert lib.cuCheckpointProcessLock(worker, ctypes.byref(args)) == 0
            try:
                run = asyncio.ensure_future(
                    c.run(
                        [PY, script("owner.py", OWNER), str(marker), "1.0"],
                        env={**env(fake, mods), "PYTHONHASHSEED": "7"},
                    )
                )
                await granted(marker)
                hj = await c.submit(["/bin/sh", "-c", f"{PY} {job} {counts}"], env=env(fake, mods))
                await asyncio.sleep(0.5)
                assert _count(counts)[0] == 0, "the adopted job ran during the region"
                res = await run
            finally:
                lib.cuCheckpointProcessUnlock(worker, None)
            deadline = time.monotonic() + 5
            while _count(counts)[1] == 0:
                assert time.monotonic() < deadline, "the adopted job did not run after the region"
                await asyncio.sleep(0.01)
            assert _count(counts)[0] == worker
            await hj.cancel(9)
    rep = json.loads(res.stdout)
    assert "CUDA_ERROR_ILLEGAL_STATE" in rep["pool_unheld"][str(worker)], rep
    assert hj.command in rep["frozen"], rep


async def test_region_during_a_workers_context_creation_waits_for_it_then_locks_it(
    fake: Fake, script, tmp_path: Path
) -> None:
    """A region that begins while a pool worker creates its context (here 2 s, and a CUDA call
    after it, as torch makes) does not lock that worker mid-creation: it waits for the creation
    (pool_wait_s) and then locks the warm worker. Locked mid-creation, the worker's next CUDA call
    blocked the creation the region waited for: every entry took 60 s on the H200."""
    _probes_or_skip()
    mods = tmp_path / "mods"
    mods.mkdir()
    marker = tmp_path / "granted"
    init = GPU_INIT + "_lib.cuLaunchKernel(None)  # a call after the creation, as torch's init\n"
    # --lock-wait 5 covers the creation: a lock asked for mid-creation lands as it ends
    async with pool_daemon(fake, mods, "--lock-wait", "5", init=init, FAKE_CUDA_CTX_MS="2000") as d:
        async with await d.client() as c:
            deadline = time.monotonic() + 30
            worker = 0
            while not worker:  # the worker has opened its GPU file: its creation is in flight
                for w in (await c.status())["pools"]["cpu"]["workers"]:
                    if w["state"] == "starting" and "/dev/nvidia0" in _fd_targets(w["pid"]):
                        worker = w["pid"]
                assert time.monotonic() < deadline, "the worker did not start creating its context"
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            res = await asyncio.wait_for(
                c.run(
                    [PY, script("owner.py", OWNER), str(marker), "0.3"],
                    env={**env(fake, mods), "PYTHONHASHSEED": "7"},
                ),
                timeout=30,
            )
            assert time.monotonic() - t0 < 15, "the region waited for a creation it had blocked"
            assert fake.lock_state(worker) == 0  # unlocked at the release
            assert (await c.status())["pools"]["cpu"]["warm"] == 1
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["pool_wait_s"] > 0.2, rep  # it waited for the creation in flight
    assert rep["pool_locked"] == [worker] and worker in rep["locked_pids"], rep
    assert "pool_unheld" not in rep, rep


async def test_an_owner_gone_while_its_entry_waits_for_a_creation_frees_the_device_at_once(
    fake: Fake, script, tmp_path: Path
) -> None:
    """The entry waits for a worker's context creation in flight (up to 60 s); an owner killed
    meanwhile must not keep the device held for the rest of it."""
    _probes_or_skip()
    mods = tmp_path / "mods"
    mods.mkdir()
    async with pool_daemon(fake, mods, "--lock-wait", "5", FAKE_CUDA_CTX_MS="20000") as d:
        async with await d.client() as c:
            deadline = time.monotonic() + 30
            while not any(
                w["state"] == "starting" and "/dev/nvidia0" in _fd_targets(w["pid"])
                for w in (await c.status())["pools"]["cpu"]["workers"]
            ):
                assert time.monotonic() < deadline, "the worker did not start creating its context"
                await asyncio.sleep(0.02)
            h = await c.submit(
                [PY, script("owner.py", OWNER), str(tmp_path / "granted"), "0.3"], env=env(fake, mods)
            )
            while (await c.status())["devices"][0]["region"] is None:  # its entry has begun
                assert time.monotonic() < deadline, "the region was not asked for"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            await h.cancel(9)
            t0 = time.monotonic()
            while (await c.status())["devices"][0]["region"] is not None:
                assert time.monotonic() - t0 < 5, "the device stayed held for an owner that is gone"
                await asyncio.sleep(0.05)
            assert (await h.wait()).report.state == "cancelled"


def _fd_targets(pid: int) -> list[str]:
    out = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
    except OSError:
        pass
    return out
