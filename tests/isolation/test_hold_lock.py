"""Regions that hold siblings through the driver lock (--hold lock), through a real daemon with the
cgroup backend and the fake libcuda (fakecuda.py) loaded by the daemon through KREX_LIBCUDA.

Siblings: `cuda` holds a GPU device file and a context (locked: its CUDA calls stop, its CPU thread
runs on), `vk` holds a GPU device file but no context (a Vulkan or raw-ioctl user: frozen, with the
reason), `cpu` holds neither (left running, fenced). Crash safety: the watchdog, the next daemon's
start-up and `krex cleanup` unlock what a SIGKILLed daemon locked."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from krex_async import Client

from ..conftest import PY, is_frozen, proc_state, py_env, run_daemon, until
from .fakecuda import Fake, build

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0,
        reason="needs root: cgroups, and a mount namespace for the sibling's stand-in GPU device file",
    ),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare (util-linux) missing"),
]

# Takes a region, writes the time of the grant to argv[1], holds it argv[2] s, prints the report.
# With argv[3], it asks for the region only once that file exists (saying it is ready in argv[3].owner).
OWNER = """
import os, sys, time, msgspec
from krex_async import region
if len(sys.argv) > 3:
    open(sys.argv[3] + ".owner", "w").close()
    while not os.path.exists(sys.argv[3]):
        time.sleep(0.002)
with region("timing") as r:
    open(sys.argv[1], "w").write(str(time.time()))
    time.sleep(float(sys.argv[2]))
