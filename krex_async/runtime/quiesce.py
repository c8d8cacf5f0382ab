"""The quiesce listener inside a command: stop the main thread, synchronise, acknowledge, resume.

    daemon                               listener thread                 main thread
      <-- Hello(role=command) ----------  connect($KREX_SOCKET)
      <-- QuiesceReady(cmd, token, pid) -
      --- Quiesce(id, region) --------->  pending = region, gate closed,
                                         pthread_kill(main, signal) ---> handler at the next
                                                                         bytecode boundary:
      <-- QuiesceAck(id, region, synced, seconds) ---------------------- devicework.synchronize()
          (daemon freezes the cgroup)                                    waits on the gate
      --- Resume(region) ------------->  pending = None, gate open ----> returns to user code

The connection closing (daemon gone) opens the gate too, and the main thread never waits longer
than KREX_QUIESCE_MAX_S (default 600) in one quiesce: nothing here can hang a program forever.

At exit, stop() in a process holding a GPU file sends ExitHeld and waits for the daemon's Resume,
at most KREX_EXIT_HOLD_MAX_S (default 120): the exit tears the CUDA context down and frees its
memory through the driver, GPU work that no lock stops and that slowed a sibling's timing on the
H200. The daemon answers at once, or at the end of the region of another command on the device; a
process a region locked through the driver was told so (Held(region)) and waits for that region.

Frames are those of krex_async.protocol (4-byte big-endian length, msgpack map with a "type" tag)
but encoded here with a small msgpack codec of the standard library: the command's interpreter may
lack msgspec, and the runtime must cost nothing at start-up. tests/runtime check the codec against
krex_async.protocol both ways. Every error ends the listener silently; none reaches the program.
"""

from __future__ import annotations

import _socket
import _struct as struct  # the C module: `struct` and `typing` would cost the listener ~10 ms
import _thread
import os
import sys
import time

if False:  # for type checkers only (annotations are strings here)
    from typing import Any

MAX_FRAME = 16 * 1024 * 1024
_state: _Listener | None = None
_stopping = False  # stop() was called: a listener that connects afterwards ends at once
_forked_with_gpu = False  # a forked child that holds its parent's GPU files (wait_unheld)


def peer_trusted(sock: _socket.socket) -> bool:
    """Whether the listener at the other end of `sock` runs as root, this user, or the uid in
    $KREX_SOCKET_UID (as client/trust.py decides): the command's token goes to nobody else."""
    try:
        uid = struct.unpack("3i", sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12))[1]
    except OSError:
        return False
    if uid in (0, os.getuid(), os.geteuid()):
        return True
    named = os.environ.get("KREX_SOCKET_UID", "").strip()
    return named.isdigit() and int(named) == uid


def connect_trusted(sock: _socket.socket, path: str, timeout: float) -> None:
    """Connect `sock` to the daemon at `path` within `timeout`, and leave it blocking. OSError where
    that fails or its listener is not one this command may trust (peer_trusted): the command's
    token, sent next, goes to nobody else. For every runtime connection (here, adopt.py, cudagate.py)."""
    sock.settimeout(timeout)
    sock.connect(path)
    sock.settimeout(None)
    if not peer_trusted(sock):
        raise OSError("the socket's listener is not the daemon this command may trust")


def hello(client: str) -> dict[str, Any]:
    """A runtime connection's first request (protocol.Hello), id 1: `reply` skips its answer."""
    return {"type": "hello", "id": 1, "version": 1, "role": "command", "client": client}


# ------------------------------------------------------------------------------ a tiny msgpack


def pack(obj: Any) -> bytes:
    """msgpack of None, bool, int, float, str, bytes, list and dict (what our messages hold)."""
    out = bytearray()
    _pack(obj, out)
    return bytes(out)


def _pack(o: Any, out: bytearray) -> None:
    if o is None:
        out.append(0xC0)
    elif o is True or o is False:
        out.append(0xC3 if o else 0xC2)
    elif isinstance(o, int):
        if 0 <= o < 128:
            out.append(o)
        elif -32 <= o < 0:
            out.append(o & 0xFF)
        elif 0 <= o < 2**64:
            out += b"\xcf" + struct.pack(">Q", o)
        else:
            out += b"\xd3" + struct.pack(">q", o)
    elif isinstance(o, float):
        out += b"\xcb" + struct.pack(">d", o)
    elif isinstance(o, str):
        b = o.encode()
        out += (bytes([0xA0 | len(b)]) if len(b) < 32 else b"\xdb" + struct.pack(">I", len(b))) + b
    elif isinstance(o, (bytes, bytearray)):
        out += b"\xc6" + struct.pack(">I", len(o)) + o
    elif isinstance(o, (list, tuple)):
        out += b"\xdd" + struct.pack(">I", len(o))
        for x in o:
            _pack(x, out)
    elif isinstance(o, dict):
        out += b"\xdf" + struct.pack(">I", len(o))
        for k, v in o.items():
            _pack(k, out)
            _pack(v, out)
    else:
        raise TypeError(f"cannot pack {type(o).__name__}")


