"""One peer of the daemon's socket: its credentials, the frames it sends (read, decoded, answered
with an error where they do not decode), the requests dispatched to the `Daemon`, and the replies
queued for it without ever blocking the loop (a slow consumer is dropped).

A frame that does not decode gets an error reply and the connection goes on; a frame that breaks the
framing (oversize length, truncated body, slow body) gets an error and the connection is closed.
The server (server.py) owns the listener and the set of connections, and hands each the narrow
`Host` it needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any, Protocol

import msgspec

from krex_async import logs
from krex_async import protocol as P
from krex_async.daemon.commands.access import RequestError, visible_event, visible_status
from krex_async.daemon.config import ServeConfig
from krex_async.daemon.daemon import Daemon

log = logs.get("krex.server")

_CREDS = struct.Struct("3i")


class _IdOnly(msgspec.Struct):
    id: P.ReqId = 0


def _request_id(body: bytes) -> int:
    """The id of an undecodable request, for its error reply; 0 when the id itself is unusable
    (an id out of ReqId's range would make the error reply undecodable for the client)."""
    try:
        return msgspec.msgpack.decode(body, type=_IdOnly).id
    except Exception:
        return 0


# A stream reader buffers up to twice this (and one read) before it pauses its peer: what a peer
# may have the daemon hold outside the inbound budget.
READ_LIMIT = 1 << 16
_SUM_ABOVE = 1 << 20  # a peer's unsent bytes above which the node-wide total is checked


class Host(Protocol):
    """What a connection asks of its server (server.py's `Server`): the limits, the daemon, the
    node-wide inbound budget, who is an admin, and the bytes queued for all peers."""

    config: ServeConfig
    daemon: Daemon
    inbound: P.InboundBudget

    def is_admin(self, uid: int, gid: int) -> bool: ...
    def unsent_total(self) -> int: ...


class Connection:
    """One peer. `send()` never blocks the loop: past `max_buffer` unsent bytes the peer is dropped
    as a slow consumer (with the reason logged) instead of growing memory without bound."""

    def __init__(self, server: Host, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer
        sock = writer.get_extra_info("socket")
        self.pid, self.uid, self.gid = _CREDS.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
        )
        # Root and members of --admin-group act on every command; everyone else on their own.
        self.admin = server.is_admin(self.uid, self.gid)
        # The daemon recognises a connection's subscriptions by the identity of its send function
        # (`s.send is send`), and every `self.send` access makes a new bound method: bind each once.
        self.send = self.send  # type: ignore[method-assign]
        self._send_own = self._send_own  # type: ignore[method-assign]
        self.closed = False  # no more reading or writing
        self.gone = False  # and the daemon has been told (disconnected)
        self.close_reason = ""
        self.tasks: set[asyncio.Task[Any]] = set()
        self.greeted = False

    def send(self, msg: P.Msg) -> bool:
        """Queue `msg` for the peer. Returns False only once the daemon has been told that this
        connection is gone (`Daemon.disconnected`): until then a message for a closing peer is
        dropped but True is returned, so the daemon's subscriptions stay in place until
        `disconnected()` ends them under each command's on_disconnect rule (a False here makes
        `Command.publish` forget the subscriber silently, and the command would never be killed)."""
        if self.gone:
            return False
        if self.closed or self.writer.transport.is_closing():
            self.closed = True
            return True
        self.writer.write(P.encode(msg))
        cfg = self.server.config
        unsent = self.writer.transport.get_write_buffer_size()
        if unsent > cfg.max_conn_buffer:
            self.drop(f"slow consumer: more than {cfg.max_conn_buffer} bytes unread")
        elif unsent > _SUM_ABOVE and self.server.unsent_total() > cfg.max_buffered_total:
            self.drop(
                f"slow consumer: {unsent} bytes unread while all connections together "
                f"hold more than {cfg.max_buffered_total}"
            )
        return True

    def drop(self, reason: str) -> None:
        if not self.closed:
            self.closed = True
            self.close_reason = reason
            log.warning("connection_dropped", pid=self.pid, uid=self.uid, reason=reason)
            self.writer.transport.abort()

    def error(self, req_id: int, code: str, message: str) -> None:
        self.send(P.Error(id=req_id, code=code, message=message))

    async def serve(self) -> None:
        cfg = self.server.config
        daemon = self.server.daemon
        try:
            while not self.closed:
                try:
                    body = await P.read_frame(
                        self.reader, cfg.max_frame, cfg.read_timeout, self.server.inbound
                    )
                except P.FrameError as e:
                    self.error(0, "bad_frame", str(e))
                    break
                except TimeoutError:
                    self.error(
                        0, "bad_frame", f"frame not received within {cfg.read_timeout} s of its first byte"
                    )
                    break
                if body is None:
                    break
                try:
                    req = P.decode_request(body)
                except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
                    self.error(_request_id(body), "bad_request", f"undecodable request: {e}")
                    continue
                finally:
                    del body  # out of the inbound budget now: it must not outlive its frame
                self.dispatch(req)
        except (ConnectionError, OSError):
            pass
        finally:
            self.closed = True
            daemon.disconnected(self.send)
            self.gone = True
            for t in list(self.tasks):
                t.cancel()
            with contextlib.suppress(Exception):
                self.writer.close()

    def dispatch(self, req: P.Request) -> None:
        daemon = self.server.daemon
        if not self.greeted and not isinstance(req, P.Hello):
            self.error(req.id, "bad_request", "the first request must be hello")
            return
        try:
            match req:
                case P.Hello():
                    if req.version != P.PROTOCOL_VERSION:
                        self.error(
                            req.id,
                            "version",
                            f"protocol version {req.version} is not "
                            f"supported (this daemon speaks "
                            f"{P.PROTOCOL_VERSION})",
                        )
                        return
                    self.greeted = True
                    self.send(
                        P.Welcome(
                            id=req.id,
                            version=P.PROTOCOL_VERSION,
                            server="krex",
                            policy=daemon.core.scheduler.policy.value,
                            uid=self.uid,
                            features=list(P.FEATURES),
                        )
                    )
                case P.Submit():
                    self._spawn(req.id, daemon.submit(req, self.uid, self.gid, self.send, admin=self.admin))
                case P.Attach():
                    daemon.attach(req, self.acting_uid, self.send)
                case P.StdinData():
                    self._spawn(req.id, daemon.stdin(req, self.acting_uid), ok=True)
                case P.Cancel():
                    self._spawn(req.id, daemon.cancel(req, self.acting_uid), ok=True)
                case P.Status():
                    self._spawn(req.id, self._status(req.id))
                case P.RegionEnter():
                    daemon.region_enter(req, self.pid, self.send)
                case P.RegionExit():
                    daemon.region_exit(req, self.pid)
                case P.QuiesceReady():
                    daemon.quiesce_ready(req, self.pid, self.send)
                    self.send(P.Ok(id=req.id))
                case P.QuiesceAck():
                    daemon.quiesce_ack(req, self.pid)
                case P.ExitHeld():
                    daemon.exit_held(req, self.pid, self.send)
                case P.MemGate():
                    self._spawn(req.id, daemon.mem_gate(req, self.pid), ok=True)
                case P.Adopt():
                    self._spawn(req.id, daemon.adopt(req, self.pid, self.send))
                case P.Timeline():
                    daemon.send_timeline(req, self.send, None if self.admin else self._visible)
                case P.Subscribe():
                    send = self.send if self.admin else self._send_own
                    daemon.subscribe_trace(
                        send if req.probes else _no_probes(send, lambda: not self.gone), req.id
                    )
                    self.send(P.Ok(id=req.id))
        except RequestError as e:
            self.error(req.id, e.code, str(e))
        except Exception as e:  # a bug must cost one request, not the connection or the daemon
            log.exception("request_failed", req_id=req.id, type=type(req).__name__)
            self.error(req.id, "internal", f"{type(e).__name__}: {e}")

    @property
    def acting_uid(self) -> int:
        """The uid the daemon checks ownership against: 0 (every command) for admins."""
        return 0 if self.admin else self.uid

    def _visible(self, ev: P.TraceEvent) -> bool:
        """Whether this peer, not an admin, may see `ev`: live or in the timeline (visible_event)."""
        return visible_event(ev, self.server.daemon.core.commands, self.uid)

    def _send_own(self, msg: P.Msg) -> bool:
        """A trace subscriber that is not an admin sees only events of its own commands, and the
        node's own (visible_event)."""
        if isinstance(msg, P.TraceEvent) and not self._visible(msg):
            return not self.gone
        return self.send(msg)

    async def _status(self, req_id: int) -> None:
        status = await self.server.daemon.status.live()
        if not self.admin:
            status = visible_status(status, self.uid)
        self.send(P.StatusReply(id=req_id, status=status))

    def _spawn(self, req_id: int, coro: Any, ok: bool = False) -> None:
        async def run() -> None:
            try:
                await coro
                if ok:
                    self.send(P.Ok(id=req_id))
            except RequestError as e:
                self.error(req_id, e.code, str(e))
            except Exception as e:  # a bug must cost one request, not the daemon
                log.exception("request_failed", req_id=req_id)
                self.error(req_id, "internal", f"{type(e).__name__}: {e}")

        task = asyncio.get_running_loop().create_task(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


def _no_probes(send: Any, alive: Any) -> Any:
    """A trace subscriber that asked for no probe events (Subscribe.probes false): strays, which
    belong to a region's story, still reach it."""

    def send_some(msg: P.Msg) -> bool:
        if isinstance(msg, P.TraceEvent) and msg.kind == "probe":
            return bool(alive())
        return bool(send(msg))

    return send_some
