"""lock_clocks with a slow nvidia-smi (on PATH, as test_atrex_compat's stand-in): the gateway answers
requests while a lock or reset runs, a reset never overlaps the next lock, and a job cancelled while
its lock is being taken gives it back after it landed, never before or during."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from krex_async.gateway import clocks
from krex_async.gateway.clocks import ClockError
from tests.conftest import ROOT, until

from .conftest import stack
from .test_atrex_compat import STUB_EVAL, client_job, typed
from .test_kinds import install_tools

SLOW_SMI = textwrap.dedent("""\
    #!/bin/sh
    log="$(dirname "$0")/smi.log"
    case "$1" in
      --query-supported-clocks=gr) printf '1980\\n345\\n' ;;
      --lock-gpu-clocks) echo lock-start >> "$log"; sleep {lock}; echo lock-end >> "$log" ;;
      --reset-gpu-clocks) echo reset-start >> "$log"; {reset_wait}; echo reset-end >> "$log" ;;
      --query-gpu=compute_cap) echo 9.0 ;;
      --query-gpu=*) echo "NVIDIA H200, 143771, 580.159.04" ;;
    esac
""")


# The reset waits until the test creates reset.gate beside the log (at most 30 s; the gateway kills
# it at clocks.TOOL_TIMEOUT, 20 s): a test that asks "still resetting?" gets yes until it says so.
GATE_WAIT = (
    'n=0; while [ ! -e "$(dirname "$0")/reset.gate" ] && [ $n -lt 600 ]; do sleep 0.05; n=$((n+1)); done'
)


def slow_smi(bindir: Path, lock: float, reset: float | None) -> Path:
    """A stand-in nvidia-smi whose lock and reset take `lock` and `reset` seconds (reset None: until
    reset.gate exists beside the log, see open_gate); returns its log."""
    bindir.mkdir(parents=True, exist_ok=True)
    smi = bindir / "nvidia-smi"
    smi.write_text(SLOW_SMI.format(lock=lock, reset_wait=GATE_WAIT if reset is None else f"sleep {reset}"))
    smi.chmod(0o755)
    (bindir / "smi.log").write_text("")
    return bindir / "smi.log"


def open_gate(log: Path) -> None:
    """Let a gated reset (slow_smi with reset=None) end."""
    (log.parent / "reset.gate").touch()


def calls(log: Path) -> list[str]:
    return log.read_text().split()


def serial(events: list[str]) -> bool:
    """Every lock and reset ended before the next one began."""
    return all(e.endswith("-start") == (i % 2 == 0) for i, e in enumerate(events)) and all(
        events[i].split("-")[0] == events[i + 1].split("-")[0] for i in range(0, len(events) - 1, 2)
    )


@pytest.fixture
def shared(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Fresh shares, the nvidia-smi path (never NVML: a machine with GPUs keeps its clocks)."""
    monkeypatch.setattr(clocks, "_SHARED", None)
    monkeypatch.setattr(clocks, "_nvml", lambda: (None, "NVML is not used in this test"))
    log = slow_smi(tmp_path / "bin", lock=0.6, reset=0.6)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return log


async def test_a_reset_does_not_stall_the_loop_nor_overlap_the_next_lock(shared: Path) -> None:
    """The reset runs until the test opens its gate, so a loop that waited for it would stall
    until clocks.TOOL_TIMEOUT killed it (20 s): the bound on the loop's lag can be far above what
    a loaded machine adds (it was 0.3 s against a 0.6 s reset)."""
    log = slow_smi(shared.parent, lock=0.6, reset=None)
    lag, ticks = 0.0, 0

    async def ticker() -> None:
        nonlocal lag, ticks
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            lag, ticks = max(lag, time.monotonic() - t - 0.01), ticks + 1

    tick = asyncio.ensure_future(ticker())
    try:
        a = await clocks.acquire()
        b = await clocks.acquire()  # joins: no second lock
        await b.release()
        assert calls(log) == ["lock-start", "lock-end"]
        lag = 0.0
        reset = asyncio.ensure_future(a.release())  # the last share: resets
        await until(lambda: "reset-start" in calls(log), lambda: f"the reset began: {calls(log)}")
        again = asyncio.ensure_future(clocks.acquire())  # asked while the reset runs
        seen = ticks
        await until(lambda: ticks >= seen + 5, "the loop ticked during the reset")
        assert calls(log)[-1] == "reset-start" and not again.done(), (calls(log), again)  # it waits
        open_gate(log)
        c = await again
        await reset
        assert lag < clocks.TOOL_TIMEOUT / 2, f"the event loop stalled {lag:.2f} s during the reset"
        await c.release()
    finally:
        open_gate(log)
        tick.cancel()
    events = calls(log)
    assert events == ["lock-start", "lock-end", "reset-start", "reset-end"] * 2, events


