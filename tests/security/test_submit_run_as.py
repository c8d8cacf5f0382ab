"""Submit.run_as: a root peer (the HTTP gateway) runs a command as another user; nobody else may,
not even a member of --admin-group. Real users over the real socket."""

from __future__ import annotations

import asyncio

import pytest

from krex_async import KrexError

from .helpers import config_daemon, python_as

ASK = r"""
import asyncio, sys
from krex_async import Client, KrexError

async def main(path, uid):
    async with await Client.connect(path) as c:
        try:
            res = await c.run(["/bin/sh", "-c", "id -u"], env={"PATH": "/usr/bin:/bin"},
                              run_as=int(uid))
            print(res.stdout.decode().strip())
        except KrexError as e:
            print(e.code)

asyncio.run(main(*sys.argv[1:]))
"""


def ask_as(user, socket: str, uid: int) -> str:
    return python_as(user, ASK, socket, str(uid)).strip()


async def test_only_root_may_run_a_command_as_another_user(users):
    alice, mallory, admin = users["alice"], users["mallory"], users["admin"]
    show = ["/bin/sh", "-c", "id -u; id -g; id -G"]
    async with config_daemon(dir_mode=0o755, socket_group="krexg", admin_group="krexadm") as d:
        # Root asks for alice: uid, primary group and groups are alice's.
        async with await d.client() as root:
            res = await root.run(show, env={"PATH": "/usr/bin:/bin"}, run_as=alice.uid)
            uid, gid, groups = res.stdout.decode().split("\n")[:3]
            assert (int(uid), int(gid)) == (alice.uid, alice.gid), res.stdout
            assert set(map(int, groups.split())) == {alice.gid, *alice.groups}
            status = await root.status()
            mine = [c for c in status["commands"] if c["command"] == res.report.command]
            assert not mine or mine[0].get("uid") == alice.uid
        # A member of the admin group, and a plain user, may not; asking for oneself is a no-op.
        assert await asyncio.to_thread(ask_as, admin, d.socket, alice.uid) == "forbidden"
        assert await asyncio.to_thread(ask_as, mallory, d.socket, 0) == "forbidden"
        assert await asyncio.to_thread(ask_as, mallory, d.socket, mallory.uid) == str(mallory.uid)
        # A uid with no passwd entry is refused (its groups could not be known).
        async with await d.client() as root:
            with pytest.raises(KrexError) as e:
                await root.run(show, env={}, run_as=3_999_999_999)
            assert e.value.code == "bad_request"
