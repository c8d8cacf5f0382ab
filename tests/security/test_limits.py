"""Node-wide limits: what many peers together may not take, though each stays within its own bound.

Each peer is bounded (frame size, --max-conn-buffer); these tests show the daemon also bounds the
sum: unsent bytes over all connections (--max-buffered-total), frame bodies being read at once
(--max-inbound-bytes), open connections (--max-connections) and commands it keeps (--max-commands),
and each user's share of the last two (--max-*-per-user), so that one user cannot lock out the
others, root and admins least of all. Each refusal is a clear error or a logged drop, and the daemon
keeps serving everyone else."""

from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import time

import pytest

from krex_async import Client
from krex_async import protocol as P
from krex_async.client.submit import KrexError

from ..conftest import PY, run_daemon
from .helpers import USER_PY, config_daemon, hello, raw, recv, rss_kib, user_env
from .test_authz import call

FLOOD = "import os\nb = b'x' * (1 << 20)\nfor _ in range({mib}): os.write(1, b)\n"


async def test_commands_beyond_max_commands_are_refused_busy():
    async with run_daemon("--max-commands", "2", "--retention", "30") as d:
        async with await d.client() as c:
            first = await c.submit(["sleep", "30"])
            await c.run(["true"])  # ended, but its result is kept: it still counts
            with pytest.raises(KrexError) as e:
                await c.submit(["true"])
            assert e.value.code == "busy" and "--max-commands" in str(e.value)
            await first.cancel(9)
            assert (await first.wait()).report.state == "cancelled"
            st = await c.status()  # still serving
            assert len(st["commands"]) == 2


async def test_connections_beyond_max_connections_are_refused_busy():
    async with run_daemon("--max-connections", "3") as d:
        held = [await d.client() for _ in range(3)]
        try:
            with pytest.raises(KrexError) as e:
                await Client.connect(d.socket, timeout=5)
            assert e.value.code == "busy"
            await held[0].close()
            for _ in range(100):  # the daemon notices the close, then has room again
                try:
                    async with await Client.connect(d.socket, timeout=5) as c:
                        assert (await c.run(["echo", "ok"])).stdout == b"ok\n"
                        break
                except KrexError as err:
                    assert err.code == "busy"
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError("no room after a connection closed")
        finally:
            for c in held[1:]:
                await c.close()
        assert "too many connections" in d.logs()


async def test_peers_that_stop_reading_are_dropped_once_their_sum_passes_the_total():
    """Three agents that never read, each under --max-conn-buffer (64 MiB here), together pass
    --max-buffered-total (6 MiB): a growing one is dropped for the total, and others are served."""
    async with config_daemon(max_conn_buffer=64 << 20, max_buffered_total=6 << 20, output_tail=1 << 20) as d:
        socks = []
        for i in range(3):
            s = await asyncio.to_thread(raw, d.socket)
            s.setsockopt(1, 8, 4096)  # SO_RCVBUF: small, so the daemon's own buffer fills
            await asyncio.to_thread(hello, s)
            s.sendall(
                P.encode(P.Submit(id=5 + i, argv=[PY, "-c", FLOOD.format(mib=40)], on_disconnect="keep"))
            )
            socks.append(s)
        try:
            async with await d.client() as c:
                for _ in range(400):
                    if "all connections together" in d.logs():
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("no peer was dropped for the node-wide total: " + d.logs())
                assert "more than 67108864 bytes unread" not in d.logs()  # not the per-peer bound
                assert (await c.run(["echo", "served"])).stdout == b"served\n"
        finally:
            for s in socks:
                s.close()


# As a test user: open N connections, then one more; print that one's outcome; hold them all until
# stdin ends.
HOLD = r"""
import asyncio, sys
from krex_async import Client, KrexError

async def main(path, n):
    held = [await Client.connect(path) for _ in range(int(n))]
    try:
        held.append(await Client.connect(path, timeout=5))
        print("ok", flush=True)
    except KrexError as e:
        print(e.code, e, flush=True)
    await asyncio.to_thread(sys.stdin.read)

asyncio.run(main(*sys.argv[1:]))
"""


