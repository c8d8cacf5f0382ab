"""`krex` as a new user meets it: stdin passed like a shell would, errors instead of tracebacks,
--version, a subcommand's own usage with a suggestion, flags that name their KREX_* variable."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pty
import re
import subprocess
import time
from pathlib import Path

from ..conftest import PY, ROOT, py_env, run_daemon, until

KREX = [PY, "-m", "krex_async"]


def krex(*args: str, env: dict[str, str] | None = None, **kw: object) -> subprocess.CompletedProcess:
    kw.setdefault("capture_output", True)
    kw.setdefault("timeout", 60)
    return subprocess.run([*KREX, *args], env=env or py_env(), cwd=ROOT, **kw)  # type: ignore


def no_traceback(p: subprocess.CompletedProcess) -> None:
    assert b"Traceback" not in p.stderr, p.stderr.decode()


async def test_stdin_is_passed_from_a_pipe_and_a_terminal_and_not_with_no_stdin() -> None:
    async with run_daemon() as d:
        env = py_env(KREX_SOCKET=d.socket)
        piped = await asyncio.to_thread(krex, "run", "--", "cat", env=env, input=b"hello\n")
        big = os.urandom(3 << 20)
        whole = await asyncio.to_thread(krex, "run", "--", "sha256sum", env=env, input=big)
        # a command that stops reading ends; krex run does not wait for its stdin's EOF
        yes = await asyncio.to_thread(
            subprocess.run,
            f"yes | {' '.join(KREX)} run -- head -2",
            shell=True,
            capture_output=True,
            env=env,
            cwd=ROOT,
            timeout=60,
        )
        # --no-stdin: /dev/null, even while this process's stdin stays open
        held = subprocess.Popen(
            [*KREX, "run", "--no-stdin", "--", "cat"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        assert await asyncio.to_thread(held.wait, 30) == 0
        assert held.stdin is not None
        held.stdin.close()
        # a terminal: what is typed reaches the command
        master, slave = pty.openpty()
        tty = subprocess.Popen(
            [*KREX, "run", "--", "head", "-1"], stdin=slave, stdout=subprocess.PIPE, env=env, cwd=ROOT
        )
        os.close(slave)
        await asyncio.sleep(1.0)
        os.write(master, b"typed\n")
        assert await asyncio.to_thread(tty.wait, 30) == 0
        os.close(master)
    import hashlib

    assert (piped.returncode, piped.stdout) == (0, b"hello\n"), piped.stderr
    assert whole.stdout.split()[0].decode() == hashlib.sha256(big).hexdigest()
    assert (yes.returncode, yes.stdout) == (0, b"y\ny\n"), yes.stderr
    assert tty.stdout is not None and tty.stdout.read() == b"typed\n"


async def test_bad_paths_are_errors_not_tracebacks(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    gone = tmp_path / "nonexistent"  # not /nonexistent: on a shared machine someone may have made it
    async with run_daemon() as d:
        env = py_env(KREX_SOCKET=d.socket)
        rep = await asyncio.to_thread(
            krex, "run", "--report", str(gone / "r.json"), "--", "touch", str(marker), env=env
        )
        exp = await asyncio.to_thread(krex, "export", "--perfetto", str(gone / "x.json"), env=env)
        # the report cannot be written once the command ran (it made a directory there): its
        # exit status still stands, and an error says why
        late = tmp_path / "late"
        after = await asyncio.to_thread(
            krex, "run", "--report", str(late), "--", "sh", "-c", f"mkdir {late}; exit 3", env=env
        )
        await asyncio.to_thread(krex, "run", "--", "true", env=env)
        out = await asyncio.to_thread(krex, "export", "--perfetto", "-", env=env)
    assert rep.returncode == 2 and b"/nonexistent" in rep.stderr and not marker.exists()
    no_traceback(rep)
    assert after.returncode == 3 and b"cannot write the report" in after.stderr
    no_traceback(after)
    assert exp.returncode == 2 and b"--perfetto" in exp.stderr and b"/nonexistent" in exp.stderr
    no_traceback(exp)
    assert out.returncode == 0 and not Path(ROOT / "-").exists()
    assert any(e.get("ph") == "X" for e in json.loads(out.stdout)["traceEvents"])


async def test_odd_input_and_a_reader_that_leaves_are_errors_not_tracebacks(tmp_path: Path) -> None:
    """Arguments that are not UTF-8, a stdout whose reader left (| head), a stdout closed: each
    ends with a message or the status a pipe gives, never a traceback."""
    async with run_daemon() as d:
        env = py_env(KREX_SOCKET=d.socket)
        odd = await asyncio.to_thread(
            subprocess.run, [*KREX, "run", "--", "echo", b"\xff"], capture_output=True, env=env, cwd=ROOT
        )
        head = await asyncio.to_thread(
            subprocess.run,
            f"{' '.join(KREX)} run -- seq 1000000 | head -2; echo rc=${{PIPESTATUS[0]}}",
            shell=True,
            executable="/bin/bash",
            capture_output=True,
            env=env,
            cwd=ROOT,
            timeout=60,
        )
        closed = await asyncio.to_thread(
            subprocess.run,
            [*KREX, "run", "--", "echo", "x"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            cwd=ROOT,
            timeout=60,
        )
    assert odd.returncode == 125 and b"argument 1" in odd.stderr and b"not UTF-8" in odd.stderr
    no_traceback(odd)
    assert head.stdout == b"1\n2\nrc=141\n", head
    no_traceback(head)
    assert closed.returncode == 0
    no_traceback(closed)


def test_serve_gateway_status_and_demo_refuse_what_cannot_work(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    state = krex("serve", "--socket", str(tmp_path / "s"), "--state-dir", str(tmp_path / "file"))
    assert state.returncode == 2 and b"--state-dir" in state.stderr and b"not a directory" in state.stderr
    long_sock = krex("serve", "--socket", str(tmp_path / ("x" * 120)))
    assert long_sock.returncode == 1 and b"under 108" in long_sock.stderr
    gw = ["gateway", "--state-dir", str(tmp_path / "gw"), "--socket", str(tmp_path / "s")]
    port = krex(*gw, "--listen", "127.0.0.1:99999")
    assert port.returncode == 2 and b"out of range" in port.stderr
    lim = krex(*gw, "--max-body", "-5")
    assert lim.returncode == 2 and b"--max-body must be a positive number" in lim.stderr
    over = krex(*gw, "--default-timeout", "1000", "--max-timeout", "600")
    assert over.returncode == 2 and b"is over --max-timeout" in over.stderr
    watch = krex("status", "--watch", "0")
    assert watch.returncode == 2 and b"at least 0.1" in watch.stderr
    demo = krex("demo", "-n", "0")
    assert demo.returncode == 2 and b"not in 1..64" in demo.stderr
    gone = krex("status", "--json", "--socket", str(tmp_path / "nobody.sock"))
    assert gone.returncode == 1 and json.loads(gone.stdout)["error"] == "unreachable"
    for p in (state, long_sock, port, lim, over, watch, demo, gone):
        no_traceback(p)


async def test_a_socket_that_never_answers_is_said_so(tmp_path: Path) -> None:
    """A stopped or stuck daemon (here: a listener that never reads): the handshake gives up."""
    import socket as socket_mod

    from krex_async import Client, KrexError

    path = str(tmp_path / "silent")
    srv = socket_mod.socket(socket_mod.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    try:
        t0 = time.monotonic()
        try:
            await Client.connect(path, timeout=0.5)
        except KrexError as e:
            assert e.code == "unreachable" and "did not answer in 0.5 s" in e.message, e
        else:
            raise AssertionError("connected to a socket that never answered")
        assert time.monotonic() - t0 < 5
    finally:
        srv.close()


def test_version_suggestions_and_human_errors() -> None:
    from krex_async import __version__

    v = krex("--version")
    assert v.returncode == 0 and v.stdout.decode().strip() == f"krex {__version__}"
    typo = krex("run", "--devcie", "0", "--", "true")
    assert typo.returncode == 2
    assert b"usage: krex run" in typo.stderr and b"did you mean --device?" in typo.stderr
    neg = krex("run", "--timeout", "-1", "--", "true")
    assert neg.returncode == 2 and b"--timeout" in neg.stderr and b"> 0" in neg.stderr
    assert b"$." not in neg.stderr and b"undecodable" not in neg.stderr
    gone = krex("status", "--socket", "/tmp/krex-nobody-here.sock")
    assert gone.returncode == 1 and b"krex serve" in gone.stderr
    no_traceback(gone)


def test_every_serve_flag_has_help_naming_its_variable() -> None:
    from krex_async.daemon.config import ServeConfig

    text = krex("serve", "--help", env={**py_env(), "COLUMNS": "400"}).stdout.decode()
    flags = re.findall(r"^  (--[a-z-]+)(?: [A-Z_{},a-z-]+)?\s+(.*)$", text, re.M)
    helped = {f: h for f, h in flags}
    for name in ServeConfig.__struct_fields__:
        flag = "--" + name.replace("_", "-")
        assert flag in helped, (flag, text)
        assert f"KREX_{name.upper()}" in helped[flag], (flag, helped[flag])
        assert helped[flag].strip() != f"env KREX_{name.upper()}", f"{flag} has no help of its own"


def test_bench_analysis_usage() -> None:
    for args in ([], ["--help"]):
        p = subprocess.run([PY, "-m", "bench.analysis", *args], capture_output=True, cwd=ROOT, timeout=60)
        no_traceback(p)
        assert b"usage:" in p.stdout + p.stderr
        assert p.returncode == (0 if args else 2)
    missing = subprocess.run(
        [PY, "-m", "bench.analysis", "/nonexistent.json"], capture_output=True, cwd=ROOT, timeout=60
    )
    no_traceback(missing)
    assert missing.returncode == 2 and b"/nonexistent.json" in missing.stderr


def test_status_table_fits_and_says_its_units() -> None:
    from krex_async.ops.statusview import age, render

    st = {
        "version": "0.1.0",
        "pid": 1,
        "boot": "12345",
        "policy": "region",
        "freeze": "all",
        "region_cores": 1,
        "isolation": {"backend": "cgroup", "reason": "x" * 300},
        "devices": [
            {
                "key": "nvidia0",
                "vendor": "nvidia",
                "name": "NVIDIA H200",
                "memory_total_bytes": 150 << 30,
                "memory_free_bytes": 100 << 30,
                "utilisation_pct": 37.0,
                "commands": ["12345-1"],
                "queued": [],
                "region": None,
            }
        ],
        "commands": [
            {
                "command": "12345-1",
                "argv": ["python", "-c", "y" * 200],
                "state": "running",
                "device": "nvidia0",
                "pid": 4242,
                "age_s": 3725.0,
                "frozen": False,
                "label": "agent-7",
                "result": None,
                "rss_bytes": 300 << 20,
            },
            {
                "command": "11111-4",
                "argv": ["sleep", "1"],
                "state": "ended",
                "device": "cpu",
                "pid": None,
                "age_s": 9.0,
                "frozen": False,
                "label": "",
                "result": "lost",
            },
        ],
    }
    text = render(st)
    assert all(len(x) <= 100 for x in text.splitlines()), text
    assert "agent-7: python -c" in text and "1h02m" in text and "300M" in text
    assert "50.0G/150G" in text and "37%" in text
    assert "11111-4" not in text and "1 commands of an earlier daemon" in text
    assert "11111-4" in render(st, show_all=True)
    assert [age(x) for x in (0.25, 12.34, 125, 90000)] == ["250ms", "12.3s", "2m05s", "1d01h"]
    st["devices"][0]["region"] = {
        "name": "timing",
        "command": "12345-1",
        "state": "held",
        "frozen": ["a"],
        "cores": [1],
        "held": [{"command": "b", "mode": "lock"}],
    }
    text = render(st)
    assert "'timing' by 12345-1 (held)" in text and "holds frozen 1, locked 1, cores [1]" in text


def test_status_keeps_a_long_reason_whole_and_counts_lost_apart() -> None:
    """A settings line is wrapped, never cut: the isolation reason of a hybrid host (longer than
    the table) reads to its end; earlier commands that exited are not called lost."""
    from krex_async.ops.statusview import render

    reason = "hybrid: freezer in v2 at /sys/fs/cgroup/unified, cpuset in v1 at /sys/fs/cgroup/cpuset END"
    earlier = {"argv": ["true"], "state": "ended", "device": "cpu", "pid": None, "age_s": 1.0}
    st = {
        "pid": 1,
        "boot": "b2",
        "policy": "region",
        "freeze": "all",
        "region_cores": 1,
        "isolation": {"backend": "cgroup", "reason": reason},
        "devices": [],
        "commands": [
            {**earlier, "command": "b1-1", "frozen": False, "label": "", "result": "exited"},
            {**earlier, "command": "b1-2", "frozen": False, "label": "", "result": "lost"},
        ],
    }
    text = render(st)
    assert all(len(x) <= 100 for x in text.splitlines()), text
    assert "…" not in text, text
    assert " ".join(text.split()).count(reason) == 1, text
    assert "2 commands of an earlier daemon, 1 of them lost" in text, text


def test_status_escapes_control_characters_of_a_users_label_argv_and_region() -> None:
    """Another user's label, argv or region name cannot clear an admin's screen or forge a row."""
    from krex_async.ops.statusview import render

    evil = "x\x1b[2J\x1b[31m\r\nforged 1-1 running"
    st = {
        "pid": 1,
        "boot": "b",
        "policy": "region",
        "freeze": "all",
        "region_cores": 1,
        "isolation": {"backend": "cgroup", "reason": "r"},
        "devices": [
            {
                "key": "cpu",
                "vendor": "cpu",
                "commands": ["b-1"],
                "queued": [],
                "region": {"name": evil, "command": "b-1", "state": "held", "frozen": [], "cores": [1]},
            }
        ],
        "commands": [
            {
                "command": "b-1",
                "argv": ["sh", "-c", evil],
                "state": "running",
                "device": "cpu",
                "pid": 7,
                "age_s": 1.0,
                "frozen": False,
                "label": evil,
                "result": None,
            }
        ],
    }
    text = render(st)
    assert "\x1b" not in text and "\r" not in text, repr(text)
    assert not any(line.startswith("forged") for line in text.splitlines()), text
    assert text.count("x\\x1b[2J\\x1b[31m\\r\\nforged") == 2, text  # label and argv, escaped


async def test_status_shows_label_memory_and_watches(tmp_path: Path) -> None:
    async with run_daemon() as d:
        env = py_env(KREX_SOCKET=d.socket)
        async with await d.client() as c:
            h = await c.submit(["sleep", "30"], label="agent-7")
            await asyncio.sleep(0.5)
            once = await asyncio.to_thread(krex, "status", env=env)
            shown = tmp_path / "watch.txt"
            with open(shown, "wb") as f:
                watch = subprocess.Popen(
                    [*KREX, "status", "--watch", "0.3"], stdout=f, stderr=subprocess.PIPE, env=env, cwd=ROOT
                )
            await until(lambda: shown.read_bytes().count(b"COMMAND ") >= 3, "three redraws")
            watch.send_signal(2)
            _, err = await asyncio.to_thread(watch.communicate, timeout=30)
            out = shown.read_bytes()
            await h.cancel(9)
    text = once.stdout.decode()
    row = next(x for x in text.splitlines() if x.startswith(h.command))
    assert "agent-7: sleep 30" in row and re.search(r"\d+(\.\d)?[KM] ", row), row
    assert all(len(x) <= 100 for x in text.splitlines())
    assert watch.returncode == 0 and b"Traceback" not in err
    assert out.count(b"COMMAND ") >= 3, out


def test_tree_memory_sums_a_process_tree() -> None:
    """psutil's one pass over the process table: a parent with two children counts three
    processes and at least the parent's own RSS; a pid that is gone has no entry."""
    from krex_async.linux.procfs import tree_memory

    p = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 10
        while True:
            got = tree_memory({"t": p.pid, "gone": 2**22 - 1}, pss=True)
            if got["t"]["processes"] == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for c in __import__("psutil").Process(p.pid).children(recursive=True):
            c.kill()
        p.kill()
        p.wait()
    assert got["t"]["processes"] == 3 and got["t"]["rss_bytes"] > 1 << 20
    assert 0 < got["t"]["pss_bytes"] <= got["t"]["rss_bytes"]
    assert "gone" not in got