sys.stdout.write(msgspec.json.encode(r.report).decode())
"""


# The tests that expect a lock give it time: on a loaded 2-core VM the fake's lock thread may wait
# to be scheduled longer than the default bound (5 ms), and a freeze would be a right answer there.
SLOW = ("--lock-timeout", "0.5")


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Fake:
    return build(tmp_path_factory.mktemp("fakecuda"))


def daemon_env(fake: Fake, **extra: str) -> dict[str, str]:
    return py_env(**fake.env(**extra))


async def start(
    c: Client, fake: Fake, name: str, mode: str = "cuda", gpu_file: bool = True, *extra: str, **kw: Any
) -> tuple[Any, int]:
    (fake.state / f"{name}.stats").unlink(missing_ok=True)
    h = await c.submit(fake.argv(name, mode, gpu_file, *extra), env=daemon_env(fake), **kw)
    deadline = time.monotonic() + 15
    while fake.stats(name)[0] == 0 or (mode == "cuda" and fake.stats(name)[1] == 0):
        assert time.monotonic() < deadline, f"sibling {name} did not start"
        await asyncio.sleep(0.01)
    return h, fake.stats(name)[0]


async def granted(marker: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline, "the region was not granted"
        await asyncio.sleep(0.01)


async def test_lock_holds_cuda_siblings_freezes_the_rest(fake: Fake, script, tmp_path: Path) -> None:
    owner = script("owner.py", OWNER)
    marker = tmp_path / "granted"
    async with run_daemon(
        "--hold", "lock", "--freeze", "all", "--lock-timeout", "0.2", env=daemon_env(fake)
    ) as d:
        async with await d.client() as c:
            st = await c.status()
            assert st["hold"]["mode"] == "lock" and st["hold"]["lock_available"], st["hold"]
            hc, cuda = await start(c, fake, "cuda")
            hv, vk = await start(c, fake, "vk", "nocuda")
            hp, cpu = await start(c, fake, "cpu", "nocuda", gpu_file=False)
            run = asyncio.ensure_future(c.run([PY, owner, str(marker), "1.0"], env=py_env()))
            await granted(marker)
            await asyncio.sleep(0.05)
            assert fake.lock_state(cuda) == 1
            assert not is_frozen(cuda) and is_frozen(vk) and is_frozen(cpu)
            g0, c0 = fake.stats("cuda")[1:]
            await asyncio.sleep(0.4)
            g1, c1 = fake.stats("cuda")[1:]
            assert g1 - g0 <= 1, f"{g1 - g0} CUDA calls completed during the region"
            assert c1 - c0 >= 40, f"the locked sibling's CPU thread made only {c1 - c0} ticks"
            res = await run
            assert res.returncode == 0, res.stderr
            rep = json.loads(res.stdout)
            await asyncio.sleep(0.2)
            assert fake.lock_state(cuda) == 0 and not is_frozen(vk) and not is_frozen(cpu)
            assert fake.stats("cuda")[1] > g1, "no CUDA calls after the release"
            for h in (hc, hv, hp):
                await h.cancel(9)
    ids = {hc.command: "cuda", hv.command: "vk", hp.command: "cpu"}
    assert rep["hold"] == "lock"
    assert [ids[x] for x in rep["locked"]] == ["cuda"] and rep["locked_pids"] == [cuda]
    assert sorted(ids[x] for x in rep["frozen"]) == ["cpu", "vk"]
    assert [ids[x] for x in rep["hold_fallback"]] == ["vk"]
    assert "holds a GPU device file but was not locked" in rep["hold_fallback"][hv.command]
    assert "CUDA_ERROR_INVALID_VALUE" in rep["hold_fallback"][hv.command]
    assert 0 < rep["lock_s"] < 0.5 and 0 < rep["lock_max_s"] <= rep["lock_s"] + 0.01
    assert rep["unlock_s"] > 0


async def test_device_holders_lock_fences_the_others(fake: Fake, script, tmp_path: Path) -> None:
    owner = script("owner.py", OWNER)
    marker = tmp_path / "granted"
    async with run_daemon(
        *SLOW, "--hold", "lock", "--freeze", "device-holders", "--region-cores", "1", env=daemon_env(fake)
    ) as d:
        async with await d.client() as c:
            hc, cuda = await start(c, fake, "cuda")
            hp, cpu = await start(c, fake, "cpu", "nocuda", gpu_file=False)
            run = asyncio.ensure_future(c.run([PY, owner, str(marker), "2.0"], env=py_env()))
            await granted(marker)
            await asyncio.sleep(0.05)
            aff = os.sched_getaffinity(cpu)
            st = await c.status()
            region = st["devices"][0]["region"]
            assert st["hold"]["devices"]["cpu"] == {"hold": "lock", "why": "", "freeze": "device-holders"}
            text = subprocess.run(
                [sys.executable, "-m", "krex_async", "status", "--socket", d.socket],
                capture_output=True,
                text=True,
                env=py_env(),
            ).stdout
            assert "hold lock: driver lock available (cuCheckpointProcessLock" in text, text
            assert "  cpu: lock device-holders" in text, text
            assert "exits: one in user space frozen at once" in text and st["hold"]["exit_wait_s"] == 0, text
            assert "one begun over 2 s ago waited for (--exit-starve)" in " ".join(text.split()), text
            c0 = fake.stats("cpu")[2]
            await asyncio.sleep(0.3)
            assert fake.stats("cpu")[2] - c0 >= 30, "the CPU-only sibling did not run on"
            res = await run
            for h in (hc, hp):
                await h.cancel(9)
    rep = json.loads(res.stdout)
    assert region["locked"] == [hc.command]
    assert rep["locked"] == [hc.command] and rep.get("frozen", []) == []
    assert rep["fenced"] == [hp.command]
    assert not aff & set(rep["cores"]), f"the fenced sibling ran on the region cores {aff}"


async def test_lock_timeout_falls_back_to_freeze(fake: Fake, script, tmp_path: Path) -> None:
    owner = script("owner.py", OWNER)
    marker = tmp_path / "granted"
    async with run_daemon("--hold", "lock", "--lock-timeout", "0.03", env=daemon_env(fake)) as d:
        async with await d.client() as c:
            hs, slow = await start(c, fake, "slow", "slow")
            await asyncio.sleep(0.1)  # inside its 3 s CUDA call
            res = await c.run([PY, owner, str(marker), "0.1"], env=py_env())
            await hs.cancel(9)
    rep = json.loads(res.stdout)
    assert rep["frozen"] == [hs.command] and rep.get("locked", []) == []
    assert "inside a CUDA call for over --lock-wait 0.05s" in rep["hold_fallback"][hs.command], rep
    [entry] = rep["lock_late"]
    assert entry["pid"] == slow and entry["outcome"] == "frozen" and entry["state"] == "running", entry
    assert 0.05 <= entry["after_s"] < 1.0, entry  # it was waited for, --lock-wait (default 0.05 s)
    assert 0.05 <= rep["enter_s"] < 1.5, rep


@pytest.mark.parametrize("hold", ["lock", "auto"])
async def test_no_driver_lock(fake: Fake, script, tmp_path: Path, hold: str) -> None:
    """Without the API (an older driver): --hold lock freezes each sibling and says why in every
    region; auto freezes as --hold freeze does, and `krex status` says why."""
    owner = script("owner.py", OWNER)
    env = py_env(**fake.env())
    env["KREX_LIBCUDA"] = fake.old
    async with run_daemon("--hold", hold, "--freeze", "all", env=env) as d:
        async with await d.client() as c:
            st = (await c.status())["hold"]
            hc, cuda = await start(c, fake, "cuda")
            res = await c.run([PY, owner, str(tmp_path / "g"), "0.1"], env=py_env())
            await hc.cancel(9)
    assert not st["lock_available"] and "predates the checkpoint API" in st["reason"]
    rep = json.loads(res.stdout)
    assert rep["frozen"] == [hc.command] and rep["hold"] == "freeze"
    assert rep["hold_why"].startswith("no driver lock: ")
    if hold == "lock":  # asked for by name: each sibling says why it was frozen instead
        assert rep["hold_why"] == rep["hold_fallback"][hc.command]
    else:
        assert "hold_fallback" not in rep


@pytest.mark.parametrize("end", ["timeout", "cancelled"])
async def test_locked_command_still_dies(fake: Fake, script, tmp_path: Path, end: str) -> None:
    owner = script("owner.py", OWNER)
    marker = tmp_path / "granted"
    async with run_daemon(*SLOW, "--hold", "lock", "--kill-grace", "0.5", env=daemon_env(fake)) as d:
        async with await d.client() as c:
            hc, cuda = await start(c, fake, "cuda", timeout=2.0 if end == "timeout" else 60)
            run = asyncio.ensure_future(c.run([PY, owner, str(marker), "6"], env=py_env()))
            await granted(marker)
            assert fake.lock_state(cuda) == 1
            t0 = time.monotonic()
            if end == "cancelled":
                await hc.cancel(15)
            res = await asyncio.wait_for(hc.wait(), 10)
            assert res.report.state == end
            assert time.monotonic() - t0 < 4
            assert not os.path.exists(f"/proc/{cuda}") or proc_state(cuda) == "Z"
            assert not run.done(), "the region outlived the locked sibling"
            await run


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def _watchdog_of(daemon_pid: int) -> int:
    for child in _children(daemon_pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"krex_async.isolation.watchdog" in f.read():
                return child
    raise AssertionError("no watchdog child")


@pytest.mark.parametrize("who", ["watchdog", "startup", "cleanup"])
async def test_sigkilled_daemon_leaves_nothing_locked(fake: Fake, script, tmp_path: Path, who: str) -> None:
    owner = script("owner.py", OWNER)
    marker = tmp_path / "granted"
    state = str(tmp_path / "state")
    cg = None
    async with run_daemon(
        *SLOW, "--hold", "lock", "--freeze", "all", "--state-dir", state, env=daemon_env(fake)
    ) as d:
        cg = next(a for a in d.proc.args if "krex-test-" in str(a))  # type: ignore[union-attr]
        c = await d.client()
        hc, cuda = await start(c, fake, "cuda", on_disconnect="keep")
        hv, vk = await start(c, fake, "vk", "nocuda", on_disconnect="keep")
        asyncio.ensure_future(c.run([PY, owner, str(marker), "30"], env=py_env(), on_disconnect="keep"))
        await granted(marker)
        assert fake.lock_state(cuda) == 1 and is_frozen(vk)
        if who != "watchdog":
            os.kill(_watchdog_of(d.proc.pid), signal.SIGKILL)
            await asyncio.sleep(0.1)
        d.proc.kill()
        d.proc.wait()
        t0 = time.monotonic()
        if who == "watchdog":
            while fake.lock_state(cuda) == 1 and time.monotonic() - t0 < 3:
                await asyncio.sleep(0.01)
            dt = time.monotonic() - t0
            assert fake.lock_state(cuda) == 0, "the watchdog did not unlock"
            assert dt < 1.0, f"unlocked {dt:.2f} s after the daemon's death"
            assert not is_frozen(vk)
        else:
            await asyncio.sleep(1.0)
            assert fake.lock_state(cuda) == 1, "nothing else should have unlocked it"
            if who == "startup":
                async with run_daemon(
                    "--hold", "lock", "--state-dir", state, "--cgroup-root", str(cg), env=daemon_env(fake)
                ) as d2:
                    assert "unlocked pid" in d2.logs()
                    assert fake.lock_state(cuda) == 0
            else:
                out = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "krex_async",
                        "cleanup",
                        "--state-dir",
                        state,
                        "--root",
                        str(cg),
                        "--force",
                    ],
                    capture_output=True,
                    text=True,
                    env=daemon_env(fake),
                )
                assert out.returncode == 0, out.stderr
                assert f"unlocked pid {cuda}" in out.stdout
                assert fake.lock_state(cuda) == 0 and not is_frozen(vk)
        for pid in (cuda, vk):
            os.kill(pid, signal.SIGKILL)


# A Python sibling with krex's in-command runtime: a context through the fake driver, launches on
# the main thread (each a C call that blocks while locked, without the GIL). Its main thread blocks
# the runtime's quiesce signal: like a thread inside a long C call (an import, CUDA initialisation,
# a synchronise the lock holds), it cannot answer a quiesce in time.
PY_SIB = """
import ctypes, os, signal, sys, time
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMAX - 6])
lib = ctypes.CDLL(os.environ["KREX_LIBCUDA"])
ctx = ctypes.c_void_p()
assert lib.cuInit(0) == 0 and lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, 0) == 0
gpu = os.open("/dev/nvidia0", os.O_RDONLY)
open(sys.argv[1], "w").write(str(os.getpid()))
while True:
    lib.cuLaunchKernel(None)
    time.sleep(0.0005)
