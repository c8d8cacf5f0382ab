"""`krex gateway`: the agate jobs API over HTTP, running every job as a krex command.

    krex gateway --listen 127.0.0.1:8000 --state-dir DIR [--socket PATH] [--gpu-alias NAME ...]
                 [--token-file F | --no-auth] [--run-as USER] [--job-python PY]
                 [--allow-remote] [--max-running N|auto] [--max-body BYTES] [--job-retention S|never]
                 [--queue-timeout S] ...

Trust (auth.py, files.py): every request but /healthz needs a bearer token (generated into
<state>/token at first start unless given); each token's jobs are its own; jobs never run as root.

Clients of the public agate API (the agate CLI, Atrex's tools/sandbox.py) talk to it unchanged; the
daemon found through --socket or $KREX_SOCKET runs the jobs under its policy, and KREX_AUTO_REGION=1
in each job's environment makes its triton do_bench loops regions. krex_async/cli.py adds the verb
with `gateway.add_parser(sub)` and runs it with `gateway.main(args)`.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import ipaddress
import json
import math
import os
import signal
import socket
import sqlite3
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from krex_async import cliargs
from krex_async.gateway import conns, options
from krex_async.gateway.limits import AUTO_MAX_RUNNING, Limits, max_running_arg
from krex_async.gateway.retention import DEFAULT as DEFAULT_RETENTION
from krex_async.gateway.retention import parse as parse_retention

RETENTION_ENV = "KREX_GATEWAY_JOB_RETENTION"
QUEUE_TIMEOUT_ENV = "KREX_GATEWAY_QUEUE_TIMEOUT"
TOKEN_ENV = "KREX_GATEWAY_TOKEN"
TOKEN_IN_ARGV = (
    "--token puts the token in the command line, where every local user and every job reads it "
    f"(ps, /proc/PID/cmdline): pass --token-file F (a 0600 file, one token a line) or set ${TOKEN_ENV}"
)
LIMITS = {  # the gateway's size and time limits, flag by flag (--max-body, ...)
    "max_body": "bytes",
    "max_file": "bytes",
    "max_files": "files",
    "max_command": "bytes",
    "max_env": "variables",
    "max_files_total": "bytes",
    "max_output": "bytes per stream",
    "max_timeout": "seconds",
    "default_timeout": "seconds",
    "max_wait": "seconds",
}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `gateway` verb (its options) to the krex command line's subparsers."""
    d = Limits()
    p = subparsers.add_parser("gateway", help="serve the agate jobs API (HTTP) over the daemon")
    p.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT (port 0: any free port)")
    p.add_argument("--state-dir", required=True, help="jobs.db and per-job directories")
    p.add_argument("--socket", help="the daemon's socket (default: $KREX_SOCKET or krex's default)")
    p.add_argument(
        "--gpu-alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another target_hardware name to accept besides 'local' (repeatable)",
    )
    p.add_argument(
        "--allow-remote", action="store_true", help="allow a non-loopback bind (never with --no-auth)"
    )
    p.add_argument(
        "--token",
        help="refused: a token on the command line is readable by every local user (ps, "
        "/proc/PID/cmdline); use --token-file F or $KREX_GATEWAY_TOKEN",
    )
    p.add_argument(
        "--token-file",
        help="tokens, one per line: TOKEN, or NAME TOKEN [USER] (a "
        "0600 file of the gateway's user; created with one token if missing; default "
        "<state-dir>/token)",
    )
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="INSECURE: no token; any local user submits jobs and sees every job (loopback only)",
    )
    p.add_argument(
        "--run-as",
        metavar="USER",
        help="run jobs as USER (a gateway started as root without it runs them as nobody; never root)",
    )
    p.add_argument(
        "--job-python",
        default=sys.executable,
        help="the interpreter `python` runs in jobs and evaluators run with (default "
        "this one; it must be executable by the jobs' user)",
    )
    p.add_argument("--atrex-bench-root", help="an Atrex-Bench checkout for eval/profile jobs")
    p.add_argument(
        "--max-running",
        default=str(d.max_running),
        metavar="N|auto",
        help=f"jobs submitted to the daemon at once, an upper bound (default {d.max_running}); auto: "
        f"up to {AUTO_MAX_RUNNING}, the daemon's memory admission deciding which start",
    )
    p.add_argument(
        "--job-retention",
        metavar="SECONDS|never",
        help="remove a finished job's directory and record this long after it ended (default "
        f"$KREX_GATEWAY_JOB_RETENTION, else {DEFAULT_RETENTION:g}: a day; 0 or 'never' keeps them)",
    )
    p.add_argument(
        "--queue-timeout",
        metavar="SECONDS",
        help="fail a job not started this long after it was submitted (reason queue_timeout; "
        f"default ${QUEUE_TIMEOUT_ENV}, else none: a job waits for a daemon, node or slot for ever)",
    )
    options.add(p)  # the flags of the trust model's limits
    for name, unit in LIMITS.items():
        default = getattr(d, name)
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"{unit} (default {default})",
        )
    return p  # type: ignore[no-any-return]


