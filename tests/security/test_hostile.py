"""Hostile input against a live daemon: each gets a clear error or a clean close, memory stays
bounded, and the daemon keeps serving everyone else."""

from __future__ import annotations

import asyncio
import struct

import msgspec
import pytest

from krex_async import protocol as P

from ..conftest import run_daemon
from .helpers import config_daemon, hello, raw, recv, rss_kib


async def still_serving(d) -> None:
    async with await d.client() as c:
        res = await c.run(["echo", "alive"])
        assert res.stdout == b"alive\n"


def nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]


def mapping(**fields: bytes) -> bytes:
    out = bytes([0x80 | len(fields)])
    for k, v in fields.items():
        out += msgspec.msgpack.encode(k) + v
    return out


def framed(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


async def test_a_huge_length_allocates_nothing():
    async with run_daemon() as d:
        await still_serving(d)
        before = rss_kib(d.proc.pid)
        for _ in range(20):
            s = await asyncio.to_thread(raw, d.socket)
            s.sendall(struct.pack(">I", 0xFFFFFFFF))
            reply = await asyncio.to_thread(recv, s)
            assert isinstance(reply, P.Error) and reply.code == "bad_frame", reply
            assert "exceeds the limit of 16777216" in reply.message
            assert await asyncio.to_thread(recv, s) is None
            s.close()
        after = rss_kib(d.proc.pid)
        assert after - before < 4096, (before, after)  # KiB: nowhere near one 4 GiB (or 16 MiB) buffer
        await still_serving(d)


async def test_a_header_that_stops_half_way_times_out():
    async with run_daemon("--read-timeout", "0.5") as d:
        s = await asyncio.to_thread(raw, d.socket)
        await asyncio.to_thread(hello, s)
        s.sendall(b"\x00\x00")  # two bytes of a header, then silence
        reply = await asyncio.to_thread(recv, s)
        assert isinstance(reply, P.Error) and reply.code == "bad_frame" and "0.5" in reply.message
        assert await asyncio.to_thread(recv, s) is None
        await still_serving(d)


@pytest.mark.parametrize("where", ["unknown field", "known field", "top level"])
@pytest.mark.parametrize("depth", [1000, 100_000, 1_000_000])
async def test_deeply_nested_msgpack_is_answered_not_fatal(where, depth):
    body = {
        "unknown field": mapping(type=msgspec.msgpack.encode("status"), id=b"\x07", zz=nested(depth)),
        "known field": mapping(type=msgspec.msgpack.encode("submit"), id=b"\x07", argv=nested(depth)),
        "top level": nested(depth),
    }[where]
    async with run_daemon() as d:
        s = await asyncio.to_thread(raw, d.socket)
        await asyncio.to_thread(hello, s)
        s.sendall(framed(body))
        reply = await asyncio.to_thread(recv, s)
        assert isinstance(reply, P.Error) and reply.code == "bad_request", reply
        s.sendall(P.encode(P.Status(id=8)))  # the connection goes on
        assert isinstance(await asyncio.to_thread(recv, s), P.StatusReply)
        s.close()
        await still_serving(d)
        assert d.proc.poll() is None


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(argv=["x" * 100_000] * 30), "exec accepts"),  # each arg fits, their sum does not
        (dict(argv=["true"], env={f"K{i}": "v" * 100_000 for i in range(25)}), "exec accepts"),
        (dict(argv=["true"], stdin=b"\0" * (P.MAX_STDIN + 1)), "$.stdin"),
        (dict(argv=["true"], label="l" * 257), "$.label"),
        (dict(argv=["true"], timeout=-1.0), "$.timeout"),
        (dict(argv=["true"], timeout=float("nan")), "$.timeout"),
        (dict(argv=["true"], mem=-5), "$.mem"),
        (dict(argv=[1, 2]), "$.argv[0]"),
        (dict(argv=["true"], on_disconnect="maybe"), "$.on_disconnect"),
    ],
    ids=["argv-total", "env-total", "stdin", "label", "timeout", "nan", "mem", "argv-type", "literal"],
)
async def test_oversize_and_mistyped_fields_name_the_field(fields, words):
    async with run_daemon() as d:
        s = await asyncio.to_thread(raw, d.socket)
        await asyncio.to_thread(hello, s)
        s.sendall(framed(msgspec.msgpack.encode({"type": "submit", "id": 11, **fields})))
        reply = await asyncio.to_thread(recv, s)
        assert isinstance(reply, P.Error) and reply.code == "bad_request", reply
        assert reply.id == 11 and words in reply.message, reply.message
        s.close()
        await still_serving(d)


