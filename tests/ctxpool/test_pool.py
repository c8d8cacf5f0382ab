"""The pool's life: recovery from crashes, reuse hygiene, what it accepts, warming and pausing."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from krex_async.ctxpool import Pool, PoolConfig, WorkerStartError
from krex_async.devices.base import Device
from krex_async.linux.spawn import Launched, LaunchSpec, spawn
from tests.ctxpool.conftest import CPU, PY, finish, make_spec, run_pooled

# A command that leaves a thread running: the worker that ran it retires as it ends.
THREAD_LEFT = "import threading, time; threading.Thread(target=time.sleep, args=(30,), daemon=True).start()"


async def test_os_exit_reported_and_pool_recovers(pool: Pool, tmp_path: Path) -> None:
    r = await run_pooled(pool, [PY, "-c", "import os; os._exit(9)"], str(tmp_path))
    assert r.returncode == 9
    await pool.wait_warm(timeout=30)
    st = pool.status()
    assert st["warm"] == 2 and st["retired"] >= 1
    assert (await run_pooled(pool, [PY, "-c", "print('again')"], str(tmp_path))).stdout == b"again\n"


async def test_crash_by_signal_reported_and_pool_recovers(pool: Pool, tmp_path: Path) -> None:
    r = await run_pooled(pool, [PY, "-c", "import ctypes; ctypes.string_at(0)"], str(tmp_path))
    assert r.returncode == -signal.SIGSEGV
    await pool.wait_warm(timeout=30)
    assert pool.status()["warm"] == 2


async def test_idle_worker_killed_is_replaced(pool: Pool) -> None:
    victim = pool._lending.idle[0].pid
    os.kill(victim, signal.SIGKILL)
    async with asyncio.timeout(30):
        while any(w.pid == victim for w in pool._workers):
            await asyncio.sleep(0.02)
    assert all(w.pid != victim for w in pool._workers)
    await pool.wait_warm(timeout=30)
    assert pool.status()["retired"] == 1


async def test_killed_process_group_resolves_launched(pool: Pool, tmp_path: Path) -> None:
    """The daemon's timeout kills the command's process group: the worker is its leader."""
    spec, ours = make_spec([PY, "-c", "import time; print('up', flush=True); time.sleep(60)"], str(tmp_path))
    launched = await pool.launch(spec)
    assert launched is not None
    loop = asyncio.get_running_loop()
    first = b""
    while not first.endswith(b"\n"):  # unbuffered (PYTHONUNBUFFERED) print writes "up", then "\n"
        first += await loop.run_in_executor(None, os.read, ours[0], 100)
    # it runs: now time it out
    os.killpg(launched.pid, signal.SIGKILL)
    r = await finish(spec, ours, launched)
    assert (r.returncode, first + r.stdout) == (-signal.SIGKILL, b"up\n")


async def test_single_use_worker_exits_and_replacement_warms_ahead(pool: Pool, tmp_path: Path) -> None:
    spec, ours = make_spec([PY, "-c", "import time; time.sleep(60)"], str(tmp_path))
    launched = await pool.launch(spec)
    assert launched is not None
    await pool.wait_warm(2, timeout=30)  # a replacement is warm while the command still runs
    assert pool.status()["busy"] == 1
    os.killpg(launched.pid, signal.SIGTERM)
    r = await finish(spec, ours, launched)
    assert r.returncode == -signal.SIGTERM
    assert pool.status()["busy"] == 0 and pool.status()["warm"] == 2
    assert launched.pid not in [w.pid for w in pool._workers]  # single use: that worker is gone


async def test_launch_returns_none_when_nothing_warm(tmp_path: Path) -> None:
    p = Pool(CPU, PoolConfig(size=1, preload=["json"]))
    await p.start()
    try:
        await p.wait_warm(timeout=30)
        spec, _ = make_spec([PY, "-c", "import time; time.sleep(0.3)"], str(tmp_path))
        first = await p.launch(spec)
        spec2, _ = make_spec([PY, "-c", "pass"], str(tmp_path))
        assert first is not None and await p.launch(spec2) is None  # replacement still warming
        assert p.status()["misses"] == 1
        await first.wait()
    finally:
        await p.close()


async def test_reuse_leaks_no_module_env_or_cwd(reuse_pool: Pool, tmp_path: Path) -> None:
    cwd = str(tmp_path)
    first = await run_pooled(
        reuse_pool,
        [
            PY,
            "-c",
            (
                "import os, sys, colorsys, xml.dom, logging; os.environ['LEAK'] = '1'; os.chdir('/'); "
                "sys.path.append('/leak'); os.umask(0o077); logging.basicConfig(); print(os.getpid())"
            ),
        ],
        cwd,
    )
    probe = (
        "import os, sys; print(os.getpid(), 'colorsys' in sys.modules, 'xml.dom' in sys.modules, "
        "'LEAK' in os.environ, os.getcwd(), '/leak' in sys.path, oct(os.umask(0o022)), "
        "sorted(os.environ) == sorted(%r))"
    )
    env = dict(os.environ)
    umask = os.umask(0)
    os.umask(umask)
    second = await run_pooled(reuse_pool, [PY, "-c", probe % sorted(env)], cwd, env)
    pid = first.stdout.split()[0]
    assert first.launched.pid == second.launched.pid == int(pid)
    assert second.stdout.decode().split() == [
        pid.decode(),
        "False",
        "False",
        "False",
        cwd,
        "False",
        oct(umask),
        "True",
    ]
    # xml may be baseline (imported by a preload) or not; its .dom attribute must not survive either way
    third = await run_pooled(reuse_pool, [PY, "-c", "import xml, sys; print(hasattr(xml, 'dom'))"], cwd)
    assert third.launched.pid == first.launched.pid and third.stdout == b"False\n"
    await reuse_pool.wait_warm(timeout=30)  # max_uses=3 reached: that worker exited, another is warm
    assert first.launched.pid not in [w.pid for w in reuse_pool._workers]


async def test_reuse_reports_exit_codes_and_exceptions(reuse_pool: Pool, tmp_path: Path) -> None:
    r1 = await run_pooled(reuse_pool, [PY, "-c", "import sys; sys.exit(4)"], str(tmp_path))
    r2 = await run_pooled(reuse_pool, [PY, "-c", "raise KeyError('k')"], str(tmp_path))
    assert (r1.returncode, r2.returncode) == (4, 1)
    assert r2.stderr.endswith(b"KeyError: 'k'\n") and r1.launched.pid == r2.launched.pid


async def test_reuse_retires_worker_with_thread_left(reuse_pool: Pool, tmp_path: Path) -> None:
    import structlog.testing

    with structlog.testing.capture_logs() as logged:
        r = await run_pooled(reuse_pool, [PY, "-c", THREAD_LEFT], str(tmp_path))
        assert r.returncode == 0
        await reuse_pool.wait_warm(timeout=30)
    (line,) = [e for e in logged if e["event"] == "pool_worker_retired"]  # logged with its particulars
    assert line["device"] == "cpu" and line["reason"].startswith("threads left running: Thread-"), line
    assert r.launched.pid not in [w.pid for w in reuse_pool._workers]
    st = reuse_pool.status()
    assert st["retired"] == 1 and st["retired_why"] == {"threads left running": 1}, st
    # the count's class, and its last reason in full: which thread
    assert st["retired_last"]["threads left running"].startswith("threads left running: Thread-"), st


async def test_a_worker_retiring_as_its_command_ends_is_told_unsettled_once(tmp_path: Path) -> None:
    """on_unsettled (the region cores' fence_worker) hears of a worker once each time it comes to be in
    no command: started, back from a command to reset, and retired as its command ends. The last was
    told twice: by the retirement and again as a worker back from its command."""
    told: list[int] = []
    p = Pool(CPU, PoolConfig(size=1, max_uses=3, preload=["json"]), on_unsettled=told.append)
    await p.start()
    try:
        pid = (await run_pooled(p, [PY, "-c", "pass"], str(tmp_path))).launched.pid
        assert told == [pid, pid]  # started, then back from its command
        r = await run_pooled(p, [PY, "-c", THREAD_LEFT], str(tmp_path))
        assert r.returncode == 0 and r.launched.pid == pid
        await p.wait_warm(timeout=30)  # its replacement
        assert p.status()["retired_why"] == {"threads left running": 1}
        (new,) = p.pids() - {pid}
        assert sorted(told) == sorted([pid, pid, pid, new]), told  # + retired; the replacement started
    finally:
        await p.close()


async def test_a_worker_retired_while_a_region_holds_the_device_ends_at_the_regions_end(
    reuse_pool: Pool, tmp_path: Path
) -> None:
    """Ending, a worker frees its device memory in the kernel, which no hold stops: a worker that
    retires while a region has the pool paused waits (in its channel's receive) until the region
    ends (resume), then exits. Before, it exited at once, beside the region's timing."""
    if os.uname().machine != "x86_64":
        pytest.skip("reads the x86-64 number of the system call a worker waits in")
    reuse_pool.pause()  # what a region's entry does (quiesce)
    r = await run_pooled(reuse_pool, [PY, "-c", THREAD_LEFT], str(tmp_path))
    pid = r.launched.pid
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while reuse_pool.status()["retired"] < 1:  # it said why it retires: its command is over
        assert loop.time() < deadline, reuse_pool.status()
        await asyncio.sleep(0.02)
    while (now := _syscall(pid)) not in (None, RECVMSG):  # then: gone, or waiting for the pool
        assert loop.time() < deadline, now
        await asyncio.sleep(0.02)
    assert now == RECVMSG, "the retired worker ended while the region held the device"
    reuse_pool.resume()  # the region's release
    while _syscall(pid) is not None:
        assert loop.time() < deadline, f"worker {pid} did not end at the resume"
        await asyncio.sleep(0.02)


RECVMSG = 47  # x86-64: the receive a worker blocks in (socket.recv_fds)


def _syscall(pid: int) -> int | str | None:
    """The system call `pid`'s main thread is blocked in ("running" when it is not); None once it
    is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return None
        with open(f"/proc/{pid}/syscall") as f:
            first = f.read().split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return int(first) if first.lstrip("-").isdigit() else first


async def test_reuse_os_exit_resolves_with_real_status(reuse_pool: Pool, tmp_path: Path) -> None:
    r = await run_pooled(reuse_pool, [PY, "-c", "import os; os._exit(3)"], str(tmp_path))
    assert r.returncode == 3
    await reuse_pool.wait_warm(timeout=30)


async def test_warm_failure_is_a_typed_error_with_the_child_traceback() -> None:
    p = Pool(CPU, PoolConfig(size=1, preload=["no_such_module_krex"]))
    await p.start()
    try:
        with pytest.raises(WorkerStartError, match="ModuleNotFoundError"):
            await p.wait_warm(timeout=30)
        assert p.status()["failures"] >= 1
    finally:
        await p.close()


def test_accepts(tmp_path: Path) -> None:
    p = Pool(CPU, PoolConfig(size=1))
    env = dict(os.environ)

    def spec(argv: list[str], **kw: object) -> LaunchSpec:
        e = kw.pop("env", env)
        return LaunchSpec(argv=argv, cwd=str(tmp_path), env=e, stdin_fd=0, stdout_fd=1, stderr_fd=2, **kw)  # type: ignore[arg-type]

    assert p.accepts(spec([PY, "-c", "pass"]))
    assert p.accepts(spec([PY, "script.py", "-u"]))
    assert p.accepts(spec([PY, "-m", "json.tool"]))
    assert p.accepts(spec(["python", "-c", "pass"], env=dict(env, PATH=os.path.dirname(PY))))
    assert p.accepts(spec([PY, "-c", "pass"], uid=os.getuid()))
    assert not p.accepts(spec(["python", "-c", "pass"], env=dict(env, PATH="/nonexistent")))
    assert not p.accepts(spec(["echo", "hi"]))
    assert not p.accepts(spec(["/bin/sh", "-c", "echo hi"]))
    assert not p.accepts(spec([PY]))
    assert not p.accepts(spec([PY, "-u", "-c", "pass"]))
    assert not p.accepts(spec([PY, "-I", "script.py"]))
    assert not p.accepts(spec([PY, "-"]))
    assert not p.accepts(spec([PY, "-c", "pass"], uid=os.getuid() + 1))
    assert not p.accepts(spec([PY, "-c", "pass"], env=dict(env, PYTHONPATH="/elsewhere")))
    base = os.path.realpath(PY)  # the interpreter a venv links to, without the venv's site-packages
    if sys.prefix != sys.base_prefix:
        assert not p.accepts(spec([base, "-c", "pass"]))
    other = shutil.which("python3", path="/usr/bin:/bin")
    if other and os.path.realpath(other) != base:
        assert not p.accepts(spec([other, "-c", "pass"]))
    assert not Pool(CPU, PoolConfig(size=0)).accepts(spec([PY, "-c", "pass"]))


AMD = Device(index=0, key="amd0", vendor="amd", name="needs init, has no driver path without torch")


async def test_pause_holds_context_creation() -> None:
    """A non-cpu device goes through the node lock; while paused no worker gets to create a context."""
    p = Pool(AMD, PoolConfig(size=2, preload=["json"]))
    p.pause()
    await p.start()
    try:
        await asyncio.sleep(1.5)  # long enough to import json and ask for the lock
        st = p.status()
        assert (st["warm"], st["starting"], st["paused"]) == (0, 2, True)
        p.resume()
        await p.wait_warm(timeout=30)
        assert p.status()["warm"] == 2
    finally:
        await p.close()


async def test_context_creation_one_at_a_time_across_pools() -> None:
    from krex_async.ctxpool.pool import node_lock

    pools = [Pool(Device(index=i, key=f"amd{i}", vendor="amd", name="x"), PoolConfig(size=2)) for i in (0, 1)]
    lock, held = node_lock(), []

    async def watch() -> None:
        while True:
            held.append(lock.locked())
            await asyncio.sleep(0)

    w = asyncio.ensure_future(watch())
    for p in pools:
        await p.start()
    try:
        for p in pools:
            await p.wait_warm(timeout=30)
        assert any(held)  # every init went through the one node lock
    finally:
        w.cancel()
        for p in pools:
            await p.close()


async def test_context_creations_never_overlap(tmp_path: Path) -> None:
    """Each creation (an --pool-init module that records its start and end, sleeping between)
    of 2 pools x 2 workers runs alone: the recorded windows, sorted, never overlap."""
    marks = tmp_path / "marks"
    (tmp_path / "ctxmark.py").write_text(
        "import os, time\n"
        f"t0 = time.monotonic(); time.sleep(0.2)\n"
        f"open({str(marks)!r}, 'a').write(f'{{t0}} {{time.monotonic()}} {{os.getpid()}}\\n')\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    pools = [
        Pool(
            Device(index=i, key=f"amd{i}", vendor="amd", name="x"),
            PoolConfig(size=2, init_modules=["ctxmark"]),
            env=env,
        )
        for i in (0, 1)
    ]
    for p in pools:
        await p.start()
    try:
        for p in pools:
            await p.wait_warm(timeout=30)
    finally:
        for p in pools:
            await p.close()
    windows = sorted(tuple(map(float, ln.split()[:2])) for ln in marks.read_text().splitlines())
    assert len(windows) == 4, windows
    for (_, end), (start, _) in zip(windows, windows[1:]):
        assert end <= start, windows


async def test_close_stops_idle_workers() -> None:
    p = Pool(CPU, PoolConfig(size=2))
    await p.start()
    await p.wait_warm(timeout=30)
    pids = [w.pid for w in p._workers]
    await p.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


V2 = "/sys/fs/cgroup/unified" if os.path.exists("/sys/fs/cgroup/unified/cgroup.procs") else "/sys/fs/cgroup"


async def test_worker_joins_command_cgroup(pool: Pool, tmp_path: Path) -> None:
    if os.geteuid() != 0 or not os.access(os.path.join(V2, "cgroup.procs"), os.W_OK):
        pytest.skip("needs a writable cgroup v2 hierarchy")
    cg = os.path.join(V2, f"krex-ctxpool-test-{os.getpid()}")
    os.mkdir(cg)
    try:
        spec, ours = make_spec([PY, "-c", "print(open('/proc/self/cgroup').read())"], str(tmp_path))
        spec.cgroup_procs = os.path.join(cg, "cgroup.procs")
        launched = await pool.launch(spec)
        assert launched is not None
        r = await finish(spec, ours, launched)
        assert f"0::/{os.path.basename(cg)}" in r.stdout.decode()
    finally:
        for _ in range(100):
            try:
                os.rmdir(cg)
                break
            except OSError:
                await asyncio.sleep(0.05)


async def test_status_latencies(pool: Pool, tmp_path: Path) -> None:
    for form in (["-c", "pass"],):
        await run_pooled(pool, [PY, *form], str(tmp_path))
    st = pool.status()
    assert st["launched"] == 1 and st["start_latency_s"]["n"] == 1
    assert 0 < st["start_latency_s"]["p50"] < 1.0 and st["by_form"]["code"]["n"] == 1


async def test_sitecustomize_runs_with_the_command_env(tmp_path: Path) -> None:
    """A sitecustomize on PYTHONPATH (the daemon's runtime hook) runs per command, in its env."""
    from tests.ctxpool.conftest import run_plain

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nprint('site sees', os.environ.get('MARK'))\n")
    env = dict(os.environ, PYTHONPATH=str(site))
    p = Pool(CPU, PoolConfig(size=1), env=env)
    await p.start()
    try:
        cmd_env = dict(env, MARK="command-1")
        argv = [PY, "-c", "import sitecustomize, sys; print(sys.path[:2])"]
        plain = await run_plain(argv, str(tmp_path), cmd_env)
        pooled = await run_pooled(p, argv, str(tmp_path), cmd_env)
        assert plain.stdout.startswith(b"site sees command-1\n")
        assert (pooled.stdout, pooled.stderr, pooled.returncode) == (plain.stdout, plain.stderr, 0)
    finally:
        await p.close()


async def test_launch_nowait_for_sync_callers(pool: Pool, tmp_path: Path) -> None:
    spec, ours = make_spec([PY, "-c", "print('sync')"], str(tmp_path))
    launched = pool.launch_nowait(spec)
    assert launched is not None and launched.via == "pool"
    r = await finish(spec, ours, launched)
    assert (r.returncode, r.stdout) == (0, b"sync\n")


async def test_reused_worker_leaves_the_command_cgroup(reuse_pool: Pool, tmp_path: Path) -> None:
    if os.geteuid() != 0 or not os.access(os.path.join(V2, "cgroup.procs"), os.W_OK):
        pytest.skip("needs a writable cgroup v2 hierarchy")
    cg = os.path.join(V2, f"krex-ctxpool-reuse-{os.getpid()}")
    os.mkdir(cg)
    try:
        spec, ours = make_spec([PY, "-c", "print(open('/proc/self/cgroup').read())"], str(tmp_path))
        spec.cgroup_procs = os.path.join(cg, "cgroup.procs")
        launched = await reuse_pool.launch(spec)
        assert launched is not None
        r = await finish(spec, ours, launched)
        assert f"0::/{os.path.basename(cg)}" in r.stdout.decode()
        await reuse_pool.wait_warm(timeout=30)
        assert [w.pid for w in reuse_pool._workers] == [launched.pid]  # reused, not retired
        with open(spec.cgroup_procs) as f:
            assert f.read() == ""  # back home: the command's cgroup is empty and can go
    finally:
        os.rmdir(cg)


async def test_cgroup_hook_gets_the_worker_pid(tmp_path: Path) -> None:
    seen: list[int] = []

    async def hook(pid: int, spec: LaunchSpec) -> None:
        seen.append(pid)

    p = Pool(CPU, PoolConfig(size=1), cgroup_hook=hook)
    await p.start()
    try:
        r = await run_pooled(p, [PY, "-c", "import os; print(os.getpid())"], str(tmp_path))
        assert seen == [r.launched.pid] == [int(r.stdout)]
    finally:
        await p.close()


async def test_a_failing_cgroup_hook_gives_the_worker_to_an_adopter_that_waited_meanwhile(
    tmp_path: Path,
) -> None:
    """launch() awaits the hook with the worker out of the idle queue; an adopter that came then
    waits (nothing idle). When the hook fails the worker must go to that adopter at once, not back
    to an idle queue nobody is watching while the adopter waits out its timeout."""
    entered, fail = asyncio.Event(), asyncio.Event()

    async def hook(pid: int, spec: LaunchSpec) -> None:
        entered.set()
        await fail.wait()
        raise OSError("cgroup gone")

    p = Pool(AMD, PoolConfig(size=2, preload=["json"]), cgroup_hook=hook)
    await p.start()
    try:
        await p.wait_warm(2, timeout=30)
        p.pause()  # replacements stay warming
        other = await p.take(0)  # one reserved: its replacement warms, held by the pause
        assert other is not None
        (warm,) = p.idle_pids()
        spec, ours = make_spec([PY, "-c", "pass"], str(tmp_path))
        launching = asyncio.ensure_future(p.launch(spec))
        await entered.wait()
        waiting = asyncio.ensure_future(p.take(20))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        fail.set()
        with pytest.raises(OSError, match="cgroup gone"):
            await launching
        w = await asyncio.wait_for(waiting, 2)
        assert w is not None and w.pid == warm and w.reserved
        p.untake(w)
        p.untake(other)
        for fd in (spec.stdin_fd, spec.stdout_fd, spec.stderr_fd, *ours):
            os.close(fd)
    finally:
        await p.close()


async def test_reuse_resets_region_client_state(reuse_pool: Pool, tmp_path: Path) -> None:
    """region() outside krex warns once per process: a reused worker warns again for each command."""
    code = "from krex_async import region\nwith region('t'):\n    pass\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KREX_")}
    a = await run_pooled(reuse_pool, [PY, "-c", code], str(tmp_path), env)
    b = await run_pooled(reuse_pool, [PY, "-c", code], str(tmp_path), env)
    assert a.launched.pid == b.launched.pid
    assert a.stderr and a.stderr == b.stderr, (a.stderr, b.stderr)


async def test_pool_of_another_user(tmp_path: Path) -> None:
    """The daemon runs as root and commands as their agent's user: a pool per user takes theirs."""
    if os.geteuid() != 0:
        pytest.skip("needs root to start workers as another user")
    nobody = 65534
    spec, ours = make_spec([PY, "-m", "krex_async.ctxpool.forms"], os.getcwd())
    spec.uid = spec.gid = nobody
    spec.groups = []
    try:
        readable = (await finish(spec, ours, spawn(spec))).returncode == 0
    except PermissionError:
        for fd in (spec.stdin_fd, spec.stdout_fd, spec.stderr_fd, *ours):
            os.close(fd)
        readable = False
    if not readable:
        pytest.skip("this interpreter or checkout is not usable by uid 65534")
    os.chmod(tmp_path, 0o777)
    p = Pool(CPU, PoolConfig(size=1), user=(nobody, nobody, []))
    await p.start()
    try:
        spec, ours = make_spec(
            [PY, "-c", "import os; print(os.getuid(), os.getgid(), os.getgroups())"], str(tmp_path)
        )
        assert not p.accepts(spec)  # the daemon's own identity: not this pool's
        spec.uid, spec.gid, spec.groups = nobody, nobody, []
        assert p.accepts(spec)
        await p.wait_warm(timeout=30)
        launched = await p.launch(spec)
        assert launched is not None
        r = await finish(spec, ours, launched)
        assert r.stdout == f"{nobody} {nobody} []\n".encode()
    finally:
        await p.close()


async def test_large_environment_crosses_the_channel(pool: Pool, tmp_path: Path) -> None:
    env = dict(os.environ, BIG="x" * 300_000, MANY="1")
    env.update({f"KREX_T_{i}": str(i) * 50 for i in range(2000)})
    code = "import os; print(len(os.environ['BIG']), len(os.environ), os.environ['KREX_T_1999'][:4])"
    r = await run_pooled(pool, [PY, "-c", code], str(tmp_path), env)
    assert r.stdout == f"300000 {len(env)} 1999\n".encode(), r.stderr


async def test_fork_in_reused_worker_child_exits_like_python(reuse_pool: Pool, tmp_path: Path) -> None:
    from tests.ctxpool.conftest import run_plain

    code = (
        "import os, sys\npid = os.fork()\nif pid == 0:\n    print('child', flush=True)\n"
        "    sys.exit(3)\n_, st = os.waitpid(pid, 0)\n"
        "print('parent saw', os.waitstatus_to_exitcode(st))\n"
    )
    plain = await run_plain([PY, "-c", code], str(tmp_path))
    pooled = await run_pooled(reuse_pool, [PY, "-c", code], str(tmp_path))
    assert (pooled.returncode, pooled.stdout, pooled.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    again = await run_pooled(reuse_pool, [PY, "-c", "print('next')"], str(tmp_path))
    assert again.stdout == b"next\n" and again.launched.pid == pooled.launched.pid


async def test_reuse_resets_logging(reuse_pool: Pool, tmp_path: Path) -> None:
    """logging is baseline in a worker; a command's basicConfig must not silence the next one's."""
    from tests.ctxpool.conftest import run_plain

    code = "import logging; logging.basicConfig(format='%(levelname)s:%(message)s'); logging.warning('hi')"
    plain = await run_plain([PY, "-c", code], str(tmp_path))
    a = await run_pooled(reuse_pool, [PY, "-c", code], str(tmp_path))
    b = await run_pooled(reuse_pool, [PY, "-c", code.replace("%(levelname)s", "L")], str(tmp_path))
    assert a.launched.pid == b.launched.pid
    assert (a.stderr, b.stderr) == (plain.stderr, b"L:hi\n")


async def test_surplus_worker_does_not_leave_while_paused(tmp_path: Path) -> None:
    """A reused worker that comes back surplus (a replacement warmed while it was busy) exits at
    once, tearing its device context down; while a region holds the device (paused) it waits idle
    instead, and leaves at resume(). (keep_s=0: no keep window, which would keep it past resume.)"""
    p = Pool(CPU, PoolConfig(size=2, max_uses=3, preload=["json"], keep_s=0))
    p.set_demand(1)
    await p.start()
    try:
        await p.wait_warm(1, timeout=30)
        spec, ours = make_spec([PY, "-c", "import time; time.sleep(1.0)"], str(tmp_path))
        launched = await p.launch(spec)
        assert launched is not None
        p.set_demand(2)  # a second worker warms while the first runs
        await p.wait_warm(1, timeout=30)
        p.set_demand(1)
        p.pause()
        assert (await finish(spec, ours, launched)).returncode == 0
        await p.wait_warm(2, timeout=30)  # back, surplus, and still here
        await asyncio.sleep(0.3)
        assert launched.pid in p.pids() and p.status()["retired"] == 0
        p.resume()
        for _ in range(100):
            if launched.pid not in p.pids():
                break
            await asyncio.sleep(0.05)
        assert launched.pid not in p.pids() and p.status()["retired"] == 1
    finally:
        await p.close()


async def _back_while_demand_fell(
    p: Pool, tmp_path: Path, go: Path
) -> tuple[int, LaunchSpec, list[int], Launched]:
    """Two commands on two warm workers; the first ends while the demand is one (its agent thinks,
    the other runs on until `go` exists). Returns the first one's worker once it came back (idle)
    or left, and the second command (spec, our fds, Launched)."""
    p.set_demand(2)
    await p.start()
    await p.wait_warm(2, timeout=30)
    first, ours1 = make_spec([PY, "-c", "pass"], str(tmp_path))
    wait = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.02)"
    other, ours2 = make_spec([PY, "-c", wait], str(tmp_path))
    l1, l2 = await p.launch(first), await p.launch(other)
    assert l1 is not None and l2 is not None and l1.pid != l2.pid
    p.set_demand(1)  # the first command ended
    assert (await finish(first, ours1, l1)).returncode == 0
    async with asyncio.timeout(30):  # its worker resets and says "ready": idle again, or gone
        while l1.pid not in p.idle_pids() and l1.pid in p.pids():
            await asyncio.sleep(0.02)
    return l1.pid, other, ours2, l2


@pytest.mark.parametrize("keep_s", [30.0, 0.0])
async def test_worker_back_in_a_demand_dip_serves_the_next_job(keep_s: float, tmp_path: Path) -> None:
    """A reused worker that comes back in the gap between its agent's jobs (the demand one lower
    for the moment) stays for keep_s, and the agent's next job runs in it, with nothing warmed
    from scratch. keep_s=0 (the old behaviour): it leaves at once as surplus, and a replacement
    warms when the demand comes back."""
    p = Pool(CPU, PoolConfig(size=2, max_uses=3, preload=["json"], keep_s=keep_s))
    go = tmp_path / "go"
    try:
        pid, other, ours2, l2 = await _back_while_demand_fell(p, tmp_path, go)
        st = p.status()
        assert st["keep_s"] == keep_s and (st["demand"], st["target"]) == (1, 1)
        if keep_s:
            assert pid in p.idle_pids() and st["retired"] == 0 and st["kept"] == 2, st
            p.set_demand(2)  # the agent's next job
            assert p.status()["starting"] == 0  # nothing to warm: the worker stayed
            r = await run_pooled(p, [PY, "-c", "import os; print(os.getpid())"], str(tmp_path))
            assert (r.returncode, r.launched.pid, r.stdout) == (0, pid, f"{pid}\n".encode())
            assert p.status()["retired"] == 0
        else:
            async with asyncio.timeout(30):
                while pid in p.pids():
                    await asyncio.sleep(0.02)
            assert p.status()["retired_why"] == {"surplus": 1} and st["kept"] == 1
            p.set_demand(2)
            assert p.status()["starting"] == 1  # a replacement warms from scratch
        go.touch()
        assert (await finish(other, ours2, l2)).returncode == 0
    finally:
        go.touch()
        await p.close()


@pytest.mark.parametrize("paused", [False, True])
async def test_surplus_worker_leaves_after_keep_s_of_low_demand(paused: bool, tmp_path: Path) -> None:
    """With the demand low for keep_s, the worker kept leaves then (a timer, nothing else happens),
    counted as surplus; while a region holds the device (paused) not even then, but at resume()."""
    keep_s = 1.0
    p = Pool(CPU, PoolConfig(size=2, max_uses=3, preload=["json"], keep_s=keep_s))
    go = tmp_path / "go"
    try:
        if paused:
            p.pause()
        t0 = time.monotonic()  # before set_demand(1): the window starts no earlier
        pid, other, ours2, l2 = await _back_while_demand_fell(p, tmp_path, go)
        if paused:
            async with asyncio.timeout(30):  # the window ends (and its timer runs): still here, idle
                while p.status()["kept"] == 2:
                    await asyncio.sleep(0.02)
                end = time.monotonic() + 0.5
                while time.monotonic() < end:
                    assert pid in p.idle_pids() and p.status()["retired"] == 0
                    await asyncio.sleep(0.05)
            p.resume()
        async with asyncio.timeout(30):
            while pid in p.pids():
                await asyncio.sleep(0.02)
        assert time.monotonic() - t0 >= keep_s
        assert p.status()["retired_why"] == {"surplus": 1} and p.status()["kept"] == 1
        go.touch()
        assert (await finish(other, ours2, l2)).returncode == 0
    finally:
        go.touch()
        await p.close()


def test_demand_keeps_the_largest_of_the_last_keep_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """keep.Demand: warming follows the demand now; retiring the largest within keep_s."""
    from krex_async.ctxpool import keep

    now = [100.0]
    monkeypatch.setattr(keep.time, "monotonic", lambda: now[0])
    d = keep.Demand(size=4, keep_s=10.0)
    assert (d.target(), d.kept()) == (4, 4)  # no demand yet: the size
    for t, n in ((100.0, 3), (101.0, 2), (102.0, 0), (103.0, 1)):
        now[0] = t
        d.set(n)
    assert (d.target(), d.kept()) == (1, 4)  # the size, until 100 + 10
    now[0] = 110.5
    assert (d.target(), d.kept()) == (1, 3)  # 3 ended at 101
    now[0] = 111.5
    assert d.kept() == 2
    now[0] = 112.5
    assert d.kept() == 1
    z = keep.Demand(size=4, keep_s=0.0)
    z.set(3)
    z.set(1)
    assert (z.target(), z.kept()) == (1, 1)


async def test_take_serves_adopters_first_come_and_reserves_the_worker(tmp_path: Path) -> None:
    """Adopters waiting for warming workers (take()) are served in arrival order; the worker a
    waiter is offered is out of the idle queue, so nothing else takes it before its hand-over
    (on the H200 a later adopter took it while the first was held for a region, and the first
    ran without the pool), until untake(); and its replacement starts warming at once."""
    p = Pool(AMD, PoolConfig(size=2, preload=["json"]))
    p.pause()  # both workers stay warming (no context creation) until resume()
    await p.start()
    try:
        first = asyncio.ensure_future(p.take(30))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(p.take(30))
        await asyncio.sleep(0)
        third = asyncio.ensure_future(p.take(30))
        await asyncio.sleep(1.0)
        assert not any(t.done() for t in (first, second, third)) and p.status()["starting"] == 2
        p.resume()
        done, _ = await asyncio.wait([first, second], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert done == {first}  # contexts come one at a time: the first ready goes to the first
        w1 = first.result()
        assert w1 is not None and w1.state == "warm"
        w2 = await asyncio.wait_for(second, 30)
        # the third is served by a replacement started when the first two were reserved
        w3 = await asyncio.wait_for(third, 30)
        assert w2 is not None and w3 is not None and len({w1.pid, w2.pid, w3.pid}) == 3
        spec, _ = make_spec([PY, "-c", "pass"], str(tmp_path))
        async with asyncio.timeout(30):  # the replacements of w2 and w3 warm, idle
            while len(p.idle_pids()) < 2:
                await asyncio.sleep(0.05)
        idle = set(p.idle_pids())
        assert len(idle) == 2 and not idle & {w1.pid, w2.pid, w3.pid}  # reserved: not idle
        # given back with its replacement warm and nobody waiting, it is one too many: it leaves
        p.untake(w1)
        async with asyncio.timeout(30):
            while w1.pid in p.pids():
                await asyncio.sleep(0.02)
        assert set(p.idle_pids()) == idle and p.status()["retired"] == 1
        # given back while an adopter waits, it goes to that adopter at once
        p.pause()
        i1, i2 = await p.take(0), await p.take(0)  # the idle two; their replacements held warming
        assert i1 is not None and i2 is not None and {i1.pid, i2.pid} == idle
        waiting = asyncio.ensure_future(p.take(30))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        p.untake(i1)
        assert await asyncio.wait_for(waiting, 1) is i1
        assert await p.launch(spec) is None  # nothing idle: all reserved or warming
    finally:
        await p.close()


async def test_take_cancelled_or_closed_leaves_no_waiter(tmp_path: Path) -> None:
    """A cancelled waiter (its adopter went away) leaves the queue, and the worker it waited for
    becomes idle for the next one; close() answers a waiter at once (None)."""
    p = Pool(AMD, PoolConfig(size=1, preload=["json"]))
    p.pause()
    await p.start()
    try:
        waiting = asyncio.ensure_future(p.take(30))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert not p._lending.waiters
        p.resume()
        await p.wait_warm(1, timeout=30)
        assert len(p.idle_pids()) == 1
        p.pause()
        assert await p.take(0) is not None  # reserved: its replacement warms, held by the pause
        last = asyncio.ensure_future(p.take(30))
        await asyncio.sleep(0.3)
        assert not last.done() and p.status()["starting"] == 1
        await asyncio.wait_for(p.close(), 10)
        assert await asyncio.wait_for(last, 1) is None
    finally:
        await p.close()


async def test_a_reserved_worker_that_died_is_not_replaced_by_another_at_the_hand_over() -> None:
    """The region hold was checked for the reserved worker: if it died before the hand-over, the
    adoption is declined (the interpreter starts fresh) rather than given an unchecked worker."""
    p = Pool(CPU, PoolConfig(size=2, preload=["json"]))
    await p.start()
    try:
        await p.wait_warm(2, timeout=30)
        w = await p.take(0)
        assert w is not None
        os.kill(w.pid, signal.SIGKILL)
        await asyncio.wait_for(w.exited, 10)
        assert p.idle_pids()  # another worker is idle, and is not used instead
        pidfd = os.pidfd_open(os.getpid())
        try:
            got = await asyncio.wait_for(
                p.adopt(make_spec([PY, "-c", "pass"], "/")[0], pidfd, {}, worker=w), 5
            )
        finally:
            os.close(pidfd)
        assert got == "reserved worker gone"
    finally:
        await p.close()


def test_retire_reasons_are_counted_without_their_particulars() -> None:
    """Status counts retirements by class: the same cause with another path, pid or size is one key."""
    from krex_async.ctxpool.procs import retire_class

    a = retire_class("cannot go back to '/sys/fs/cgroup/a/cgroup.procs': [Errno 13] Permission denied")
    b = retire_class("cannot go back to '/sys/fs/cgroup/b/cgroup.procs': [Errno 1] Operation not permitted")
    assert a == b == "cannot go back to …"
    assert retire_class("device memory not returned: 512 bytes") == "device memory not returned"
    assert retire_class("threads left running: t1") != retire_class("surplus")
