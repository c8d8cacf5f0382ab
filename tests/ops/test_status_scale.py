"""`krex status` on a busy node: live commands first, old ended ones counted, filters and sort,
the table fitted to an 80-column terminal, --watch keeping the devices on an 80x24 screen, and a
user who is not an admin told how many commands of others share a device (never which)."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import PY, ROOT, py_env, run_daemon, until
from ..security.helpers import USER_PY, User, config_daemon, make_users, user_env

KREX = [PY, "-m", "krex_async"]


def status(socket: str, *args: str, cols: int = 80, lines: int = 24) -> subprocess.CompletedProcess[str]:
    env = py_env(COLUMNS=str(cols), LINES=str(lines))
    return subprocess.run(
        [*KREX, "status", "--socket", socket, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )


def rows(text: str) -> list[list[str]]:
    """The command table's rows, split (the lines after the COMMAND header, up to a blank/note)."""
    lines = text.splitlines()
    i = next(n for n, ln in enumerate(lines) if ln.startswith("COMMAND "))
    out = []
    for ln in lines[i + 1 :]:
        if not ln or ln.startswith(("(", "+")):
            break
        out.append(ln.split())
    return out


async def test_status_lists_live_commands_first_collapses_old_ended_filters_and_fits_80() -> None:
    async with run_daemon() as d:
        async with await d.client() as c:
            ended = [(await c.run(["true"], label=f"done-{i}")).report.command for i in range(6)]
            a = await c.submit(["sh", "-c", "sleep 60", "x" * 150], label="agent-a")
            b = await c.submit(["sleep", "61"], label="agent-b")
            live = {a.command, b.command}
            for _ in range(600):  # until both run (a submit returns before the spawn)
                st = await c.status()
                if {x["command"] for x in st["commands"] if x["state"] == "running"} >= live:
                    break
                await asyncio.sleep(0.05)
            plain, every, only_ended, only_a, by_dev, mine, bad = await asyncio.gather(
                asyncio.to_thread(status, d.socket),
                asyncio.to_thread(status, d.socket, "--all"),
                asyncio.to_thread(status, d.socket, "--state", "ended", "--sort", "command"),
                asyncio.to_thread(status, d.socket, "--label", "agent-a"),
                asyncio.to_thread(status, d.socket, "--device", "nosuch"),
                asyncio.to_thread(status, d.socket, "--user", "root", "--state", "running"),
                asyncio.to_thread(status, d.socket, "--user", "no-such-user-x"),
            )
            await a.cancel(9)
            await b.cancel(9)
    for p in (plain, every, only_ended, only_a, by_dev, mine):
        assert p.returncode == 0, p.stderr
        assert all(len(x) <= 80 for x in p.stdout.splitlines()), p.stdout
    flat = " ".join(plain.stdout.split())
    if "cannot load libcuda" in flat:  # a node without the driver: the reason is said once
        assert flat.count("cannot load libcuda") == 1 and "(no driver lock: as above)" in flat, flat
    head = next(x for x in plain.stdout.splitlines() if x.startswith("COMMAND "))
    assert head.split()[:8] == ["COMMAND", "STATE", "DEVICE", "PID", "STARTED", "AGE", "WAIT", "RSS"], head
    got = rows(plain.stdout)
    assert [r[0] for r in got[:2]] == [a.command, b.command], plain.stdout  # live first, oldest first
    assert [r[1] for r in got[:2]] == ["running", "running"]
    assert [r[0] for r in got[2:]] == ended[-3:], plain.stdout  # the last three ended
    assert "(+3 older ended: exited 3; krex status --all or --state ended)" in plain.stdout, plain.stdout
    assert {r[0] for r in rows(every.stdout)} == {a.command, b.command, *ended}, every.stdout
    assert [r[0] for r in rows(only_ended.stdout)] == sorted(ended), only_ended.stdout
    assert [r[0] for r in rows(only_a.stdout)] == [a.command], only_a.stdout
    assert "(no commands match)" in by_dev.stdout, by_dev.stdout
    assert [r[0] for r in rows(mine.stdout)] == [a.command, b.command], mine.stdout
    assert bad.returncode == 2 and "no user 'no-such-user-x'" in bad.stderr, bad.stderr


async def test_watch_keeps_settings_and_devices_on_an_80x24_screen(tmp_path: Path) -> None:
    out = tmp_path / "watch.txt"
    async with run_daemon() as d:
        async with await d.client() as c:
            hs = [await c.submit(["sleep", "60"], label=f"agent-{i}") for i in range(30)]
            with open(out, "w") as f:
                w = subprocess.Popen(
                    [*KREX, "status", "--socket", d.socket, "--watch", "0.2"],
                    stdout=f,
                    stderr=subprocess.PIPE,
                    env=py_env(COLUMNS="80", LINES="24"),
                    cwd=ROOT,
                )
            try:
                await until(lambda: out.read_text().count("every 0.2 s") >= 3, "three frames", timeout=60)
            finally:
                w.send_signal(2)
                _, err = await asyncio.to_thread(w.communicate, timeout=30)
            for h in hs:
                await h.cancel(9)
    assert w.returncode == 0 and "Traceback" not in err.decode(), err
    frames = [f for f in out.read_text().split("every 0.2 s") if f.strip()]
    for frame in frames[:-1]:  # the last may be cut by the Ctrl-C
        lines = ("every 0.2 s" + frame).rstrip("\n").split("\n")
        assert len(lines) <= 23 and all(len(x) <= 80 for x in lines), frame  # 24: it would scroll
        assert any(x.startswith("DEVICE ") for x in lines) and any(x.startswith("cpu ") for x in lines)
        assert any(x.startswith("+") and "more" in x for x in lines), frame


@pytest.fixture(scope="module")
def users() -> Iterator[dict[str, User]]:
    yield from make_users()


async def test_a_user_counts_other_users_commands_on_a_device_without_seeing_them(users) -> None:
    """Before, CMDS counted only the user's own commands: 0 beside another user's running one."""
    alice = users["alice"]
    async with config_daemon(dir_mode=0o755, socket_group="krexg") as d:
        async with await d.client() as root:
            h = await root.submit(["sh", "-c", "sleep 60", "krex-secret-7f3a"])
            for _ in range(600):  # until it runs on its device (a submit returns before the spawn)
                if (await root.status())["devices"][0]["commands"]:
                    break
                await asyncio.sleep(0.05)
            p = await asyncio.to_thread(
                subprocess.run,
                [USER_PY, "-m", "krex_async", "status", "--socket", d.socket],
                user=alice.uid,
                group=alice.gid,
                extra_groups=alice.groups,
                env={**user_env(), "COLUMNS": "80"},
                cwd="/tmp",
                capture_output=True,
                text=True,
                timeout=60,
            )
            await h.cancel(9)
    assert p.returncode == 0, p.stderr
    assert h.command not in p.stdout and "krex-secret" not in p.stdout, p.stdout
    head = next(x for x in p.stdout.splitlines() if x.startswith("DEVICE "))
    cpu = next(x for x in p.stdout.splitlines() if x.startswith("cpu "))
    end = head.index("CMDS") + len("CMDS")
    assert cpu[end - 4 : end].strip() == "1", p.stdout
    assert "(1 command of other users not shown)" in p.stdout, p.stdout
