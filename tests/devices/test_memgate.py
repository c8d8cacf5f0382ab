"""--mem-gate on (the default): a command starts at once and memory admission waits for its first
CUDA start, so its imports and inputs overlap the device work of the others (runtime/cudagate.py,
daemon/commands/admission.py). On a real daemon with the fake test vendor (devices/fake.py), whose
allocator asks at the gate as a torch job's CUDA start does, and with a stand-in `torch` package
whose `torch.cuda._lazy_init` calls `torch._C._cuda_init` as the real one does."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

from krex_async.daemon.commands.admission import REGION_GATE_MAX_S
from krex_async.daemon.model.command import RUNTIME_DIR

from ..conftest import PY, krex_status, run_daemon, until
from .conftest import MiB
from .test_admission import alloc, eventually, released, row, until_status

# A stand-in for torch's CUDA start: `torch.cuda._lazy_init()` calls `torch._C._cuda_init()`, looked
# up at call time as in torch; the "context" it makes is 300 MiB on the fake device.
FAKE_TORCH = {
    "torch/__init__.py": "from torch import _C\nfrom torch import cuda\n",
    "torch/_C.py": """
        import os
        from pathlib import Path
        from krex_async.devices import fake

        def _cuda_init():
            root = Path(os.environ[fake.DIR_VAR]) / os.environ[fake.DEVICE_VAR]
            if not fake.allocate(root, int(os.environ[fake.MEM_VAR]), 300 << 20):
                raise RuntimeError("CUDA out of memory")
        """,
    "torch/cuda/__init__.py": """
        import torch
        _initialized = False

        def _lazy_init():
            global _initialized
            if not _initialized:
                torch._C._cuda_init()
                _initialized = True
        """,
}

# a torch job: imports (here: says so), then starts CUDA, then holds its memory until released
TORCH_JOB = """
    import sys
    from pathlib import Path
    import torch
    Path(sys.argv[1]).touch()  # imported: the CPU part of the job runs
    torch.cuda._lazy_init()
    Path(sys.argv[2]).touch()  # CUDA started
    import time
    while not Path(sys.argv[3]).exists():
        time.sleep(0.02)
    """


def fake_torch(tmp_path: Path) -> str:
    root = tmp_path / "faketorch"
    for name, source in FAKE_TORCH.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(source))
    return str(root)


def gated(*extra: str, env: dict[str, str]) -> Any:
    return run_daemon("--devices", "fake:1", "--mem-headroom", "0", "--policy", "shared", *extra, env=env)


def held(fake_env: dict[str, str], pid: int) -> bool:
    """Whether process `pid` holds memory on the fake device."""
    return (Path(fake_env["KREX_FAKE_GPU_DIR"]) / "fake0" / str(pid)).exists()


async def test_a_gated_command_runs_at_once_and_waits_for_memory_at_its_cuda_start(fake, tmp_path):
    """A holds 600 of 1000 MiB. B (needs 600) is not queued: its process starts and runs (its
    'imports') while A holds the memory, and waits at its CUDA start, with its reason in status and
    none of the device's memory taken; A's end lets it on. A command that never starts CUDA ends
    with its gate unused; one that fits passes B's place in the queue (--mem-backfill). On the old
    code B was queued at submit and its process did not run."""
    env = fake
    ra, rb, b_ready = (str(tmp_path / n) for n in ("ra", "rb", "b-ready"))
    async with gated("--mem-commit", "peak", env=env) as d:
        c = await d.client()
        a = await c.submit(alloc("600M", release=ra), env=env, mem=600 * MiB)
        await until_status(c, a.command, lambda s: s["gate"] == "passed", "A passed its gate")
        b = await c.submit(alloc("600M", release=rb) + ["--ready", b_ready], env=env, mem=600 * MiB)
        assert not b.queued, "a gated command starts at once"
        await until(lambda: os.path.exists(b_ready), "B's process runs while A holds the memory")
        st = await until_status(c, b.command, lambda s: s["gate"] == "asked", "B waits at its gate")
        assert st["state"] == "running"
        assert "waiting for memory on fake0: needs ~0.6 GiB (declared), 0.4 GiB free" in st["waiting_for"]
        assert not held(env, st["pid"]), "B took no device memory while it waited"
        text = " ".join((await krex_status(d.socket, env)).stdout.split())
        assert f"1 queued for memory: {b.command}" in text, text
        only = await asyncio.to_thread(
            subprocess.run,
            [PY, "-m", "krex_async", "status", "--socket", d.socket, "--state", "gated", "--json"],
            capture_output=True,
            text=True,
            env=env,
            timeout=30,
        )
        assert [x["command"] for x in json.loads(only.stdout)["commands"]] == [b.command], only.stdout
        unused = await c.submit([PY, "-c", "pass"], env=env, mem=1)
        assert (await unused.wait()).report.gate == "unused"
        small = await c.submit(alloc("1M"), env=env, mem=MiB)  # fits: within --mem-backfill it passes B
        rep_small = (await small.wait()).report
        assert rep_small.exit_code == 0 and rep_small.gate == "passed", rep_small
        assert (await row(c, b.command))["gate"] == "asked"
        released(ra)
        assert (await a.wait()).report.exit_code == 0
        await until_status(c, b.command, lambda s: s["gate"] == "passed", "B let on once A ended")
        released(rb)
        rep = (await b.wait()).report
        assert rep.exit_code == 0 and rep.gate == "passed", rep
        assert rep.gate_s > 0, rep
        await c.close()


async def test_the_torch_cuda_start_is_what_waits(fake, tmp_path, script):
    """The runtime wraps torch._C._cuda_init as torch.cuda is imported: a torch job imports and
    runs its CPU part at once, and its CUDA start (300 MiB here) waits while A holds 800 of 1000."""
    env = dict(fake)
    env["PYTHONPATH"] = fake_torch(tmp_path) + os.pathsep + env["PYTHONPATH"]
    job = script("job.py", TORCH_JOB)
    ra, imported, started, rb = (str(tmp_path / n) for n in ("ra", "imported", "started", "rb"))
    async with gated("--mem-commit", "peak", env=env) as d:
        c = await d.client()
        a = await c.submit(alloc("800M", release=ra), env=env, mem=800 * MiB)
        await until_status(c, a.command, lambda s: s["gate"] == "passed", "A passed its gate")
        b = await c.submit([PY, job, imported, started, rb], env=env, mem=300 * MiB)
        await until(lambda: os.path.exists(imported), "the job imported torch and ran on")
        await until_status(c, b.command, lambda s: s["gate"] == "asked", "its CUDA start waits")
        assert not os.path.exists(started)
        released(ra)
        await until(lambda: os.path.exists(started), "its CUDA started once A ended")
        released(rb)
        rep = (await b.wait()).report
        assert rep.exit_code == 0 and rep.gate == "passed" and rep.gate_s > 0, rep
        await c.close()


# a torch job whose first CUDA start comes inside its region
CUDA_IN_REGION = """
    import sys
    from pathlib import Path
    import torch
    from krex_async import region
    with region("first-cuda"):
        torch.cuda._lazy_init()
        Path(sys.argv[1]).touch()
    """


async def test_a_cuda_start_inside_the_commands_own_region_passes_at_once(fake, tmp_path, script):
    """Under policy region, a job whose CUDA starts inside its own region holds the others off
    the device: waiting there for their memory would last until the region's timeout. It passes
    at once, though its declared 500 MiB does not fit beside A's 600."""
    env = dict(fake)
    env["PYTHONPATH"] = fake_torch(tmp_path) + os.pathsep + env["PYTHONPATH"]
    job = script("job.py", CUDA_IN_REGION)
    ra, started = str(tmp_path / "ra"), str(tmp_path / "started")
    async with gated(
        "--mem-commit",
        "peak",
        "--policy",
        "region",
        "--freeze",
        "device-holders",
        "--region-timeout",
        "600",
        env=env,
    ) as d:
        c = await d.client()
        a = await c.submit(alloc("600M", release=ra), env=env, mem=600 * MiB)
        await until_status(c, a.command, lambda s: s["gate"] == "passed", "A passed its gate")
        b = await c.submit([PY, job, started], env=env, mem=500 * MiB)
        rep = (await b.wait()).report
        assert rep.exit_code == 0 and rep.gate == "passed" and os.path.exists(started), rep
        assert (await row(c, a.command))["state"] == "running", "B passed while A held its memory"
        released(ra)
        assert (await a.wait()).report.exit_code == 0
        await c.close()


