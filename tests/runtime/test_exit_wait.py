"""The runtime's exit wait (quiesce._Listener.wait_unheld) against a Quiesce that arrives in the
middle of it, in this process, with a socket pair standing in for the daemon: the Quiesce's signal
handler runs on the main thread while wait_unheld holds the listener's lock, and must not leave the
listener thread unable to deliver the Resume it waits for (the exit then hung for
KREX_QUIESCE_MAX_S, 600 s by default)."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from krex_async.runtime import quiesce as q


def _reader(sock: socket.socket, handle: Callable[[dict[str, Any]], None]) -> None:
    buf = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except OSError:
            return
        if not chunk:
            return
        buf += chunk
        while len(buf) >= 4 and len(buf) >= 4 + (n := int.from_bytes(buf[:4], "big")):
            handle(q.unpack(buf[4 : 4 + n]))
            buf = buf[4 + n :]


class _SignalOnAcquire:
    """held_gate, firing the Quiesce's signal at its first acquire: inside wait_unheld's lock."""

    def __init__(self, signum: int) -> None:
        self.lock, self.signum, self.fired = threading.Lock(), signum, False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self.fired:
            self.fired = True
            signal.pthread_kill(threading.get_ident(), self.signum)
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()


def test_a_quiesce_arriving_inside_the_exit_wait_is_served_and_the_exit_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KREX_QUIESCE_MAX_S", "3")
    monkeypatch.setenv("KREX_EXIT_HOLD_MAX_S", "10")
    monkeypatch.setattr(q, "holds_gpu_file", lambda pid="self", *, unreadable=False: True)
    a, b = socket.socketpair()
    signum = signal.SIGRTMAX - 6
    st = q._Listener(a, threading.get_ident(), signum)
    gate = _SignalOnAcquire(signum)
    st.held_gate = gate  # type: ignore[assignment]
    monkeypatch.setattr(q, "_state", st)
    monkeypatch.setattr(
        q, "_devicework", lambda: type("D", (), {"synchronize": staticmethod(lambda: "none")})
    )
    old = signal.signal(signum, lambda s, f: q.on_signal())
    seen: list[str] = []

    def daemon(msg: dict[str, Any]) -> None:  # Resume the quiesce's region, and the exit
        seen.append(msg["type"])
        if msg["type"] == "quiesce_ack":
            b.sendall(q.frame({"type": "resume", "id": 0, "region": msg["region"]}))
        elif msg["type"] == "exit_held":
            b.sendall(q.frame({"type": "resume", "id": 0, "region": ""}))

    threading.Thread(target=_reader, args=(b, daemon), daemon=True).start()
    threading.Thread(
        target=_reader, args=(a, lambda m: m["type"] == "resume" and st.on_resume(m["region"])), daemon=True
    ).start()
    st.pending = q._Quiesce(5, "B.1")  # on_quiesce has run: its signal lands in wait_unheld's lock
    try:
        t0 = time.monotonic()
        st.wait_unheld()
        took = time.monotonic() - t0
    finally:
        signal.signal(signum, old)
        a.close()
        b.close()
    assert gate.fired
    assert took < 2.0, f"the exit waited {took:.1f} s: the Resume could not be delivered"
    assert seen == ["quiesce_ack", "exit_held"], seen
    assert st.held is None and st.pending is None


def test_a_child_forked_with_its_parents_gpu_files_exits_without_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A forked child holds copies of its parent's GPU files: closing them frees nothing of the
    parent's context, so its exit neither asks the daemon nor waits (unless a region holds it)."""
    monkeypatch.setattr(q, "holds_gpu_file", lambda pid="self", *, unreadable=False: True)
    monkeypatch.setattr(q, "_forked_with_gpu", False)
    parent_sock, _ = socket.socketpair()
    monkeypatch.setattr(q, "_state", q._Listener(parent_sock, threading.get_ident(), signal.SIGRTMAX - 6))
    q.forget_parent_connection()  # what the child's fork hook does with the parent's connection
    assert q._forked_with_gpu and q._state is None
    a, b = socket.socketpair()
    st = q._Listener(a, threading.get_ident(), signal.SIGRTMAX - 6)  # the child's own connection
    t0 = time.monotonic()
    st.wait_unheld()
    assert time.monotonic() - t0 < 0.5
    b.setblocking(False)
    with pytest.raises(BlockingIOError):
        b.recv(1)  # nothing was sent: no exit_held
    assert st.held is None
    a.close()
    b.close()