async def test_stdin_pipe_waits_while_full_refuses_a_second_writer_and_wakes_on_close() -> None:
    """The daemon's side: a write into a full pipe waits (memory stays one pipe buffer), a second
    write meanwhile is refused (busy), and closing wakes the waiting one with StdinClosed."""
    import pytest

    from krex_async.daemon.model.stdinpipe import StdinBusy, StdinClosed, StdinPipe

    pipe = StdinPipe()
    reader = pipe.reader()
    try:
        first = asyncio.ensure_future(pipe.write(b"x" * (4 << 20)))
        await asyncio.sleep(0.2)
        assert not first.done(), "a write beyond the pipe's buffer must wait for the reader"
        with pytest.raises(StdinBusy):
            await pipe.write(b"more")
        assert len(os.read(reader, 1 << 16)) > 0
        pipe.close()
        with pytest.raises(StdinClosed):
            await asyncio.wait_for(first, 5)
        with pytest.raises(StdinClosed):
            await pipe.write(b"late")
    finally:
        os.close(reader)


async def test_run_whose_daemon_dies_says_its_command_may_still_run(tmp_path: Path) -> None:
    """A daemon killed under `krex run` (SIGKILL: no shutdown report) leaves its command running;
    `krex run` exits 125 saying so and how it ends, not only that a connection closed."""
    async with run_daemon() as d:
        run = subprocess.Popen(
            [*KREX, "run", "--", "sleep", "60"],
            env=py_env(KREX_SOCKET=d.socket),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        pid = None
        try:
            async with await d.client() as c:
                for _ in range(500):
                    rows = [x for x in (await c.status())["commands"] if x["state"] == "running"]
                    if rows and rows[0]["pid"]:
                        pid = rows[0]["pid"]
                        break
                    await asyncio.sleep(0.02)
            assert pid is not None, "the command did not start"
            d.proc.kill()
            _, err = await asyncio.to_thread(run.communicate, timeout=30)
            assert run.returncode == 125, err
            assert b"may still be running" in err and b"reports it lost" in err, err
            no_traceback(subprocess.CompletedProcess([], 125, b"", err))
        finally:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, 9)
            if run.poll() is None:
                run.kill()
                run.wait()


