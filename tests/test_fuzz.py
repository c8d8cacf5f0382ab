"""Fuzzing the frame decoder and the request handlers (hypothesis, bounded: about 30 s in all).

In process: arbitrary bytes, arbitrary msgpack and structured-but-wrong requests must decode or raise
only the decoder's own errors, and the frame reader must return a body, None, or a FrameError. Against
a live daemon: the same inputs sent after a handshake must get replies or a clean close, and the daemon
must go on answering on that connection (when it stayed open) and on a fresh one.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
import time
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from krex_async import protocol as P

from .conftest import PY, py_env

DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(max_size=10) | st.integers(-(2**63), 2**63 - 1), inner, max_size=5)
    ),
    max_leaves=30,
)
TAGS = [t.__struct_config__.tag for t in P.Request.__args__]  # type: ignore[attr-defined]
FIELDS = sorted({f for t in P.Request.__args__ for f in t.__struct_fields__})  # type: ignore[attr-defined]
SAFE_ARGV0 = ["true", "false", "/no/such/krex-fuzz", "", "\x00", "relative/no-such"]


@st.composite
def wrong_requests(draw: st.DrawFn, live: bool = False) -> dict[object, object]:
    """A known message type with a random mix of known field names (and junk) holding random
    values; for a live daemon argv[0] is drawn from harmless programs."""
    msg: dict[object, object] = {"type": draw(st.sampled_from(TAGS) | st.text(max_size=12))}
    for name in draw(st.lists(st.sampled_from(FIELDS) | st.text(max_size=8), max_size=8)):
        msg[name] = draw(values)
    if "id" not in msg or draw(st.booleans()):
        msg["id"] = draw(st.integers(min_value=-5, max_value=2**53 + 5))
    if live and "argv" in msg:
        msg["argv"] = [draw(st.sampled_from(SAFE_ARGV0)), *draw(st.lists(st.text(max_size=20), max_size=3))]
    return msg


def check_decode(body: bytes) -> None:
    try:
        P.decode_request(body)
    except DECODE_ERRORS:
        pass


@settings(max_examples=600, deadline=None)
@given(st.binary(max_size=300))
def test_decoder_on_arbitrary_bytes(body: bytes) -> None:
    check_decode(body)


@settings(max_examples=300, deadline=None)
@given(values)
def test_decoder_on_arbitrary_msgpack(obj: object) -> None:
    check_decode(msgspec.msgpack.encode(obj))


@settings(max_examples=200, deadline=None)
@given(wrong_requests())
def test_decoder_on_structured_but_wrong_requests(msg: dict[object, object]) -> None:
    check_decode(msgspec.msgpack.encode(msg))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.integers(min_value=16, max_value=64))
def test_frame_reader_on_arbitrary_streams(stream: bytes, limit: int) -> None:
    async def read_all() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(stream)
        reader.feed_eof()
        consumed = 0
        while True:
            try:
                body = await P.read_frame(reader, limit, 1.0)
            except P.FrameError:
                return
            if body is None:
                assert consumed == len(stream)
                return
            assert len(body) <= limit
            consumed += 4 + len(body)

    asyncio.run(read_all())


# ------------------------------------------------------------------------------------- live daemon


@pytest.fixture(scope="module")
def daemon_socket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    import tempfile

    d = tempfile.mkdtemp(prefix="krexf-", dir="/tmp")
    sock = os.path.join(d, "s")
    log = open(os.path.join(d, "log"), "wb")
    proc = subprocess.Popen(
        [
            PY,
            "-m",
            "krex_async",
            "serve",
            "--socket",
            sock,
            "--isolation",
            "signal",
            "--state-dir",
            os.path.join(d, "st"),
            "--read-timeout",
            "0.3",
            "--max-frame",
            "65536",
            "--log-format",
            "json",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=py_env(),
    )
    deadline = time.monotonic() + 20
    while not os.path.exists(sock):
        assert proc.poll() is None and time.monotonic() < deadline, "daemon did not start"
        time.sleep(0.02)
    yield sock, proc
    proc.terminate()
    proc.wait(20)
    log.close()
    with open(os.path.join(d, "log")) as f:
        text = f.read()
    # Surviving is not enough: no input may reach a handler's unexpected-exception path.
    assert "request_failed" not in text and "Traceback" not in text, text[-4000:]


def _recv(s: socket.socket) -> P.Reply | None:
    def exact(n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = s.recv(n - len(buf))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    head = exact(4)
    if head is None:
        return None
    body = exact(struct.unpack(">I", head)[0])
    return None if body is None else P.decode_reply(body)


def _exchange(path: str, payload: bytes) -> None:
    """Send a handshake, the payload, then a Status: the daemon must answer the Status, or close
    the connection after saying why (bad_frame)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    try:
        s.sendall(P.encode(P.Hello(id=1)))
        assert isinstance(_recv(s), P.Welcome)
        s.sendall(payload + P.encode(P.Status(id=2**53)))
        while True:
            reply = _recv(s)
            if reply is None:
                return  # closed: the payload broke the framing
            if isinstance(reply, P.StatusReply) and reply.id == 2**53:
                return
    finally:
        s.close()


def _framed(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _alive(path: str, proc: subprocess.Popen[bytes]) -> None:
    assert proc.poll() is None, "the daemon died"
    _exchange(path, b"")


LIVE = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@LIVE
@given(payload=st.binary(max_size=200))
def test_live_daemon_on_arbitrary_bytes(daemon_socket, payload: bytes) -> None:
    path, proc = daemon_socket
    _exchange(path, payload)
    _alive(path, proc)


@LIVE
@given(obj=values)
def test_live_daemon_on_arbitrary_msgpack(daemon_socket, obj: object) -> None:
    path, proc = daemon_socket
    _exchange(path, _framed(msgspec.msgpack.encode(obj)))
    _alive(path, proc)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msg=wrong_requests(live=True))
def test_live_daemon_on_structured_but_wrong_requests(daemon_socket, msg: dict[object, object]) -> None:
    path, proc = daemon_socket
    _exchange(path, _framed(msgspec.msgpack.encode(msg)))
    _alive(path, proc)