"""


@pytest.mark.parametrize("hold", ["lock", "freeze"])
async def test_locked_siblings_are_not_asked_to_quiesce(
    fake: Fake, script, tmp_path: Path, hold: str
) -> None:
    """--quiesce all asks every runtime of a frozen sibling to stop and synchronise. A locked
    sibling is not asked: the lock stops its GPU work, and its runtime, inside a CUDA call that
    the lock holds, could only answer after the region (a whole --quiesce-timeout lost)."""
    owner = script("owner.py", OWNER)
    ready = tmp_path / "sib.pid"
    sib = script("sib.py", PY_SIB)
    async with run_daemon(
        *SLOW,
        "--hold",
        hold,
        "--freeze",
        "all",
        "--quiesce",
        "all",
        "--quiesce-timeout",
        "0.5",
        env=daemon_env(fake),
    ) as d:
        async with await d.client() as c:
            argv = fake.argv("x", "cuda")
            h = await c.submit(argv[: argv.index(fake.sib)] + [PY, sib, str(ready)], env=daemon_env(fake))
            deadline = time.monotonic() + 15
            while not (ready.exists() and ready.read_text()):
                assert time.monotonic() < deadline, "the Python sibling did not start"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # its runtime registered
            res = await c.run([PY, owner, str(tmp_path / "g"), "0.1"], env=py_env())
            await h.cancel(9)
    rep = json.loads(res.stdout)
    if hold == "lock":
        assert rep["locked"] == [h.command] and rep.get("quiesce_s", 0) < 0.05
        assert rep["enter_s"] < 0.25, rep
        assert rep["drain"] == "not-needed"  # the cpu device has no queues; on a GPU: pending
    else:  # asked, and it could not answer: the whole timeout
        assert rep["frozen"] == [h.command] and rep["quiesce_s"] >= 0.45


async def test_probes_see_locked_siblings_and_late_openers(fake: Fake, script, tmp_path: Path) -> None:
    """Exclusivity under the lock: a locked sibling that still touches the GPU (an ioctl from its
    CPU thread) is a stray in the region's report, and a process of a locked command that opens
    a GPU device during the region gets its command frozen at once."""
    from krex_async.probes import bcc_works

    ok, why = bcc_works()
    if not ok:
        pytest.skip(f"bcc unavailable: {why}")
    owner = script("owner.py", OWNER)
    marker = tmp_path / "granted"
    late = tmp_path / "late.pid"
    async with run_daemon(
        *SLOW, "--hold", "lock", "--freeze", "all", "--probes", "ioctl", env=daemon_env(fake)
    ) as d:
        async with await d.client() as c:
            hx, x = await start(c, fake, "x", "cuda", True, "ioctl")
            # y: a locked sibling whose shell opens the "GPU" once the region is held
            argv = fake.argv("y", "cuda")
            body = (
                'mount -t tmpfs krex-fake /dev && : > /dev/nvidia0 && "$@" & '
                f"while [ ! -s {marker} ]; do sleep 0.01; done; sleep 0.2; "
                f"exec 3</dev/nvidia0; echo $$ > {late}; sleep 30"
            )
            argv[argv.index("-c") + 1] = body
            (fake.state / "y.stats").unlink(missing_ok=True)
            hy = await c.submit(argv, env=daemon_env(fake))
            deadline = time.monotonic() + 15
            while fake.stats("y")[1] == 0:
                assert time.monotonic() < deadline, "sibling y did not start"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # the probes have seen both open their device files
            res = await c.run([PY, owner, str(marker), "1.0"], env=py_env())
            for h in (hx, hy):
                await h.cancel(9)
    rep = json.loads(res.stdout)
    assert sorted(rep["locked"]) == sorted([hx.command, hy.command]), rep
    assert x in rep["stray_pids"], f"the locked sibling's ioctls were not reported: {rep}"
    assert int(late.read_text()) in rep["stray_pids"]
    assert rep["frozen"] == [hy.command], "the command whose process opened the GPU late"


SILENT_SIB = """
import signal, sys, time
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMAX - 6])  # cannot answer a quiesce
open(sys.argv[1], "w").write("up")
while True:
    time.sleep(0.01)
"""

TWO_REGIONS = """
import sys, time, msgspec
from krex_async import region
out = []
for _ in range(2):
    with region("timing") as r:
        time.sleep(0.05)
    out.append(msgspec.to_builtins(r.report))
    time.sleep(0.1)
