"""A small real daemon stand-in for the runtime tests: a unix socket that speaks krex_async.protocol
to command runtimes (Hello, QuiesceReady in; Welcome, Quiesce, Resume out; QuiesceAck in)."""

from __future__ import annotations

import socket
import struct
import threading
from pathlib import Path

from krex_async import protocol as P


class Peer:
    """One connected command runtime."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.conn.settimeout(10)
        self.hello = self.recv(10)
        assert isinstance(self.hello, P.Hello), self.hello
        self.conn.sendall(
            P.encode(P.Welcome(id=self.hello.id, version=P.PROTOCOL_VERSION, server="test", policy="region"))
        )
        self.ready = self.recv(10)
        assert isinstance(self.ready, P.QuiesceReady), self.ready

    def recv(self, timeout: float) -> P.Request | None:
        """The next request, or None when none arrives within `timeout` or the peer closed."""
        self.conn.settimeout(timeout)
        try:
            head = self._exact(4)
            if head is None:
                return None
            (n,) = struct.unpack(">I", head)
            body = self._exact(n)
        except TimeoutError:
            return None
        return None if body is None else P.decode_request(body)

    def _exact(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            chunk = self.conn.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    def send(self, msg: P.Msg) -> None:
        self.conn.sendall(P.encode(msg))

    def close(self) -> None:
        self.conn.close()


class Server:
    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(16)

    def accept(self, timeout: float = 10.0) -> Peer | None:
        self.sock.settimeout(timeout)
        try:
            conn, _ = self.sock.accept()
        except TimeoutError:
            return None
        return Peer(conn)

    def close(self) -> None:
        self.sock.close()


def accept_in_background(server: Server, n: int) -> tuple[list[Peer], threading.Thread]:
    peers: list[Peer] = []

    def run() -> None:
        for _ in range(n):
            peer = server.accept()
            if peer is None:
                return
            peers.append(peer)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return peers, t