async def test_region_requests_with_out_of_range_pids_are_refused():
    async with run_daemon() as d:
        s = await asyncio.to_thread(raw, d.socket)
        await asyncio.to_thread(hello, s)
        for pid in (-2, 1 << 40):
            s.sendall(
                framed(
                    msgspec.msgpack.encode(
                        {"type": "region_enter", "id": 3, "command": "x", "token": "t", "pid": pid}
                    )
                )
            )
            reply = await asyncio.to_thread(recv, s)
            assert isinstance(reply, P.Error) and "$.pid" in reply.message, reply
        s.close()


FLOOD = "import os\nb = b'x' * (1 << 20)\nfor _ in range({mib}): os.write(1, b)\n"


async def test_a_client_that_stops_reading_is_dropped_and_memory_stays_bounded():
    """A command floods 400 MiB of output to an agent that never reads: the agent is dropped as a
    slow consumer once --max-conn-buffer is exceeded, the command (on_disconnect=keep) goes on, the
    daemon's RSS stays far below the flood, and another client is served meanwhile."""
    from ..conftest import PY

    async with config_daemon(max_conn_buffer=4 << 20, output_tail=1 << 20) as d:
        await still_serving(d)
        before = rss_kib(d.proc.pid)
        s = await asyncio.to_thread(raw, d.socket)
        s.setsockopt(1, 8, 4096)  # SO_RCVBUF: small, so the daemon's own buffer fills quickly
        await asyncio.to_thread(hello, s)
        s.sendall(P.encode(P.Submit(id=5, argv=[PY, "-c", FLOOD.format(mib=400)], on_disconnect="keep")))
        peak = before
        async with await d.client() as c:
            for _ in range(200):
                peak = max(peak, rss_kib(d.proc.pid))
                st = await c.status()
                cmds = [x for x in st["commands"] if x["argv"][0] == PY]
                if cmds and cmds[0]["state"] == "ended":
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the flooding command did not finish")
            assert cmds[0]["result"] == "exited", cmds
            res = await c.run(["echo", "served"])
            assert res.stdout == b"served\n"
            attached = await (await c.attach(cmds[0]["command"])).wait()
        assert attached.report.stdout_bytes == 400 << 20
        assert len(attached.stdout) == 1 << 20  # the tail kept for a re-attaching agent
        assert peak - before < 48 * 1024, (before, peak)  # KiB, versus a 400 MiB flood
        assert "slow consumer" in d.logs()
        s.close()


@pytest.mark.parametrize("bad_id", [-1, 2**53 + 1, 2**64 - 1])
async def test_an_unusable_request_id_is_answered_with_id_0(bad_id):
    """The error for a request whose id is out of range must itself be decodable by clients."""
    async with run_daemon() as d:
        s = await asyncio.to_thread(raw, d.socket)
        await asyncio.to_thread(hello, s)
        s.sendall(framed(msgspec.msgpack.encode({"type": "status", "id": bad_id})))
        reply = await asyncio.to_thread(recv, s)  # recv decodes with the clients' reply decoder
        assert isinstance(reply, P.Error) and reply.code == "bad_request" and reply.id == 0, reply
        s.close()
