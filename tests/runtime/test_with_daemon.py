"""The runtime against the real daemon: a sibling's runtime acknowledges the daemon's Quiesce, and
KREX_AUTO_REGION=1 turns a fake triton's do_bench into a real region."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from ..conftest import PY, py_env, run_daemon
from ..test_regions import start_ticker, ticks
from .test_integrations import FAKE_TRITON_TESTING, write_fake_kernelbench

# A ticker that also records how many quiesces its runtime acknowledged so far.
ACK_TICKER = """
import sys, time
with open(sys.argv[1], "a", buffering=1) as f:
    while True:
        st = getattr(sys.modules.get("_krex_quiesce"), "_state", None)
        f.write(f"{time.monotonic()} {st.acks if st else -1}\\n")
        time.sleep(0.001)
"""

OWNER = """
import json, sys, time
from krex_async import region
time.sleep(0.2)
with region("timing") as r:
    t0 = time.monotonic(); time.sleep(0.3); t1 = time.monotonic()
print(json.dumps({"t0": t0, "t1": t1, "quiesce_s": r.report.quiesce_s, "frozen": r.report.frozen}))
"""

AUTO = """
import json, time
import triton.testing
def spin():
    global t0, t1
    t0 = time.monotonic(); time.sleep(0.3); t1 = time.monotonic()
time.sleep(0.2)
r = triton.testing.do_bench(spin)
print(json.dumps({"t0": t0, "t1": t1, "r": r}))
"""


@pytest.mark.parametrize("mode", ["all", "auto"])
async def test_sibling_runtime_acknowledges_the_daemons_quiesce(script, tmp_path: Path, mode: str) -> None:
    """--quiesce all: the sibling's runtime is asked, acknowledges once, and is frozen. auto: on
    the cpu device nobody is asked (no device work to synchronise); it is frozen all the same."""
    # With a long quiesce timeout, entering takes that long unless the sibling acknowledges.
    async with run_daemon("--quiesce-timeout", "5", "--quiesce", mode) as d:
        async with await d.client() as c:
            out = tmp_path / "acks"
            ticker = await c.submit([PY, script("ticker.py", ACK_TICKER), str(out)], env=py_env())
            deadline = time.monotonic() + 10
            while not (out.exists() and " 0\n" in out.read_text()):
                assert time.monotonic() < deadline, f"no connected runtime: {out.read_text()[-200:]}"
                time.sleep(0.01)
            res = await c.run([PY, script("owner.py", OWNER)], env=py_env())
            assert res.returncode == 0, res.stderr
            info = json.loads(res.stdout)
            time.sleep(0.1)
            await ticker.cancel(9)
            await ticker.wait()
    rows = [(float(t), int(n)) for t, n in (ln.split() for ln in out.read_text().splitlines())]
    assert info["frozen"], "the ticker was not frozen"
    assert info["quiesce_s"] < 1.0, f"the daemon waited for an ack: {info['quiesce_s']} s"
    assert [t for t, _ in rows if info["t0"] < t < info["t1"]] == []
    assert {n for t, n in rows if t < info["t0"]} <= {-1, 0}  # -1: before the runtime loaded
    acks = {n for t, n in rows if t > info["t1"]}
    if mode == "all":
        assert acks == {1}, "the runtime did not acknowledge once"
    else:
        assert acks == {0}, "a runtime on the cpu device was asked to quiesce"


async def test_auto_region_wraps_do_bench_in_a_real_region(script, tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    (fake / "triton").mkdir(parents=True)
    (fake / "triton" / "__init__.py").write_text("")
    (fake / "triton" / "testing.py").write_text(FAKE_TRITON_TESTING)
    async with run_daemon() as d:
        async with await d.client() as c:
            ticker, out = await start_ticker(c, script, tmp_path)
            env = py_env(KREX_AUTO_REGION="1")
            env["PYTHONPATH"] = f"{fake}:{env['PYTHONPATH']}"
            res = await c.run([PY, script("auto.py", AUTO)], env=env)
            assert res.returncode == 0, res.stderr
            info = json.loads(res.stdout)
            await ticker.cancel(9)
            await ticker.wait()
            regions = res.report.regions
    assert info["r"] == 1.25
    assert [r.name for r in regions] == ["triton.do_bench"], regions
    assert regions[0].frozen, "the sibling was not frozen for the auto-region"
    assert [t for t in ticks(out) if info["t0"] < t < info["t1"]] == []


KB_AUTO = """
import json, time
from kernelbench import timing
def spin():
    global t0, t1
    t0 = time.monotonic(); time.sleep(0.3); t1 = time.monotonic()
    return 1.0
time.sleep(0.2)
r = timing.get_timing_function("cuda_event")(spin, [], num_trials=1)
print(json.dumps({"t0": t0, "t1": t1, "r": r}))
"""


async def test_auto_region_wraps_kernelbench_timing_in_a_real_region(script, tmp_path: Path) -> None:
    """KernelBench's harness, unchanged, times inside a region: the sibling makes no progress."""
    fake = write_fake_kernelbench(tmp_path / "fake")
    (fake / "krex_recorder.py").write_text("EVENTS = []\n")
    async with run_daemon() as d:
        async with await d.client() as c:
            ticker, out = await start_ticker(c, script, tmp_path)
            env = py_env(KREX_AUTO_REGION="1")
            env["PYTHONPATH"] = f"{fake}:{env['PYTHONPATH']}"
            res = await c.run([PY, script("kb_auto.py", KB_AUTO)], env=env)
            assert res.returncode == 0, res.stderr
            info = json.loads(res.stdout)
            await ticker.cancel(9)
            await ticker.wait()
            regions = res.report.regions
    assert info["r"] == [1.0]
    assert [r.name for r in regions] == ["kernelbench.time_execution_with_cuda_event"], regions
    assert regions[0].frozen, "the sibling was not frozen for the auto-region"
    assert [t for t in ticks(out) if info["t0"] < t < info["t1"]] == []


# Blocks SIGUSR1 in its (only) thread and waits for it with sigwaitinfo, as a program that handles
# signals synchronously does; first it waits for krex's listener thread to be running beside it.
SIGWAITER = """
import _thread, os, signal, sys, time
deadline = time.monotonic() + 10
while _thread._count() < 1 and time.monotonic() < deadline:  # the runtime's listener thread
    time.sleep(0.01)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
print("ready", _thread._count(), os.getpid(), flush=True)
info = signal.sigwaitinfo([signal.SIGUSR1])
print("got", info.si_signo, flush=True)
"""


async def test_a_signal_sent_to_a_program_never_lands_on_krexs_listener_thread(script) -> None:
    """The kernel gives a process's signal to any thread that does not block it. krex's listener
    thread took them: a program blocking SIGUSR1 to sigwait for it was killed by it (SIG_DFL in
    that thread), and a SIGINT landing there left the main thread's sleep uninterrupted. Now the
    listener blocks them, so the program's own threads alone receive them, as in a fresh process."""
    import os
    import signal

    async with run_daemon() as d:
        async with await d.client() as c:
            h = await c.submit([PY, script("sigwait.py", SIGWAITER)], env=py_env())
            said = b""
            async for _, data in h.output():
                said += data
                if b"\n" in said:
                    break
            assert said.startswith(b"ready 1"), said  # its listener thread runs beside it
            os.kill(int(said.split()[2]), signal.SIGUSR1)
            res = await h.wait()
    assert res.returncode == 0 and res.stdout.endswith(b"got 10\n"), (res.returncode, res.stdout)
