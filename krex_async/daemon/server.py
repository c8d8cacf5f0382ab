"""The Unix-socket server: listener, connections, framing, dispatch, and an orderly shutdown.

Server, connection and daemon state are kept apart (uvicorn's layout): the server owns the listener and
the set of connections; a `Connection` owns one peer's reader and writer and the tasks it started; the
`Daemon` owns all runtime state. A frame that does not decode gets an error reply and the connection
goes on; a frame that breaks the framing (oversize length, truncated body, slow body) gets an error and
the connection is closed. Nothing a peer sends can stop the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import pwd
import resource
import signal
import socket
import stat
import struct
import time
from typing import Any

import msgspec

from krex_async import logs
from krex_async import protocol as P
from krex_async.daemon.access import RequestError
from krex_async.daemon.attribution import Attributor
from krex_async.daemon.commands import CommandState
from krex_async.daemon.config import ServeConfig
from krex_async.daemon.daemon import Daemon
from krex_async.daemon.warmpools import pool_user
from krex_async.devices import Unavailable, open_node
from krex_async.isolation import RootUnusable, choose_backend
from krex_async.linux import sdnotify

log = logs.get("krex.server")

_CREDS = struct.Struct("3i")
LISTEN_BACKLOG = 4096


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


class Connection:
    """One peer. `send()` never blocks the loop: past `max_buffer` unsent bytes the peer is dropped
    as a slow consumer (with the reason logged) instead of growing memory without bound."""

    def __init__(self, server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
                            policy=daemon.scheduler.policy.value,
                            uid=self.uid,
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
                case P.Adopt():
                    self._spawn(req.id, daemon.adopt(req, self.pid, self.send))
                case P.Timeline():
                    daemon.send_timeline(req, self.send, None if self.admin else self._visible)
                case P.Subscribe():
                    send = self.send if self.admin else self._send_own
                    daemon.tracers.append(
                        (send if req.probes else _no_probes(send, lambda: not self.gone), req.id)
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
        return visible_event(ev, self.server.daemon.commands, self.uid)

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


# Events about the node rather than a command: every subscriber may see them (a probes_failed
# means that each region from then on is reported tainted, theirs too).
NODE_EVENTS = frozenset({"probes_failed"})


def visible_event(ev: P.TraceEvent, commands: dict[str, Any], uid: int) -> bool:
    """Whether a subscriber that is not an admin may see `ev`: its own commands' events (a stray in
    its region included, whoever's process it was) and the node's own."""
    if not ev.command:
        return ev.kind in NODE_EVENTS
    cmd = commands.get(ev.command)
    return cmd is not None and cmd.uid == uid


def visible_status(status: dict[str, Any], uid: int) -> dict[str, Any]:
    """What `krex status` shows a peer that is not an admin: its own commands in full, other users'
    commands only counted (`other_commands`), and a device held by another user's region as held,
    without naming its command or region."""
    mine = [c for c in status["commands"] if c.get("uid") == uid]
    own = {c["command"] for c in mine}

    def own_id(x: object) -> bool:  # a command id, or a region id "<command>.<n>"
        return isinstance(x, str) and (x in own or x.rsplit(".", 1)[0] in own)

    devices = []
    for d in status["devices"]:
        d = dict(
            d,
            commands=[c for c in d["commands"] if c in own],
            other_commands=sum(c not in own for c in d["commands"]),
            queued=[q for q in d["queued"] if own_id(q)],
            holder=d["holder"] if d["holder"] is None or own_id(d["holder"]) else "other",
        )
        r = d.get("region")
        if r is not None and r.get("command") not in own:
            d["region"] = {
                "region": "other",
                "name": "",
                "command": "other user",
                "pid": None,
                "state": r.get("state"),
                "cores": r.get("cores", []),
                "frozen": [f for f in r.get("frozen", []) if f in own],
            }
        devices.append(d)
    return dict(status, devices=devices, commands=mine, other_commands=len(status["commands"]) - len(mine))


async def _refuse(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, message: str, **why: object
) -> None:
    """Answer a connection over a limit with a 'busy' error, then close it (logged with `why`)."""
    log.warning("connection_refused", **why)
    writer.write(P.encode(P.Error(id=0, code="busy", message=message)))
    # Take in the peer's hello before closing: closing a Unix socket with unread data resets the
    # peer, which would then lose the error it was just sent.
    with contextlib.suppress(Exception):
        await asyncio.wait_for(reader.read(1 << 16), 1.0)
    writer.close()


def _group_id(group: str, option: str = "--socket-group") -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isdigit():
            return int(group)
        raise SystemExit(f"krex: {option} {group!r}: no such group") from None


def check_socket_path(path: str) -> None:
    """Whether `path` can be served on, before anything is started (SystemExit saying why not):
    short enough for a client to connect to, its directory made, nothing there but a socket nobody
    answers on (left by a daemon that died: bind_socket replaces it)."""
    if len(os.fsencode(path)) >= 108:
        raise SystemExit(
            f"krex: --socket {path}: {len(os.fsencode(path))} bytes; a Unix socket path must be "
            "under 108 (no client could connect to it)"
        )
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise SystemExit(f"krex: --socket {path}: {e.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise SystemExit(f"krex: {path} exists and is not a socket; not replacing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # stale: left by a daemon that died; bind_socket's rename replaces it
    except OSError as e:
        raise SystemExit(f"krex: {path} exists and is not a usable socket: {e}") from None
    else:
        raise SystemExit(f"krex: another daemon is serving on {path}")
    finally:
        probe.close()


def bind_socket(path: str, group: str = "") -> socket.socket:
    """Bind and listen with the final mode from the first instant; only then give it its name.

    The socket is bound under a temporary name with umask 0177 (mode 0600), given its group and mode
    0660 when `group` is set, put into listening state, and renamed onto `path`: at no moment is there
    a file at `path` with a looser mode, or one that refuses connections because it is not listening
    yet. A leftover socket at `path` that nobody answers on is replaced; a live one is never stolen;
    anything that is not a socket is left alone (SystemExit), so a wrong path deletes nothing.
    """
    gid = _group_id(group) if group else None
    check_socket_path(path)
    # A short temporary name in the same directory (AF_UNIX paths end near 108 bytes; a path too
    # long for a suffix is bound directly: its mode is still right, only the listen window remains).
    tmp = os.path.join(os.path.dirname(path), f".{os.getpid()}~")
    if len(os.fsencode(tmp)) >= 108:
        tmp = path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(tmp)
    finally:
        os.umask(old)
    try:
        if gid is not None:
            os.chown(tmp, -1, gid)
            os.chmod(tmp, 0o660)
        sock.listen(LISTEN_BACKLOG)
        if tmp != path:
            os.rename(tmp, path)
    except BaseException:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    sock.setblocking(False)
    return sock


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (thousands of idle agents are normal).
    Returns the soft limit now in force; never raises."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
        except (ValueError, OSError):
            pass
    return soft


class Server:
    def __init__(self, config: ServeConfig, daemon: Daemon) -> None:
        self.config = config
        self.daemon = daemon
        self.connections: set[Connection] = set()
        self.inbound = P.InboundBudget(config.max_inbound_bytes, small=READ_LIMIT)
        self.stop = asyncio.Event()
        self.admin_gid = _group_id(config.admin_group, "--admin-group") if config.admin_group else None

    def is_admin(self, uid: int, gid: int) -> bool:
        """Root, or a user whose primary or supplementary groups (from the group database, not
        the peer's /proc entry, whose pid may be reused) include --admin-group."""
        if uid == 0:
            return True
        if self.admin_gid is None:
            return False
        if gid == self.admin_gid:
            return True
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            return False
        return self.admin_gid in os.getgrouplist(name, gid)

    def unsent_total(self) -> int:
        """Bytes queued for all peers (summed only when one peer already holds over 1 MiB)."""
        return sum(c.writer.transport.get_write_buffer_size() for c in self.connections if not c.closed)

    async def on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        cfg = self.config
        if len(self.connections) >= cfg.max_connections:
            await _refuse(
                reader,
                writer,
                f"the daemon has {cfg.max_connections} connections open (--max-connections)",
                reason="too many connections",
                limit=cfg.max_connections,
            )
            return
        try:
            conn = Connection(self, reader, writer)
        except OSError as e:  # the peer vanished before its credentials could be read
            log.warning("connection_refused", error=repr(e))
            writer.transport.abort()
            return
        if (
            not conn.admin
            and sum(c.uid == conn.uid for c in self.connections) >= cfg.max_connections_per_user
        ):
            await _refuse(
                reader,
                writer,
                f"uid {conn.uid} has {cfg.max_connections_per_user} "
                "connections open (--max-connections-per-user)",
                reason="too many connections of one user",
                uid=conn.uid,
                limit=cfg.max_connections_per_user,
            )
            return
        self.connections.add(conn)
        try:
            await conn.serve()
        finally:
            self.connections.discard(conn)

    async def run(self) -> int:
        cfg = self.config
        loop = asyncio.get_running_loop()
        nofile = raise_nofile_limit()
        sock = bind_socket(cfg.socket, cfg.socket_group)
        # backlog: start_unix_server re-listens with its own (default 100), which a storm of
        # connects overflows; the kernel caps this at net.core.somaxconn.
        server = await asyncio.start_unix_server(
            self.on_connect, sock=sock, limit=READ_LIMIT, backlog=LISTEN_BACKLOG
        )
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        log.info(
            "serving",
            socket=cfg.socket,
            policy=cfg.policy.value,
            isolation=self.daemon.backend.name,
            isolation_reason=self.daemon.backend.reason,
            pid=os.getpid(),
            devices=[d.key for d in self.daemon.devices],
            region_cores=cfg.region_cores,
            freeze=cfg.freeze,
            nofile=nofile,
        )
        print(
            f"krex: serving on {cfg.socket} (policy {cfg.policy}, isolation {self.daemon.backend.name})",
            flush=True,
        )
        sdnotify.notify(f"READY=1\nSTATUS=serving on {cfg.socket}\nMAINPID={os.getpid()}")
        watchdog = loop.create_task(sdnotify.watchdog_loop(), name="sd-watchdog")
        try:
            await self.stop.wait()
        finally:
            sdnotify.notify("STOPPING=1")
            watchdog.cancel()
            log.info(
                "shutting_down",
                commands=sum(c.state != CommandState.ENDED for c in self.daemon.commands.values()),
            )
            server.close()
            await self.daemon.shutdown()
            # Let the last reports reach their agents, then close everyone.
            deadline = time.monotonic() + 2
            for conn in list(self.connections):
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.writer.drain(), max(0.01, deadline - time.monotonic()))
                conn.writer.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(cfg.socket)
            log.info("stopped")
        return 0


