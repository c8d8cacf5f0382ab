"""Who may act on what: commands run as their submitter; agents see and act only on their own
commands (root and --admin-group excepted). Clients run as real other users over the real socket."""

from __future__ import annotations

import asyncio
import json
import os

from .helpers import config_daemon, python_as, run_python_as, user_env

AGENT = r"""
import asyncio, json, sys
from krex_async import Client, KrexError

async def main(path, action, *args):
    async with await Client.connect(path) as c:
        try:
            if action == "keep":
                h = await c.submit(list(args), on_disconnect="keep", env=json.loads(sys.stdin.read()))
                print(h.command)
            elif action == "run":
                res = await c.run(list(args), env=json.loads(sys.stdin.read()))
                print(json.dumps({"stdout": res.stdout.decode(), "state": res.report.state}))
            elif action == "cancel":
                await c.cancel(args[0], 9)
                print("ok")
            elif action == "attach":
                h = await c.attach(args[0])
                print("ok", h.command)
            elif action == "whoami":
                print(c.welcome.uid)
            elif action == "status":
                print(json.dumps(await c.status()))
            elif action == "timeline":
                print(json.dumps([[ev.kind, ev.command] for ev in await c.timeline()]))
            elif action == "trace":  # subscribe, create args[1], print what came in args[0] s
                seen = []
                async def watch():
                    async for ev in c.trace():
                        seen.append([ev.kind, ev.command])
                task = asyncio.create_task(watch())
                await c.status()  # the Subscribe went first on this connection: it is in effect
                open(args[1], "w").close()
                await asyncio.sleep(float(args[0]))
                task.cancel()
                print(json.dumps(seen))
        except KrexError as e:
            print(e.code)

asyncio.run(main(*sys.argv[1:]))
"""

SECRET = "krex-secret-argument-7f3a"


def agent(user, path: str, action: str, *args: str, env: dict[str, str] | None = None) -> str:
    return python_as(
        user, AGENT, path, action, *args, input=json.dumps(env if env is not None else user_env())
    ).strip()


async def call(*a, **kw) -> str:
    return await asyncio.to_thread(agent, *a, **kw)


async def test_agents_see_and_act_only_on_their_own_commands(users):
    alice, mallory, admin = users["alice"], users["mallory"], users["admin"]
    async with config_daemon(dir_mode=0o755, socket_group="krexg", admin_group="krexadm") as d:
        cid = await call(alice, d.socket, "keep", "/bin/sh", "-c", "sleep 30", SECRET)
        assert cid and " " not in cid, cid
        # Another user: cannot cancel, attach or see it.
        assert await call(mallory, d.socket, "cancel", cid) == "forbidden"
        assert await call(mallory, d.socket, "attach", cid) == "forbidden"
        st_m = await call(mallory, d.socket, "status")
        assert SECRET not in st_m and cid not in st_m
        st = json.loads(st_m)
        assert st["commands"] == [] and st["other_commands"] == 1
        assert st["devices"][0]["commands"] == [] and st["devices"][0]["other_commands"] == 1
        # The owner sees it in full.
        st_a = json.loads(await call(alice, d.socket, "status"))
        assert [c["command"] for c in st_a["commands"]] == [cid] and SECRET in st_a["commands"][0]["argv"]
        # An admin sees everything and may cancel it.
        st_adm = json.loads(await call(admin, d.socket, "status"))
        assert cid in [c["command"] for c in st_adm["commands"]]
        assert await call(admin, d.socket, "attach", cid) == f"ok {cid}"
        assert await call(admin, d.socket, "cancel", cid) == "ok"
        async with await d.client() as root:  # root is an admin too
            res = await (await root.attach(cid)).wait()
        assert res.report.signal == 9 or res.report.state == "cancelled", res.report


