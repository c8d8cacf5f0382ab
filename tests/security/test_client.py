"""The client against a daemon that misbehaves: an undecodable reply fails its request, not the
connection."""

from __future__ import annotations

import asyncio
import os
import tempfile

import msgspec

from krex_async import Client, KrexError
from krex_async import protocol as P


async def test_an_undecodable_reply_fails_only_its_request():
    d = tempfile.mkdtemp(prefix="krexc-", dir="/tmp")
    path = os.path.join(d, "s")

    async def fake_daemon(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (body := await P.read_frame(reader)) is not None:
            req = P.decode_request(body)
            if isinstance(req, P.Hello):
                writer.write(P.encode(P.Welcome(id=req.id, version=1, server="fake", policy="region")))
            elif isinstance(req, P.Status) and req.id == 1:  # a reply type this client does not know
                bad = msgspec.msgpack.encode({"type": "from_the_future", "id": req.id})
                writer.write(P.HEADER.pack(len(bad)) + bad)
            elif isinstance(req, P.Status):
                writer.write(P.encode(P.StatusReply(id=req.id, status={"ok": True})))
        writer.close()

    server = await asyncio.start_unix_server(fake_daemon, path)
    try:
        async with await Client.connect(path) as c:
            try:
                await asyncio.wait_for(c.status(), 5)
            except KrexError as e:
                assert e.code == "bad_reply"
            else:
                raise AssertionError("an undecodable reply was taken for a status")
            assert await asyncio.wait_for(c.status(), 5) == {"ok": True}  # the connection goes on
    finally:
        server.close()
        os.unlink(path)
        os.rmdir(d)
