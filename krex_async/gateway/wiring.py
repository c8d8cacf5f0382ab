"""`krex gateway`'s wiring (serve): the state directory, locked so two gateways never share it; the
token gate; the job store; the runner; the HTTP app and its listener; the queue timeout and the
retention sweeper. Started in that order, stopped in reverse on SIGTERM/SIGINT.

The gateway's own modules are imported where they are used: `krex` imports the gateway's command
line (cli.py, which imports this) at every start, and the HTTP app needs aiohttp, an extra.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import signal
import sqlite3
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from krex_async.gateway import conns
from krex_async.gateway.limits import Limits

if TYPE_CHECKING:
    from krex_async.gateway.app import Gateway
    from krex_async.gateway.auth import Auth, RunAs
    from krex_async.gateway.store import Store

TOKEN_ENV = "KREX_GATEWAY_TOKEN"


class Refused(Exception):
    """Why the gateway cannot start (one line, exit 2); what it held is released by then."""


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--listen {value!r} must be HOST:PORT")
    if int(port) > 65535:
        raise ValueError(f"--listen {value!r}: port {port} is out of range (0-65535)")
    return host.strip("[]"), int(port)


def _say(line: str) -> None:
    print(f"krex gateway: {line}", file=sys.stderr, flush=True)


def _lock_state(state_dir: str) -> tuple[Path, int]:
    """The state dir, resolved, and its lock (an fd, flock held). The lock comes first (only the
    directory itself is made or checked before it): a second gateway on this state dir is refused
    before it changes anything the first one owns."""
    from krex_async.gateway.files import StateError, open_lock, own_dir

    try:
        state = Path(state_dir).resolve()
    except FileNotFoundError:  # relative, from a directory that was removed
        raise Refused(
            f"--state-dir {state_dir}: the current directory was removed; "
            "give an absolute path or cd to an existing directory"
        ) from None
    try:
        own_dir(state, 0o711)
        lock = open_lock(state / "gateway.lock")  # an fd: no link followed, 0600
    except (StateError, OSError) as e:
        raise Refused(str(e)) from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise Refused(f"{state} is in use by another gateway") from None
    return state, lock


def _gate(args: argparse.Namespace, state: Path) -> tuple[RunAs, Auth]:
    """The jobs' user and the token gate, the start-up checks said. Raises Refused."""
    from krex_async.client.submit import agent_socket
    from krex_async.gateway import auth
    from krex_async.gateway.command import job_env
    from krex_async.gateway.files import StateError, prepare_state

    euid = os.geteuid()
    try:
        prepare_state(state)
        run_as, note = auth.job_user(args.run_as, euid)
        # Read once and dropped: no child (the start-up probes, a job) inherits it.
        token = os.environ.pop(TOKEN_ENV, "") or None
        if args.token_file or args.no_auth:  # a flag given wins over the env
            token = None
        gate, where = auth.load(state, args.token_file, token, args.no_auth, run_as, euid, f"${TOKEN_ENV}")
    except (auth.AuthError, StateError, OSError) as e:
        raise Refused(str(e)) from None
    names = frozenset(args.job_env)

    def probe_env(u: auth.RunAs) -> dict[str, str]:  # what a job of `u` gets, for the start-up probes
        return job_env("start-up-check", state / "jobs", {}, state / "bin", args.job_python, u, names)

    checks = auth.check_job_users(gate, args.job_python, agent_socket(args.socket), probe_env, state / "jobs")
    for line in (note, where, *checks.splitlines()):
        if line:
            _say(line)
    return run_as, gate


def _store(args: argparse.Namespace, state: Path) -> Store:
    """The job store, with the per-identity caps and what a restart found said. Raises Refused."""
    from krex_async.gateway.store import Store

    try:
        store = Store(state / "jobs.db")
    except (sqlite3.Error, OSError) as e:  # corrupt, not a database, unreadable
        raise Refused(
            f"{state / 'jobs.db'} cannot be used ({type(e).__name__}: {e}); move it "
            "aside to start with an empty job list"
        ) from None
    store.max_running_per_owner = args.max_running_per_identity
    store.max_active_per_owner = args.max_queued_per_identity
    if store.note:
        _say(store.note)
    if store.restarted:
        _say(
            f"{store.restarted} job(s) were running when the last gateway "
            "stopped: marked failed (gateway_restarted)"
        )
    return store


