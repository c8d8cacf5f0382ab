"""`region()`: inside a command, hold the command's device exclusively for a block of code.

    from krex_async import region

    with region("timing") as r:          # returns once the daemon granted exclusivity
        t = time_kernel()
    if r.report is not None:             # None outside krex
        print(r.report.enter_s, r.report.frozen)

The request travels over the daemon's socket (KREX_SOCKET) with the command's id and token, on one
blocking connection per process (re-made after fork). The daemon checks the token and that the
connection's peer is a process of the command. If the process dies inside the block its connection
closes and the daemon releases the region at once. Outside krex (KREX_SOCKET, KREX_COMMAND or
KREX_TOKEN unset) the block runs unprotected after a single warning on stderr, so the same script
still runs alone.
"""

from __future__ import annotations

import asyncio
import atexit
import grp
import itertools
import os
import socket
import sys
import threading
import warnings
from types import TracebackType
from typing import Any

from krex_async import protocol as P
from krex_async.client.trust import UntrustedSocket, check_peer, expected_peer
from krex_async.linux.trust import who


class RegionError(Exception):
    """The daemon refused or lost the region: `code` says why (forbidden, region_refused, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class _Channel:
    """One blocking connection to the daemon per process."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(path)
            check_peer(
                path, self.sock, expected_peer()
            )  # the token goes only to a daemon this user may trust
        except (OSError, UntrustedSocket, ValueError) as e:
            self.sock.close()
            raise RegionError("unreachable", unreachable(path, e)) from None
        self.pid = os.getpid()
        self.ids = itertools.count(1)
        self.revoked: dict[int, P.RegionReport] = {}
        reply = self.call(P.Hello(id=0, role="command", client=f"pid {self.pid}"))
        if not isinstance(reply, P.Welcome):
            raise RegionError("handshake", f"unexpected reply {reply!r}")

    def _recv(self) -> P.Reply:
        head = self._exact(4)
        (n,) = P.HEADER.unpack(head)
        return P.decode_reply(self._exact(n))

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise RegionError("disconnected", "the krex daemon closed the connection")
            buf += chunk
        return bytes(buf)

    def call(self, msg: P.Msg) -> P.Reply:
        """Send and wait for the reply with the same id, keeping revocations that arrive meanwhile."""
        self.sock.sendall(P.encode(msg))
        want = msg.id  # type: ignore[attr-defined]
        while True:
            reply = self._recv()
            if reply.id == want:
                return reply
            if isinstance(reply, P.RegionRevoked):
                self.revoked[reply.id] = reply.report

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def unreachable(path: str, e: BaseException) -> str:
    """One line: which socket, why a command cannot reach it, and the fix."""
    if isinstance(e, UntrustedSocket | ValueError):
        return str(e)
    if isinstance(e, PermissionError):
        return f"the krex daemon's socket {path} is not open to {who(os.getuid())}: {_not_member(path)}"
    if isinstance(e, FileNotFoundError | ConnectionRefusedError):
        return (
            f"no krex daemon answers at {path} ({e.strerror}): it stopped, or KREX_SOCKET names another "
            "path; start it (`systemctl start krex`, or `krex serve --socket PATH`) and run the job again"
        )
    return f"cannot reach the krex daemon at {path}: {getattr(e, 'strerror', None) or e}"


def _not_member(path: str) -> str:
    """Why EACCES: the socket's group (not this user's) or a directory on the way; the fix."""
    try:
        st = os.stat(path)
    except PermissionError:
        return (
            f"a directory above it cannot be entered by this user; the operator must let the job's "
            f"user reach {os.path.dirname(path)} (or run the job as a user who can)"
        )
    except OSError as e:
        return str(e.strerror)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return (
        f"only its owner and group {group} may connect (mode {st.st_mode & 0o777:04o}) and this user is "
        f"not in {group}: add it (`usermod -aG {group} USER`, then start a new session) or run the job as a "
        "member (the daemon's --socket-group)"
    )


def _one_line_if_uncaught() -> None:
    """Should the program not catch a daemon it cannot reach, say so in one line (`krex: ...`,
    exit 1) instead of a traceback: the fix is the operator's, not in the program's code."""
    previous = sys.excepthook
    if getattr(previous, "_krex", False):
        return

    def hook(et: type[BaseException], ev: BaseException, tb: TracebackType | None) -> None:
        if isinstance(ev, RegionError) and ev.code == "unreachable":
            print(f"krex: region(): {ev.message}", file=sys.stderr, flush=True)
        else:
            previous(et, ev, tb)

    hook._krex = True  # type: ignore[attr-defined]
    sys.excepthook = hook


_lock = threading.Lock()
_channel: _Channel | None = None
_warned = False
_held: tuple[int, region] | None = None  # (pid, the outermost region) while this process holds one


def _get_channel() -> _Channel:
    global _channel
    if _channel is None or _channel.pid != os.getpid():
        if _channel is None:
            atexit.register(reset)
        _channel = _Channel(os.environ["KREX_SOCKET"])
    return _channel


def _drop_channel() -> None:
    """Close this process's connection (the daemon then ends the regions it held or awaited)."""
    global _channel
    if _channel is not None:
        _channel.close()
    _channel = None


def reset() -> None:
    """Forget this process's connection and warning (a pool worker does this between commands)."""
    global _channel, _warned, _held
    _held = None
    if _channel is not None:
        _channel.close()
    _channel = None
    _warned = False


COMMAND_VARS = ("KREX_SOCKET", "KREX_COMMAND", "KREX_TOKEN")  # what krex gives each command


def inside_krex() -> bool:
    return all(os.environ.get(k) for k in COMMAND_VARS)