async def test_watch_of_a_daemon_that_stops_cleanly_says_it_stopped() -> None:
    """A SIGTERM'd daemon ends `krex status --watch` with exit 1 and a line, and without the
    warning about commands left running that a killed daemon's `krex run` gets."""
    async with run_daemon() as d:
        watch = subprocess.Popen(
            [*KREX, "status", "--watch", "0.2"],
            env=py_env(KREX_SOCKET=d.socket),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            await asyncio.sleep(1.0)
            d.proc.terminate()
            _, err = await asyncio.to_thread(watch.communicate, timeout=30)
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.wait()
    assert watch.returncode == 1, err
    assert b"closed the connection (it stopped, or died)" in err and b"may still be running" not in err, err


async def test_run_from_a_removed_directory_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    """A shell left in a directory that was removed: `krex run` says so and exits 125."""
    gone = tmp_path / "gone"
    gone.mkdir()
    async with run_daemon() as d:
        script = f"import os, runpy, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); "
        script += (
            "sys.argv = ['krex', 'run', '--', 'true']; runpy.run_module('krex_async', run_name='__main__')"
        )
        p = await asyncio.to_thread(
            subprocess.run,
            [PY, "-c", script],
            env=py_env(KREX_SOCKET=d.socket),
            capture_output=True,
            timeout=60,
        )
    no_traceback(p)
    assert p.returncode == 125 and b"current directory was removed" in p.stderr, p.stderr


def test_output_files_relative_to_a_removed_directory_are_usage_errors(tmp_path: Path) -> None:
    """`--report rel.json` / `--perfetto rel.json` from a directory that was removed: exit 2 naming
    the flag and why (getcwd() failed in a traceback), before anything connects or runs."""
    gone = tmp_path / "gone"
    marker = tmp_path / "ran"
    for args in (
        ["run", "--report", "rel.json", "--", "touch", str(marker)],
        ["export", "--perfetto", "rel.json"],
    ):
        gone.mkdir()
        script = f"import os, runpy, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); "
        script += f"sys.argv = ['krex', *{args!r}]; runpy.run_module('krex_async', run_name='__main__')"
        p = subprocess.run([PY, "-c", script], env=py_env(), capture_output=True, timeout=60)
        no_traceback(p)
        flag = args[1].encode()
        assert p.returncode == 2 and flag + b" rel.json: a relative path" in p.stderr, p.stderr
        assert b"current directory was removed" in p.stderr and not marker.exists(), p.stderr


async def test_a_missing_program_path_is_127_and_one_that_cannot_run_is_126(tmp_path: Path) -> None:
    """As the shell: `krex run -- /missing/path` is "not found" (127), a file without its x bit, a
    path through a regular file or a directory cannot be executed (126), and none of those says
    "not found"."""
    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\ntrue\n")
    async with run_daemon() as d:
        env = py_env(KREX_SOCKET=d.socket)
        missing = await asyncio.to_thread(krex, "run", "--", str(tmp_path / "nonexistent"), env=env)
        under = await asyncio.to_thread(krex, "run", "--", str(plain / "x"), env=env)
        noexec = await asyncio.to_thread(krex, "run", "--", str(plain), env=env)
        a_dir = await asyncio.to_thread(krex, "run", "--", str(tmp_path), env=env)
    assert missing.returncode == 127 and b"not found" in missing.stderr, missing.stderr
    for p in (under, noexec, a_dir):
        assert p.returncode == 126 and b"cannot be executed" in p.stderr, p.stderr
        assert b"not found" not in p.stderr
        no_traceback(p)
