"""The messages between a pool and its workers, over one AF_UNIX SOCK_SEQPACKET socketpair per worker.

A message is a JSON object with a "t" (type) field. SEQPACKET keeps packet boundaries, so a message is
one or more packets: each packet starts with one flag byte, b"+" (more follows) or b"." (last), and a
message longer than CHUNK is split (argv and env can exceed a socket buffer). File descriptors
(SCM_RIGHTS) ride on the first packet only. json with ensure_ascii round-trips the surrogate escapes that
os.environ uses for undecodable bytes.

Worker to pool:   {"t": "imported", "pid", "s"}        modules preloaded, asks to create its context
                  {"t": "ready", "s"}                  context created (or none needed), idle
                  {"t": "failed", "error"}             warming failed; the worker exits
                  {"t": "started", "ts"}               about to run the command's first instruction
                  {"t": "exited", "code", "retire", "user_s", "system_s"}   (max_uses > 1 only)
Pool to worker:   {"t": "init"}                        create the context now (holding the node lock)
                  {"t": "run", "spec": {...}} + fds [stdin, stdout, stderr]

This module is imported by the worker, so it imports nothing beyond the standard library.
"""

from __future__ import annotations

import array
import json
import select
import socket
from typing import Any

CHUNK = 32 * 1024
MAX_FDS = 3


def send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    """Send one message (blocking sends; a pool socket is non-blocking but the messages are small).

    Raises OSError (EPIPE, ECONNRESET) when the peer is gone.
    """
    data = json.dumps(msg, separators=(",", ":")).encode()
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
    for i, chunk in enumerate(chunks):
        flag = b"." if i == len(chunks) - 1 else b"+"
        anc = []
        if i == 0 and fds:
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        _send_all(sock, flag + chunk, anc)


def _send_all(sock: socket.socket, packet: bytes, anc: list[tuple[int, int, bytes]]) -> None:
    # A non-blocking SEQPACKET socket either takes the whole packet or raises BlockingIOError: wait
    # for room with a bounded select, since the worker drains its socket promptly.
    while True:
        try:
            sock.sendmsg([packet], anc)
            return
        except BlockingIOError:
            if not select.select([], [sock], [], 5.0)[1]:
                raise TimeoutError("worker channel stayed full for 5 s") from None


class Receiver:
    """Reassembles packets into messages; `feed` returns a message when its last packet arrived."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._fds: list[int] = []

    def feed(self, packet: bytes, fds: list[int]) -> tuple[dict[str, Any], list[int]] | None:
        if not packet:
            raise EOFError("channel closed")
        self._parts.append(packet[1:])
        self._fds.extend(fds)
        if packet[:1] == b"+":
            return None
        data, got = b"".join(self._parts), self._fds
        self._parts, self._fds = [], []
        return json.loads(data), got


def recv(sock: socket.socket, rx: Receiver) -> tuple[dict[str, Any], list[int]]:
    """Blocking receive of one message with its fds (worker side). Raises EOFError at EOF."""
    while True:
        packet, fds, _flags, _addr = socket.recv_fds(sock, CHUNK + 1, MAX_FDS)
        got = rx.feed(packet, fds)
        if got is not None:
            return got