# holds a region named argv[1] until argv[2] exists, then another until argv[3] exists
REGION_OWNER = """
    import os, sys, time
    from krex_async import region
    def hold(name, until):
        with region(name):
            while not os.path.exists(until):
                time.sleep(0.02)
    hold("first", sys.argv[1])
    hold("second", sys.argv[2])
    """


async def b_asks_in_as_region(c: Any, env: dict[str, str], owner: str, r1: str, r2: str, rb: str) -> Any:
    """A holds its first region (until r1, then a second until r2); B (100 MiB, until rb) then
    asks at its gate. Returns A's and B's handles and B's status row."""
    a = await c.submit([PY, owner, r1, r2], env=env, mem=1)
    held = await eventually(c.status, lambda st: (st["devices"][0]["region"] or {}).get("name"), "A's region")
    assert held["devices"][0]["region"]["name"] == "first"
    b = await c.submit(alloc("100M", release=rb), env=env, mem=100 * MiB)
    st = await until_status(c, b.command, lambda s: s["gate"] == "asked", "B waits at its gate")
    return a, b, st


async def test_a_cuda_start_waits_for_the_region_that_holds_the_device(fake, tmp_path, script):
    """Under policy region a CUDA start does not begin beside another command's region (a context's
    creation is driver work beside its timing): B, which fits in memory, waits at its gate while A's
    region holds the device and starts at its release, not waiting for A's end."""
    env = fake
    owner = script("owner.py", REGION_OWNER)
    r1, r2, rb = (str(tmp_path / n) for n in ("r1", "r2", "rb"))
    async with gated("--policy", "region", "--freeze", "device-holders", env=env) as d:
        c = await d.client()
        a, b, st = await b_asks_in_as_region(c, env, owner, r1, r2, rb)
        assert "waiting for region" in st["waiting_for"] and "on fake0 to end" in st["waiting_for"], st
        released(r1)  # A's first region ends; A runs on, then holds a second
        await until_status(c, b.command, lambda s: s["gate"] == "passed", "B passed at the release")
        released(r2)
        released(rb)
        rep_a, rep_b = (await a.wait()).report, (await b.wait()).report
        assert rep_a.exit_code == 0 and rep_b.exit_code == 0 and rep_b.gate_s > 0, (rep_a, rep_b)
        await c.close()


