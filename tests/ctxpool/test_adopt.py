"""Adoption: Python interpreters started anywhere in a command's tree run in warm pool workers.

Each test runs a real daemon (cgroup backend: a worker must join the command's cgroup) with
`colorsys` preloaded: a program sees it in sys.modules only when a worker ran it, which is the
marker of adoption. Every path is compared with what a plain interpreter does with the same input.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import subprocess
import textwrap
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest

from ..conftest import PY, krex_status, py_env, run_daemon, v2_mount

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or v2_mount() is None, reason="adoption needs the cgroup backend: root and cgroup v2"
)

MARK = "import sys as _s; _M = 'colorsys' in _s.modules\n"  # first line of every job


def write(d: Path, name: str, src: str) -> str:
    p = d / name
    p.parent.mkdir(parents=True, exist_ok=True)
    mark = src.startswith(MARK)
    p.write_text((MARK if mark else "") + textwrap.dedent(src[len(MARK) :] if mark else src))
    return str(p)


async def warm(c: Any, n: int = 1, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = (await c.status())["pools"]["cpu"]
        if st["warm"] >= n:
            return st
        assert time.monotonic() < deadline, st
        await asyncio.sleep(0.05)


# A not-adopted interpreter's runtime reports why from a thread, after the program started; one
# that ends first is not counted. A job calls declined(n) to end only once its command counts n.
DECLINED = """
import asyncio, os
from krex_async import Client

async def _counted(n):
    async with await Client.connect(os.environ["KREX_SOCKET"]) as c:
        while True:
            mine = [x for x in (await c.status())["commands"] if x["command"] == os.environ["KREX_COMMAND"]]
            if sum(mine[0]["pool_declined"].values()) >= n:
                return
            await asyncio.sleep(0.02)

def declined(n):
    asyncio.run(asyncio.wait_for(_counted(n), 30))