def limits_problem(args: argparse.Namespace) -> str:
    """Why the --max-*/--default-timeout/--max-wait values cannot serve ("" when they can)."""
    for name in LIMITS:
        v = getattr(args, name)
        if not (math.isfinite(v) and v > 0):
            return f"--{name.replace('_', '-')} must be a positive number, not {v}"
    if args.default_timeout > args.max_timeout:
        return f"--default-timeout {args.default_timeout:g} is over --max-timeout {args.max_timeout:g}"
    return ""


def job_retention(flag: str | None, env: Mapping[str, str]) -> float | None:
    """Seconds a finished job is kept (None: forever), from --job-retention, else
    $KREX_GATEWAY_JOB_RETENTION, else a day. Raises ValueError naming the flag or variable."""
    if flag is not None:
        where, text = "--job-retention", flag
    elif env.get(RETENTION_ENV):  # an empty variable counts as unset, as krex serve's KREX_* do
        where, text = RETENTION_ENV, env[RETENTION_ENV]
    else:
        return DEFAULT_RETENTION
    try:
        return parse_retention(text)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def queue_timeout_s(flag: str | None, env: Mapping[str, str]) -> float | None:
    """Seconds a job may stay queued (None: no limit), from --queue-timeout, else
    $KREX_GATEWAY_QUEUE_TIMEOUT. Raises ValueError naming the flag or variable."""
    if flag is not None:
        where, text = "--queue-timeout", flag
    elif env.get(QUEUE_TIMEOUT_ENV):  # empty: unset, as for the retention
        where, text = QUEUE_TIMEOUT_ENV, env[QUEUE_TIMEOUT_ENV]
    else:
        return None
    try:
        return cliargs.timeout(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{where}: {e}") from None


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"--listen {value!r} must be HOST:PORT")
    if int(port) > 65535:
        raise ValueError(f"--listen {value!r}: port {port} is out of range (0-65535)")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