async def test_a_cuda_start_waits_for_regions_at_most_region_gate_max_s(fake, tmp_path, script):
    """Regions that never leave the device free do not starve a CUDA start: after
    REGION_GATE_MAX_S at its gate it goes beside the region that still holds the device."""
    env = fake
    owner = script("owner.py", REGION_OWNER)
    r1, r2, rb = (str(tmp_path / n) for n in ("r1", "r2", "rb"))
    async with gated("--policy", "region", "--freeze", "device-holders", env=env) as d:
        c = await d.client()
        a, b, _ = await b_asks_in_as_region(c, env, owner, r1, r2, rb)
        await until_status(c, b.command, lambda s: s["gate"] == "passed", "B went after the bound")
        st = await c.status()
        assert st["devices"][0]["region"]["name"] == "first", "A's region still holds the device"
        released(rb)
        rep_b = (await b.wait()).report
        assert rep_b.exit_code == 0 and rep_b.gate_s >= REGION_GATE_MAX_S, rep_b
        released(r1)
        released(r2)
        assert (await a.wait()).report.exit_code == 0
        await c.close()


async def test_no_more_start_ahead_of_their_cuda_start_than_the_device_has_cpus(fake, tmp_path):
    """As many commands as the device has CPUs wait at their gates (X holds the memory): the next one
    is queued at submit, its process not started, with its reason; once one of them passes, it
    starts. Without the bound, --max-running auto's 64 jobs would all import at once."""
    env = fake
    cap = len(os.sched_getaffinity(0))  # the fake device's CPUs: the daemon's affinity
    rx = str(tmp_path / "rx")
    async with gated("--mem-commit", "peak", env=env) as d:
        c = await d.client()
        x = await c.submit(alloc("950M", release=rx), env=env, mem=950 * MiB)
        await until_status(c, x.command, lambda s: s["gate"] == "passed", "X passed its gate")
        ahead = [await c.submit(alloc("100M"), env=env, mem=100 * MiB + i) for i in range(cap)]
        for h in ahead:
            await until_status(c, h.command, lambda s: s["gate"] == "asked", "waits at its gate")
        last = await c.submit(alloc("100M"), env=env, mem=100 * MiB)
        assert last.queued
        st = await row(c, last.command)
        assert (
            st["state"] == "queued" and f"are ahead of their CUDA start (its {cap} CPUs)" in st["waiting_for"]
        ), st
        released(rx)
        for h in [*ahead, last]:
            rep = (await h.wait()).report
            assert rep.exit_code == 0 and rep.gate == "passed", rep
        await c.close()