def hold(user, path: str, n: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [USER_PY, "-c", HOLD, path, str(n)],
        user=user.uid,
        group=user.gid,
        extra_groups=user.groups,
        env=user_env(),
        cwd="/tmp",
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


async def test_a_user_at_its_connection_share_is_refused_while_root_and_admins_connect(users):
    async with config_daemon(
        dir_mode=0o755, socket_group="krexg", admin_group="krexadm", max_connections_per_user=2
    ) as d:
        mallory = hold(users["mallory"], d.socket, 2)
        admin = hold(users["admin"], d.socket, 2)
        try:
            out_m = await asyncio.to_thread(mallory.stdout.readline)
            out_a = await asyncio.to_thread(admin.stdout.readline)
            assert out_m.startswith("busy") and "--max-connections-per-user" in out_m, (
                out_m,
                mallory.stderr.read() if mallory.poll() is not None else "",
            )
            assert out_a == "ok\n", out_a  # an admin is held to the node-wide limit only
            roots = [await d.client() for _ in range(3)]  # and so is root, over its share
            try:
                assert (await roots[-1].run(["echo", "ok"])).stdout == b"ok\n"
            finally:
                for c in roots:
                    await c.close()
            # Another user has a share of their own.
            assert int(await call(users["alice"], d.socket, "whoami")) == users["alice"].uid
        finally:
            for p in (mallory, admin):
                p.communicate(timeout=30)
        assert "too many connections of one user" in d.logs()


SUBMIT = r"""
import asyncio, sys
from krex_async import Client, KrexError

async def main(path):
    async with await Client.connect(path) as c:
        try:
            print("ok", (await c.submit(["sleep", "30"], on_disconnect="keep")).command)
        except KrexError as e:
            print(e.code, e)

asyncio.run(main(sys.argv[1]))
"""


async def test_a_user_at_its_command_share_is_refused_while_root_submits(users):
    mallory = users["mallory"]
    async with config_daemon(dir_mode=0o755, socket_group="krexg", max_commands_per_user=2) as d:
        held = [await call(mallory, d.socket, "keep", "sleep", "30") for _ in range(2)]
        assert all(h and " " not in h for h in held), held
        third = await asyncio.to_thread(mallory.run_py, SUBMIT, d.socket)
        assert third.stdout.startswith("busy") and "--max-commands-per-user" in third.stdout, third
        async with await d.client() as root:
            mine = [await root.submit(["sleep", "30"]) for _ in range(3)]  # root: over its share
            assert (await root.run(["echo", "ok"])).stdout == b"ok\n"
            for h in mine:
                await h.cancel(9)
            for cid in held:
                await root.cancel(cid, 9)


def push_partial_frames(socks: list[socket.socket], length: int, send: int) -> int:
    """Send each socket the header of a `length`-byte frame and `send` bytes of its body, as far as
    the daemon takes them in (until none moves for a second). Returns the bytes sent in all."""
    chunk = b"\x00" * (256 << 10)
    sent = dict.fromkeys(range(len(socks)), 0)
    for s in socks:
        s.sendall(struct.pack(">I", length))
        s.setblocking(False)
    idle_since = time.monotonic()
    while time.monotonic() - idle_since < 1.0 and any(n < send for n in sent.values()):
        moved = False
        for i, s in enumerate(socks):
            if sent[i] < send:
                try:
                    sent[i] += s.send(chunk[: send - sent[i]])
                    moved = True
                except BlockingIOError:
                    pass
        if moved:
            idle_since = time.monotonic()
        else:
            time.sleep(0.01)
    for s in socks:
        s.setblocking(True)
    return sum(sent.values())


async def test_partial_frames_together_stay_within_the_inbound_budget():
    """40 peers each part-way through a 16 MiB frame would hold 40 x 12 MiB; with a 32 MiB budget for
    frame bodies being read, the others wait (their bytes stay in the kernel), RSS stays far below the
    flood, a normal client is served meanwhile, a waiting frame that outlasts --read-timeout is refused
    naming the budget, and a frame larger than the whole budget is refused at once."""
    async with config_daemon(max_inbound_bytes=32 << 20, max_frame=48 << 20, read_timeout=5) as d:
        async with await d.client() as c:
            assert (await c.run(["echo", "ok"])).stdout == b"ok\n"
        before = rss_kib(d.proc.pid)
        socks = [await asyncio.to_thread(raw, d.socket, 15) for _ in range(40)]
        for s in socks:
            await asyncio.to_thread(hello, s)
        try:
            sent = await asyncio.to_thread(push_partial_frames, socks, 16 << 20, 12 << 20)
            grown = rss_kib(d.proc.pid) - before
            # KiB, versus 480 MiB in flight: 2 x 12 MiB read within the budget, and each waiting
            # peer's stream reader holds no more than a few hundred KiB
            assert grown < 64 * 1024, (grown, sent)
            async with await d.client() as c:
                assert (await c.run(["echo", "served"])).stdout == b"served\n"
            big = await asyncio.to_thread(raw, d.socket)
            await asyncio.to_thread(hello, big)
            big.sendall(struct.pack(">I", 40 << 20))
            reply = await asyncio.to_thread(recv, big)
            assert isinstance(reply, P.Error) and reply.code == "bad_frame", reply
            assert "--max-inbound-bytes" in reply.message, reply.message
            big.close()
            replies = await asyncio.gather(*(asyncio.to_thread(recv, s) for s in socks))
            assert all(isinstance(r, P.Error) and r.code == "bad_frame" for r in replies), replies
            waited = [r for r in replies if "--max-inbound-bytes" in r.message]
            assert waited and len(waited) < len(replies), [r.message for r in replies]
        finally:
            for s in socks:
                s.close()
        async with await d.client() as c:
            assert (await c.run(["echo", "still"])).stdout == b"still\n"
