"""`krex gateway`'s command line: its flags (add_parser), the checks of what they say, and main,
which refuses what cannot serve (exit 2, one line) before wiring.serve starts anything.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import math
import os
import socket
import sys
from collections.abc import Mapping
from typing import Any

from krex_async import cliargs
from krex_async.gateway import options
from krex_async.gateway.limits import AUTO_MAX_RUNNING, Limits, max_running_arg
from krex_async.gateway.retention import DEFAULT as DEFAULT_RETENTION
from krex_async.gateway.retention import parse as parse_retention
from krex_async.gateway.wiring import TOKEN_ENV, parse_listen, serve

RETENTION_ENV = "KREX_GATEWAY_JOB_RETENTION"
QUEUE_TIMEOUT_ENV = "KREX_GATEWAY_QUEUE_TIMEOUT"
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
        f"up to {AUTO_MAX_RUNNING}, the daemon's admission deciding which start (its memory only "
        "under --mem-commit now or peak: docs/admission.md)",
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


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


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