async def test_a_command_on_the_device_without_asking_is_counted_once_seen(fake, tmp_path):
    """A program without torch never asks: once a sample sees it hold memory it is counted (gate
    'bypassed'), and B's CUDA start waits for it as for any other."""
    env = fake
    ra, rb = str(tmp_path / "ra"), str(tmp_path / "rb")
    async with gated("--mem-commit", "peak", env=env) as d:
        c = await d.client()
        a = await c.submit(alloc("600M", release=ra) + ["--no-cuda-gate"], env=env, mem=600 * MiB)
        await until_status(c, a.command, lambda s: s["gate"] == "bypassed", "A seen on the device")
        b = await c.submit(alloc("600M", release=rb), env=env, mem=600 * MiB)
        st = await until_status(c, b.command, lambda s: s["gate"] == "asked", "B waits at its gate")
        assert "waiting for memory on fake0" in st["waiting_for"], st
        released(ra)
        await until_status(c, b.command, lambda s: s["gate"] == "passed", "B let on once A ended")
        released(rb)
        rep_a, rep_b = (await a.wait()).report, (await b.wait()).report
        assert rep_a.gate == "bypassed" and rep_b.gate == "passed", (rep_a, rep_b)
        assert rep_a.exit_code == 0 and rep_b.exit_code == 0
        await c.close()


async def test_mem_gate_off_admits_at_the_start(fake, tmp_path):
    """--mem-gate off: B waits in the daemon's queue, its process not started (as before the gate)."""
    env = fake
    ra = str(tmp_path / "ra")
    async with gated("--mem-commit", "peak", "--mem-gate", "off", env=env) as d:
        c = await d.client()
        a = await c.submit(alloc("600M", release=ra), env=env, mem=600 * MiB)
        b = await c.submit(alloc("600M"), env=env, mem=600 * MiB)
        assert b.queued and (await row(c, b.command))["state"] == "queued"
        released(ra)
        rep_a, rep_b = (await a.wait()).report, (await b.wait()).report
        assert rep_b.exit_code == 0 and rep_a.gate == "" and rep_b.gate == "", (rep_a, rep_b)
        await c.close()