async def test_a_user_cannot_reach_the_daemon_without_the_socket_group(users):
    async with config_daemon(dir_mode=0o755, socket_group="krexg") as d:
        p = await asyncio.to_thread(run_python_as, users["outsider"], AGENT, d.socket, "status", input="{}")
        assert p.returncode != 0 and "unreachable" in p.stderr, (p.stdout, p.stderr)
        assert "not open to this user" in p.stderr and "--socket-group" in p.stderr, p.stderr
        assert os.stat(d.socket).st_mode & 0o007 == 0


async def test_each_connection_is_identified_by_its_own_peer_credentials(users):
    async with config_daemon(dir_mode=0o755, socket_group="krexg") as d:
        got = await asyncio.gather(*(call(users[u], d.socket, "whoami") for u in ("alice", "mallory")))
        assert [int(x) for x in got] == [users["alice"].uid, users["mallory"].uid]
        async with await d.client() as c:
            assert c.welcome is not None and c.welcome.uid == 0


async def test_a_trace_subscriber_sees_its_own_commands_and_the_node_not_others(users):
    from krex_async import protocol as P
    from krex_async.daemon.server import visible_event

    alice, mallory = users["alice"], users["mallory"]
    flags = [f"/tmp/krex-trace-{os.getpid()}-{u.name}" for u in (mallory, alice)]
    async with config_daemon(dir_mode=0o755, socket_group="krexg", admin_group="krexadm") as d:
        watchers = [
            asyncio.create_task(call(u, d.socket, "trace", "3", f)) for u, f in zip((mallory, alice), flags)
        ]
        for _ in range(600):  # both subscribed
            if all(os.path.exists(f) for f in flags):
                break
            await asyncio.sleep(0.05)
        assert all(os.path.exists(f) for f in flags), "a watcher never subscribed"
        for f in flags:
            os.unlink(f)
        cid = await call(alice, d.socket, "keep", "/bin/sh", "-c", "sleep 0.3")
        seen_m, seen_a = [json.loads(x) for x in await asyncio.gather(*watchers)]
    assert ["command_start", cid] in seen_a and ["command_end", cid] in seen_a, seen_a
    assert seen_m == [], f"mallory saw alice's events: {seen_m}"

    commands = {cid: type("Cmd", (), {"uid": alice.uid})()}
    node = P.TraceEvent(id=0, ts=0.0, kind="probes_failed", detail={"reason": "x"})
    assert visible_event(node, commands, mallory.uid), "a node-wide event was hidden"
    other = P.TraceEvent(id=0, ts=0.0, kind="freeze")  # no command, not a node event
    assert not visible_event(other, commands, mallory.uid)
    own = P.TraceEvent(id=0, ts=0.0, kind="region_grant", command=cid)
    assert visible_event(own, commands, alice.uid) and not visible_event(own, commands, mallory.uid)


async def test_a_timeline_holds_only_the_peers_own_commands_and_the_node(users):
    """The timeline ring is filtered like live trace events: mallory's holds her own command, and
    none of root's (whose events, argv aside, would tell her what ran and when); root's holds both."""
    mallory = users["mallory"]
    async with config_daemon(dir_mode=0o755, socket_group="krexg", admin_group="krexadm") as d:
        async with await d.client() as root:
            theirs = (await root.run(["true"])).report.command
            mine = await call(mallory, d.socket, "keep", "/bin/sh", "-c", "exit 0")
            for _ in range(200):  # her command has ended
                st = await root.status()
                if all(c["state"] == "ended" for c in st["commands"]):
                    break
                await asyncio.sleep(0.05)
            seen_root = {(e.kind, e.command) for e in await root.timeline()}
        seen_m = {tuple(e) for e in json.loads(await call(mallory, d.socket, "timeline"))}
    assert {("command_start", theirs), ("command_end", theirs)} <= seen_root, seen_root
    assert {("command_start", mine), ("command_end", mine)} <= seen_root, seen_root
    assert {("command_start", mine), ("command_end", mine)} <= seen_m, seen_m
    assert not {e for e in seen_m if e[1] not in (mine, "")}, f"mallory saw others' events: {seen_m}"