def is_krex_process(
    daemon: Daemon, attributor: Attributor, tgid: int, cgroup_root: str | None = None
) -> bool:
    """Whether `tgid` is inside krex, for the launch probe's scope `outsiders` (such a process is
    never trapped): it belongs to a command (the attributor: a descendant of a command's root
    process, cached per tgid; or, with `cgroup_root`, the cgroup v2 mount, a process in a command's
    cgroup, which catches one that left the command's process tree by a double fork), or it is one
    of the daemon's pool workers. A pool worker is not a command while it waits, but it takes one
    without a new exec, and a probed worker would trap its command's launches until the next
    rescan; a warm worker launches nothing while it waits, and creates no context while a region
    holds its device. Reads /proc (the attributor's cache is the loop's): call it on the loop only.
    """
    if attributor.command_of(tgid) is not None:
        return True
    if any(tgid in pool.pids() for pool in daemon.pools.values()):
        return True
    if cgroup_root is None:
        return False
    from krex_async.isolation.cgroupfs import own_cgroups

    try:
        path = cgroup_root + own_cgroups(str(tgid)).get("", "/")
    except (OSError, ValueError):
        return False
    path = path.rstrip("/")
    for cmd in daemon.commands.values():
        cg = (
            daemon.backend.cgroup_dir(cmd.group)
            if cmd.group is not None and cmd.state in (CommandState.STARTING, CommandState.RUNNING)
            else None
        )
        if cg and (path == cg.rstrip("/") or path.startswith(cg.rstrip("/") + "/")):
            return True
    return False


