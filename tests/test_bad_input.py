"""Bad input gets a clear error and never stops the daemon or leaves anything frozen."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess

import msgspec
import pytest

from krex_async import KrexError
from krex_async import protocol as P

from .conftest import PY, py_env, run_daemon, until


def raw(sock_path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(sock_path)
    return s


def recv(s: socket.socket) -> P.Reply | None:
    head = b""
    while len(head) < 4:
        chunk = s.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (n,) = struct.unpack(">I", head)
    body = b""
    while len(body) < n:
        body += s.recv(n - len(body))
    return P.decode_reply(body)


def frame(obj: object) -> bytes:
    body = msgspec.msgpack.encode(obj)
    return struct.pack(">I", len(body)) + body


def hello(s: socket.socket) -> None:
    s.sendall(P.encode(P.Hello(id=1)))
    assert isinstance(recv(s), P.Welcome)


async def still_serving(d) -> None:
    async with await d.client() as c:
        res = await c.run(["echo", "alive"])
        assert res.stdout == b"alive\n"


@pytest.mark.parametrize(
    "payload, code",
    [
        (frame({"type": "no_such_message", "id": 3}), "bad_request"),
        (frame({"type": "submit", "id": 4, "argv": "not-a-list"}), "bad_request"),
        (frame({"type": "submit", "id": 5, "argv": []}), "bad_request"),
        (frame({"type": "submit", "id": 6, "argv": ["x" * 200_000]}), "bad_request"),
        (frame([1, 2, 3]), "bad_request"),
        (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "bad_request"),  # 0xc1 is never valid msgpack
        (struct.pack(">I", 7) + b"\x81\xa4typ\xff\xc0", "bad_request"),  # invalid UTF-8 in a key
    ],
    ids=[
        "unknown-type",
        "wrong-field-type",
        "empty-argv",
        "oversize-arg",
        "not-a-map",
        "invalid-msgpack",
        "invalid-utf8",
    ],
)
async def test_undecodable_frames_get_an_error_and_the_connection_goes_on(payload, code):
    async with run_daemon() as d:
        s = await asyncio.to_thread(raw, d.socket)
        await asyncio.to_thread(hello, s)
        s.sendall(payload)
        reply = await asyncio.to_thread(recv, s)
        assert isinstance(reply, P.Error) and reply.code == code, reply
        s.sendall(P.encode(P.Status(id=9)))  # the same connection still works
        assert isinstance(await asyncio.to_thread(recv, s), P.StatusReply)
        s.close()
        await still_serving(d)


async def test_exit_held_from_a_process_no_region_locked_changes_nothing():
    """ExitHeld is the runtime's word that a process holding a GPU file is exiting: for a region
    that does not exist or one that did not lock it, it is ignored (no reply, no report entry);
    from a process that is no command's runtime, the exit is let go at once (a Resume, so that a
    runtime the daemon no longer knows never waits); and the connection goes on."""
    async with run_daemon() as d:
        s = await asyncio.to_thread(raw, d.socket)
        await asyncio.to_thread(hello, s)
        s.sendall(P.encode(P.ExitHeld(id=3, region="nope.1", pid=1)))
        s.sendall(P.encode(P.ExitHeld(id=4, region="", pid=-1)))
        s.sendall(P.encode(P.Status(id=9)))
        reply = await asyncio.to_thread(recv, s)
        assert isinstance(reply, P.Resume) and reply.region == "", reply
        reply = await asyncio.to_thread(recv, s)
        assert isinstance(reply, P.StatusReply) and reply.id == 9, reply
        s.close()
        await still_serving(d)


async def test_oversize_length_is_refused_before_reading():
    async with run_daemon("--max-frame", "65536") as d:
        s = await asyncio.to_thread(raw, d.socket)
        s.sendall(struct.pack(">I", 0xFFFFFFFF))
        reply = await asyncio.to_thread(recv, s)
        assert isinstance(reply, P.Error) and reply.code == "bad_frame" and "limit" in reply.message
        assert await asyncio.to_thread(recv, s) is None  # then closed
        await still_serving(d)


async def test_truncated_frame_and_first_message_not_hello():
    async with run_daemon("--read-timeout", "0.5") as d:
        s = await asyncio.to_thread(raw, d.socket)
        s.sendall(P.encode(P.Status(id=2)))
        reply = await asyncio.to_thread(recv, s)
        assert isinstance(reply, P.Error) and "hello" in reply.message
        s.sendall(struct.pack(">I", 100) + b"abc")  # then silence: a slow sender
        reply = await asyncio.to_thread(recv, s)
        assert isinstance(reply, P.Error) and reply.code == "bad_frame"
        s.close()
        s = await asyncio.to_thread(raw, d.socket)
        s.sendall(P.encode(P.Hello(id=1, version=99)))
        reply = await asyncio.to_thread(recv, s)
        assert isinstance(reply, P.Error) and reply.code == "version"
        await still_serving(d)


async def test_bad_specs_are_refused_with_reasons(tmp_path):
    plain = tmp_path / "plain"  # there, but without its x bit
    plain.write_text("true\n")
    async with run_daemon() as d:
        async with await d.client() as c:
            cases = [
                (dict(argv=["/no/such/binary"]), "not found"),
                (dict(argv=[str(plain)]), "not an executable"),
                (dict(argv=["no-such-prog-krex"]), "not found on PATH"),
                (dict(argv=["true"], cwd="relative/dir"), "absolute"),
                (dict(argv=["true"], cwd=str(tmp_path / "missing")), "not a directory"),
                (dict(argv=["true"], env={"A=B": "1", "PATH": os.environ["PATH"]}), "invalid"),
                (dict(argv=["true"], device="gpu9"), "unknown device"),
            ]
            for kw, words in cases:
                with pytest.raises(KrexError) as e:
                    await c.submit(**kw)
                assert words in e.value.message, (kw, e.value.message)
            with pytest.raises(KrexError) as e:
                await c.cancel("nope")
            assert e.value.code == "unknown_command"
        await still_serving(d)


async def test_region_requests_from_outside_the_command_are_refused(script):
    async with run_daemon() as d:
        async with await d.client() as c:
            h = await c.submit(
                [PY, "-c", "import os,time; print(os.environ['KREX_TOKEN'], flush=True); time.sleep(5)"],
                env=py_env(),
            )
            token = None
            async for _stream, data in h.output():
                token = data.decode().strip()
                break
            # The right token from a process that is not the command's: refused.
            src = script(
                "steal.py",
                f"""
                import os
                os.environ.update(KREX_SOCKET={d.socket!r}, KREX_COMMAND={h.command!r},
                                  KREX_TOKEN={token!r})
                from krex_async import region, RegionError
                try:
                    with region("x"):
                        print("granted")
                except RegionError as e:
                    print(e.code)
                os.environ["KREX_TOKEN"] = "0" * 32
                try:
                    with region("x"):
                        print("granted")
                except RegionError as e:
                    print(e.code)
            """,
            )
            p = await asyncio.to_thread(
                subprocess.run, [PY, src], env=py_env(), capture_output=True, timeout=30
            )
            assert p.stdout.split() == [b"forbidden", b"forbidden"], p.stderr
            st = await c.status()
            assert st["devices"][0]["region"] is None
            await h.cancel(9)
            await h.wait()
        await still_serving(d)


async def test_nested_region_joins_the_outer_one_and_raw_nesting_is_refused(script):
    src = script(
        "nest.py",
        """
        import os
        from krex_async import region, RegionError
        from krex_async import protocol as P
        from krex_async.client.region import _get_channel
        with region("outer") as outer:
            with region("inner") as inner:
                print(inner.report.region == outer.report.region)
            # The daemon itself refuses a second region for the same process.
            ch = _get_channel()
            reply = ch.call(P.RegionEnter(id=999, command=os.environ["KREX_COMMAND"],
                                          token=os.environ["KREX_TOKEN"], pid=os.getpid()))
            print(reply.code)
        print(outer.report.outcome)
    """,
    )
    async with run_daemon() as d:
        async with await d.client() as c:
            res = await c.run([PY, src], env=py_env())
    assert res.stdout.split() == [b"True", b"bad_request", b"released"], res.stderr
    assert len(res.report.regions) == 1


async def test_a_live_socket_is_not_stolen():
    async with run_daemon() as d:
        e = py_env()
        p = await asyncio.to_thread(
            subprocess.run,
            [PY, "-m", "krex_async", "serve", "--socket", d.socket],
            capture_output=True,
            env=e,
            timeout=30,
        )
        assert p.returncode != 0 and b"another daemon" in p.stderr
        await still_serving(d)
        mode = os.stat(d.socket).st_mode & 0o777
        assert mode == 0o600, oct(mode)


def test_region_outside_a_command_names_what_is_missing_and_a_long_name_is_refused_by_name(script):
    """KREX_SOCKET exported in a shell (for `krex run`) does not make a plain `python` a command:
    the warning names the variables that are missing, not KREX_SOCKET. A region name over the
    protocol's limit is a ValueError saying so, before any request."""
    src = script(
        "alone.py",
        """
        from krex_async import region
        with region("timing") as r:
            pass
        print(r.report)
        try:
            region("x" * 257)
        except ValueError as e:
            print("refused:", e)
        """,
    )
    p = subprocess.run(
        [PY, src], env=py_env(KREX_SOCKET="/tmp/krex-nowhere.sock"), capture_output=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    err = p.stderr.decode()
    assert "KREX_COMMAND, KREX_TOKEN unset" in err and "KREX_SOCKET unset" not in err, err
    assert "krex run" in err, err
    assert p.stdout.decode().splitlines() == [
        "None",
        f"refused: region name must be a string of at most {P.MAX_NAME} characters",
    ], p.stdout


async def test_mem_gate_answers_bad_requests_with_errors_and_changes_nothing(tmp_path):
    """MemGate (a runtime's CUDA start asking for memory admission) from outside its command: an
    unknown command, a wrong token, the right token from a process that is not the command's, and a
    malformed request each get an error naming it; the connection and the command go on."""
    tok = tmp_path / "token"
    prog = f"import os, time; open({str(tok)!r}, 'w').write(os.environ['KREX_TOKEN']); time.sleep(60)"
    async with run_daemon() as d:
        async with await d.client() as c:
            h = await c.submit([PY, "-c", prog], env=py_env())
            await until(lambda: tok.exists() and tok.read_text(), "the command wrote its token")
            s = await asyncio.to_thread(raw, d.socket)
            await asyncio.to_thread(hello, s)
            asks = [
                (P.MemGate(id=3, command="nope-1", token="t"), "unknown_command"),
                (P.MemGate(id=4, command=h.command, token="wrong"), "forbidden"),
                (P.MemGate(id=5, command=h.command, token=tok.read_text()), "forbidden"),
            ]
            for req, code in asks:
                s.sendall(P.encode(req))
                reply = await asyncio.to_thread(recv, s)
                assert isinstance(reply, P.Error) and reply.code == code and reply.id == req.id, reply
            s.sendall(frame({"type": "mem_gate", "id": 6, "command": "x" * 300, "token": "t"}))
            reply = await asyncio.to_thread(recv, s)
            assert isinstance(reply, P.Error) and reply.code == "bad_request", reply
            s.sendall(P.encode(P.Status(id=9)))
            st = await asyncio.to_thread(recv, s)
            assert isinstance(st, P.StatusReply)
            s.close()
            row = next(x for x in (await c.status())["commands"] if x["command"] == h.command)
            assert row["state"] == "running" and row["gate"] == "", row
            await h.cancel(9)
            await h.wait()
        await still_serving(d)


async def test_mem_alike_is_bounded_and_a_list():
    """Submit.mem_alike from a peer: more than MAX_ALIKE features, or one longer than a name, is
    refused as a bad request on a connection that goes on; a client given one string instead of a
    list says so instead of sending its characters as features."""
    async with run_daemon() as d:
        s = await asyncio.to_thread(raw, d.socket)
        await asyncio.to_thread(hello, s)
        for alike in (["f"] * (P.MAX_ALIKE + 1), ["x" * (P.MAX_NAME + 1)]):
            s.sendall(P.encode(P.Submit(id=3, argv=["true"], mem_alike=alike)))
            reply = await asyncio.to_thread(recv, s)
            assert isinstance(reply, P.Error) and "mem_alike" in reply.message, reply
        s.close()
        c = await d.client()
        with pytest.raises(KrexError, match="mem_alike is a list of features"):
            await c.submit(["true"], mem_alike="abc")  # type: ignore[arg-type]
        await c.close()
        await still_serving(d)
