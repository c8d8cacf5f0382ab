"""The daemon runs Python commands in warm pool workers, indistinguishably from plain processes."""

from __future__ import annotations

import asyncio
import os

import pytest

from .conftest import PY, krex_status, py_env, run_daemon


async def test_python_commands_run_in_the_pool_and_match_plain_runs(script):
    src = script(
        "p.py",
        """
        import os, sys
        from krex_async import region
        print(sys.argv[1:], os.environ.get("KREX_DEVICE"), flush=True)
        with region("timing") as r:
            pass
        print(r.report.outcome, file=sys.stderr)
        raise SystemExit(3)
    """,
    )
    env = py_env()
    async with run_daemon("--pool-size", "2", "--pool-preload", "json", env=env) as d:
        async with await d.client() as c:
            for _ in range(100):  # wait for a warm worker
                st = await c.status()
                if st["pools"]["cpu"]["warm"] >= 1:
                    break
                await asyncio.sleep(0.1)
            pooled = await c.run([PY, src, "a", "b"], env=env)
            plain = await c.run([PY, "-X", "dev", src, "a", "b"], env=env)  # flags: never pooled
    assert pooled.report.via == "pool" and plain.report.via == "exec"
    assert pooled.report.start_latency_s is not None
    for res in (pooled, plain):
        assert res.returncode == 3
        assert res.stdout == b"['a', 'b'] cpu\n"
        assert res.stderr.strip().endswith(b"released")
        assert res.report.regions[0].outcome == "released"


def _backend_args(backend: str) -> tuple[str, ...]:
    """Daemon flags for an isolation backend; skips where the cgroup backend cannot run here."""
    if backend == "signal":
        return ("--isolation", "signal")
    from .conftest import v2_mount

    if os.geteuid() != 0 or v2_mount() is None:
        pytest.skip("the cgroup backend needs root and a cgroup v2 hierarchy")
    return ("--isolation", "cgroup")


async def _wait_pool(c, want: dict[str, int], timeout: float = 30) -> dict:
    """Poll status until the cpu pool's counts include `want`; returns that pool's status."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        st = (await c.status())["pools"]["cpu"]
        if all(st[k] == v for k, v in want.items()):
            return st
        assert asyncio.get_running_loop().time() < deadline, st
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("backend", ["signal", "cgroup"])
async def test_daemon_reuses_a_worker_and_leaks_nothing(backend: str, tmp_path) -> None:
    """--pool-max-uses 3: three commands in a row run in one worker pid, the pool is warm again
    between them, and neither a module nor a variable of one command is seen by the next.
    (--pool-keep-s reaches the pool.)"""
    env = py_env()
    first = "import os, sys, colorsys; os.environ['LEAK'] = '1'; print(os.getpid())"
    probe = (
        "import os, sys; print(os.getpid(), 'colorsys' in sys.modules, 'LEAK' in os.environ, "
        "open('/proc/self/cgroup').read().count('krex'))"
    )
    args = ("--pool-size", "1", "--pool-max-uses", "3", "--pool-keep-s", "5", *_backend_args(backend))
    async with run_daemon(*args, env=env) as d:
        async with await d.client() as c:
            await _wait_pool(c, {"warm": 1, "keep_s": 5.0})
            runs = []
            for code in (first, probe, probe):
                runs.append(await c.run([PY, "-c", code], env=env, cwd=str(tmp_path)))
                assert runs[-1].report.via == "pool", runs[-1].report
                if len(runs) < 3:  # the worker is back, warm, and was not retired
                    st = await _wait_pool(c, {"warm": 1})
                    assert st["retired"] == 0, st
            st = await _wait_pool(c, {"warm": 1, "retired": 1})  # its third use ended it; one warmed
            assert st["retired_why"] == {"used up (--pool-max-uses)": 1}, st
    pids = [int(r.stdout.split()[0]) for r in runs]
    assert pids[0] == pids[1] == pids[2], [r.stdout for r in runs]
    for r in runs[1:]:
        assert r.returncode == 0 and r.stdout.split()[1:3] == [b"False", b"False"], r.stdout


async def test_status_shows_pools_and_command_start_latency(tmp_path) -> None:
    """Plain `krex status`: a pool table (device, size, warm, busy, retired, start p50/p95) and a
    WAIT column holding the start latency of a command started through the pool."""
    env = py_env()
    async with run_daemon("--pool-size", "1", env=env) as d:
        async with await d.client() as c:
            await _wait_pool(c, {"warm": 1})
            pooled = await c.run([PY, "-c", "pass"], env=env, cwd=str(tmp_path))
            plain = await c.run([PY, "-X", "dev", "-c", "pass"], env=env, cwd=str(tmp_path))
            await _wait_pool(c, {"warm": 1})
            pst = (await c.status())["pools"]["cpu"]
        shown = await krex_status(d.socket, env)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["POOL", "SIZE"])
    assert lines[head].split() == ["POOL", "SIZE", "WARM", "BUSY", "RETIRED", "START_P50", "START_P95"]
    row = lines[head + 1].split()
    lat = pst["start_latency_s"]
    assert pst["retired_why"] == {"used up (--pool-max-uses)": pst["retired"]} and pst["retired"] >= 1, pst
    assert lines[head + 1].endswith(f"retired: {pst['retired']} (used up (--pool-max-uses) {pst['retired']})")
    assert row[:7] == [
        "cpu",
        "1",
        "1",
        "0",
        str(pst["retired"]),
        f"{lat['p50'] * 1e3:.1f}ms",
        f"{lat['p95'] * 1e3:.1f}ms",
    ], lines
    chead = next(ln for ln in lines if ln.startswith("COMMAND"))
    assert chead.split()[:7] == ["COMMAND", "STATE", "DEVICE", "PID", "STARTED", "AGE", "WAIT"]
    rows = {
        ln.split()[0]: ln.split()
        for ln in lines
        if ln.split()[:1] in ([pooled.report.command], [plain.report.command])
    }
    assert rows[pooled.report.command][6] == f"{pooled.report.start_latency_s * 1e3:.1f}ms", lines
    assert rows[plain.report.command][6] == "-", lines


async def test_region_waits_for_a_context_creation_in_flight(script, tmp_path) -> None:
    """A worker's context creation (here a slow --pool-init module, imported while the worker holds
    the node lock) that began before a region was asked for on its device ends before the grant,
    and the region's report says how long it waited."""
    mods = tmp_path / "mods"
    mods.mkdir()
    marks = tmp_path / "marks"
    (mods / "slowinit.py").write_text(
        "import time\n"
        f"open({str(marks)!r}, 'a').write(f'start {{time.time()}}\\n')\n"
        "time.sleep(1.5)\n"
        f"open({str(marks)!r}, 'a').write(f'end {{time.time()}}\\n')\n"
    )
    src = script(
        "r.py",
        """
        import time
        from krex_async import region
        with region("timing") as r:
            print(time.time(), flush=True)
    """,
    )
    env = py_env()
    env["PYTHONPATH"] = f"{mods}{os.pathsep}{env['PYTHONPATH']}"
    async with run_daemon("--pool-size", "1", "--pool-init", "slowinit", env=env) as d:
        async with await d.client() as c:
            for _ in range(200):
                if marks.exists():
                    break
                await asyncio.sleep(0.02)
            assert marks.exists(), d.logs()
            res = await c.run([PY, "-X", "dev", src], env=env)  # plain: the worker is not warm yet
            await _wait_pool(c, {"warm": 1})
    assert res.returncode == 0, res.stderr
    times = dict(ln.split() for ln in marks.read_text().splitlines())
    granted = float(res.stdout)
    assert float(times["start"]) < float(times["end"]) < granted, (times, granted)
    assert res.report.regions[0].pool_wait_s > 0.5, res.report.regions[0]