print(msgspec.json.encode(out).decode())
"""


async def test_a_runtime_that_did_not_answer_is_not_asked_again_at_once(
    script,
    tmp_path: Path,
) -> None:
    """Under the freezer: a sibling whose runtime could not answer the last quiesce (inside a long
    C call) is frozen without asking in the next region, which then does not wait for it."""
    up = tmp_path / "up"
    async with run_daemon("--hold", "freeze", "--quiesce", "all", "--quiesce-timeout", "0.3") as d:
        async with await d.client() as c:
            h = await c.submit([PY, script("silent.py", SILENT_SIB), str(up)], env=py_env())
            deadline = time.monotonic() + 15
            while not up.exists():
                assert time.monotonic() < deadline, "the sibling did not start"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # its runtime registered
            res = await c.run([PY, script("two.py", TWO_REGIONS)], env=py_env())
            await h.cancel(9)
    first, second = json.loads(res.stdout)
    assert first["frozen"] == [h.command] and first["quiesce_s"] >= 0.28, first
    assert second["frozen"] == [h.command] and second.get("quiesce_s", 0) < 0.05, second


async def _start_creating(c: Client, fake: Fake, name: str, ctx_ms: int) -> tuple[Any, int]:
    """A sibling that holds a GPU file and spends `ctx_ms` creating its context (a lock answers
    CUDA_ERROR_NOT_READY meanwhile) while its CPU thread counts; returns once it is creating."""
    (fake.state / f"{name}.stats").unlink(missing_ok=True)
    h = await c.submit(fake.argv(name, "cuda"), env=daemon_env(fake, FAKE_CUDA_CTX_MS=str(ctx_ms)))
    deadline = time.monotonic() + 15
    while fake.stats(name)[0] == 0 or fake.lock_state(fake.stats(name)[0]) is None:
        assert time.monotonic() < deadline, f"sibling {name} did not start"
        await asyncio.sleep(0.005)
    return h, fake.stats(name)[0]


async def test_sibling_inside_a_cuda_call_is_waited_for_and_locked_as_it_ends(
    fake: Fake, script, tmp_path: Path
) -> None:
    """A sibling inside a CUDA call (here its context's creation) answers the lock NOT_READY: the
    region waits, before its grant, for the driver to lock it as the call ends (no CUDA call of it
    completes in the region), without freezing it (its CPU thread runs on throughout), and
    unlocks it at the end with the others."""
    owner = script("owner.py", OWNER)
    marker = tmp_path / "granted"
    wait = ("--lock-wait", "1.5")  # longer than the call (the default, 0.05 s, freezes it)
    async with run_daemon(*SLOW, *wait, "--hold", "lock", "--freeze", "all", env=daemon_env(fake)) as d:
        async with await d.client() as c:
            hc, cuda = await start(c, fake, "cuda")
            hl, late = await _start_creating(c, fake, "late", 700)
            t_create = time.monotonic()
            c0 = fake.stats("late")[2]
            run = asyncio.ensure_future(c.run([PY, owner, str(marker), "1.0"], env=py_env()))
            await granted(marker)
            assert time.monotonic() - t_create > 0.6, "granted while the sibling was inside its call"
            assert fake.lock_state(cuda) == 1 and fake.lock_state(late) == 1
            assert not is_frozen(late), "the sibling inside a CUDA call was frozen"
            assert fake.stats("late")[2] - c0 >= 30, "its CPU thread did not run on meanwhile"
            g0, c1 = fake.stats("late")[1:3]
            await asyncio.sleep(0.3)
            assert fake.stats("late")[1] - g0 <= 1, "the waited-for sibling launched in the region"
            assert fake.stats("late")[2] - c1 >= 30, "its CPU thread stopped in the region"
            res = await run
            assert res.returncode == 0, res.stderr
            await asyncio.sleep(0.2)
            assert fake.lock_state(late) == 0 and fake.lock_state(cuda) == 0, "not unlocked"
            assert fake.stats("late")[1] > g0 + 1, "no CUDA calls after the release"
            for h in (hc, hl):
                await h.cancel(9)
    rep = json.loads(res.stdout)
    assert sorted(rep["locked"]) == sorted([hc.command, hl.command]), rep
    assert rep.get("frozen", []) == [] and rep.get("hold_fallback", {}) == {}, rep
    [entry] = rep["lock_late"]
    assert entry["pid"] == late and entry["command"] == hl.command, entry
    assert entry["outcome"] == "locked" and 0.3 < entry["after_s"] < 0.7, entry
    assert entry["attempts"] == 2 and entry["state"] == "running", entry
    assert late in rep["locked_pids"] and cuda in rep["locked_pids"]
    assert 0.3 < rep["enter_s"] < 1.0, rep


@pytest.mark.parametrize("end", ["frozen", "exited"])
async def test_sibling_busy_past_the_wait_is_frozen_or_forgotten_if_it_exits(
    fake: Fake, script, tmp_path: Path, end: str
) -> None:
    """Still inside its call after --lock-wait: the sibling's command is frozen, the report says
    why; a sibling that exits during the wait is neither frozen nor locked (nothing to hold). The
    lock record names no locked process afterwards either way."""
    owner = script("owner.py", OWNER)
    marker = tmp_path / "granted"
    state = tmp_path / "state"
    args = ("--lock-wait", "0.4" if end == "frozen" else "1.5", "--state-dir", str(state))
    async with run_daemon(*SLOW, "--hold", "lock", "--freeze", "all", *args, env=daemon_env(fake)) as d:
        async with await d.client() as c:
            hl, late = await _start_creating(c, fake, "late", 3000)
            run = asyncio.ensure_future(c.run([PY, owner, str(marker), "0.3"], env=py_env()))
            if end == "exited":
                await asyncio.sleep(0.3)  # the region is waiting for it
                assert not marker.exists()
                os.kill(late, signal.SIGKILL)
            await granted(marker)
            if end == "frozen":
                assert is_frozen(late), "still busy after the wait, yet not frozen"
            res = await run
            assert res.returncode == 0, res.stderr
            await hl.cancel(9)
    rep = json.loads(res.stdout)
    [entry] = rep["lock_late"]
    assert entry["outcome"] == end and entry["pid"] == late, entry
    assert late not in rep.get("locked_pids", [])
    if end == "frozen":
        assert rep["frozen"] == [hl.command], rep
        assert "inside a CUDA call for over --lock-wait 0.4s" in rep["hold_fallback"][hl.command], rep
    else:
        assert rep.get("frozen", []) == [] and rep.get("hold_fallback", {}) == {}, rep
    for pid, _ in json.loads((state / "locks.json").read_text())["locked"]:
        assert fake.lock_state(pid) != 1, pid


async def test_late_lock_is_undone_by_the_watchdog(fake: Fake, script, tmp_path: Path) -> None:
    """A lock taken after waiting for a CUDA call is recorded like any other: the daemon's death
    while it holds it leaves nothing locked a second later."""
    owner = script("owner.py", OWNER)
    marker = tmp_path / "granted"
    async with run_daemon(
        *SLOW,
        "--hold",
        "lock",
        "--freeze",
        "all",
        "--state-dir",
        str(tmp_path / "state"),
        env=daemon_env(fake),
    ) as d:
        c = await d.client()
        hl, late = await _start_creating(c, fake, "late", 300)
        asyncio.ensure_future(c.run([PY, owner, str(marker), "30"], env=py_env(), on_disconnect="keep"))
        await granted(marker)
        assert not is_frozen(late)
        deadline = time.monotonic() + 3
        while fake.lock_state(late) != 1:
            assert time.monotonic() < deadline, "not locked once its context existed"
            await asyncio.sleep(0.005)
        d.proc.kill()
        d.proc.wait()
        t0 = time.monotonic()
        while fake.lock_state(late) == 1 and time.monotonic() - t0 < 3:
            await asyncio.sleep(0.01)
        assert fake.lock_state(late) == 0 and time.monotonic() - t0 < 1.0, "the watchdog did not unlock"
        os.kill(late, signal.SIGKILL)


# A Python sibling holding the stand-in GPU file with a context of the fake driver (so a region
# locks it), its krex runtime loaded as in every command; it exits when told, by sys.exit (the
# runtime's exit hook runs) or os._exit (it does not).
EXITING = """
import ctypes, os, sys, time
lib = ctypes.CDLL(sys.argv[1])
state = sys.argv[2]
if sys.argv[3] != "late-open":
    fd = os.open("/dev/nvidia0", os.O_RDWR)
    assert lib.cuCtxCreate_v2(ctypes.byref(ctypes.c_void_p()), 0, 0) == 0
def mark(name, text):  # whole or not at all: a reader polls for the file, then reads it
    open(state + name + ".tmp", "w").write(text)
    os.replace(state + name + ".tmp", state + name)
mark(".ready", str(os.getpid()))
while not os.path.exists(state + ".go"):
    time.sleep(0.002)
if sys.argv[3] == "late-open":  # a GPU file opened now, unseen by a region begun before
    fd = os.open("/dev/nvidia0", os.O_RDWR)
mark(".exiting", repr(time.time()))


SLOW_S = {"slow": 0.3, "slower": 1.5, "late-open": 1.5, "slowest": 4.0}


class _SlowToDie:  # finalised after the exit hooks: the exit lasts longer, as a torch teardown does
    def __del__(self, sleep=time.sleep, seconds=SLOW_S.get(sys.argv[3], 0.0), mark=open, at=state):
        mark(at + ".finalising", "w").close()  # the exit hooks (the daemon's answer) are behind it
        sleep(seconds)


if sys.argv[3] in SLOW_S:
    _last = _SlowToDie()
if sys.argv[3] == "os._exit":
    os._exit(0)
sys.exit(0)
"""


async def _start_exiting(c: Client, fake: Fake, script, state: str, how: str) -> tuple[Any, int]:
    """EXITING as a command holding the stand-in GPU file; returns once its runtime has had time
    to announce itself to the daemon."""
    argv = fake.with_gpu_file([PY, str(script("exiting.py", EXITING)), fake.lib, state, how])
    h = await c.submit(argv, env=daemon_env(fake))
    deadline = time.monotonic() + 20
    while not os.path.exists(state + ".ready"):
        assert time.monotonic() < deadline, "the sibling did not start"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.5)
    return h, int(Path(state + ".ready").read_text())


async def _exit_inside_a_region(
    c: Client, fake: Fake, script, tmp_path: Path, how: str, seconds: float, locked: bool
) -> tuple[dict[str, Any], Any, int, float, float]:
    """EXITING started, then told to exit inside an owner's region of `seconds` (locked by it when
    `locked`, which is checked): (the region's report, the sibling's handle and pid, when it
    ended, when the region was released). Both end with status 0."""
    owner = script("owner.py", OWNER)
    marker = tmp_path / "granted"
    state = str(tmp_path / "sib")
    h, pid = await _start_exiting(c, fake, script, state, how)
    run = asyncio.ensure_future(c.run([PY, owner, str(marker), str(seconds)], env=py_env()))
    await granted(marker)
    if locked:
        assert fake.lock_state(pid) == 1, "the sibling was not locked"
    Path(state + ".go").write_text("")
    res_sib = await h.wait()
    t_end = time.time()
    res = await run
    assert res.returncode == 0 and res_sib.returncode == 0, (res.stderr, res_sib.stderr)
    rep = json.loads(res.stdout)
    t_release = float(marker.read_text()) + rep["held_s"]
    assert float(Path(state + ".exiting").read_text()) < t_release - 0.5, "it did not exit inside the region"
    return rep, h, pid, t_end, t_release


@pytest.mark.parametrize("how", ["sys.exit", "os._exit"])
async def test_a_locked_sibling_exits_after_the_region(fake: Fake, script, tmp_path: Path, how: str) -> None:
    """A locked sibling that exits during a region would free its GPU memory beside the timing (the
    driver's teardown, which no lock stops): its runtime defers the exit to the region's release
    and the report names it (exit_deferred). An exit its runtime cannot see (os._exit) ends during
    the region, and the report says so (held_exited)."""
    async with run_daemon(*SLOW, "--hold", "lock", "--freeze", "all", env=daemon_env(fake)) as d:
        async with await d.client() as c:
            rep, h, pid, t_end, t_release = await _exit_inside_a_region(
                c, fake, script, tmp_path, how, 1.0, locked=True
            )
    if how == "sys.exit":
        assert t_end >= t_release - 0.05, f"ended {t_release - t_end:.3f} s before the release"
        assert rep["exit_deferred"] == [pid], rep
        assert "held_exited" not in rep, rep
    else:
        assert t_end < t_release - 0.3, "os._exit waited for the release?"
        assert rep["held_exited"] == [h.command], rep
        assert "exit_deferred" not in rep, rep


@pytest.mark.parametrize("wait", ["0.5", "0.1"])
async def test_the_next_region_waits_for_a_deferred_exit(
    fake: Fake, script, tmp_path: Path, wait: str
) -> None:
    """A sibling whose exit the first region deferred tears its context down as that region is
    released (here for 0.3 s). The region queued behind it waits for that exit before its grant
    (else it would lock the process mid-exit and the teardown would run beside its own timing):
    the sibling is gone by the second grant, which names it in exits_waited; nothing is
    held_exited. An exit longer than --lock-wait is named in exits_unfinished, and its command is
    frozen for the region (a lock does not stop an exit): it ends after the release."""
    owner = script("owner.py", OWNER)
    m1, m2 = tmp_path / "granted1", tmp_path / "granted2"
    state = str(tmp_path / "sib")
    args = ("--hold", "lock", "--freeze", "all", "--lock-wait", wait, "--exit-wait", "-1")
    async with run_daemon(*SLOW, *args, env=daemon_env(fake)) as d:
        async with await d.client() as c:
            h, pid = await _start_exiting(c, fake, script, state, "slow")
            first = asyncio.ensure_future(c.run([PY, owner, str(m1), "0.8"], env=py_env()))
            await granted(m1)
            second = asyncio.ensure_future(c.run([PY, owner, str(m2), "0.3"], env=py_env()))
            await asyncio.sleep(0.3)  # the second region is asked for, and waits for the first
            Path(state + ".go").write_text("")
            await granted(m2)
            alive_at_grant = proc_state(pid) not in (None, "Z")
            frozen_in_region = alive_at_grant and is_frozen(pid)
            r1, r2 = await first, await second
            assert (await h.wait()).returncode == 0
            t_end = time.time()
    rep1, rep2 = json.loads(r1.stdout), json.loads(r2.stdout)
    assert rep1["exit_deferred"] == [pid], rep1
    assert "held_exited" not in rep1, rep1
    if wait == "0.5":
        assert not alive_at_grant, "the second region was granted before the sibling's exit ended"
        assert rep2.get("exits_waited") == [pid] and "exits_unfinished" not in rep2, rep2
        assert "held_exited" not in rep2 and pid not in rep2.get("locked_pids", []), rep2
    else:  # 0.3 s of exit against a 0.1 s wait: said, then frozen (a lock would not stop the exit)
        assert alive_at_grant
        assert rep2.get("exits_unfinished") == [pid] and "exits_waited" not in rep2, rep2
        assert frozen_in_region and h.command in rep2["frozen"], rep2
        assert pid not in rep2.get("locked_pids", []) and "exiting" in rep2["hold_fallback"][h.command], rep2
        assert "held_exited" not in rep2, rep2
        assert t_end >= float(m2.read_text()) + rep2["held_s"] - 0.05, "it ended inside the second region"


async def test_an_exit_with_no_region_goes_at_once_and_the_next_region_waits_for_it(
    fake: Fake, script, tmp_path: Path
) -> None:
    """A sibling holding a GPU file that exits while no region runs is not delayed (the daemon
    answers its runtime at once), and a region asked for during its teardown (1.5 s here) waits
    for the exit before its grant: the driver frees the process's GPU memory as it ends, beside
    whatever would be timed. The previous region's owner exiting as the next region begins is
    this case on the H200 (every region of a KernelBench run had one)."""
    owner = script("owner.py", OWNER)
    marker = tmp_path / "granted"
    state = str(tmp_path / "sib")
    args = ("--hold", "lock", "--freeze", "all", "--lock-wait", "5", "--exit-wait", "5")
    async with run_daemon(*SLOW, *args, env=daemon_env(fake)) as d:
        async with await d.client() as c:
            h, pid = await _start_exiting(c, fake, script, state, "slower")
            Path(state + ".go").write_text("")
            while not os.path.exists(state + ".exiting"):
                await asyncio.sleep(0.005)
            res = await c.run([PY, owner, str(marker), "0.2"], env=py_env())
            t_grant = float(marker.read_text())
            res_sib = await h.wait()
    assert res.returncode == 0 and res_sib.returncode == 0, (res.stderr, res_sib.stderr)
    rep = json.loads(res.stdout)
    t_exiting = float(Path(state + ".exiting").read_text())
    assert t_grant - t_exiting < 3.0, "the sibling's exit was delayed with no region to wait for"
    assert rep.get("exits_waited") == [pid] and rep["exits_wait_s"] > 0.2, rep
    assert pid not in rep.get("locked_pids", []) and "held_exited" not in rep, rep


async def _region_after_an_exit(
    c: Client, owner: Path, marker: Path, state: str, deadline: float
) -> asyncio.Future[Any]:
    """OWNER run on cue: the EXITING sibling at `state` is told to exit with no region yet, and once
    it is in its finalisation (the daemon has noted its exit) the owner asks for its region, which
    waits for that exit. Returns the owner's run."""
    run = asyncio.ensure_future(c.run([PY, str(owner), str(marker), "0.2", state + ".cue"], env=py_env()))
    await until(
        lambda: os.path.exists(state + ".cue.owner"), "the owner's start", deadline - time.monotonic()
    )
    Path(state + ".go").write_text("")
    await until(
        lambda: os.path.exists(state + ".finalising"), "the sibling's exit", deadline - time.monotonic()
    )
    Path(state + ".cue").write_text("")
    return run


async def test_a_sibling_inside_a_cuda_call_is_waited_for_beside_an_exit_not_after_it(
    fake: Fake, script, tmp_path: Path
) -> None:
    """A region that waits for a sibling's exit (4 s of teardown here) tries the lock of its
    other siblings meanwhile: one inside a CUDA call past --lock-wait (0.8 s) is frozen as the
    exit ends, not 0.8 s after it. (On the H100 a region's entry spent both one after the other:
    an exit in the kernel's teardown, 73-117 ms, then 50 ms for a sibling inside a call.)"""
    owner = script("owner.py", OWNER)
    marker = tmp_path / "granted"
    state = str(tmp_path / "sib")
    args = ("--hold", "lock", "--freeze", "all", "--lock-wait", "0.8", "--exit-wait", "8")
    async with run_daemon(*SLOW, *args, env=daemon_env(fake)) as d:
        async with await d.client() as c:
            h, pid = await _start_exiting(c, fake, script, state, "slowest")
            hl, late = await _start_creating(c, fake, "late", 60000)
            run = await _region_after_an_exit(c, owner, marker, state, time.monotonic() + 30)
            res = await run
            assert (await h.wait()).returncode == 0
            await hl.cancel(9)
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep.get("exits_waited") == [pid] and rep["exits_wait_s"] > 1.0, rep
    [entry] = rep["lock_late"]
    assert entry["pid"] == late and entry["outcome"] == "frozen", entry
    assert hl.command in rep["frozen"] and "inside a CUDA call" in rep["hold_fallback"][hl.command], rep
    assert pid not in rep.get("locked_pids", []), rep
    # the lock's 0.8 s ran inside the wait for the exit: the entry is not their sum
    assert rep["enter_s"] - rep["exits_wait_s"] < 0.6, rep


async def test_a_command_whose_exiting_process_ended_in_the_wait_is_locked_not_frozen(
    fake: Fake, script, tmp_path: Path
) -> None:
    """A command of two GPU processes, one of them exiting as a region begins (1.5 s of teardown):
    the region locks its other sibling while it waits for that exit, then locks the command's
    remaining process, once that first lock has landed. The command is not frozen: its exit ended
    within the wait (the first form of the overlap froze every command with an exit)."""
    owner = script("owner.py", OWNER)
    marker = tmp_path / "granted"
    state = str(tmp_path / "sib")
    exiting = shlex.join([PY, str(script("exiting.py", EXITING)), fake.lib, state, "slower"])
    sib = shlex.join([fake.sib, fake.lib, "both", "cuda", "/dev/nvidia0"])
    # (its /dev is a private tmpfs: a plain /dev/null there, for the shell's background job)
    async with run_daemon(
        *SLOW, "--hold", "lock", "--freeze", "all", "--exit-wait", "8", env=daemon_env(fake)
    ) as d:
        async with await d.client() as c:
            (fake.state / "both.stats").unlink(missing_ok=True)
            hb = await c.submit(
                fake.with_gpu_file(["sh", "-c", f": > /dev/null && {{ {exiting} & }} && exec {sib}"]),
                env=daemon_env(fake),
            )
            ho, other = await start(c, fake, "other")
            deadline = time.monotonic() + 30
            await until(
                lambda: (
                    os.path.exists(state + ".ready") and fake.lock_state(fake.stats("both")[0]) is not None
                ),
                "the two-process command's start",
                deadline - time.monotonic(),
            )
            pid, both = int(Path(state + ".ready").read_text()), fake.stats("both")[0]
            await asyncio.sleep(0.5)  # the exiting process's runtime has announced itself
            run = await _region_after_an_exit(c, owner, marker, state, deadline)
            res = await run
            for h in (hb, ho):
                await h.cancel(9)
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep.get("exits_waited") == [pid] and "exits_unfinished" not in rep, rep
    assert {both, other} <= set(rep["locked_pids"]) and pid not in rep["locked_pids"], rep
    assert sorted(rep["locked"]) == sorted([hb.command, ho.command]), rep
    assert hb.command not in rep.get("frozen", []) and hb.command not in rep.get("hold_fallback", {}), rep


async def test_a_gpu_process_a_locked_sibling_starts_during_the_wait_is_locked_after_it(
    fake: Fake, script, tmp_path: Path
) -> None:
    """A sibling locked while the region waits for another's exit (4 s of teardown) starts a second
    GPU process meanwhile: once the wait has ended, that process is locked too, after the first
    lock, and the sibling is named once among the locked commands, not frozen."""
    owner = script("owner.py", OWNER)
    marker = tmp_path / "granted"
    state = str(tmp_path / "sib")
    b1, b2 = (shlex.join([fake.sib, fake.lib, n, "cuda", "/dev/nvidia0"]) for n in ("b1", "b2"))
    more = shlex.quote(state + ".more")
    # (its /dev is a private tmpfs: a plain /dev/null there, for the shell's background job)
    two = f": > /dev/null && {{ {b1} & }} && while [ ! -e {more} ]; do sleep 0.01; done && exec {b2}"
    async with run_daemon(
        *SLOW, "--hold", "lock", "--freeze", "all", "--exit-wait", "8", env=daemon_env(fake)
    ) as d:
        async with await d.client() as c:
            he, pid = await _start_exiting(c, fake, script, state, "slowest")
            for n in ("b1", "b2"):
                (fake.state / f"{n}.stats").unlink(missing_ok=True)
            hb = await c.submit(fake.with_gpu_file(["sh", "-c", two]), env=daemon_env(fake))
            deadline = time.monotonic() + 30
            left = deadline - time.monotonic()
            await until(lambda: fake.lock_state(fake.stats("b1")[0]) is not None, "the sibling's start", left)
            first = fake.stats("b1")[0]
            run = await _region_after_an_exit(c, owner, marker, state, deadline)
            left = deadline - time.monotonic()  # locked while the region waits for the exit:
            await until(lambda: fake.lock_state(first) == 1, "the sibling's lock during the wait", left)
            Path(state + ".more").write_text("")
            left = deadline - time.monotonic()
            await until(
                lambda: fake.lock_state(fake.stats("b2")[0]) is not None, "the second GPU process", left
            )
            second = fake.stats("b2")[0]
            assert not marker.exists(), "granted before the second GPU process started"
            res = await run
            for h in (hb, he):
                await h.cancel(9)
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep.get("exits_waited") == [pid] and rep["exits_wait_s"] > 1.0, rep
    assert {first, second} <= set(rep["locked_pids"]), rep
    assert rep["locked"] == [hb.command], rep
    assert hb.command not in rep.get("frozen", []) and not rep.get("hold_fallback"), rep


async def test_exit_wait_0_freezes_an_exit_still_in_user_space_for_every_region_until_it_ends(
    fake: Fake, script, tmp_path: Path
) -> None:
    """--exit-wait 0 (the default): a region does not wait for a sibling's exit still in user
    space (Python's finalisation here, 1.5 s, as a torch teardown): it is named in
    exits_unfinished and frozen with its command for the region, never locked (a lock does not
    stop an exit). Thawed at the release, it goes on exiting, so the region right after treats it
    the same way again (before, it was forgotten after one region and locked mid-exit); it ends
    after both regions."""
    owner = script("owner.py", OWNER)
    m1, m2 = tmp_path / "granted1", tmp_path / "granted2"
    state = str(tmp_path / "sib")
    args = ("--hold", "lock", "--freeze", "all", "--lock-wait", "5")  # --exit-wait 0, the default
    async with run_daemon(*SLOW, *args, env=daemon_env(fake)) as d:
        async with await d.client() as c:
            h, pid = await _start_exiting(c, fake, script, state, "slower")
            Path(state + ".go").write_text("")
            while not os.path.exists(state + ".exiting"):
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.1)  # its exit hook has been answered: it is in its finalisation
            first = asyncio.ensure_future(c.run([PY, owner, str(m1), "0.3"], env=py_env()))
            await granted(m1)
            frozen_first = is_frozen(pid)
            second = asyncio.ensure_future(c.run([PY, owner, str(m2), "0.3"], env=py_env()))
            await granted(m2)
            frozen_second = proc_state(pid) not in (None, "Z") and is_frozen(pid)
            r1, r2 = await first, await second
            assert (await h.wait()).returncode == 0
            t_end = time.time()
    t_exiting = float(Path(state + ".exiting").read_text())
    rep1, rep2 = json.loads(r1.stdout), json.loads(r2.stdout)
    assert float(m1.read_text()) - t_exiting < 0.8, "the first region waited for the exit"
    for rep in (rep1, rep2):
        assert rep.get("exits_unfinished") == [pid] and rep["exits_wait_s"] < 0.3, rep
        assert pid not in rep.get("locked_pids", []) and h.command in rep["frozen"], rep
    assert frozen_first and frozen_second
    assert t_end >= float(m2.read_text()) + rep2["held_s"] - 0.05, "it ended inside the second region"