def start_probes(daemon: Daemon) -> None:
    """Open the probe backend `--probes` asks for and feed its events to the attributor. A probe
    that cannot run is a logged state, never a reason not to serve; so is one that fails later
    (Attributor.probe_failed). `daemon.probes` (in `krex status`) says which state, and why."""
    cfg = daemon.config
    if cfg.probes == "off":
        log.info("probes", backend=None, reason="off (--probes off)")
        daemon.probes.update(state="off", reason="--probes off")
        return
    from krex_async.probes import FailureReporting, open_probes

    attributor: Attributor | None = None
    from krex_async.probes.attribution import cgroup2_root

    cg_root = cgroup2_root()

    def is_command(tgid: int) -> bool:  # the launch probe calls it on the loop only
        return attributor is not None and is_krex_process(daemon, attributor, tgid, cg_root)

    backend, reason = open_probes(
        cfg.probes,
        cfg.probe_prefix_list or None,
        cfg.launch_lib_list or None,
        launch_scope=cfg.launch_scope,
        is_command=is_command,
    )
    log.info("probes", backend=backend.name if backend else None, reason=reason)
    daemon.probes.update(state="unavailable", reason=reason)
    if backend is None:
        return
    loop = asyncio.get_running_loop()

    def started(b: Any) -> str:
        """Start `b` feeding a new attributor: "" or why it could not (what did start is stopped)."""
        nonlocal attributor
        attributor = Attributor(daemon.core, daemon.regions, b)
        if isinstance(b, FailureReporting):
            b.on_failure = attributor.probe_failed
        try:
            b.start(loop, attributor.on_events)
        except Exception as e:  # ProbeUnavailable or a failed attach
            with contextlib.suppress(Exception):
                b.stop()  # whatever part of it did start (programs, threads) goes
            attributor = None
            return f"{b.name} failed to start: {e}"
        return ""

    why = started(backend)
    if why and cfg.probes == "auto" and backend.name != "tracefs":
        # auto: bcc compiled a test program but not this one (an older kernel, a missing
        # tracepoint): tracefs may still serve
        fallback, fallback_reason = open_probes("tracefs", cfg.probe_prefix_list or None)
        if fallback is not None:
            if not (why_not := started(fallback)):
                backend, reason, why = fallback, f"{fallback_reason}, after {why}", ""
            else:
                why = f"{why}; tracefs failed too: {why_not}"
    if why:  # run without probes, and say so
        log.warning("probes", backend=None, reason=why)
        daemon.probes.update(reason=why)
        return
    daemon.attributor = attributor
    daemon.probes.update(state="running", backend=backend.name, reason=reason)
    failed = getattr(backend, "failed", None)
    if failed:
        log.warning("probes_partial", failed=failed)
        daemon.probes["partial"] = dict(failed)