@pytest.mark.parametrize("max_uses", ["1", "3"])
async def test_pooled_command_past_its_timeout_is_reported_and_the_pool_recovers(max_uses, tmp_path) -> None:
    env = py_env()
    async with run_daemon("--pool-size", "1", "--pool-max-uses", max_uses, env=env) as d:
        async with await d.client() as c:
            await _wait_pool(c, {"warm": 1})
            slow = await c.run(
                [PY, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                env=env,
                cwd=str(tmp_path),
                timeout=1.0,
            )
            assert slow.report.via == "pool" and slow.report.state == "timeout", slow.report
            assert slow.stdout == b"up\n" and 0.9 < slow.report.wall_s < 10, slow.report
            st = await _wait_pool(c, {"warm": 1, "busy": 0, "retired": 1})
            assert st["failures"] == 0, st
            after = await c.run([PY, "-c", "print('ok')"], env=env, cwd=str(tmp_path))
    assert after.report.via == "pool" and (after.returncode, after.stdout) == (0, b"ok\n")


async def test_pooled_command_runs_inside_its_command_cgroup(tmp_path) -> None:
    """Under the daemon's cgroup backend a worker runs the command in that command's cgroup (v2 and,
    on hybrid hosts, the v1 cpuset), seen from inside the command."""
    env = py_env()
    code = "import os; print(os.environ['KREX_COMMAND']); print(open('/proc/self/cgroup').read())"
    async with run_daemon("--pool-size", "1", *_backend_args("cgroup"), env=env) as d:
        async with await d.client() as c:
            await _wait_pool(c, {"warm": 1})
            res = await c.run([PY, "-c", code], env=env, cwd=str(tmp_path))
    assert res.report.via == "pool" and res.returncode == 0, res.stderr
    cid, *lines = res.stdout.decode().splitlines()
    v2 = next(ln for ln in lines if ln.startswith("0::"))
    assert "/krex/d-" in v2 and v2.endswith(f"/cmd-{cid}/run"), lines  # krex/<instance>/cmd-<id>
    cpuset = [ln for ln in lines if ln.split(":")[1:2] == ["cpuset"]]
    if cpuset and cpuset[0].split(":", 2)[2] != "/":  # hybrid host with the v1 cpuset in use
        assert f"cmd-{cid}" in cpuset[0], lines