# Two regions back to back in one owner: the second is asked for as the first is released, with no
# start of a process between them (a second owner, frozen into the first as it started, would ask
# only once thawed and through its imports).
BACK_TO_BACK = """
import sys, time, msgspec
from krex_async import region
with region("timing") as r1:
    open(sys.argv[1], "w").write(str(time.time()))
    time.sleep(float(sys.argv[2]))
with region("timing") as r2:
    time.sleep(0.3)
sys.stdout.write(msgspec.json.encode([r1.report, r2.report]).decode())
"""


async def test_an_exit_a_region_deferred_is_not_starved_when_the_next_region_begins(
    fake: Fake, script, tmp_path: Path
) -> None:
    """--exit-starve counts from an exit's start: a locked sibling that exits during a region
    (ExitHeld) starts its exit only at the release, however long the region held it. The region
    granted right after finds it just begun (its finalisation, 1.5 s here): frozen at once under
    --exit-wait 0, not waited for as starved (before, its note was the ExitHeld's, 2.5 s old)."""
    owner = script("back_to_back.py", BACK_TO_BACK)
    marker = tmp_path / "granted"
    state = str(tmp_path / "sib")
    args = ("--hold", "lock", "--freeze", "all", "--lock-wait", "5", "--exit-starve", "1")
    async with run_daemon(*SLOW, *args, env=daemon_env(fake)) as d:
        async with await d.client() as c:
            h, pid = await _start_exiting(c, fake, script, state, "slower")
            run = asyncio.ensure_future(c.run([PY, owner, str(marker), "2.5"], env=py_env()))
            await granted(marker)
            assert fake.lock_state(pid) == 1, "the sibling was not locked"
            Path(state + ".go").write_text("")  # it exits now, deferred to the first's release
            res = await run
            assert res.returncode == 0 and (await h.wait()).returncode == 0, res.stderr
    rep1, rep2 = json.loads(res.stdout)
    assert rep1["exit_deferred"] == [pid], rep1
    assert "exits_starved" not in rep2 and rep2.get("exits_unfinished") == [pid], rep2
    assert rep2["exits_wait_s"] < 0.5 and h.command in rep2["frozen"], rep2