async def test_a_job_cancelled_while_locking_gives_the_lock_back_after_it_landed(shared: Path) -> None:
    job = asyncio.ensure_future(clocks.acquire())
    while "lock-start" not in calls(shared):
        await asyncio.sleep(0.01)
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job
    assert calls(shared) == ["lock-start"]  # still locking on its thread
    other = await clocks.acquire()  # another job meanwhile shares the lock once it landed
    await other.release()
    await asyncio.wait_for(clocks.settle(), 10)
    events = calls(shared)
    assert events == ["lock-start", "lock-end", "reset-start", "reset-end"], events
    assert clocks._SHARED is not None and clocks._SHARED.count == 0


async def test_the_gateway_answers_while_clocks_reset(tmp_path: Path, gwhome: Path) -> None:
    """An eval with lock_clocks ends; its reset runs until the test lets it end: /healthz is
    answered meanwhile. (A gateway whose loop waited for the reset would answer only once the
    gateway killed it, after clocks.TOOL_TIMEOUT.) The job itself may be answered before the reset
    has even begun (its long poll answers first): under load that beat the old test's check."""
    bench, env = install_tools(gwhome / "scratch", STUB_EVAL)
    log = slow_smi(gwhome / "scratch" / "bin", lock=0.1, reset=None)
    async with stack(tmp_path, "--atrex-bench-root", str(bench), env=env) as (_, _gw, c):
        job = asyncio.ensure_future(
            client_job(c, "eval", typed("run", "class Model: pass\n", lock_clocks=True))
        )
        try:
            await until(
                lambda: "reset-start" in calls(log) or (job.done() and job.exception() is not None),
                lambda: f"the reset began: {calls(log)}, {job}",
            )
            assert not (job.done() and job.exception() is not None), job
            t = time.monotonic()
            assert await asyncio.wait_for(c.health(), clocks.TOOL_TIMEOUT / 2) == "ok"
            took = time.monotonic() - t
            assert calls(log)[-1] == "reset-start", (calls(log), f"/healthz took {took:.2f} s")
        finally:
            open_gate(log)
        done = await asyncio.wait_for(job, 30)
        assert done["status"] == "succeeded" and done["result"]["clock_locked"] is True, done
        await until(lambda: "reset-end" in calls(log), lambda: f"the reset ended: {calls(log)}")
    assert serial(calls(log)) and calls(log) == ["lock-start", "lock-end", "reset-start", "reset-end"], calls(
        log
    )


class TwoGpuNvml:
    """NVML's calls as _lock_nvml makes them, for two GPUs where the second cannot be locked the
    way `broken` says; records which GPUs are locked now. (No GPU here: the failure paths of a
    real NVML cannot be provoked on purpose, so this stands in for the library's answers.)"""

    class NVMLError(Exception):
        pass

    def __init__(self, broken: str) -> None:
        self.broken, self.locked = broken, set[int]()

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetSupportedMemoryClocks(self, h: int) -> list[int]:
        return [] if h == 1 and self.broken == "no memory clocks" else [2619]

    def nvmlDeviceGetSupportedGraphicsClocks(self, h: int, m: int) -> list[int]:
        return [] if h == 1 and self.broken == "no graphics clocks" else [1980, 345]

    def nvmlDeviceSetGpuLockedClocks(self, h: int, lo: int, hi: int) -> None:
        if h == 1 and self.broken == "refused":
            raise self.NVMLError("Insufficient Permissions")
        self.locked.add(h)

    def nvmlDeviceResetGpuLockedClocks(self, h: int) -> None:
        self.locked.discard(h)


