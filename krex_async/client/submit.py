"""The async client for agents: many concurrent commands over one connection.

    async with await Client.connect() as c:
        h = await c.submit(["python", "bench.py"], device="auto", timeout=600)
        async for stream, data in h.output():
            ...
        res = await h.wait()          # Result(report, stdout, stderr)

Replies are routed to their request by id by one reader task; each request has its own queue.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from krex_async import protocol as P
from krex_async.client.trust import UntrustedSocket, check_listener, expected_peer, unreachable_reason
from krex_async.protocol import NODE_SOCKET, default_socket

CLOSED = "the daemon closed the connection (it stopped, or died)"
# A command's stream lost with no word from the daemon: it died (a clean stop ends each command's
# stream with a `shutdown` report first), and the command's processes may live on.
DISCONNECTED = (
    "the daemon closed the connection without a word (it died or was killed): a command it ran may "
    "still be running; the next daemon started on the same state dir ends it and reports it lost"
)


def agent_socket(path: str | None = None) -> str:
    """The socket an agent connects to: PATH, else $KREX_SOCKET, else the default path. A user who
    runs no daemon of their own (nothing at $XDG_RUNTIME_DIR/krex.sock) reaches the node's daemon
    at /run/krex/krex.sock, as `krex run` on a node with the systemd unit should."""
    if path:
        return path
    own = default_socket()
    if os.environ.get("KREX_SOCKET") or own == NODE_SOCKET:
        return own
    return NODE_SOCKET if not os.path.lexists(own) and os.path.lexists(NODE_SOCKET) else own


async def _connect_unix(path: str) -> socket.socket:
    """A connected Unix socket. A full accept backlog (a daemon busy with a storm of connects) makes
    a non-blocking connect fail with EAGAIN; that is retried with a short backoff (asyncio's own
    sock_connect would instead hand back a socket that is not connected). Other errors raise."""
    delay = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
            return sock
        except BlockingIOError:
            sock.close()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        except BaseException:
            sock.close()
            raise


class _IdOnly(msgspec.Struct):
    id: P.ReqId = 0


def _reply_id(body: bytes) -> int:
    try:
        return msgspec.msgpack.decode(body, type=_IdOnly).id
    except Exception:
        return 0


class KrexError(Exception):
    """The daemon answered with an error: `code` is machine-readable, the message is for people."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[type[KrexError], tuple[str, str]]:
        # Pickled whole (a fleet agent's error crosses Ray to its client): code and message kept.
        return type(self), (self.code, self.message)


@dataclass
class Result:
    report: P.CommandReport
    stdout: bytes
    stderr: bytes

    @property
    def returncode(self) -> int | None:
        """As subprocess reports it: the exit code, or minus the signal that ended the command."""
        if self.report.signal:
            return -self.report.signal
        return self.report.exit_code


class CommandHandle:
    def __init__(
        self, client: Client, req_id: int, accepted: P.Accepted, queue: asyncio.Queue[P.Reply | None]
    ) -> None:
        self.client = client
        self.req_id = req_id
        self.command = accepted.command
        self.device = accepted.device
        self.queued = accepted.queued
        self.pid: int | None = None
        self._queue = queue
        self._out = bytearray()
        self._err = bytearray()
        self._result: Result | None = None
        self.reruns = 0  # times the daemon re-ran it after a co-located out-of-memory

    async def output(
        self, started: bool = False, reruns: bool = False, keep: bool = True
    ) -> AsyncIterator[tuple[str, bytes]]:
        """Yield (stream, data) as the command writes, until it ends (then `wait()` returns at once).
        `started`: also ("started", b"") as it starts (`pid` set), for a relay (the fleet's agent).
        `reruns`: also ("rerun", b"") where the daemon re-runs it (Submit.rerun_on_oom): what it
        wrote so far is void, the re-run's output replaces it. `keep=False`: what is yielded is not
        kept for the Result too (a relay keeps its own copy, or none), so its stdout/stderr are only
        the tails the daemon sends with the end."""
        while self._result is None:
            msg = await self._queue.get()
            if msg is None:
                raise KrexError("disconnected", DISCONNECTED)
            match msg:
                case P.Output():
                    if keep:
                        (self._out if msg.stream == "stdout" else self._err).extend(msg.data)
                    yield msg.stream, msg.data
                case P.Started():
                    self.pid = msg.pid
                    if started:
                        yield "started", b""
                case P.Rerun():
                    self._out.clear()
                    self._err.clear()
                    self.pid, self.queued = None, True  # in its device's queue again
                    self.reruns += 1
                    if reruns:
                        yield "rerun", b""
                case P.Exited():
                    self._out += msg.stdout_tail
                    self._err += msg.stderr_tail
                    self._result = Result(msg.report, bytes(self._out), bytes(self._err))
                    self.client._forget(self.req_id)
                case P.Error():
                    self.client._forget(self.req_id)
                    raise KrexError(msg.code, msg.message)

    async def wait(self) -> Result:
        async for _ in self.output():
            pass
        assert self._result is not None
        return self._result

    async def cancel(self, sig: int = 15) -> None:
        await self.client.cancel(self.command, sig)

    async def write_stdin(self, data: bytes, eof: bool = False) -> None:
        """Send more of the command's stdin (submitted with stdin_stream=True), 1 MiB a request at
        most; returns once the daemon wrote it into the pipe. `eof` closes it after. Raises
        KrexError("stdin_closed") once the command no longer reads it."""
        view = memoryview(data)
        while True:
            chunk, view = view[: 1 << 20], view[1 << 20 :]
            last = not view
            await self.client._call(
                P.StdinData(
                    id=next(self.client._ids), command=self.command, data=bytes(chunk), eof=eof and last
                )
            )
            if last:
                return


class Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str) -> None:
        self.path = path
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue[P.Reply | None]] = {}
        self._task: asyncio.Task[None] | None = None
        self.welcome: P.Welcome | None = None

    @property
    def connected(self) -> bool:
        """The connection is up: False once closed or lost (a caller then connects again)."""
        return self._task is not None and not self._task.done()

    @classmethod
    async def connect(
        cls, path: str | None = None, timeout: float = 10.0, *, peer_uid: int | None = None
    ) -> Client:
        """Connect and shake hands. Raises KrexError('unreachable', ...) when nobody listens, and
        KrexError('untrusted', ...), with nothing sent, when the listener may not be trusted (see
        client/trust.py): `peer_uid` (else $KREX_SOCKET_UID) names a daemon's uid to trust besides
        root and this user's own."""
        explicit = bool(path or os.environ.get("KREX_SOCKET"))
        path = agent_socket(path)
        try:
            expect = expected_peer(peer_uid)
        except ValueError as e:
            raise KrexError("bad_input", str(e)) from None
        try:
            sock = await asyncio.wait_for(_connect_unix(path), timeout)
            check_listener(path, sock, explicit, expect)  # closes it when it refuses
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=P.MAX_FRAME + 8)
        except UntrustedSocket as e:
            raise KrexError("untrusted", str(e)) from None
        except (OSError, TimeoutError) as e:
            raise KrexError("unreachable", unreachable_reason(path, e)) from None
        self = cls(reader, writer, path)
        self._task = asyncio.get_running_loop().create_task(self._read_loop())
        try:
            reply = await self._call(P.Hello(id=0, role="agent", client=f"pid {os.getpid()}"), timeout)
        except (TimeoutError, KrexError) as e:
            await self.close()
            if isinstance(e, KrexError) and e.code != "disconnected":
                raise
            said = "closed the connection" if isinstance(e, KrexError) else f"did not answer in {timeout:g} s"
            raise KrexError(
                "unreachable",
                f"whatever listens at {path} {said} (not a krex daemon, or one that is stopped or stuck)",
            ) from None
        if not isinstance(reply, P.Welcome):
            await self.close()
            raise KrexError("unreachable", f"whatever listens at {path} is not a krex daemon")
        self.welcome = reply
        return self

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (OSError, asyncio.CancelledError):
            pass

    async def _read_loop(self) -> None:
        try:
            while True:
                body = await P.read_frame(self._reader, P.MAX_FRAME * 4, None)
                if body is None:
                    break
                try:
                    msg = P.decode_reply(body)
                except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
                    # A reply this client cannot read (a newer daemon's message, a daemon bug):
                    # the request it answers fails with the reason; the connection goes on.
                    msg = P.Error(
                        id=_reply_id(body),
                        code="bad_reply",
                        message=f"undecodable reply from the daemon: {e}",
                    )
                q = self._queues.get(msg.id)
                if q is not None:
                    q.put_nowait(msg)
        except (OSError, P.FrameError, asyncio.IncompleteReadError):
            pass
        finally:
            for q in self._queues.values():
                q.put_nowait(None)

    def _forget(self, req_id: int) -> None:
        self._queues.pop(req_id, None)

    def _send(self, msg: P.Msg) -> asyncio.Queue[P.Reply | None]:
        """Queue `msg`; its replies arrive on the queue returned (None: the connection ended).
        Raises KrexError("disconnected") when the connection already ended: no reply could come."""
        if self._task is not None and self._task.done():
            raise KrexError("disconnected", CLOSED)
        q: asyncio.Queue[P.Reply | None] = asyncio.Queue()
        self._queues[msg.id] = q  # type: ignore[attr-defined]
        self._writer.write(P.encode(msg))
        return q

    async def _call(self, msg: P.Msg, timeout: float | None = None) -> P.Reply:
        """Send `msg` and wait for its reply (TimeoutError after `timeout` s, when given). The
        reply's queue is registered before anything awaits: a daemon that answers at once (a
        refusal, then EOF) is heard, not taken for a closed connection."""
        q = self._send(msg)
        try:
            reply = await (q.get() if timeout is None else asyncio.wait_for(q.get(), timeout))
        finally:
            self._forget(msg.id)  # type: ignore[attr-defined]
        if reply is None:
            raise KrexError("disconnected", CLOSED)
        if isinstance(reply, P.Error):
            raise KrexError(reply.code, reply.message)
        return reply

    async def submit(
        self,
        argv: list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        device: str | int = "auto",
        timeout: float | None = None,
        mem: int = 0,
        stdin: bytes | None = None,
        on_disconnect: str = "kill",
        label: str = "",
        stream: bool = True,
        run_as: int | None = None,
        stdin_stream: bool = False,
        mem_key: str = "",
        rerun_on_oom: bool = False,
        mem_alike: list[str] | None = None,
    ) -> CommandHandle:
        """Start a command. env=None passes this process's environment (as a shell would);
        run_as: another uid to run it as (the daemon allows that to a root peer only).
        stdin: all of it at once (then EOF); stdin_stream: a pipe that `write_stdin` fills.
        Raises KrexError("bad_spec") where cwd is not given and this process's own is gone."""
        if isinstance(mem_alike, (str, bytes)):  # not a list of one-character features
            raise KrexError("bad_spec", "mem_alike is a list of features, not one string")
        if not cwd:
            try:
                cwd = os.getcwd()
            except FileNotFoundError:  # a shell still in a directory someone removed
                raise KrexError(
                    "bad_spec",
                    "the current directory was removed, so the command has no cwd to start in: "
                    "cd to an existing directory (or pass cwd=)",
                ) from None
        req_id = next(self._ids)
        msg = P.Submit(
            id=req_id,
            argv=list(argv),
            cwd=cwd,
            env=dict(os.environ) if env is None else env,
            device=str(device),
            timeout=timeout,
            mem=mem,
            stdin=stdin,
            on_disconnect=on_disconnect,  # type: ignore[arg-type]
            label=label,
            stream=stream,
            run_as=run_as,
            stdin_stream=stdin_stream,
            mem_key=mem_key,
            rerun_on_oom=rerun_on_oom,
            mem_alike=list(mem_alike or ()),
        )
        q = self._send(msg)
        first = await q.get()
        if first is None:
            raise KrexError("disconnected", CLOSED)
        if isinstance(first, P.Error):
            self._forget(req_id)
            raise KrexError(first.code, first.message)
        assert isinstance(first, P.Accepted)
        return CommandHandle(self, req_id, first, q)

    async def run(self, argv: list[str], **kw: Any) -> Result:
        return await (await self.submit(argv, **kw)).wait()

    async def attach(self, command: str) -> CommandHandle:
        req_id = next(self._ids)
        q = self._send(P.Attach(id=req_id, command=command))
        first = await q.get()
        if isinstance(first, P.Error):
            self._forget(req_id)
            raise KrexError(first.code, first.message)
        if first is None:
            raise KrexError("disconnected", CLOSED)
        assert isinstance(first, P.Accepted)
        return CommandHandle(self, req_id, first, q)

    async def status(self) -> dict[str, Any]:
        reply = await self._call(P.Status(id=next(self._ids)))
        assert isinstance(reply, P.StatusReply)
        return reply.status

    async def cancel(self, command: str, sig: int = 15, queued_only: bool = False) -> None:
        """Signal a command (a queued one ends unstarted). `queued_only`: end it only if it has not
        started; KrexError("not_queued") otherwise, and it runs on untouched. A daemon that does not
        say it honours that (an older one would signal a started command all the same) is sent
        nothing: KrexError("unsupported")."""
        if queued_only and (self.welcome is None or P.CANCEL_QUEUED_ONLY not in self.welcome.features):
            raise KrexError(
                "unsupported",
                f"the daemon (an older krex) ignores a cancel's queued_only: nothing sent for {command}",
            )
        await self._call(P.Cancel(id=next(self._ids), command=command, signal=sig, queued_only=queued_only))

    async def timeline(self) -> list[P.TraceEvent]:
        """The daemon's recent trace records (its bounded ring), oldest first."""
        req_id = next(self._ids)
        q = self._send(P.Timeline(id=req_id))
        out: list[P.TraceEvent] = []
        try:
            while True:
                msg = await q.get()
                if msg is None:
                    raise KrexError("disconnected", CLOSED)
                if isinstance(msg, P.Error):
                    raise KrexError(msg.code, msg.message)
                if isinstance(msg, P.TimelineChunk):
                    out += msg.events
                    if msg.last:
                        return out
        finally:
            self._forget(req_id)

    async def trace(self, probes: bool = True) -> AsyncIterator[P.TraceEvent]:
        req_id = next(self._ids)
        q = self._send(P.Subscribe(id=req_id, probes=probes))
        while True:
            msg = await q.get()
            if msg is None:
                return
            if isinstance(msg, P.Error):
                raise KrexError(msg.code, msg.message)
            if isinstance(msg, P.TraceEvent):
                yield msg