_FIXED = {
    0xCC: ">B",
    0xCD: ">H",
    0xCE: ">I",
    0xCF: ">Q",
    0xD0: ">b",
    0xD1: ">h",
    0xD2: ">i",
    0xD3: ">q",
    0xCA: ">f",
    0xCB: ">d",
}
_LEN = {
    0xD9: ">B",
    0xDA: ">H",
    0xDB: ">I",
    0xC4: ">B",
    0xC5: ">H",
    0xC6: ">I",
    0xDC: ">H",
    0xDD: ">I",
    0xDE: ">H",
    0xDF: ">I",
}


def unpack(data: bytes) -> Any:
    """Decode one msgpack value; ValueError for anything malformed or an extension type."""
    try:
        value, end = _unpack(data, 0)
    except (IndexError, struct.error) as e:  # type: ignore[attr-defined]
        raise ValueError(f"truncated msgpack: {e}") from None
    if end != len(data):
        raise ValueError("trailing bytes after msgpack value")
    return value


def _unpack(d: bytes, i: int) -> tuple[Any, int]:
    t = d[i]
    i += 1
    if t < 0x80:
        return t, i
    if t >= 0xE0:
        return t - 256, i
    if 0xA0 <= t <= 0xBF:
        n = t & 0x1F
        return d[i : i + n].decode(), i + n
    if 0x90 <= t <= 0x9F:
        return _array(d, i, t & 0x0F)
    if 0x80 <= t <= 0x8F:
        return _map(d, i, t & 0x0F)
    if t == 0xC0:
        return None, i
    if t in (0xC2, 0xC3):
        return t == 0xC3, i
    if t in _FIXED:
        fmt = _FIXED[t]
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, d, i)[0], i + size
    if t in _LEN:
        fmt = _LEN[t]
        n = struct.unpack_from(fmt, d, i)[0]
        i += struct.calcsize(fmt)
        if t in (0xD9, 0xDA, 0xDB):
            return bytes(d[i : i + n]).decode(), i + n
        if t in (0xC4, 0xC5, 0xC6):
            return bytes(d[i : i + n]), i + n
        if t in (0xDC, 0xDD):
            return _array(d, i, n)
        return _map(d, i, n)
    raise ValueError(f"unsupported msgpack type byte 0x{t:02x}")


def _array(d: bytes, i: int, n: int) -> tuple[list[Any], int]:
    out = []
    for _ in range(n):
        v, i = _unpack(d, i)
        out.append(v)
    return out, i


def _map(d: bytes, i: int, n: int) -> tuple[dict[Any, Any], int]:
    out = {}
    for _ in range(n):
        k, i = _unpack(d, i)
        v, i = _unpack(d, i)
        out[k] = v
    return out, i


def frame(msg: dict[str, Any]) -> bytes:
    body = pack(msg)
    return struct.pack(">I", len(body)) + body