async def serve(config: ServeConfig) -> int:
    cfg = config.resolved()
    pool_as = pool_user(cfg.pool_user)  # an unknown user is refused before anything is made
    check_socket_path(cfg.socket)  # likewise a socket that cannot be served on
    try:
        os.makedirs(cfg.state_dir, mode=0o700, exist_ok=True)  # FileExistsError: not a directory
    except OSError as e:
        raise SystemExit(f"krex: --state-dir {cfg.state_dir}: {e.strerror}") from None
    try:
        backend = choose_backend(cfg.isolation, cgroup_root=cfg.cgroup_root, state_dir=cfg.state_dir)
    except RootUnusable as e:  # check_here refused it already, unless it went since then
        raise SystemExit(f"krex: {e}; {e.HINT}") from None
    for line in await backend.reconcile():
        log.info("reconciled", action=line)
    start_watchdog = getattr(backend, "start_watchdog", None)
    if start_watchdog is not None:
        start_watchdog()  # thaws every krex cgroup within 1 s of this daemon's death
    try:
        node = open_node(cfg.devices)
    except (ValueError, Unavailable) as e:
        raise SystemExit(f"krex: --devices {cfg.devices}: {e}") from None
    for note in node.notes:
        log.info("devices", note=note)
    daemon = Daemon(cfg, backend, node.devices, node=node)
    if cfg.metrics:
        from krex_async.daemon.metrics import MetricsUnavailable

        try:
            host, port = daemon.metrics.start(cfg.metrics)
        except (MetricsUnavailable, ValueError, OSError) as e:
            raise SystemExit(f"krex: --metrics {cfg.metrics}: {e}") from None
        log.info("metrics_serving", address=f"http://{host}:{port}/metrics")
        daemon.track(
            asyncio.get_running_loop().create_task(daemon.status.sample_metrics(), name="metrics-sampler")
        )
    from krex_async import __version__

    daemon.metrics.info(__version__, cfg.policy.value, backend.name)
    for d in daemon.devices:
        daemon.metrics.device_info(d.key, d.index, d.uuid, d.name, d.vendor)
    start_probes(daemon)
    await daemon.regions.clock.warm()
    await daemon.start_pools(pool_as)
    try:
        return await Server(cfg, daemon).run()
    finally:
        daemon.metrics.stop()


def run(config: ServeConfig) -> int:
    logs.configure(config.log_format, config.log_level)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; asyncio still works
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))