def test_an_unreachable_daemon_lets_cuda_start(tmp_path):
    """The gate never stops the program: with no daemon at KREX_SOCKET its CUDA starts at once."""
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": RUNTIME_DIR + os.pathsep + fake_torch(tmp_path),
        "KREX_CUDA_GATE": "1",
        "KREX_SOCKET": str(tmp_path / "none.sock"),
        "KREX_COMMAND": "x-1",
        "KREX_TOKEN": "t",
        "KREX_FAKE_GPU_DIR": str(tmp_path),
        "KREX_FAKE_GPU_DEVICE": "fake0",
        "KREX_FAKE_GPU_MEM": str(1 << 30),
    }
    (tmp_path / "fake0").mkdir()
    code = (
        "import sys, torch; torch.cuda._lazy_init(); "
        "g = sys.modules['_krex_cudagate']; print(g._asked, g.errors)"
    )
    out = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True ['FileNotFoundError"), out.stdout


# Waits at the gate on a thread (the daemon at KREX_SOCKET never answers), forks meanwhile, and
# prints what the child's gate holds.
FORK_WHILE_WAITING = """
    import os, sys, threading, time
    import torch
    gate = sys.modules["_krex_cudagate"]
    threading.Thread(target=torch.cuda._lazy_init, daemon=True).start()
    while gate._sock is None or not gate._asked:
        time.sleep(0.01)
    pid = os.fork()
    if pid == 0:
        print("child", gate._asked, gate._sock, flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    print("parent", gate._asked, gate._sock is not None, flush=True)
    os._exit(0)
    """


def test_a_child_forked_while_its_parent_waits_at_the_gate_asks_for_itself(tmp_path, script):
    """A fork while another thread waits at the gate: the child's own CUDA start asks for itself
    (it does not inherit 'asked'), and it drops its copy of the parent's connection."""
    import socket

    path = str(tmp_path / "mute.sock")
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(path)
    mute.listen(4)  # accepts (the kernel's backlog) and never answers
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": RUNTIME_DIR + os.pathsep + fake_torch(tmp_path),
        "KREX_CUDA_GATE": "1",
        "KREX_SOCKET": path,
        "KREX_COMMAND": "x-1",
        "KREX_TOKEN": "t",
    }
    try:
        out = subprocess.run(
            [PY, script("fork.py", FORK_WHILE_WAITING)], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        mute.close()
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["child False None", "parent True True"], out.stdout


async def test_an_oom_beside_a_command_never_seen_is_not_called_its_own(fake, tmp_path):
    """A program without torch never asks at its gate, and where NVML's pids are not the daemon's
    (KREX_FAKE_GPU_PID_OFFSET) no sample ever sees it: A holds 700 MiB uncounted. B, admitted
    alone, grows to 700 MiB and runs out of memory. The verdict reads the device now: something
    else holds memory there, so B was co-located and is re-run. Before, B's failure was called its
    own (`oom: "alone"`), not re-run. Here A holds its memory to the end, so the re-runs (guarded
    at the floor B's out-of-memory showed, then alone, by the figures, which do not see A) fail
    too, and the report says co-location, naming the device."""
    from krex_async.devices.fake import usage

    env = dict(fake, KREX_FAKE_GPU_PID_OFFSET="4000000")
    root = Path(env["KREX_FAKE_GPU_DIR"]) / "fake0"
    grow, ra = str(tmp_path / "grow"), str(tmp_path / "ra")
    async with gated(env=env) as d:
        c = await d.client()
        b = await c.submit(alloc("50M", "700M", gate=grow), env=env, rerun_on_oom=True)
        await until_status(c, b.command, lambda s: s["gate"] == "passed", "B passed its gate")
        await until(lambda: sum(usage(root).values()) >= 50 * MiB, "B allocated 50 MiB")
        a = await c.submit([*alloc("700M", release=ra), "--no-cuda-gate"], env=env)
        await until(lambda: sum(usage(root).values()) >= 750 * MiB, "A allocated 700 MiB, unasked")
        assert (await row(c, a.command))["gate"] == "open", "A was counted: the case is gone"
        released(grow)
        rep = (await b.wait()).report
        released(ra)
        rep_a = (await a.wait()).report
        await c.close()
    assert rep.exit_code != 0 and rep.reruns == 2 and rep.rerun_reason == "co-located OOM", rep
    assert rep.oom == "co-located" and "co-located on fake0" in rep.error, (rep.oom, rep.error)
    assert rep_a.exit_code == 0 and rep_a.gate in ("open", "unused", "bypassed"), rep_a