def recv_exact(sock: Any, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def reply(sock: Any) -> dict[str, Any] | None:
    """The daemon's answer to request 2 after a hello (id 1, its welcome skipped), or its error to
    the hello; None at EOF or past MAX_FRAME. For the one-request connections of adopt.py and
    cudagate.py."""
    while True:
        head = recv_exact(sock, 4)
        if head is None or (n := struct.unpack(">I", head)[0]) > MAX_FRAME:
            return None
        body = recv_exact(sock, n)
        if body is None:
            return None
        msg = unpack(body)
        if isinstance(msg, dict) and (
            msg.get("id") == 2 or (msg.get("type") == "error" and msg.get("id") in (0, 1))
        ):
            return msg


# ------------------------------------------------------------------------------------ listener


class _Quiesce:
    """One pending quiesce; `released` is held until its Resume (or the end of the connection)."""

    def __init__(self, req_id: int, region: str) -> None:
        self.id = req_id
        self.region = region
        self.released = _thread.allocate_lock()
        self.released.acquire()


class _Listener:
    def __init__(self, sock: Any, main: int, signum: int) -> None:
        self.sock = sock
        self.main = main
        self.signum = signum
        self.send_lock = _thread.allocate_lock()
        self.mu = _thread.allocate_lock()  # guards `pending` transitions
        self.pending: _Quiesce | None = None
        self.closed = False
        self.in_handler = False
        self.acks = 0  # how many quiesces this process acknowledged
        self.gpu = False  # a GPU device file was seen open here (sticky)
        self.held: str | None = None  # the region that locked this process (Held), until its Resume
        self.held_gate = _thread.allocate_lock()  # acquired while held
        self.finished = _thread.allocate_lock()  # released when the listener thread is done
        self.finished.acquire()

    def send(self, msg: dict[str, Any]) -> None:
        data = frame(msg)
        with self.send_lock:
            self.sock.sendall(data)

    def recv_exact(self, n: int) -> bytes | None:
        return recv_exact(self.sock, n)

    def on_quiesce(self, req_id: int, region: str) -> None:
        with self.mu:
            if self.pending is not None:
                if self.pending.region == region:
                    return  # a repeat: the handler already has it
                self.pending.released.release()  # a new region replaces an unresumed one
            self.pending = _Quiesce(req_id, region)
        import _signal

        _signal.pthread_kill(self.main, self.signum)

    def on_resume(self, region: str) -> None:
        with self.mu:
            p = self.pending
            if p is not None and (not region or p.region == region):
                self.pending = None
                p.released.release()
            if self.held is not None and (not region or self.held == region):
                self.held = None
                self.held_gate.release()

    def on_held(self, region: str) -> None:
        with self.mu:
            if self.closed:
                return
            if self.held is None:
                self.held_gate.acquire()
            self.held = region

    def wait_unheld(self) -> None:
        """At exit, in a process that holds a GPU device file: say so, and wait (bounded) for the
        daemon's Resume. It answers at once unless a region of another command runs on the
        device, or holds this process (Held): then at that region's end. An exit frees the
        process's GPU memory through the driver (a scrub no lock stops, 11% on a memory-bound
        kernel's trials on the H200); the region granted next waits for the exit to finish. A
        child forked with its parent's GPU files frees nothing of the parent's: it goes at once
        unless a region holds it."""
        fresh = sys.modules.get("krex_async.ctxpool.fresh")
        if getattr(fresh, "staying", False):  # a pool worker serving on: it tears nothing down
            return
        gpu = not _forked_with_gpu and (self.gpu or holds_gpu_file(unreadable=True))
        # The main thread holds `mu` below: a Quiesce's signal handler run meanwhile would wait
        # for a Resume that on_resume could not deliver without `mu`. It is served after.
        self.in_handler = True
        try:
            with self.mu:
                if self.closed:
                    return
                region = self.held
                if region is None:
                    if not gpu:
                        return
                    self.held_gate.acquire()
                    self.held = ""  # released by a Resume for no region or for this exit's region
        finally:
            self.in_handler = False
            if self.pending is not None:
                on_signal()
        try:
            self.send({"type": "exit_held", "id": 0, "region": region or "", "pid": os.getpid()})
        except OSError:
            return
        cap = float(os.environ.get("KREX_EXIT_HOLD_MAX_S") or 120)
        if self.held_gate.acquire(True, cap):
            self.held_gate.release()

    def close(self) -> None:
        with self.mu:
            self.closed = True
            p, self.pending = self.pending, None
            if p is not None:
                p.released.release()
            if self.held is not None:
                self.held = None
                self.held_gate.release()
        try:
            self.sock.close()
        except OSError:
            pass


def on_signal() -> None:
    """The main thread's signal handler body: for each pending quiesce, synchronise the device and
    acknowledge it, then wait until it is resumed (or the connection ends, or the cap passes).

    A KeyboardInterrupt (or any exception from another handler) while waiting propagates to the
    program as it would have without krex; the listener's state stays consistent.
    """
    st = _state
    if st is None or st.in_handler or st.pending is None:
        return
    st.in_handler = True
    drained = False
    try:
        cap = float(os.environ.get("KREX_QUIESCE_MAX_S") or 600)
        deadline = time.monotonic() + cap
        while True:
            p = st.pending
            if p is None or st.closed:
                drained = True
                return
            t0 = time.perf_counter()
            st.gpu = st.gpu or holds_gpu_file(unreadable=True)
            # Without a GPU device file there is no context and nothing queued: skip the device
            # libraries' probing (six dlopen(RTLD_NOLOAD) searches, milliseconds).
            synced = _devicework().synchronize() if st.gpu else "none"
            seconds = time.perf_counter() - t0
            if st.pending is not p:  # resumed (or replaced) while we synchronised: no stale ack
                continue
            try:
                st.send(
                    {
                        "type": "quiesce_ack",
                        "id": p.id,
                        "region": p.region,
                        "synced": synced,
                        "seconds": seconds,
                    }
                )
                st.acks += 1
            except OSError:
                return
            while not p.released.acquire(True, 0.25):
                if time.monotonic() > deadline:
                    return
    finally:
        st.in_handler = False
        # A Quiesce that arrived while this handler was on its way out (after it found nothing
        # pending, before in_handler was cleared) had its signal's handler return at once on
        # in_handler: serve it now rather than leave the daemon to its quiesce timeout.
        if drained and st.pending is not None and not st.closed:
            on_signal()


# The device files of GPU drivers (NVIDIA, AMD KFD, DRM render nodes). Here because this module
# needs only the standard library: the daemon, the probes and the command's runtime all use it.
GPU_PREFIXES = ("/dev/nvidia", "/dev/kfd", "/dev/dri/renderD")


def holds_gpu_file(pid: int | str = "self", *, unreadable: bool = False) -> bool:
    """Whether the process has a GPU device file open (from /proc/<pid>/fd); `unreadable` is the
    answer when its fds cannot be listed (gone, or no permission)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return unreadable
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(GPU_PREFIXES):
                return True
        except OSError:
            continue
    return False


def _devicework() -> Any:
    module = sys.modules.get("_krex_devicework")
    if module is None:
        here = os.path.dirname(os.path.abspath(__file__))
        from importlib.machinery import ModuleSpec, SourceFileLoader

        path = os.path.join(here, "devicework.py")
        loader = SourceFileLoader("_krex_devicework", path)
        module = type(sys)("_krex_devicework")
        module.__spec__ = ModuleSpec("_krex_devicework", loader, origin=path)
        module.__file__ = path
        loader.exec_module(module)
        sys.modules["_krex_devicework"] = module
    return module


def forget_parent_connection() -> None:
    """In a forked child: drop the parent's connection (close our copy of the fd; the parent's
    stays open) so that the child's own listener starts clean."""
    global _state, _forked_with_gpu
    st = _state
    _state = None
    if st is not None:
        # its GPU files are its parent's: closing them at its exit frees nothing (wait_unheld)
        _forked_with_gpu = st.gpu or holds_gpu_file(unreadable=True)
        try:
            st.sock.close()
        except OSError:
            pass


