"""The gateway over a daemon with memory-aware admission (the fake test vendor, devices/fake.py):
a job that runs out of memory beside another is run again alone, and its job says so; and
`--max-running auto` is accepted, a bad value refused."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from krex_async.client.submit import Client
from krex_async.gateway.command import job_features, job_shape

from ..conftest import until_async
from .conftest import JOB_USER, stack

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
        # Its guarded re-run waits at the floor its out-of-memory showed (50 MiB held, 650 more),
        # learned for its problem (its features, and this very job's floor key), not at its
        # --mem-default 100 MiB, which fit beside B and met B again (docs/admission.md)
        assert r["krex"]["reruns"] == 1 and r["krex"]["rerun_reason"] == "co-located OOM", r["krex"]
        assert r["stdout"] == "allocated 52428800\nallocated 734003200\n" and r["stderr"] == "", r
        assert (r["krex"]["mem_source"], r["krex"]["mem_need"]) == ("learned", 700 * MiB), r

        done_b = await c.wait(b["job_id"], 60)
        assert done_b["status"] == "succeeded" and done_b["result"]["krex"]["mem_peak"] >= 400 * MiB, done_b
        await krex.close()
        # B taught its own shape (its command and file names) and its kind; A's OOM its floor to
        # its problem (its features and its floor key, not its shape), and its re-run its peak,
        # where sampled, to its shape as well (memory.json is written within footprints.WRITE_S)
        state = Path(daemon.socket).parent / "state" / "memory.json"
        b_shape = job_shape({"command": f"python -m krex_async.devices.fake 400M --release {rb}"})
        user = f"u{pwd.getpwnam(JOB_USER).pw_uid if os.geteuid() == 0 else os.getuid()}"  # the job's
        key = f"{user} key gateway dev / {b_shape}"
        await until_async(lambda: _learned(state, key), "B's peak written to memory.json")
        learned = json.loads(state.read_text())["peaks"]
        assert learned[key] == [400 * MiB], learned
        assert 400 * MiB in learned[f"{user} key gateway dev"], learned
        a_shape = job_shape({"command": f"python -m krex_async.devices.fake 50M 700M --gate {gate}"})
        peak = r["krex"]["mem_peak"]  # 0 where its re-run ended before a sample saw it
        assert learned.get(f"{user} key gateway dev / {a_shape}", []) == ([peak] if peak else []), learned
        assert [v for k, v in learned.items() if k.startswith(f"{user} floor ")] == [[700 * MiB]], learned


async def _learned(state: Path, key: str) -> bool:
    return state.exists() and key in json.loads(state.read_text())["peaks"]


RUN = "import os, runpy, sys\nsys.argv = ['fake', {size!r}, '--release', os.environ['RELEASE']]\n" + (
    "runpy.run_module('krex_async.devices.fake', run_name='__main__')\n"
)


async def test_a_job_is_taken_at_what_its_own_problem_peaked_not_its_shapes_largest(
    tmp_path: Path, fake_gpu: str
) -> None:
    """Jobs of one shape (`python run.py`, as an agent's candidates all are) for two problems, one
    peaking at 400 MiB and one at 50: the small problem's next job is taken to need its own 50 MiB
    (the file it shares with its earlier job), not the shape's 400 (the old key of command and file
    names lumped every problem together, and admission held small jobs for the largest)."""
    daemon_args = ("--devices", "fake:1", "--mem-headroom", "0")
    async with stack(tmp_path, "--max-running", "auto", daemon_args=daemon_args) as (daemon, _gw, c):
        krex = await Client.connect(daemon.socket)  # type: ignore[attr-defined]

        async def job(size: str, release: str) -> dict:
            run = {"run.py": RUN.format(size=size)}  # the same file for each job of a problem
            j = await c.dev("python run.py", files=run, env_vars={"RELEASE": release})
            await until_async(
                lambda: _running(krex, f"gateway {j['job_id']}", int(size[:-1]) * MiB), f"{size} allocated"
            )
            Path(release).touch()
            done = await c.wait(j["job_id"], 60)
            assert done["status"] == "succeeded", done
            return done["result"]["krex"]

        releases = (os.path.join(fake_gpu, f"r{i}") for i in range(3))
        assert (await job("400M", next(releases)))["mem_peak"] >= 400 * MiB
        first = await job("50M", next(releases))  # its problem not seen yet: the shape's typical, 400
        assert (first["mem_need"], first["mem_source"]) == (400 * MiB, "typical"), first
        again = await job("50M", next(releases))
        assert (again["mem_need"], again["mem_source"]) == (50 * MiB, "learned"), again
        await krex.close()


def test_a_jobs_shape_is_its_command_and_file_names_not_their_contents() -> None:
    one = {"command": "python eval.py", "files": {"eval.py": "a", "kernel.cu": "x"}}
    assert job_shape(one) == job_shape({**one, "files": {"kernel.cu": "y", "eval.py": "b"}})
    assert job_shape(one) != job_shape({**one, "command": "python eval.py --big"})
    assert job_shape(one) != job_shape({**one, "files": {"eval.py": "a"}})


def test_a_jobs_features_are_its_contents_one_by_one() -> None:
    """What the daemon learns a job's need by: each file's name and content, its command; an eval
    job's reference and candidate; nothing of its environment or timeout."""
    one = {"command": "python eval.py", "files": {"eval.py": "a", "kernel.cu": "x"}, "timeout_s": 5}
    two = {**one, "files": {"eval.py": "a", "kernel.cu": "y"}, "env_vars": {"A": "1"}, "timeout_s": 9}
    f1, f2 = job_features(one), job_features(two)
    assert len(f1) == 3 and f1[:2] == f2[:2] and f1[2] != f2[2], (f1, f2)  # only the kernel differs
    assert [x.split()[:2] for x in f1[1:]] == [["file", "eval.py"], ["file", "kernel.cu"]], f1
    assert f1[0].startswith("command "), f1
    ev = job_features({"reference": {"reference_py": "r"}, "candidate": "c", "options": {}})
    assert [x.split()[0] for x in ev] == ["candidate", "reference"], ev
    many = job_features({"files": {f"f{i:03}.py": "" for i in range(100)}})
    assert len(many) == 64 and many[-1].startswith("file f063.py"), many[-1]


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