async def test_an_exit_during_another_commands_region_waits_for_its_end(
    fake: Fake, script, tmp_path: Path
) -> None:
    """A sibling the region does not hold (--freeze device-holders: it had no GPU file at the
    grant; no probes to see it open one) that opens a GPU file and exits during the region has its
    exit deferred to the region's release by its runtime (exit_deferred), and the region granted
    next waits for that exit."""
    owner = script("owner.py", OWNER)
    m1, m2 = tmp_path / "granted1", tmp_path / "granted2"
    state = str(tmp_path / "sib")
    args = (
        "--hold",
        "lock",
        "--freeze",
        "device-holders",
        "--probes",
        "off",
        "--lock-wait",
        "5",
        "--exit-wait",
        "5",
    )
    async with run_daemon(*SLOW, *args, env=daemon_env(fake)) as d:
        async with await d.client() as c:
            h, pid = await _start_exiting(c, fake, script, state, "late-open")
            first = asyncio.ensure_future(c.run([PY, owner, str(m1), "1.5"], env=py_env()))
            await granted(m1)
            second = asyncio.ensure_future(c.run([PY, owner, str(m2), "0.2"], env=py_env()))
            Path(state + ".go").write_text("")
            res_sib = await h.wait()
            t_end = time.time()
            r1, r2 = await first, await second
    assert res_sib.returncode == 0 and r1.returncode == 0 and r2.returncode == 0, (r1.stderr, r2.stderr)
    rep1, rep2 = json.loads(r1.stdout), json.loads(r2.stdout)
    t_release = float(m1.read_text()) + rep1["held_s"]
    assert float(Path(state + ".exiting").read_text()) < t_release - 0.5, "it did not exit inside the region"
    assert t_end >= t_release - 0.05, f"ended {t_release - t_end:.3f} s before the release"
    assert rep1["exit_deferred"] == [pid] and pid not in rep1.get("locked_pids", []), rep1
    assert rep2.get("exits_waited") == [pid], rep2


async def test_under_shared_an_exit_during_a_region_is_not_deferred(
    fake: Fake, script, tmp_path: Path
) -> None:
    """Under --policy shared a region holds nothing: a GPU sibling exiting during one ends at once
    (its runtime's Resume comes straight back), and nothing is reported deferred."""
    async with run_daemon("--policy", "shared", env=daemon_env(fake)) as d:
        async with await d.client() as c:
            rep, _, _, t_end, t_release = await _exit_inside_a_region(
                c, fake, script, tmp_path, "slow", 2.0, locked=False
            )
    assert t_end < t_release - 0.5, f"the exit waited for a region under shared ({t_release - t_end:.2f} s)"
    assert "exit_deferred" not in rep, rep
