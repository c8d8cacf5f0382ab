"""Commands on real processes: output, environment, timeout, policies, the CLI, and shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import pytest

from krex_async import KrexError

from .conftest import PY, ROOT, is_frozen, proc_state, py_env, run_daemon, until


async def test_a_relay_reads_the_output_once_and_sees_the_connection_end() -> None:
    """What a relay (the gateway's runner, the fleet's agent) needs of the client, in public: output
    streamed with keep=False is not kept a second time in the handle (the runner cleared the
    handle's private buffers, and read the client's private reader task to see a lost connection)."""
    async with run_daemon() as d:
        c = await d.client()
        assert c.connected
        argv = ["sh", "-c", "echo one; echo two >&2"]
        kept, relayed = await c.submit(argv), await c.submit(argv)
        seen = [x async for x in kept.output()]
        told = [x async for x in relayed.output(keep=False)]
        a, b = await kept.wait(), await relayed.wait()
        assert sorted(seen) == sorted(told) == [("stderr", b"two\n"), ("stdout", b"one\n")]
        assert (a.stdout, a.stderr) == (b"one\n", b"two\n") and a.returncode == b.returncode == 0
        assert (b.stdout, b.stderr) == (b"", b"")  # the relay's copy is its own
        await c.close()
        assert not c.connected
        lost = await d.client()
    await until(lambda: not lost.connected, "the stopped daemon's connection to end")
    await lost.close()


async def test_output_env_and_exit(script, tmp_path):
    src = script(
        "env.py",
        """
        import os, sys
        print("out", flush=True)
        print("err", file=sys.stderr, flush=True)
        print(os.getcwd())
        for k in ("KREX_COMMAND", "KREX_DEVICE", "FOO"):
            print(k, os.environ.get(k))
        print("token", bool(os.environ.get("KREX_TOKEN")), "socket", bool(os.environ.get("KREX_SOCKET")))
        sys.exit(5)
    """,
    )
    async with run_daemon() as d:
        async with await d.client() as c:
            h = await c.submit([PY, src], cwd=str(tmp_path), env=py_env(FOO="bar"))
            chunks = [(s, data) async for s, data in h.output()]
            res = await h.wait()
    assert res.returncode == 5
    assert b"".join(data for s, data in chunks if s == "stderr") == b"err\n"
    assert b"".join(data for s, data in chunks if s == "stdout") == res.stdout
    lines = res.stdout.decode().splitlines()
    assert lines[0] == "out" and lines[1] == str(tmp_path)
    assert f"KREX_COMMAND {h.command}" in lines and "KREX_DEVICE cpu" in lines
    assert "FOO bar" in lines and "token True socket True" in lines
    assert res.report.state == "exited" and res.report.wall_s > 0


async def test_timeout_kills_the_whole_tree(tmp_path):
    pidfile = tmp_path / "child.pid"
    async with run_daemon() as d:
        async with await d.client() as c:
            t0 = time.monotonic()
            res = await c.run(["sh", "-c", f"sleep 30 & echo $! > {pidfile}; wait"], timeout=0.5)
            elapsed = time.monotonic() - t0
    assert res.report.state == "timeout" and res.report.signal == signal.SIGKILL
    assert elapsed < 5
    child = int(pidfile.read_text())
    assert proc_state(child) in (None, "Z"), "the timed-out command's child survived"


async def test_leftover_processes_end_with_the_leader(tmp_path):
    pidfile = tmp_path / "bg.pid"
    async with run_daemon() as d:
        async with await d.client() as c:
            res = await c.run(["sh", "-c", f"sleep 30 > /dev/null 2>&1 & echo $! > {pidfile}"])
            await asyncio.sleep(0.3)
    assert res.returncode == 0
    assert proc_state(int(pidfile.read_text())) in (None, "Z")


async def test_command_policy_serialises_commands(script):
    async with run_daemon("--policy", "command") as d:
        async with await d.client() as c:
            src = script(
                "r.py",
                """
                import time
                from krex_async import region
                t0 = time.monotonic()
                with region("timing") as r:
                    time.sleep(0.3)
                print(t0, time.monotonic(), r.report.frozen, r.report.policy)
            """,
            )
            a, b = await asyncio.gather(c.run([PY, src], env=py_env()), c.run([PY, src], env=py_env()))
    (a0, a1, *_), (b0, b1, *_) = (x.stdout.split() for x in (a, b))
    first, second = sorted([(float(a0), float(a1)), (float(b0), float(b1))])
    assert second[0] >= first[1], "under policy command two commands on a device overlapped"
    assert max(a.report.queued_s, b.report.queued_s) > 0.25
    assert a.report.regions[0].policy == "command" and a.report.regions[0].frozen == []


async def test_device_none_and_bad_devices():

    async with run_daemon("--devices", "cpu:2") as d:
        async with await d.client() as c:
            res = await c.run(["sh", "-c", "echo $KREX_DEVICE"], device="none")
            assert res.stdout == b"none\n"
            res = await c.run(["sh", "-c", "echo $KREX_DEVICE"], device="cpu1")
            assert res.stdout == b"cpu1\n"
            with pytest.raises(KrexError) as e:
                await c.submit(["true"], device="7")
            assert e.value.code == "bad_device" and "cpu0" in e.value.message


async def test_cli_run_behaves_like_the_command(tmp_path):
    report = tmp_path / "r.json"
    cmd = ["sh", "-c", "echo to-out; echo to-err >&2; exit 4"]
    direct = subprocess.run(cmd, capture_output=True)
    async with run_daemon() as d:
        env = py_env(KREX_SOCKET=d.socket)
        p = await asyncio.to_thread(
            subprocess.run,
            [PY, "-m", "krex_async", "run", "--report", str(report), "--", *cmd],
            capture_output=True,
            env=env,
            cwd=ROOT,
            timeout=30,
        )
        missing = await asyncio.to_thread(
            subprocess.run,
            [PY, "-m", "krex_async", "run", "--", "no-such-program-krex"],
            capture_output=True,
            env=env,
            timeout=30,
        )
        killed = await asyncio.to_thread(
            subprocess.run,
            [PY, "-m", "krex_async", "run", "--", "sh", "-c", "kill -9 $$"],
            capture_output=True,
            env=env,
            timeout=30,
        )
        st = await asyncio.to_thread(
            subprocess.run,
            [PY, "-m", "krex_async", "status", "--json"],
            capture_output=True,
            env=env,
            timeout=30,
        )
    assert (p.returncode, p.stdout, p.stderr) == (direct.returncode, direct.stdout, direct.stderr)
    rep = json.loads(report.read_text())
    assert rep["exit_code"] == 4 and rep["state"] == "exited"
    assert missing.returncode == 127 and b"not found" in missing.stderr
    assert killed.returncode == 128 + 9
    status = json.loads(st.stdout)
    assert status["policy"] == "region" and status["devices"][0]["key"] == "cpu"


async def test_shutdown_mid_region_leaves_nothing_stopped(script, tmp_path):
    pids = tmp_path / "pids"
    sibling = script(
        "sib.py",
        f"""
        import os, time
        open({str(pids)!r}, "a").write(f"{{os.getpid()}}\\n")
        while True:
            time.sleep(0.01)
    """,
    )
    holder = script(
        "hold.py",
        f"""
        import os, time
        from krex_async import region
        with region("timing"):
            open({str(pids)!r}, "a").write(f"{{os.getpid()}}\\n")
            time.sleep(60)
    """,
    )
    async with run_daemon() as d:
        async with await d.client() as c:
            hs = [await c.submit([PY, sibling], env=py_env()) for _ in range(2)]
            await asyncio.sleep(0.5)
            owner = await c.submit([PY, holder], env=py_env())
            deadline = time.monotonic() + 10
            while not pids.exists() or len(pids.read_text().split()) < 3:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
            all_pids = [int(x) for x in pids.read_text().split()]
            assert any(is_frozen(p) for p in all_pids), "no sibling was frozen"
            t0 = time.monotonic()
            d.proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*(h.wait() for h in [*hs, owner]))
            rc = await asyncio.to_thread(d.proc.wait, 20)
    assert rc == 0
    assert time.monotonic() - t0 < 10
    assert all(r.report.state == "shutdown" for r in results)
    assert not os.path.exists(d.socket), "the socket was not removed"
    for p in all_pids:
        assert proc_state(p) in (None, "Z"), f"pid {p} left behind in state {proc_state(p)}"


async def test_cancel_and_attach_after_disconnect(script):
    async with run_daemon() as d:
        async with await d.client() as c:
            h = await c.submit(["sh", "-c", "echo early; sleep 0.5; echo late"], on_disconnect="keep")
            cid = h.command
        await asyncio.sleep(1.0)
        async with await d.client() as c:
            res = await (await c.attach(cid)).wait()
            assert res.returncode == 0 and res.stdout == b"early\nlate\n"
            h2 = await c.submit(["sleep", "30"])
            await asyncio.sleep(0.2)
            await c.cancel(h2.command)
            r2 = await h2.wait()
            assert r2.report.state == "cancelled" and r2.returncode == -15


async def test_disconnect_kills_or_keeps_per_request(tmp_path):
    pids = {k: tmp_path / k for k in ("kill", "keep")}
    async with run_daemon() as d:
        c = await d.client()
        for mode, path in pids.items():
            await c.submit(["sh", "-c", f"echo $$ > {path}; exec sleep 30"], on_disconnect=mode)
        deadline = time.monotonic() + 10
        while not all(p.exists() and p.read_text().strip() for p in pids.values()):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await c.close()
        await asyncio.sleep(1.0)
        killed, kept = (int(p.read_text()) for p in pids.values())
        assert proc_state(killed) in (None, "Z"), "on_disconnect=kill left the command running"
        assert proc_state(kept) not in (None, "Z"), "on_disconnect=keep ended the command"


async def test_a_request_on_a_connection_the_daemon_closed_fails_at_once():
    """The gateway keeps one daemon connection: a request sent after the daemon went away must
    fail ("disconnected"), not wait for a reply that can never come (a job stayed running)."""
    async with run_daemon() as d:
        c = await d.client()
        d.stop()
        async with asyncio.timeout(5):
            while not c._task.done():  # the read loop sees the end of the connection
                await asyncio.sleep(0.02)
            with pytest.raises(KrexError) as e:
                await c.submit(["true"])
        assert e.value.code == "disconnected"
        await c.close()


async def test_stdin_sent_and_closed_while_queued_reaches_the_command():
    """eof while the command waits for its device (krex run streams stdin): the data stays in the
    pipe for it. Before, eof closed the read end too: its start failed, it stayed `starting` for
    ever with no report, and its device stayed taken."""
    async with run_daemon("--policy", "command", "--devices", "cpu:1") as d:
        async with await d.client() as c:
            first = await c.submit(["sleep", "30"])
            h = await c.submit(["cat"], stdin_stream=True)
            assert h.queued
            await h.write_stdin(b"hello\n", eof=True)
            await first.cancel(9)
            res = await asyncio.wait_for(h.wait(), 10)
            after = await asyncio.wait_for(c.run(["echo", "next"]), 10)  # the device is free again
    assert (res.report.state, res.stdout) == ("exited", b"hello\n"), res.report
    assert after.stdout == b"next\n"


async def test_output_reaches_every_kind_of_watcher():
    """A submitter that does not stream gets the output with the end; an agent attaching while
    the command runs gets what it wrote before the attach, then the rest."""
    async with run_daemon() as d:
        async with await d.client() as c:
            quiet = await c.submit(["sh", "-c", "echo out; echo err >&2"], stream=False)
            res = await quiet.wait()
            assert (res.stdout, res.stderr) == (b"out\n", b"err\n"), res
            h = await c.submit(["sh", "-c", "echo early; sleep 0.5; echo late"])
            async for _ in h.output():
                break
            async with await d.client() as c2:
                late = await (await c2.attach(h.command)).wait()
            assert late.stdout == b"early\nlate\n", late.stdout


async def test_a_cancel_after_the_leader_exited_keeps_its_exit():
    """The leader exited of itself while a child it left still runs: a cancel then ends the child,
    but the command's report is its leader's exit, not `cancelled`."""
    async with run_daemon() as d:
        async with await d.client() as c:
            h = await c.submit(["sh", "-c", "sleep 5 & echo up; exit 3"])
            async for _ in h.output():
                break
            await asyncio.sleep(0.2)  # the leader is gone; the daemon waits for its pipes
            await h.cancel(15)
            res = await asyncio.wait_for(h.wait(), 10)
    assert (res.report.state, res.report.exit_code) == ("exited", 3), res.report


async def test_placement_by_memory_reads_the_free_memory_now(tmp_path) -> None:
    """`--device auto` with `mem` places on the free memory of now, not on the figure read at the
    daemon's start: here 3 GiB taken after the start make a request for the start's free memory
    less 1.5 GiB fit nowhere (it was placed, on memory no longer there)."""
    import psutil

    if psutil.virtual_memory().available < 6 * 2**30:
        pytest.skip("needs 6 GiB of free memory to take 3 GiB of it")
    async with run_daemon("--devices", "cpu:1") as d:
        at_start = psutil.virtual_memory().available
        hog = subprocess.Popen(
            [PY, "-c", "import sys, time; b = bytearray(3 << 30); print('up', flush=True); time.sleep(60)"],
            stdout=subprocess.PIPE,
        )
        try:
            assert hog.stdout is not None and hog.stdout.readline() == b"up\n"
            async with await d.client() as c:
                with pytest.raises(KrexError) as e:
                    await c.submit(["true"], mem=at_start - 3 * 2**29)
                ok = await c.submit(["true"], mem=2**20)
                assert (await ok.wait()).returncode == 0
        finally:
            hog.kill()
            hog.wait()
    assert "no device has the memory asked for" in str(e.value), e.value