def run(
    path: str,
    command: str,
    token: str,
    main: int,
    signum: int,
    connect_timeout: float = 2.0,
    declined: str = "",
) -> None:
    """Connect to the daemon, announce this process, and serve Quiesce / Resume until the
    connection ends. Returns (never raises) on any error; the caller runs it on its own thread.
    `declined`: why this interpreter was not adopted by the command's pool (runtime/adopt.py)."""
    global _state
    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    except OSError:
        return
    try:
        connect_trusted(sock, path, connect_timeout)
    except OSError:
        sock.close()
        return
    st = _Listener(sock, main, signum)
    _state = st
    try:
        if _stopping:  # stop() ran while we connected, and found no listener to wake
            return
        pid = os.getpid()
        st.send(hello(f"krex-runtime/{pid}"))
        ready = {"type": "quiesce_ready", "id": 2, "command": command, "token": token, "pid": pid}
        if declined:
            ready["pool_declined"] = declined[:256]
        st.send(ready)
        while True:
            head = st.recv_exact(4)
            if head is None:
                return
            (n,) = struct.unpack(">I", head)
            if n > MAX_FRAME:
                return
            body = st.recv_exact(n)
            if body is None:
                return
            try:
                msg = unpack(body)
            except (ValueError, UnicodeDecodeError):
                continue
            if not isinstance(msg, dict):
                continue
            kind = msg.get("type")
            if kind == "quiesce":
                st.on_quiesce(int(msg.get("id") or 0), str(msg.get("region") or ""))
            elif kind == "resume":
                st.on_resume(str(msg.get("region") or ""))
            elif kind == "held":
                st.on_held(str(msg.get("region") or ""))
            elif kind == "error" and int(msg.get("id") or 0) in (1, 2):
                return  # the daemon refused this process (bad token, not a command): stay quiet
    except BaseException:  # noqa: BLE001
        return
    finally:
        if _state is st:
            st.close()
        st.finished.release()


def stop(wait_s: float = 0.5) -> None:
    """At interpreter exit (atexit, which runs before finalisation): end the listener and wait for
    its thread, so that it never wakes (a Quiesce arriving, the daemon closing) while the
    interpreter is being torn down. shutdown() wakes the thread's blocking recv; close() alone
    would not."""
    global _stopping
    _stopping = True  # set before reading _state: run() sets _state before it reads this
    st = _state
    if st is None:
        return
    try:
        st.wait_unheld()
    except BaseException:  # noqa: BLE001  (an interrupt at exit: exit now, as without krex)
        pass
    try:
        st.sock.shutdown(_socket.SHUT_RDWR)
    except OSError:
        pass
    st.finished.acquire(True, wait_s)