"""


def pooled_daemon(size: int = 2, *more: str) -> Any:
    return run_daemon(
        "--pool-size", str(size), "--pool-preload", "colorsys", "--isolation", "cgroup", *more, env=py_env()
    )


async def run_sh(c: Any, line: str, cwd: Path, **kw: Any) -> Any:
    await warm(c)
    return await c.run(["/bin/sh", "-c", line], env=py_env(**kw.pop("env", {})), cwd=str(cwd), **kw)


def plain(line: str, cwd: Path, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    """The same shell line without krex: what a fresh interpreter does."""
    return subprocess.run(
        ["/bin/sh", "-c", line], cwd=cwd, input=stdin, capture_output=True, env=py_env(), timeout=60
    )


async def test_sh_c_job_is_adopted_and_behaves_like_a_fresh_process(tmp_path: Path) -> None:
    write(
        tmp_path,
        "job.py",
        MARK
        + """
        import os, sys
        print("argv", sys.argv, "file", __file__, "name", __name__, flush=True)
        print("cwd", os.getcwd(), "env", os.environ.get("JOBVAR"), "stdin", sys.stdin.read())
        print("path0", sys.path[0], "exe", sys.executable, flush=True)
        for i in range(3):
            print("out", i, flush=True)
            print("err", i, file=sys.stderr, flush=True)
        print("adopted", _M, file=sys.stderr)
        raise SystemExit(7)
    """,
    )
    line = f"echo hello | JOBVAR=v {PY} job.py a 'b c' 2>&1; echo rc=$?"
    async with pooled_daemon() as d:
        async with await d.client() as c:
            res = await run_sh(c, line, tmp_path)
            st = (await c.status())["pools"]["cpu"]
    ref = plain(line, tmp_path)
    assert b"adopted True" in res.stdout, res.stdout
    assert res.stdout.replace(b"adopted True", b"adopted False") == ref.stdout
    assert res.stdout.endswith(b"rc=7\n")
    assert res.report.pool_adopted == 1 and res.report.pool_declined == {}, res.report
    assert st["adopted"] == 1 and all(w["rss_bytes"] for w in st["workers"]), st


async def test_runner_script_module_with_relative_imports_and_uncaught_exception(tmp_path: Path) -> None:
    write(tmp_path, "pkg/__init__.py", "")
    write(tmp_path, "pkg/helper.py", "VALUE = 42\n")
    write(
        tmp_path,
        "pkg/main.py",
        MARK
        + """
        from .helper import VALUE
        import sys
        print("value", VALUE, __name__, __package__, sys.argv, _M, flush=True)
        def boom():
            raise ValueError("bad " + sys.argv[1])
        boom()
    """,
    )
    write(
        tmp_path,
        "runner.sh",
        f"""
        set -u
        cd "$(dirname "$0")"
        {PY} -m pkg.main x
        echo "rc=$?"
    """,
    )
    async with pooled_daemon() as d:
        async with await d.client() as c:
            res = await run_sh(c, "bash runner.sh", tmp_path)
    ref = plain("bash runner.sh", tmp_path)
    assert b"True" in res.stdout and res.report.pool_adopted == 1, (res.stdout, res.report)
    assert res.stdout.replace(b"True", b"False") == ref.stdout
    assert res.stdout.endswith(b"rc=1\n")
    assert res.stderr == ref.stderr  # the same traceback, frame for frame
    assert b"ValueError: bad x" in res.stderr


async def test_subprocess_from_python_and_signals_reach_the_program(tmp_path: Path) -> None:
    """An absolute-path interpreter started by subprocess from an adopted one: SIGINT sent by the
    parent raises KeyboardInterrupt in the program; SIGTERM and SIGKILL end it as they would a
    fresh process (the parent sees -15, -9), and a killed adopter takes its worker with it."""
    write(
        tmp_path,
        "inner.py",
        MARK
        + """
        import os, sys, time
        if sys.argv[1] == "int":
            try:  # the line that tells the parent to signal is printed inside the handler's scope
                print(os.getpid(), _M, flush=True)
                time.sleep(30)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
                raise
        print(os.getpid(), _M, flush=True)
        time.sleep(30)
    """,
    )
    # No pause between interpreters: each starts while the pool warms the replacement of the
    # worker taken last, and must wait for it (--pool-wait) rather than start fresh.
    write(
        tmp_path,
        "outer.py",
        f"""
        import os, signal, subprocess, sys, time
        def running(pid):
            try:
                with open(f"/proc/{{pid}}/stat") as f:
                    return f.read().split()[2] != "Z"
            except OSError:
                return False
        for how, sig in (("int", signal.SIGINT), ("term", signal.SIGTERM), ("kill", signal.SIGKILL)):
            p = subprocess.Popen([{PY!r}, "inner.py", how], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            first = p.stdout.readline().split()
            p.send_signal(sig)
            out, err = p.communicate(timeout=20)
            print(how, p.returncode, first[1].decode(), out.decode().strip(),
                  err.decode().strip().splitlines()[-1:], flush=True)
            # a killed adopter's worker is killed by the daemon in turn: give it 10 s to be gone
            deadline = time.monotonic() + 10
            while (alive := running(int(first[0]))) and time.monotonic() < deadline:
                time.sleep(0.02)
            print(how, "program alive", alive, flush=True)
    """,
    )
    async with pooled_daemon() as d:
        async with await d.client() as c:
            res = await run_sh(c, f"{PY} outer.py", tmp_path, timeout=60)
    lines = res.stdout.decode().splitlines()
    assert lines[0] == "int -2 True interrupted ['KeyboardInterrupt']", lines
    assert lines[2] == "term -15 True  []", lines
    assert lines[4] == "kill -9 True  []", lines
    assert all(ln.endswith("alive False") for ln in lines[1::2]), lines
    assert res.report.pool_adopted == 4 and res.report.pool_declined == {}, res.report


async def test_timeout_kills_adopted_worker_and_ignored_signals_stay_ignored(tmp_path: Path) -> None:
    """A background job of sh inherits SIGINT ignored: so does its worker. At the command's
    timeout the worker dies with the command's tree."""
    write(
        tmp_path,
        "job.py",
        MARK
        + """
        import os, signal, time
        print(os.getpid(), _M, signal.getsignal(signal.SIGINT) == signal.SIG_IGN, flush=True)
        time.sleep(60)
    """,
    )
    async with pooled_daemon() as d:
        async with await d.client() as c:
            res = await run_sh(c, f"{PY} job.py & wait", tmp_path, timeout=3)
    pid, marker, ignored = res.stdout.split()
    assert (marker, ignored) == (b"True", b"True")
    assert res.report.state == "timeout"
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{int(pid)}") and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not os.path.exists(f"/proc/{int(pid)}")


async def test_multiprocessing_spawn_and_fork_in_an_adopted_program(tmp_path: Path) -> None:
    write(tmp_path, "declined.py", DECLINED)
    write(
        tmp_path,
        "mp.py",
        MARK
        + """
        import multiprocessing as mp, os, sys
        def square(x):
            return x * x
        if __name__ == "__main__":
            for method in ("spawn", "fork"):
                with mp.get_context(method).Pool(2) as p:
                    print(method, p.map(square, range(4)), flush=True)
                    if method == "spawn":  # its children are ended with the pool
                        from declined import declined
                        declined(2)
            print("adopted", _M)
    """,
    )
    async with pooled_daemon(3) as d:
        async with await d.client() as c:
            res = await run_sh(c, f"{PY} mp.py", tmp_path, timeout=60)
    assert res.stdout == b"spawn [0, 1, 4, 9]\nfork [0, 1, 4, 9]\nadopted True\n", res
    assert res.returncode == 0 and res.report.pool_adopted == 1, res.report
    # spawn's children (and its resource tracker) are handed pipes beyond fds 0-2: they start fresh
    assert res.report.pool_declined.get("fds beyond 0-2", 0) >= 2, res.report


async def test_ineligible_interpreters_run_as_before_and_say_why(tmp_path: Path) -> None:
    write(tmp_path, "declined.py", DECLINED)
    write(
        tmp_path,
        "job.py",
        MARK
        + """
        import sys
        print(_M, sys.flags.dev_mode, sys.stdout.write_through, flush=True)
        if len(sys.argv) > 1:
            from declined import declined
            declined(int(sys.argv[1]))
    """,
    )
    async with pooled_daemon() as d:
        async with await d.client() as c:
            # -u (or PYTHONUNBUFFERED) is the adopter's to choose, whatever the worker started with
            res = await run_sh(
                c,
                f"unset PYTHONUNBUFFERED; {PY} -X dev job.py 1; {PY} -u job.py; "
                f"CUDA_VISIBLE_DEVICES=7 {PY} job.py 2; {PY} job.py",
                tmp_path,
            )
    assert res.stdout.splitlines() == [
        b"False True False",
        b"True False True",
        b"False False False",
        b"True False False",
    ], (res.stdout, res.stderr)
    assert res.report.pool_adopted == 2
    assert res.report.pool_declined == {"flag -X": 1, "env CUDA_VISIBLE_DEVICES": 1}, res.report


async def test_no_pool_no_adoption_variable(tmp_path: Path) -> None:
    """Without a pool the runtime is told nothing (KREX_POOL unset): no request, nothing counted."""
    async with run_daemon("--isolation", "cgroup", env=py_env()) as d:
        async with await d.client() as c:
            res = await c.run(
                ["/bin/sh", "-c", f"{PY} -c 'import os; print(\"KREX_POOL\" in os.environ)'"],
                env=py_env(),
                cwd=str(tmp_path),
            )
    assert res.stdout == b"False\n"
    assert res.report.pool_adopted == 0 and res.report.pool_declined == {}


async def test_gateway_jobs_are_adopted(tmp_path: Path) -> None:
    """The gateway runs each job as `/bin/sh -c CMD` with its own PYTHONPATH and a `python3` shim:
    a job's interpreter and a runner script's are both adopted, and the job result says so."""
    from ..gateway.conftest import JOB_USER, stack

    if os.geteuid() == 0 and not _runs_as(JOB_USER, PY):
        pytest.skip(
            f"the gateway runs jobs as {JOB_USER}, who cannot run {PY} (a venv under a "
            "private home), so no pool of that user can serve them"
        )
    src = MARK + "import sys\nprint(_M, sys.argv[1:])\n"
    daemon_args = (
        "--pool-size",
        "2",
        "--pool-preload",
        "colorsys",
        "--isolation",
        "cgroup",
        "--pool-user",
        JOB_USER,
    )
    async with stack(tmp_path, daemon_args=daemon_args) as (daemon, _gw, c):
        async with await daemon.client() as dc:  # type: ignore[attr-defined]
            await warm(dc)
        results = []
        for line in ("python3 job.py direct", "bash runner.sh"):
            job = await c.dev(line, files={"job.py": src, "runner.sh": "python3 job.py runner\n"})
            results.append((await c.wait(job["job_id"], 60))["result"])
            async with await daemon.client() as dc:  # type: ignore[attr-defined]
                await warm(dc)
    assert [r["stdout"] for r in results] == ["True ['direct']\n", "True ['runner']\n"], results
    assert [r["krex"]["pool_adopted"] for r in results] == [1, 1], results


async def test_a_cancel_signals_the_program_once(tmp_path: Path) -> None:
    """A cancel with SIGTERM signals every process of the command, the adopter and its worker
    alike: the adopter must not forward the daemon's own signal, or the program would get two."""
    write(
        tmp_path,
        "job.py",
        MARK
        + """
        import signal, time
        got = []
        signal.signal(signal.SIGTERM, lambda *a: got.append(1))
        print("ready", _M, flush=True)
        time.sleep(1.0)
        time.sleep(0.5)  # a second signal would cut the first sleep short only once
        print("count", len(got), flush=True)
    """,
    )
    async with pooled_daemon() as d:
        async with await d.client() as c:
            await warm(c)
            h = await c.submit(
                ["/bin/sh", "-c", f"trap '' TERM; {PY} job.py"], env=py_env(), cwd=str(tmp_path)
            )
            out = b""
            async for _stream, data in h.output():
                out += data
                if b"ready" in out:
                    await h.cancel(signal.SIGTERM)
                    break
            res = await h.wait()
    assert (out + res.stdout).count(b"ready True") >= 1
    assert b"count 1\n" in out + res.stdout, (out, res.stdout)
    assert res.report.state == "cancelled" and res.report.pool_adopted == 1


async def test_only_a_process_with_the_workers_user_and_privileges_is_handed_over(tmp_path: Path) -> None:
    """Workers run as the pool's user: an adopter with any other uid (real, effective, saved or
    fs), gid, or fewer privileges (no_new_privs here; capabilities, seccomp, LSM label alike) is
    refused before a worker, or its environment and fds, are involved."""
    import ctypes
    import sys

    from krex_async import protocol as P
    from krex_async.ctxpool import Pool, PoolConfig
    from krex_async.ctxpool.adoption import refusal

    from .conftest import CPU

    pool = Pool(CPU, PoolConfig(size=1))
    await pool.start()
    await pool.wait_warm(timeout=30)
    interp = pool.interpreter
    assert interp is not None
    req = P.Adopt(
        id=2,
        command="c",
        token="t",
        argv=[PY, "job.py"],
        cwd=str(tmp_path),
        env={k: v for k, v in interp["init_env"].items() if v is not None},
        hexversion=sys.hexversion,
        flags=interp["flags"],
    )
    sleeper = [PY, "-c", "import time; time.sleep(30)"]
    other = ["/bin/sleep", "30"]  # the user check comes first; nobody may not run our interpreter
    no_new_privs = lambda: ctypes.CDLL(None).prctl(38, 1, 0, 0, 0)  # noqa: E731 PR_SET_NO_NEW_PRIVS
    procs = [
        subprocess.Popen(sleeper),
        subprocess.Popen(other, user=65534, group=65534),
        subprocess.Popen(other, group=65534),
        subprocess.Popen(sleeper, preexec_fn=no_new_privs),
    ]
    try:  # Popen returns once its child has exec'd: ids, privileges and exe are final
        assert [refusal(pool, req, p.pid) for p in procs] == [None, "user", "user", "privileges NoNewPrivs"]
        assert (
            refusal(
                pool,
                P.Adopt(id=2, command="c", token="t", argv=["/bin/sh", "x"], cwd="/", env={}),
                procs[0].pid,
            )
            == "interpreter version"
        )
    finally:
        for p in procs:
            p.kill()
            p.wait()
        await pool.close()


async def test_pool_refills_towards_the_commands_running_on_its_device(tmp_path: Path) -> None:
    """Warm workers are replaced only up to the number of commands running (at least one), never
    beyond --pool-size: three adoptions in a row from a pool of three leave one warm, not three."""
    async with pooled_daemon(3) as d:
        async with await d.client() as c:
            await warm(c, 3)
            for _ in range(3):
                res = await c.run(["/bin/sh", "-c", f"{PY} -c pass"], env=py_env(), cwd=str(tmp_path))
                assert res.report.pool_adopted == 1, res.report
            # a worker's exit is the last event that refills: wait until the used ones are gone
            deadline = time.monotonic() + 30
            while True:
                st = (await c.status())["pools"]["cpu"]
                if all(w["state"] in ("warm", "starting") for w in st["workers"]):
                    break
                assert time.monotonic() < deadline, st
                await asyncio.sleep(0.05)
    assert (st["demand"], st["target"], st["warm"] + st["starting"]) == (0, 1, 1), st


async def test_a_preloaded_module_the_program_would_load_from_elsewhere_declines(tmp_path: Path) -> None:
    """A `colorsys.py` beside the script, or on the command's PYTHONPATH, is what a fresh
    interpreter imports: the worker, which preloaded the standard one, declines and leaves."""
    write(
        tmp_path,
        "job.py",
        MARK
        + """
        import colorsys
        print(_M, colorsys.__file__.endswith("mine/colorsys.py") or "local" in colorsys.__file__)
    """,
    )
    write(tmp_path, "mine/colorsys.py", "")
    write(tmp_path, "local/job.py", MARK + "import colorsys\nprint(_M, colorsys.__file__)\n")
    write(tmp_path, "local/colorsys.py", "")
    with zipfile.ZipFile(tmp_path / "app.pyz", "w") as z:  # a zipapp bundling its own colorsys
        z.writestr(
            "__main__.py",
            "import colorsys, sys\nprint('colorsys' in sys.builtin_module_names, colorsys.__file__)\n",
        )
        z.writestr("colorsys.py", "")
    async with pooled_daemon() as d:
        async with await d.client() as c:
            res = await run_sh(c, f"{PY} job.py", tmp_path)
            shadow_path = await run_sh(c, f"PYTHONPATH={tmp_path / 'mine'}:$PYTHONPATH {PY} job.py", tmp_path)
            beside = await run_sh(c, f"{PY} local/job.py", tmp_path)
            zipped = await run_sh(c, f"{PY} app.pyz", tmp_path)
            st = (await c.status())["pools"]["cpu"]
    assert zipped.stdout == f"False {tmp_path / 'app.pyz' / 'colorsys.py'}\n".encode(), zipped
    assert zipped.report.pool_declined == {"module colorsys": 1}, zipped.report
    assert res.stdout == b"True False\n" and res.report.pool_adopted == 1, res
    assert shadow_path.stdout == b"False True\n", shadow_path
    assert shadow_path.report.pool_declined == {"module colorsys": 1}, shadow_path.report
    assert beside.stdout == f"False {tmp_path / 'local' / 'colorsys.py'}\n".encode(), beside
    assert beside.report.pool_declined == {"module colorsys": 1}, beside.report
    assert st["declined"] == {"module colorsys": 3}, st


async def test_a_reused_worker_adopts_again_and_leaks_nothing(tmp_path: Path) -> None:
    code = (
        "import os, sys; print(os.getpid(), 'json' in sys.modules, 'LEAK' in os.environ, "
        "'wave' in sys.modules); os.environ['LEAK'] = '1'; import wave"
    )
    async with run_daemon(
        "--pool-size",
        "1",
        "--pool-max-uses",
        "3",
        "--pool-preload",
        "json",
        "--isolation",
        "cgroup",
        env=py_env(),
    ) as d:
        async with await d.client() as c:
            outs = []
            for _ in range(3):
                res = await run_sh(c, f'{PY} -c "{code}"', tmp_path)
                assert res.report.pool_adopted == 1, res.report
                outs.append(res.stdout.split())
    assert len({o[0] for o in outs}) == 1, outs  # one worker served all three
    assert all(o[1:] == [b"True", b"False", b"False"] for o in outs), outs


async def test_device_holders_an_adoption_during_a_region_is_frozen_into_it(tmp_path: Path) -> None:
    """--freeze device-holders spares siblings without a GPU file, but a worker brings its
    context with it: a command adopting one during another's region is frozen until it ends."""
    owner = (
        "from krex_async import region; import time\n"
        "with region('t'):\n"
        "    print('in', flush=True); time.sleep(1.5); print(time.monotonic(), flush=True)\n"
    )
    write(tmp_path, "job.py", MARK + "import time\nprint(time.monotonic(), _M, flush=True)\n")
    async with run_daemon(
        "--pool-size",
        "2",
        "--pool-preload",
        "colorsys",
        "--isolation",
        "cgroup",
        "--freeze",
        "device-holders",
        env=py_env(),
    ) as d:
        async with await d.client() as c:
            await warm(c, 2)
            h = await c.submit([PY, "-c", owner], env=py_env(), cwd=str(tmp_path))
            out = b""
            async for _stream, data in h.output():
                out += data
                if b"in\n" in out:
                    break
            late = await c.run(["/bin/sh", "-c", f"{PY} job.py"], env=py_env(), cwd=str(tmp_path))
            first = await h.wait()
    released = float((out + first.stdout).split()[-1])
    started, marker = late.stdout.split()
    assert marker == b"True" and late.report.pool_adopted == 1, late
    assert float(started) >= released, (started, released)
    assert first.report.regions[0].frozen == [late.report.command], first.report.regions[0]


async def test_a_preload_that_sets_a_start_up_variable_does_not_decline(tmp_path: Path) -> None:
    """torch sets CUDA_MODULE_LOADING as it creates its context: a worker compares an adopter
    with the variables it started with, not with what its preloads set since."""
    mods = tmp_path / "mods"
    write(mods, "envsetter.py", "import os\nos.environ['CUDA_MODULE_LOADING'] = 'LAZY'\n")
    env = py_env(PYTHONPATH=f"{mods}:{py_env()['PYTHONPATH']}")
    env.pop("CUDA_MODULE_LOADING", None)
    write(tmp_path, "job.py", MARK + "import os\nprint(_M, os.environ.get('CUDA_MODULE_LOADING'))\n")
    async with run_daemon(
        "--pool-size", "1", "--pool-preload", "colorsys,envsetter", "--isolation", "cgroup", env=env
    ) as d:
        async with await d.client() as c:
            await warm(c)
            res = await c.run(["/bin/sh", "-c", f"{PY} job.py"], env=env, cwd=str(tmp_path))
    assert res.stdout == b"True None\n" and res.report.pool_adopted == 1, res


def _runs_as(user: str, exe: str) -> bool:
    try:
        subprocess.run([exe, "-c", ""], user=user, check=True, capture_output=True, timeout=60, cwd="/")
        return True
    except (OSError, subprocess.SubprocessError):
        return False


async def test_a_pool_of_another_user_serves_that_users_commands_only() -> None:
    """--pool-user: the gateway runs jobs as its --run-as user; a pool of that user adopts them,
    and still declines the daemon's own user's commands (never another user's privileges)."""
    import pwd
    import shutil
    import tempfile

    if not _runs_as("nobody", PY):
        pytest.skip(f"nobody cannot run {PY} (a venv under a private home)")
    nobody = pwd.getpwnam("nobody").pw_uid
    d = Path(tempfile.mkdtemp(prefix="krex-pooluser-", dir="/tmp"))
    d.chmod(0o755)
    try:
        write(d, "job.py", MARK + "print('adopted', _M)\n")
        async with run_daemon(
            "--pool-size",
            "1",
            "--pool-preload",
            "colorsys",
            "--isolation",
            "cgroup",
            "--pool-user",
            "nobody",
            env=py_env(),
        ) as dm:
            async with await dm.client() as c:
                await warm(c)
                theirs = await c.run(
                    ["/bin/sh", "-c", f"{PY} job.py"], env=py_env(), cwd=str(d), run_as=nobody
                )
                ours = await c.run(["/bin/sh", "-c", f"{PY} job.py"], env=py_env(), cwd=str(d))
        assert (theirs.stdout, theirs.report.pool_adopted) == (b"adopted True\n", 1), theirs
        assert (ours.stdout, ours.report.pool_adopted) == (b"adopted False\n", 0), ours
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_an_unknown_pool_user_is_refused_at_start(tmp_path: Path) -> None:
    for name in ("no-such-user-krex", "99999999999999999999"):
        r = subprocess.run(
            [
                PY,
                "-m",
                "krex_async",
                "serve",
                "--socket",
                str(tmp_path / "s"),
                "--state-dir",
                str(tmp_path / "st"),
                "--pool-size",
                "1",
                "--pool-user",
                name,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=py_env(),
        )
        assert r.returncode == 2 and f"flag --pool-user: {name!r}: no such user" in r.stderr, r.stderr
        # refused before the daemon made anything: no state dir, no socket
        assert not (tmp_path / "st").exists() and not (tmp_path / "s").exists()


def _gated(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A preload, `gate`, that lets the first worker warm and holds the others warming until the
    test creates `open` (the pool knows its interpreter only once a worker warmed)."""
    mods = tmp_path / "mods"
    write(
        mods,
        "gate.py",
        "import os, time\n"
        "d = os.path.dirname(os.path.abspath(__file__))\n"
        "try:\n    os.close(os.open(d + '/first', os.O_CREAT | os.O_EXCL))\n"
        "except FileExistsError:\n"
        "    while not os.path.exists(d + '/open'):\n        time.sleep(0.01)\n",
    )
    return mods, py_env(PYTHONPATH=f"{mods}:{py_env()['PYTHONPATH']}")


def gated_daemon(env: dict[str, str], pool_wait: str) -> Any:
    """A pool of one behind the gate (_gated), adopters waiting up to `pool_wait` s for a worker."""
    gate = ("--pool-size", "1", "--pool-preload", "colorsys,gate", "--isolation", "cgroup")
    return run_daemon(*gate, "--pool-wait", pool_wait, env=env)


async def test_a_burst_waits_for_warming_workers_instead_of_starting_cold(tmp_path: Path) -> None:
    """Two interpreters at once on a pool of one: the second waits (--pool-wait) for the worker
    that replaces the first, rather than paying a cold start; with --pool-wait 0 it runs plainly."""
    write(tmp_path, "job.py", MARK + "print('adopted', _M)\n")
    # Preloaded: the first worker warms at once, the others only once the test opens the gate; so
    # with --pool-wait 0 no replacement can be warm when the second interpreter asks, however slow.
    mods, env = _gated(tmp_path)
    line = f"{PY} job.py"
    for wait, adopted in (("10", 2), ("0", 1)):
        for f in ("first", "open"):
            (mods / f).unlink(missing_ok=True)
        if wait != "0":
            (mods / "open").touch()
        async with gated_daemon(env, wait) as d:
            async with await d.client() as c:
                await warm(c)
                got = await asyncio.gather(
                    *(c.run(["/bin/sh", "-c", line], env=env, cwd=str(tmp_path)) for _ in range(2))
                )
                (mods / "open").touch()
                shown = await krex_status(d.socket, env)
        # `krex status` tells, per pool, how many were adopted and why the others were not
        lines = shown.stdout.splitlines()
        row = lines[next(i for i, ln in enumerate(lines) if ln.startswith("POOL ")) + 1]
        assert f"adopted {adopted}" in row, shown.stdout
        assert ("declined" not in row) if adopted == 2 else "  declined 1 (no warm worker 1)  " in row, row
        assert sum(r.report.pool_adopted for r in got) == adopted, (wait, [r.report for r in got])
        declined = sum((collections.Counter(r.report.pool_declined) for r in got), collections.Counter())
        assert dict(declined) == ({} if adopted == 2 else {"no warm worker": 1}), (wait, declined)
        assert sorted(r.stdout for r in got) == sorted(
            [b"adopted True\n"] * adopted + [b"adopted False\n"] * (2 - adopted)
        ), wait


async def test_every_interpreter_of_a_burst_waits_its_turn(tmp_path: Path) -> None:
    """Three interpreters at once on a pool of one: each waits for the next replacement in turn.
    Before, the third gave up ("no warm worker") the moment the second was served, its own
    replacement not yet started (on the H200 a job of a burst declined so ran cold and set the
    run's makespan)."""
    write(tmp_path, "job.py", MARK + "print('adopted', _M)\n")
    env = py_env()
    async with pooled_daemon(1, "--pool-wait", "30") as d:
        async with await d.client() as c:
            await warm(c)
            got = await asyncio.gather(
                *(c.run(["/bin/sh", "-c", f"{PY} job.py"], env=env, cwd=str(tmp_path)) for _ in range(3))
            )
    assert [r.stdout for r in got] == [b"adopted True\n"] * 3, [r.report for r in got]
    assert [(r.report.pool_adopted, r.report.pool_declined) for r in got] == [(1, {})] * 3


# An adopted program that takes a region and prints its report: with `child`, it first starts a
# process of its own (still running through the region), which the region must freeze.
REGION_JOB = (
    MARK
    + """
import subprocess, sys, time, msgspec
from krex_async import region
kid = None
if "child" in sys.argv:
    kid = subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(30)"])
with region("timing", freeze_own_children=True) as r:
    time.sleep(0.1)
if kid is not None:
    kid.kill()
print(_M)
print(msgspec.json.encode(r.report).decode())
"""
)


@pytest.mark.parametrize("child", [False, True])
async def test_an_adopted_programs_region_leaves_its_waiting_interpreter_alone(
    tmp_path: Path, child: bool
) -> None:
    """The interpreter a worker adopted only waits for the worker's status, so a region of the
    adopted program does not freeze it (which would move the worker into the keep/ cgroup first:
    20-100 ms on the H200); a real child process of the program is still frozen."""
    job = write(tmp_path, "job.py", REGION_JOB)
    async with pooled_daemon() as d, await d.client() as c:
        # exec: as bash -c runs a single command (the gateway's jobs), no shell waits beside it
        res = await run_sh(c, f"exec {PY} {job}{' child' if child else ''}", tmp_path)
    assert res.returncode == 0, res.stderr
    marker, report = res.stdout.decode().splitlines()[:2]
    assert marker == "True", "not adopted"
    rep = json.loads(report)
    assert rep["outcome"] == "released", rep
    if child:
        assert rep.get("frozen_pids", 0) >= 1, rep
    else:
        assert rep.get("frozen_pids", 0) == 0 and rep.get("frozen", []) == [], rep


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_a_cancel_while_the_interpreter_waits_for_a_worker_still_ends_the_program(
    tmp_path: Path, sig: int
) -> None:
    """The interpreter waits for a warming worker with the signals it forwards blocked, and the
    worker is not yet in the command's tree: a cancel then must still reach the program. SIGTERM:
    the worker is served after the cancel, and gets the signal as it starts the program (it ran to
    its end before). SIGINT: nothing warms in time (--pool-wait 1), the interpreter runs the
    program itself and dies of the pending SIGINT (its KeyboardInterrupt was swallowed by the
    runtime's start-up before, and the program ran)."""
    write(
        tmp_path,
        "job.py",
        MARK + "import time\nprint('started', _M, flush=True)\ntime.sleep(4)\nprint('FINISHED')\n",
    )
    mods, env = _gated(tmp_path)
    adopted = sig == signal.SIGTERM
    line = f"trap 'echo shell got it' TERM INT; {PY} job.py; echo rc=$?"
    write(tmp_path, "hold.py", "import time\nprint('holding', flush=True)\ntime.sleep(60)\n")
    async with gated_daemon(env, "30" if adopted else "1") as d:
        async with await d.client() as c:
            await warm(c)
            holder = await c.submit([PY, "hold.py"], env=env, cwd=str(tmp_path))  # takes the worker
            async for _ in holder.output():
                break
            h = await c.submit(["/bin/sh", "-c", line], env=env, cwd=str(tmp_path))
            async with asyncio.timeout(20):
                while (await c.status())["pools"]["cpu"]["waiting"] < 1:
                    await asyncio.sleep(0.02)
            await h.cancel(sig)
            if adopted:
                (mods / "open").touch()
            res = await asyncio.wait_for(h.wait(), 30)
            await holder.cancel(signal.SIGKILL)
    assert b"FINISHED" not in res.stdout, res.stdout
    assert res.stdout.endswith(f"rc={128 + sig}\n".encode()), res.stdout
    assert res.report.state == "cancelled" and res.report.pool_adopted == int(adopted), res.report


async def test_what_the_adopted_program_sees_of_its_parent_and_its_own_end(tmp_path: Path) -> None:
    """Against a plain run of the same program: os.getppid() is the process that started it (not
    the daemon, so signalling it does not reach the daemon) while a child it forks sees the
    program; closing stdout gives its reader EOF at once (the waiting interpreter let go of its
    copy); a program killed by SIGKILL is seen by its parent as killed by SIGKILL (was exit 137)."""
    write(
        tmp_path,
        "inner.py",
        MARK
        + """
        import os, sys, time
        how = sys.argv[1]
        if how == "parent":
            me = os.getpid()
            pid = os.fork()
            if pid == 0:
                print("child sees program", os.getppid() == me, flush=True)
                os._exit(0)
            os.waitpid(pid, 0)
            print(os.getppid(), flush=True)
        elif how == "close":
            print("closing", flush=True)
            os.close(1)
            time.sleep(3)
        else:
            os.kill(os.getpid(), 9)
    """,
    )
    write(
        tmp_path,
        "outer.py",
        f"""
        import os, subprocess, sys, time
        def inner(*args):
            return subprocess.Popen([{PY!r}, "inner.py", *args], stdout=subprocess.PIPE)
        p = inner("parent")
        out = p.stdout.read().decode().split("\\n")
        print(out[0], out[1] == str(os.getpid()), p.wait())
        p = inner("close")
        t0 = time.monotonic()
        p.stdout.read()
        print("eof in 1 s", time.monotonic() - t0 < 1, p.wait())
        print("killed", inner("kill").wait())
    """,
    )
    async with pooled_daemon() as d:
        async with await d.client() as c:
            res = await run_sh(c, f"{PY} outer.py", tmp_path)
    ref = plain(f"{PY} outer.py", tmp_path)
    want = b"child sees program True True 0\neof in 1 s True 0\nkilled -9\n"
    assert ref.stdout == want, ref
    assert res.stdout == want, (res.stdout, res.stderr)
    assert res.report.pool_adopted >= 4, res.report


async def test_a_daemon_death_keeps_the_order_of_events_for_the_programs_parent(tmp_path: Path) -> None:
    """The daemon dies (SIGKILL) while a worker runs an adopted program: the program's status is
    lost with it (the interpreter exits 1, saying so), but its parent goes on only once the program
    ended, as it would have (before, at once, with the program still running)."""
    write(
        tmp_path,
        "job.py",
        MARK
        + "import time\nopen('started', 'w').write(str(_M))\ntime.sleep(1.5)\nopen('ended', 'w').close()\n",
    )
    line = f"{PY} job.py 2> err; echo $? > rc; if [ -e ended ]; then echo after; else echo before; fi > when"
    declined: list[Any] = []
    for _attempt in range(3):  # a loaded machine may decline an adoption (it says why): again
        for f in ("started", "ended", "rc", "err", "when"):
            (tmp_path / f).unlink(missing_ok=True)
        async with pooled_daemon() as d:
            async with await d.client() as c:
                await warm(c)
                h = await c.submit(["/bin/sh", "-c", line], env=py_env(), cwd=str(tmp_path))
                deadline = time.monotonic() + 20
                while not (tmp_path / "started").exists():
                    assert time.monotonic() < deadline, "the job did not start"
                    await asyncio.sleep(0.02)
                if (tmp_path / "started").read_text() != "True":  # ran in a fresh interpreter
                    st = await c.status()
                    declined.append([x["pool_declined"] for x in st["commands"] if x["command"] == h.command])
                    await h.wait()
                    continue
                d.proc.kill()
                d.proc.wait()
            while not (tmp_path / "when").exists():  # the tree runs on without its daemon
                assert time.monotonic() < deadline, "the shell did not go on"
                await asyncio.sleep(0.05)
        break
    assert (tmp_path / "started").read_text() == "True", f"never adopted: {declined}"
    assert (tmp_path / "when").read_text() == "after\n"
    assert (tmp_path / "rc").read_text() == "1\n" and b"lost the daemon" in (tmp_path / "err").read_bytes()


async def test_a_restarted_daemon_hands_over_the_adoptions_of_an_ended_command(tmp_path: Path) -> None:
    """The command's record gets its final report again once the pool's part is in it: a daemon
    restarted within the retention time reports how many interpreters were adopted (it said 0)."""
    write(tmp_path, "job.py", MARK + "print('adopted', _M)\n")
    state = str(tmp_path / "state")
    async with pooled_daemon(2, "--state-dir", state) as d:
        async with await d.client() as c:
            res = await run_sh(c, f"{PY} job.py; {PY} job.py", tmp_path)
    assert res.report.pool_adopted == 2, res.report
    async with pooled_daemon(2, "--state-dir", state) as d:
        async with await d.client() as c:
            again = await (await c.attach(res.report.command)).wait()
    assert again.report.pool_adopted == 2 and again.stdout == res.stdout, again
