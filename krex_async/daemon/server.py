"""The Unix-socket server: the listener, the set of connections and their limits, an orderly
shutdown, and `serve()`, which puts the daemon together and runs it.

Server, connection and daemon state are kept apart (uvicorn's layout): the server owns the listener and
the set of connections; a `Connection` (connection.py: framing, dispatch) owns one peer's reader and
writer and the tasks it started; the `Daemon` owns all runtime state. The socket itself is made in
listener.py, the probes started in probing.py. Nothing a peer sends can stop the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import time

from krex_async import logs
from krex_async import protocol as P
from krex_async.daemon.commands.access import visible_event as visible_event  # its old path, tests use it
from krex_async.daemon.commands.earlystop import EarlyStop
from krex_async.daemon.commands.warmpools import pool_user
from krex_async.daemon.config import ServeConfig
from krex_async.daemon.connection import READ_LIMIT, Connection
from krex_async.daemon.daemon import Daemon
from krex_async.daemon.listener import (
    LISTEN_BACKLOG,
    bind_socket,
    check_socket_path,
    group_id,
    raise_nofile_limit,
    usage_exit,
)
from krex_async.daemon.model.command import CommandState
from krex_async.daemon.probing import start_probes
from krex_async.devices import Unavailable, open_node
from krex_async.isolation import RootUnusable, choose_backend
from krex_async.linux import reserve, sdnotify
from krex_async.linux.trust import state_dir_problem, state_dir_refusal

log = logs.get("krex.server")


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


class Server:
    def __init__(self, config: ServeConfig, daemon: Daemon, early: EarlyStop | None = None) -> None:
        self.config = config
        self.daemon = daemon
        self.early = early or EarlyStop()  # a signal noted while the daemon started
        self.connections: set[Connection] = set()
        self.inbound = P.InboundBudget(config.max_inbound_bytes, small=READ_LIMIT)
        self.stop = asyncio.Event()
        self.admin_gid = group_id(config.admin_group, "--admin-group") if config.admin_group else None

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
        """Listen on --socket and serve until stopped. The daemon is shut down however this ends,
        a socket that cannot be listened on included (SystemExit saying why, after the release)."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        nofile = raise_nofile_limit()
        try:
            server = await self._listen()
        except BaseException:
            await self.daemon.shutdown()
            raise
        watchdog: asyncio.Task[None] | None = None
        try:  # from here any failure ends as a stop does
            self.early.hand_over(loop, self.stop.set)
            log.info(
                "serving",
                socket=cfg.socket,
                policy=cfg.policy.value,
                isolation=self.daemon.core.backend.name,
                isolation_reason=self.daemon.core.backend.reason,
                pid=os.getpid(),
                devices=[d.key for d in self.daemon.core.devices],
                region_cores=cfg.region_cores,
                freeze=cfg.freeze,
                nofile=nofile,
            )
            backend = self.daemon.core.backend.name
            try:
                print(f"krex: serving on {cfg.socket} (policy {cfg.policy}, isolation {backend})", flush=True)
            except OSError as e:  # a closed pipe: whoever waited for this line is gone
                raise SystemExit(f"krex: cannot say on stdout that it serves: {e}") from None
            sdnotify.notify(f"READY=1\nSTATUS=serving on {cfg.socket}\nMAINPID={os.getpid()}")
            watchdog = loop.create_task(sdnotify.watchdog_loop(), name="sd-watchdog")
            await self.stop.wait()
        finally:
            sdnotify.notify("STOPPING=1")
            if watchdog is not None:
                watchdog.cancel()
            log.info(
                "shutting_down",
                commands=sum(c.state != CommandState.ENDED for c in self.daemon.core.commands.values()),
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

    async def _listen(self) -> asyncio.Server:
        """The listener on --socket, or SystemExit: bind_socket's own (the path checked again: exit 2
        for a directory gone since the start checks), or one naming the socket for an OSError."""
        cfg = self.config
        try:
            sock = bind_socket(cfg.socket, cfg.socket_group)
        except OSError as e:
            raise SystemExit(f"krex: --socket {cfg.socket}: cannot listen there: {e}") from None
        try:
            # backlog: start_unix_server re-listens with its own (default 100), which a storm of
            # connects overflows; the kernel caps this at net.core.somaxconn.
            return await asyncio.start_unix_server(
                self.on_connect, sock=sock, limit=READ_LIMIT, backlog=LISTEN_BACKLOG
            )
        except BaseException:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(cfg.socket)  # bound and renamed there by bind_socket: ours
            raise


async def serve(config: ServeConfig, early: EarlyStop | None = None) -> int:
    """Put the daemon together and serve until SIGTERM/SIGINT. One that comes while it starts
    (`early`, installed here if not given) ends the start at its next phase, releasing what was
    made: exit 0, as a later stop. SystemExit for what cannot serve, after the same release."""
    early = early or EarlyStop().install()
    cfg = config.resolved()
    log.info("starting", pid=os.getpid(), socket=cfg.socket)  # from here a stop signal is clean
    pool_as = pool_user(cfg.pool_user)  # an unknown user is refused before anything is made
    check_socket_path(cfg.socket, cfg.socket_group)  # likewise a socket that cannot be served on
    try:
        os.makedirs(cfg.state_dir, mode=0o700, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a file there, or on the way to it
        usage_exit(f"--state-dir {cfg.state_dir}: not a directory")
    except OSError as e:
        raise SystemExit(f"krex: --state-dir {cfg.state_dir}: {e.strerror}") from None
    if why := state_dir_problem(cfg.state_dir):
        usage_exit(state_dir_refusal(cfg.state_dir, why))
    kept = reserve.setup(cfg.state_dir)
    if kept.full:
        log.warning("state_disk_full", state_dir=cfg.state_dir, detail="no room for the records' reserve")
    elif kept.unavailable:
        log.warning("state_disk_reserve_unavailable", state_dir=cfg.state_dir, detail=kept.unavailable)
    if early.stopped("isolation"):
        return 0
    try:
        backend = choose_backend(cfg.isolation, cgroup_root=cfg.cgroup_root, state_dir=cfg.state_dir)
    except RootUnusable as e:  # check_here refused it already, unless it went since then
        raise SystemExit(f"krex: {e}; {e.HINT}") from None
    async with contextlib.AsyncExitStack() as made:  # until the daemon owns them: its shutdown
        made.push_async_callback(backend.close)
        if early.stopped("reconcile"):
            return 0
        for line in await backend.reconcile():
            log.info("reconciled", action=line)
        start_watchdog = getattr(backend, "start_watchdog", None)
        if start_watchdog is not None:
            start_watchdog()  # thaws every krex cgroup within 1 s of this daemon's death
        if early.stopped("devices"):
            return 0
        try:
            node = open_node(cfg.devices)
        except (ValueError, Unavailable) as e:
            raise SystemExit(f"krex: --devices {cfg.devices}: {e}") from None
        made.callback(node.close)
        for note in node.notes:
            log.info("devices", note=note)
        daemon = Daemon(cfg, backend, node.devices, node=node)
        made.pop_all()
    try:
        try:
            if await _start(cfg, daemon, pool_as, early):
                await daemon.shutdown()
                return 0
            server = Server(cfg, daemon, early)  # --admin-group looked up: gone since the checks?
        except BaseException:
            await daemon.shutdown()
            raise
        return await server.run()  # which shuts the daemon down, however it ends
    finally:
        daemon.metrics.stop()


async def _start(
    cfg: ServeConfig, daemon: Daemon, pool_as: tuple[int, int, list[int]] | None, early: EarlyStop
) -> bool:
    """Metrics, probes, the clock and the warm pools; True where a stop signal ended the start."""
    if cfg.metrics:
        from krex_async.daemon.observe.metrics import MetricsUnavailable

        try:
            host, port = daemon.metrics.start(cfg.metrics)
        except (MetricsUnavailable, ValueError, OSError) as e:
            raise SystemExit(f"krex: --metrics {cfg.metrics}: {e}") from None
        log.info("metrics_serving", address=f"http://{host}:{port}/metrics")
        daemon.track(
            asyncio.get_running_loop().create_task(daemon.status.sample_metrics(), name="metrics-sampler")
        )
    if daemon.lifecycle.admission.devices:  # memory-aware admission tracks a device
        daemon.track(
            asyncio.get_running_loop().create_task(daemon.lifecycle.memory_loop(), name="memory-sampler")
        )
    from krex_async import __version__

    daemon.metrics.info(__version__, cfg.policy.value, daemon.core.backend.name)
    for d in daemon.core.devices:
        daemon.metrics.device_info(d.key, d.index, d.uuid, d.name, d.vendor)
    if early.stopped("probes"):
        return True
    start_probes(daemon)
    if early.stopped("pools"):
        return True
    await daemon.regions.clock.warm()
    await daemon.start_pools(pool_as)
    return early.stopped("serving")


def run(config: ServeConfig, early: EarlyStop | None = None) -> int:
    """Serve `config` on a new loop; `early`: the stop-signal handler the caller installed as soon
    as it knew it would serve (installed here otherwise)."""
    early = early or EarlyStop().install()  # before the loop: asyncio.Runner then leaves SIGINT be
    logs.configure(config.log_format, config.log_level)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; asyncio still works
        return asyncio.run(serve(config, early))
    return uvloop.run(serve(config, early))
