"""Which socket an agent reaches when it names none, and what it is told when the path it named
cannot be a daemon's socket. Clients run as a real other user over a real daemon's socket."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
from pathlib import Path

import pytest

from .helpers import config_daemon, run_python_as

# The node's socket (/run/krex/krex.sock) is pointed at the test daemon's; nothing else changes.
CONNECT = r"""
import asyncio, sys
import krex_async.client.submit as s
from krex_async import Client, KrexError
s.NODE_SOCKET = sys.argv[1]

async def main():
    try:
        async with await Client.connect() as c:
            print("connected", c.path, c.welcome.uid)
    except KrexError as e:
        print("refused", e.message)

asyncio.run(main())
"""


async def test_a_user_without_a_daemon_of_its_own_reaches_the_nodes(users):
    """`krex run` as a user of the node's socket group, with no KREX_SOCKET: the node's daemon
    answers, not an error about $XDG_RUNTIME_DIR/krex.sock."""
    alice = users["alice"]
    runtime = tempfile.mkdtemp(prefix="krexrt-", dir="/tmp")
    os.chown(runtime, alice.uid, alice.gid)
    try:
        async with config_daemon(dir_mode=0o755, socket_group="krexg") as d:
            env = {"XDG_RUNTIME_DIR": runtime}
            p = await asyncio.to_thread(run_python_as, alice, CONNECT, d.socket, env=env)
            assert p.stdout.split()[:3] == ["connected", d.socket, str(alice.uid)], (p.stdout, p.stderr)
            # A daemon of the user's own at the default path is preferred to the node's.
            own = os.path.join(runtime, "krex.sock")
            listener = socket.socket(socket.AF_UNIX)
            listener.bind(own)
            try:
                os.chown(own, alice.uid, alice.gid)
                p = await asyncio.to_thread(run_python_as, alice, CONNECT, d.socket, env=env)
                assert "connected" not in p.stdout and own in p.stdout, (p.stdout, p.stderr)
            finally:
                listener.close()
    finally:
        for name in os.listdir(runtime):
            os.unlink(os.path.join(runtime, name))
        os.rmdir(runtime)


@pytest.mark.parametrize("kind", ["directory", "file", "too long"])
async def test_a_path_that_is_not_a_socket_is_named_as_such(tmp_path: Path, kind: str) -> None:
    """A directory, a plain file or a path no socket can have: said so, and no advice to start a
    daemon there (which could not help)."""
    from krex_async import Client, KrexError

    path = tmp_path / "sock"
    if kind == "directory":
        path.mkdir()
    elif kind == "file":
        path.write_text("")
    else:
        path = tmp_path / ("x" * 120) / "s"
    with pytest.raises(KrexError) as e:
        await Client.connect(str(path), timeout=2)
    said = e.value.message
    expect = {"directory": "is a directory", "file": "is not a socket", "too long": "must be under 108"}
    assert f"{path}" in said and expect[kind] in said, said
    assert "--socket" in said and "krex serve --socket" not in said, said
