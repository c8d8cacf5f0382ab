"""The listening socket: private from its first instant, an optional group, stale versus live files."""

from __future__ import annotations

import asyncio
import grp
import json
import os
import resource
import shutil
import socket
import stat
import subprocess
import tempfile
import time

import pytest

from ..conftest import PY, py_env
from .helpers import LAUNCH, config_daemon, hello, raw

CONNECT = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print(type(e).__name__)
else:
    print("connected")
"""


def _watch_first_sight(path: str, deadline: float) -> tuple[int, str]:
    """Spin until `path` appears; return its mode then and what a connect at that instant gave."""
    while time.monotonic() < deadline:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            outcome = "connected"
        except OSError as e:
            outcome = type(e).__name__
        finally:
            s.close()
        return stat.S_IMODE(st.st_mode), outcome
    raise AssertionError(f"{path} never appeared")


@pytest.mark.parametrize("group", ["", "krexg"])
async def test_socket_has_its_final_mode_and_listens_from_the_first_instant(group, users):
    """Watch the path while the daemon starts: the first time the file is seen its mode is already
    final (0600, or 0660 with --socket-group) and it already accepts connections."""
    d = tempfile.mkdtemp(prefix="krexm-", dir="/tmp")
    path = os.path.join(d, "s")
    cfg = {"socket": path, "state_dir": os.path.join(d, "st"), "isolation": "signal", "socket_group": group}
    watcher = asyncio.create_task(asyncio.to_thread(_watch_first_sight, path, time.monotonic() + 20))
    await asyncio.sleep(0)
    proc = subprocess.Popen(
        [PY, "-c", LAUNCH, json.dumps(cfg)],
        env=py_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        mode, outcome = await watcher
        assert mode == (0o660 if group else 0o600), oct(mode)
        assert outcome == "connected"
        if group:
            assert os.stat(path).st_gid == grp.getgrnam(group).gr_gid
    finally:
        proc.terminate()
        proc.wait(15)


async def test_socket_group_lets_members_in_and_keeps_others_out(users):
    async with config_daemon(dir_mode=0o755, socket_group="krexg") as d:
        st = os.stat(d.socket)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == grp.getgrnam("krexg").gr_gid
        member = await asyncio.to_thread(users["alice"].run_py, CONNECT, d.socket)
        other = await asyncio.to_thread(users["outsider"].run_py, CONNECT, d.socket)
        assert member.stdout.strip() == "connected", member.stderr
        assert other.stdout.strip() == "PermissionError", other.stderr
    async with config_daemon(dir_mode=0o755) as d:  # no group: the owner only
        member = await asyncio.to_thread(users["alice"].run_py, CONNECT, d.socket)
        assert member.stdout.strip() == "PermissionError", member.stderr


async def test_unknown_socket_group_is_refused_before_any_file_exists(tmp_path):
    path = str(tmp_path / "s")
    cfg = {"socket": path, "state_dir": str(tmp_path / "st"), "socket_group": "no-such-group-krex"}
    p = await asyncio.to_thread(
        subprocess.run,
        [PY, "-c", LAUNCH, json.dumps(cfg)],
        env=py_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode != 0 and "no such group" in p.stderr
    assert not [n for n in os.listdir(tmp_path) if n.startswith("s") and n != "st"]


async def test_stale_socket_from_a_crash_is_replaced(tmp_path):
    d = tempfile.mkdtemp(prefix="krexst-", dir="/tmp")
    path = os.path.join(d, "s")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)  # a socket file nobody listens on: what a SIGKILLed daemon leaves
    dead.close()
    cfg = {"socket": path, "state_dir": os.path.join(d, "st"), "isolation": "signal"}
    proc = subprocess.Popen(
        [PY, "-c", LAUNCH, json.dumps(cfg)],
        env=py_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                s = raw(path)
                break
            except ConnectionRefusedError:
                assert proc.poll() is None, "daemon exited instead of replacing the stale socket"
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        await asyncio.to_thread(hello, s)
        s.close()
    finally:
        proc.terminate()
        proc.wait(15)


@pytest.mark.parametrize("kind", ["file", "directory"])
async def test_a_path_that_is_not_a_socket_is_left_alone(tmp_path, kind):
    path = tmp_path / "s"
    if kind == "file":
        path.write_text("precious")
    else:
        path.mkdir()
    cfg = {"socket": str(path), "state_dir": str(tmp_path / "st"), "isolation": "signal"}
    p = await asyncio.to_thread(
        subprocess.run,
        [PY, "-c", LAUNCH, json.dumps(cfg)],
        env=py_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode != 0 and "not a socket" in p.stderr, p.stderr
    assert (path.read_text() == "precious") if kind == "file" else path.is_dir()


async def test_daemon_raises_its_open_file_limit_to_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard open-file limit is only {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # the daemon inherits 1024
    try:
        async with config_daemon() as d:
            with open(f"/proc/{d.proc.pid}/limits") as f:
                line = next(ln for ln in f if ln.startswith("Max open files"))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    d_soft, d_hard = line.split()[3:5]
    assert d_soft == d_hard != "1024", line


async def test_a_socket_path_near_the_af_unix_limit_still_works(tmp_path):
    base = tempfile.mkdtemp(prefix="k", dir="/tmp")
    deep = os.path.join(base, "d" * (102 - len(base) - 1))  # a 102-byte directory
    os.mkdir(deep)
    path = os.path.join(deep, "s")  # 104 bytes: no room for a temporary name beside it
    async with config_daemon(socket=path) as d:
        assert d.socket == path and stat.S_IMODE(os.stat(path).st_mode) == 0o600
        s = await asyncio.to_thread(raw, path)
        await asyncio.to_thread(hello, s)
        s.close()
    shutil.rmtree(base, ignore_errors=True)
