"""The gateway over a daemon with memory-aware admission (the fake test vendor, devices/fake.py):
a job that runs out of memory beside another is run again alone, and its job says so; and
`--max-running auto` is accepted, a bad value refused."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from krex_async.client.submit import Client
from krex_async.gateway.command import job_shape

from .conftest import stack

MiB = 1 << 20


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> str:
    """A fake device's memory directory any job user may write (the daemon and the gateway
    inherit it through the environment)."""
    d = tempfile.mkdtemp(prefix="fakegpu-", dir="/tmp")
    for path in (d, os.path.join(d, "fake0")):
        os.makedirs(path, exist_ok=True)
        os.chmod(path, 0o1777)
    monkeypatch.setenv("KREX_FAKE_GPU_DIR", d)
    monkeypatch.setenv("KREX_FAKE_GPU_MEM", str(1000 * MiB))
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def _running(c: Client, label: str, at_least: int) -> bool:
    st = await c.status()
    return any(x["label"] == label and x["mem_peak"] >= at_least for x in st["commands"])


async def test_a_job_out_of_memory_beside_another_is_re_run_and_says_so(
    tmp_path: Path, fake_gpu: str
) -> None:
    gate, rb = os.path.join(fake_gpu, "gate"), os.path.join(fake_gpu, "rb")
    daemon_args = ("--devices", "fake:1", "--mem-headroom", "0", "--mem-default", str(100 * MiB))
    async with stack(tmp_path, "--max-running", "auto", daemon_args=daemon_args) as (daemon, _gw, c):
        krex = await Client.connect(daemon.socket)  # type: ignore[attr-defined]
        a = await c.dev(f"python -m krex_async.devices.fake 50M 700M --gate {gate}")
        await until_async(lambda: _running(krex, f"gateway {a['job_id']}", 50 * MiB), "job A allocated")
        b = await c.dev(f"python -m krex_async.devices.fake 400M --release {rb}")
        await until_async(lambda: _running(krex, f"gateway {b['job_id']}", 400 * MiB), "job B allocated")
        Path(gate).touch()  # A grows to 700 MiB beside B's 400: out of memory

        async def requeued() -> bool:
            st = await krex.status()
            return any(x["label"] == f"gateway {a['job_id']}" and x["reruns"] == 1 for x in st["commands"])

        await until_async(requeued, "job A re-queued after its out-of-memory")
        Path(rb).touch()
        done = await c.wait(a["job_id"], 60)
        assert done["status"] == "succeeded", done
        r = done["result"]
        assert r["krex"]["reruns"] == 1 and r["krex"]["rerun_reason"] == "co-located OOM", r["krex"]
        assert r["stdout"] == "allocated 52428800\nallocated 734003200\n" and r["stderr"] == "", r
        # what admission took it to need (--mem-default), and what B was seen to hold (400 MiB)
        assert (r["krex"]["mem_source"], r["krex"]["mem_need"]) == ("default", 100 * MiB), r["krex"]
        done_b = await c.wait(b["job_id"], 60)
        assert done_b["status"] == "succeeded" and done_b["result"]["krex"]["mem_peak"] >= 400 * MiB, done_b
        await krex.close()
        # B taught its own shape (its command and file names) and its kind; A's OOM taught nothing
        learned = json.loads((Path(daemon.socket).parent / "state" / "memory.json").read_text())["peaks"]
        b_shape = job_shape({"command": f"python -m krex_async.devices.fake 400M --release {rb}"})
        assert learned[f"key gateway dev / {b_shape}"] == [400 * MiB], learned
        assert 400 * MiB in learned["key gateway dev"], learned


def test_a_jobs_shape_is_its_command_and_file_names_not_their_contents() -> None:
    one = {"command": "python eval.py", "files": {"eval.py": "a", "kernel.cu": "x"}}
    assert job_shape(one) == job_shape({**one, "files": {"kernel.cu": "y", "eval.py": "b"}})
    assert job_shape(one) != job_shape({**one, "command": "python eval.py --big"})
    assert job_shape(one) != job_shape({**one, "files": {"eval.py": "a"}})


async def until_async(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 60.0) -> None:
    """conftest.until for an async check: poll until it holds, AssertionError after `timeout`."""
    t0 = asyncio.get_running_loop().time()
    while not await check():
        assert asyncio.get_running_loop().time() - t0 < timeout, f"not within {timeout:g} s: {what}"
        await asyncio.sleep(0.05)


def test_max_running_takes_a_number_or_auto(tmp_path: Path) -> None:
    from krex_async.gateway.limits import AUTO_MAX_RUNNING, max_running_arg

    assert max_running_arg("auto") == AUTO_MAX_RUNNING and max_running_arg("3") == 3
    for bad in ("0", "-1", "lots"):
        with pytest.raises(ValueError, match="--max-running"):
            max_running_arg(bad)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "krex_async.gateway",
            "--max-running",
            "lots",
            "--no-auth",
            "--state-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "--max-running 'lots': expected a number of jobs or auto" in p.stderr