async def serve(args: argparse.Namespace) -> int:
    """Run until SIGTERM/SIGINT. Holds an flock on the state dir so two gateways never share it."""
    from aiohttp import web

    from krex_async.client.submit import agent_socket
    from krex_async.fleet import fleet_connector
    from krex_async.gateway import auth
    from krex_async.gateway import catalog as K
    from krex_async.gateway.app import Gateway, make_app
    from krex_async.gateway.command import job_env, make_shims
    from krex_async.gateway.env import Environment
    from krex_async.gateway.files import StateError, open_lock, own_dir, prepare_state
    from krex_async.gateway.jobs import JobRunner
    from krex_async.gateway.queue_timeout import QueueTimeout
    from krex_async.gateway.retention import Sweeper
    from krex_async.gateway.store import Store

    host, port = parse_listen(args.listen)
    limits = Limits(**{f: getattr(args, f) for f in Limits.__dataclass_fields__})
    try:
        state = Path(args.state_dir).resolve()
    except FileNotFoundError:  # relative, from a directory that was removed
        print(
            f"krex gateway: --state-dir {args.state_dir}: the current directory was removed; "
            "give an absolute path or cd to an existing directory",
            file=sys.stderr,
        )
        return 2
    euid = os.geteuid()
    # The lock first (only the state dir itself is made or checked before it): a second gateway
    # on this state dir is refused before it changes anything the first one owns.
    try:
        own_dir(state, 0o711)
        lock = open_lock(state / "gateway.lock")  # an fd: no link followed, 0600
    except (StateError, OSError) as e:
        print(f"krex gateway: {e}", file=sys.stderr)
        return 2
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        print(f"krex gateway: {state} is in use by another gateway", file=sys.stderr)
        return 2
    try:
        prepare_state(state)
        run_as, note = auth.job_user(args.run_as, euid)
        # Read once and dropped: no child (the start-up probes, a job) inherits it.
        token = os.environ.pop(TOKEN_ENV, "") or None
        if args.token_file or args.no_auth:  # a flag given wins over the env
            token = None
        gate, where = auth.load(state, args.token_file, token, args.no_auth, run_as, euid, f"${TOKEN_ENV}")
    except (auth.AuthError, StateError, OSError) as e:
        os.close(lock)
        print(f"krex gateway: {e}", file=sys.stderr)
        return 2
    daemon_socket = agent_socket(args.socket)  # the one JobRunner's Client.connect reaches
    names = frozenset(args.job_env)

    def probe_env(u: auth.RunAs) -> dict[str, str]:  # what a job of `u` gets, for the start-up probes
        return job_env("start-up-check", state / "jobs", {}, state / "bin", args.job_python, u, names)

    checks = auth.check_job_users(gate, args.job_python, daemon_socket, probe_env, state / "jobs")
    for line in (note, where, *checks.splitlines()):
        if line:
            print(f"krex gateway: {line}", file=sys.stderr, flush=True)
    try:
        store = Store(state / "jobs.db")
    except (sqlite3.Error, OSError) as e:  # corrupt, not a database, unreadable
        os.close(lock)
        print(
            f"krex gateway: {state / 'jobs.db'} cannot be used ({type(e).__name__}: {e}); move it "
            "aside to start with an empty job list",
            file=sys.stderr,
        )
        return 2
    store.max_running_per_owner = args.max_running_per_identity
    store.max_active_per_owner = args.max_queued_per_identity
    if store.note:
        print(f"krex gateway: {store.note}", file=sys.stderr, flush=True)
    if store.restarted:
        print(
            f"krex gateway: {store.restarted} job(s) were running when the last gateway "
            "stopped: marked failed (gateway_restarted)",
            file=sys.stderr,
        )
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
    runner.env_names = names
    runner.min_free = args.min_free_space
    gw = Gateway(store, runner, Environment(aliases), limits, kinds, missing, gate)
    gw.min_free = args.min_free_space
    app_runner = web.AppRunner(make_app(gw), access_log=None, handle_signals=False, shutdown_timeout=3.0)
    await app_runner.setup()
    if said := conns.raise_nofile():  # a burst of connections meets the cap below before EMFILE
        print(f"krex gateway: {said}", file=sys.stderr, flush=True)
    gw.guard = conns.ConnectionGuard(args.max_connections_per_address, args.unauthenticated_timeout)
    gw.guard.install(app_runner.server)
    site = web.TCPSite(app_runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        print(f"krex gateway: cannot listen on {args.listen}: {e}", file=sys.stderr)
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
    print(
        f"krex gateway: listening on {url} (state {state}, kinds {', '.join(sorted(kinds))}"
        f", daemon {f'fleet {fleet}' if fleet else daemon_socket})",
        file=sys.stderr,
        flush=True,
    )
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
    print(f"krex gateway: stopped (was listening on {url})", file=sys.stderr, flush=True)
    return 0


def main(args: argparse.Namespace) -> int:
    """Entry point for `krex gateway`: checks the bind rules, then serves (uvloop when present)."""
    if args.token is not None:  # refused, not scrubbed: a wrapper's argv (sudo, a unit) keeps it too
        print(f"krex gateway: {TOKEN_IN_ARGV}", file=sys.stderr)
        return 2
    try:
        host, _ = parse_listen(args.listen)
    except ValueError as e:
        print(f"krex gateway: {e}", file=sys.stderr)
        return 2
    if not is_loopback(host):
        if not args.allow_remote:
            print(
                f"krex gateway: refusing to listen on non-loopback {host}: pass --allow-remote",
                file=sys.stderr,
            )
            return 2
        if args.no_auth:
            print(
                "krex gateway: --no-auth is for loopback only: --allow-remote requires a token",
                file=sys.stderr,
            )
            return 2
    try:
        args.job_retention = job_retention(args.job_retention, os.environ)
        args.queue_timeout = queue_timeout_s(args.queue_timeout, os.environ)
    except ValueError as e:
        print(f"krex gateway: {e}", file=sys.stderr)
        return 2
    if why := options.problem(args):
        print(f"krex gateway: {why}", file=sys.stderr)
        return 2
    try:
        args.max_running = max_running_arg(str(args.max_running))
    except ValueError as e:
        print(f"krex gateway: {e}", file=sys.stderr)
        return 2
    if args.default_timeout == Limits().default_timeout:  # not given: it follows a lower maximum
        args.default_timeout = min(args.default_timeout, args.max_timeout)
    if why := limits_problem(args):
        print(f"krex gateway: {why}", file=sys.stderr)
        return 2
    from krex_async.fleet import require_ray

    if getattr(args, "fleet", None) and require_ray():
        print(f"krex gateway: --fleet: {require_ray()}", file=sys.stderr)
        return 2
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        print("krex gateway: needs aiohttp (pip install 'krex[gateway]')", file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(serve(args))
    return uvloop.run(serve(args))