class region:  # noqa: N801 - used like a function, as `with region("timing"):`
    """Exclusive use of the command's device for the block.

    A region entered while this process already holds one (an explicit region around an
    auto-wrapped do_bench, say) joins the outer one: it returns at once with the outer report and
    releases nothing at its end.

    `report` (a protocol.RegionReport) holds what the grant cost on entry and the whole region's
    record after exit; it is None outside krex. Raises RegionError when the daemon refuses.
    """

    def __init__(
        self, name: str = "region", *, warm_ms: float | None = None, freeze_own_children: bool = True
    ) -> None:
        if not isinstance(name, str) or len(name) > P.MAX_NAME:
            # Said here, by name, rather than as the daemon's "undecodable request" at entry.
            raise ValueError(f"region name must be a string of at most {P.MAX_NAME} characters")
        self.name = name
        self.warm_ms = warm_ms
        self.freeze_own_children = freeze_own_children
        self.report: P.RegionReport | None = None
        self.expired = False
        self._enter_id = 0
        self._joined = False

    def __getattr__(self, key: str) -> Any:  # r.wait_s, r.enter_s ... straight from the report
        report = self.__dict__.get("report")
        if report is not None and key in P.RegionReport.__struct_fields__:
            return getattr(report, key)
        raise AttributeError(key)

    def __enter__(self) -> region:
        global _warned, _held
        if _held is not None and _held[0] == os.getpid():
            self._joined = True
            self.report = _held[1].report
            return self
        if not inside_krex():
            if not _warned:
                _warned = True
                unset = ", ".join(k for k in COMMAND_VARS if not os.environ.get(k))
                print(
                    f"krex: not running under krex ({unset} unset: start the program with `krex run`): "
                    "region() does not protect anything",
                    file=sys.stderr,
                )
            return self
        if "torch" in sys.modules or "cupy" in sys.modules:
            # The idle check's kernel is built and run once now, while the siblings still run: its
            # first use loads GEMM code, 120-160 ms that were spent inside regions before.
            from krex_async.runtime import devicework

            devicework.ready_probe()
        with _lock:
            try:
                ch = _get_channel()
            except RegionError as e:
                failed: RegionError | None = e
            else:
                failed = None
            if failed is not None:  # raised here: no frames from inside the connect
                _one_line_if_uncaught()
                raise failed.with_traceback(None)
            self._enter_id = next(ch.ids)
            try:
                reply = ch.call(
                    P.RegionEnter(
                        id=self._enter_id,
                        command=os.environ["KREX_COMMAND"],
                        token=os.environ["KREX_TOKEN"],
                        name=self.name,
                        pid=os.getpid(),
                        freeze_own_children=self.freeze_own_children,
                        warm_ms=-1.0 if self.warm_ms is None else self.warm_ms,
                    )
                )
                if isinstance(reply, P.RegionGranted):
                    self.report = reply.report
                    _held = (os.getpid(), self)
            except BaseException:
                # Interrupted (a signal handler raised, KeyboardInterrupt) with the request sent:
                # the daemon would grant it later to a process that does not know it holds the
                # device. Closing the connection withdraws it (the daemon ends its regions).
                _drop_channel()
                self.report = None
                _held = None
                raise
        if isinstance(reply, P.Error):
            raise RegionError(reply.code, reply.message)
        assert isinstance(reply, P.RegionGranted)
        try:
            self._prepare(reply)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _prepare(self, grant: P.RegionGranted) -> None:
        """Before the timed loop: verify the device drained when a sibling did not acknowledge, and
        warm the device's clocks when asked (both only touch this process's own device context)."""
        rep = grant.report
        if rep.drain != "pending" and not grant.warm_ms:
            return
        from krex_async.runtime import devicework

        # Drain first (a neighbour's queued work must be done before anything is timed), then
        # warm, so the timed loop starts right after the clocks were raised.
        if rep.drain == "pending":
            window = grant.drain_window or devicework.IDLE_WINDOW_S
            rep.drain, rep.drain_s = devicework.idle_verify(grant.drain_timeout, window_s=window)
        if grant.warm_ms:
            _, rep.warm_s = devicework.warm(grant.warm_ms)

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        global _held
        if self._joined:
            self._joined = False
            return
        if self.report is None:
            return
        _held = None
        with _lock:
            ch = _get_channel()
            reply: P.Reply | None = None
            if self._enter_id not in ch.revoked:
                rep = self.report
                drain = rep.drain if rep.drain in ("idle-verified", "timeout", "unverified") else ""
                try:
                    reply = ch.call(
                        P.RegionExit(
                            id=next(ch.ids),
                            region=rep.region,
                            token=os.environ["KREX_TOKEN"],
                            drain=drain,  # type: ignore[arg-type]
                            drain_s=rep.drain_s,
                            warm_s=rep.warm_s,
                        )
                    )
                except BaseException:  # interrupted: closing the connection releases the region
                    _drop_channel()
                    raise
            if self._enter_id in ch.revoked:  # it outlived --region-timeout and was taken back
                self.report = ch.revoked.pop(self._enter_id)
                self.expired = True
                print(
                    f"krex: region {self.name!r} expired after {self.report.held_s:.1f} s and was "
                    "revoked before its end: its timings are not protected",
                    file=sys.stderr,
                )
                return
        if isinstance(reply, P.RegionReleased):
            self.report = reply.report
        elif isinstance(reply, P.Error):
            warnings.warn(f"krex: region exit: {reply.code}: {reply.message}", stacklevel=2)

    async def __aenter__(self) -> region:
        return await asyncio.to_thread(self.__enter__)

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.__exit__, et, ev, tb)