async def serve(args: argparse.Namespace) -> int:
    """Run until SIGTERM/SIGINT. Holds an flock on the state dir so two gateways never share it."""
    from aiohttp import web

    from krex_async.client.submit import agent_socket
    from krex_async.fleet import fleet_connector
    from krex_async.gateway import catalog as K
    from krex_async.gateway.app import Gateway, make_app
    from krex_async.gateway.command import make_shims
    from krex_async.gateway.env import Environment
    from krex_async.gateway.jobs import JobRunner
    from krex_async.gateway.queue_timeout import QueueTimeout
    from krex_async.gateway.retention import Sweeper

    host, port = parse_listen(args.listen)
    limits = Limits(**{f: getattr(args, f) for f in Limits.__dataclass_fields__})
    try:
        state, lock = _lock_state(args.state_dir)
    except Refused as e:
        _say(str(e))
        return 2
    try:
        run_as, gate = _gate(args, state)
        store = _store(args, state)
    except Refused as e:
        os.close(lock)
        _say(str(e))
        return 2
    aliases = frozenset(["local", *args.gpu_alias])
    kinds, missing = K.build(limits, aliases, args.atrex_bench_root, args.job_python)
    gw: Gateway | None = None
    fleet = getattr(args, "fleet", None)  # --fleet, added by krex_async/cli.py
    runner = JobRunner(
        store,
        state / "jobs",
        limits,
        args.socket,
        kinds,
        lambda job_id: gw.changed(job_id) if gw else None,
        args.job_python,
        run_as.uid,
        fleet_connector(fleet, getattr(args, "ray_token_file", None)) if fleet else None,
    )
    runner.shims = make_shims(state / "bin", args.job_python)
    runner.env_names = frozenset(args.job_env)
    runner.min_free = args.min_free_space
    gw = Gateway(store, runner, Environment(aliases), limits, kinds, missing, gate)
    gw.min_free = args.min_free_space
    app_runner = web.AppRunner(make_app(gw), access_log=None, handle_signals=False, shutdown_timeout=3.0)
    await app_runner.setup()
    if said := conns.raise_nofile():  # a burst of connections meets the cap below before EMFILE
        _say(said)
    gw.guard = conns.ConnectionGuard(args.max_connections_per_address, args.unauthenticated_timeout)
    gw.guard.install(app_runner.server)
    site = web.TCPSite(app_runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        _say(f"cannot listen on {args.listen}: {e}")
        await app_runner.cleanup()
        store.close()
        os.close(lock)
        return 2
    bound = app_runner.addresses[0][1] if app_runner.addresses else port
    url = f"http://{host if ':' not in host else f'[{host}]'}:{bound}"
    info = state / "gateway.json"
    info.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    info.chmod(0o600)
    runner.start()
    expiry = None
    if args.queue_timeout is not None:
        expiry = QueueTimeout(store, args.queue_timeout, gw.changed, lambda: runner.waiting)
        runner.expiry = expiry  # a job the daemon queued is timed there too
        expiry.start()
    sweeper = None
    if args.job_retention is not None:
        sweeper = Sweeper(
            store,
            state / "jobs",
            args.job_retention,
            lambda: {*runner.running, *runner.orphans},
            gw.views.forget,
        )
        sweeper.start()
    stop = asyncio.Event()  # before the line that says it listens: a stop after it is clean
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    daemon = f"fleet {fleet}" if fleet else agent_socket(args.socket)
    _say(f"listening on {url} (state {state}, kinds {', '.join(sorted(kinds))}, daemon {daemon})")
    try:
        await stop.wait()
    finally:
        gw.close()
        if expiry is not None:
            await expiry.stop()
        if sweeper is not None:
            await sweeper.stop()
        await app_runner.cleanup()
        await runner.stop()
        store.close()
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.close(lock)
    _say(f"stopped (was listening on {url})")
    return 0