@pytest.mark.parametrize("broken", ["refused", "no graphics clocks", "no memory clocks"])
def test_a_gpu_that_cannot_be_locked_leaves_none_locked(broken: str) -> None:
    """The lock fails (ClockError, the job says why) and the GPUs locked before the failing one
    are reset: only an NVML error did that, and a GPU listing no clock left GPU 0 locked for good."""
    nv = TwoGpuNvml(broken)
    with pytest.raises(ClockError, match="lock_clocks: NVML"):
        clocks._lock_nvml(nv)
    assert nv.locked == set(), f"GPU {nv.locked} left locked"


def test_a_failed_nvidia_smi_lock_is_reset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-smi --lock-gpu-clocks locks GPU by GPU and exits non-zero at one it cannot lock:
    the ones before stay locked unless the failed lock is followed by a reset."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = bindir / "smi.log"
    (bindir / "nvidia-smi").write_text(
        '#!/bin/sh\ncase "$1" in\n'
        "  --query-supported-clocks=gr) echo 1980 ;;\n"
        f"  --lock-gpu-clocks) echo lock >> {log}; echo 'GPU 1: Insufficient Permissions' >&2; exit 4 ;;\n"
        f"  --reset-gpu-clocks) echo reset >> {log} ;;\nesac\n"
    )
    (bindir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(ClockError, match="nvidia-smi failed"):
        clocks._lock_tools("NVML is not used in this test")
    assert log.read_text().split() == ["lock", "reset"]


async def test_a_long_poll_answers_before_the_reset_ends(tmp_path: Path, gwhome: Path) -> None:
    """The job is decided before its clocks are given back: a client long-polling it (as the
    reference client reads every result) gets it then, not once the reset is over (up to 20 s
    of nvidia-smi after every lock_clocks job)."""
    bench, env = install_tools(gwhome / "scratch", STUB_EVAL)
    log = slow_smi(gwhome / "scratch" / "bin", lock=0.1, reset=4)
    async with stack(tmp_path, "--atrex-bench-root", str(bench), env=env) as (_, _gw, c):
        done = await asyncio.wait_for(
            client_job(c, "eval", typed("run", "class Model: pass\n", lock_clocks=True)), 60
        )
        assert done["status"] == "succeeded" and done["result"]["clock_locked"] is True, done
        assert "reset-end" not in calls(log), calls(log)
        deadline = time.monotonic() + 30
        while "reset-end" not in calls(log):  # and the clocks are still given back
            assert time.monotonic() < deadline, calls(log)
            await asyncio.sleep(0.05)
        assert calls(log) == ["lock-start", "lock-end", "reset-start", "reset-end"], calls(log)


HUNG_RESET = """
import asyncio, sys, time
from pathlib import Path
from krex_async.gateway import clocks
from krex_async.gateway.jobs import JobRunner
from krex_async.gateway.limits import Limits
from krex_async.gateway.store import Store

clocks.SETTLE_TIMEOUT = 0.5
clocks.lock_now = lambda: (lambda: time.sleep(600))  # a reset that hangs, as NVML can

async def main() -> None:
    share = await clocks.acquire()
    asyncio.ensure_future(share.release())  # the last share: the reset starts and hangs
    await asyncio.sleep(0.2)
    state = Path(sys.argv[1])
    runner = JobRunner(Store(state / "jobs.db"), state / "jobs", Limits(), None, {}, lambda _j: None)
    await runner.stop()

asyncio.run(main())
"""


def test_shutdown_does_not_wait_for_ever_on_a_hung_clock_reset(tmp_path: Path) -> None:
    """A reset that never returns (NVML has no timeout): the gateway's stop waits
    SETTLE_TIMEOUT, says the clocks may still be locked and how to reset them, and the process
    exits; before, stop (and asyncio.run's executor) waited for the reset for ever."""
    t = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", HUNG_RESET, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=20,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - t < 10
    assert "may still be locked" in done.stderr and "nvidia-smi -rgc" in done.stderr, done.stderr
