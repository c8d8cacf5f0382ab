"""The flags of the gateway's trust-model limits (docs/gateway-security.md), and their checks:
what jobs inherit (--job-env), what a caller without a token may hold (connections), what a full
state disk refuses (--min-free-space) and what one identity may queue and run."""

from __future__ import annotations

import argparse
import math
from typing import Any

from krex_async.gateway import conns

MIN_FREE_SPACE = 64 * 1024 * 1024


def add(p: Any) -> None:
    """Add the flags to the `gateway` verb's parser."""
    p.add_argument(
        "--job-env",
        action="append",
        default=[],
        metavar="NAME",
        help="pass the gateway's variable NAME on to jobs (repeatable); jobs otherwise get a minimal "
        "environment: PATH, PYTHONPATH, LD_LIBRARY_PATH, the locale, TZ, TERM, TMPDIR, KREX_*, "
        "CUDA_*, NVIDIA_*, NCCL_*, TRITON_*, TORCH_*",
    )
    p.add_argument(
        "--max-connections-per-address",
        type=int,
        default=conns.DEFAULT_PER_ADDRESS,
        metavar="N",
        help="open connections from one address; a new one beyond it closes that address's oldest "
        f"connection without a token (default {conns.DEFAULT_PER_ADDRESS}; behind a proxy, raise it)",
    )
    p.add_argument(
        "--unauthenticated-timeout",
        type=float,
        default=conns.DEFAULT_IDLE,
        metavar="SECONDS",
        help="close a connection that has made no request with a valid token this long after it "
        f"opened (default {conns.DEFAULT_IDLE:g})",
    )
    p.add_argument(
        "--min-free-space",
        type=int,
        default=MIN_FREE_SPACE,
        metavar="BYTES",
        help="below this much free space on the state directory's file system, new jobs are "
        f"refused (507) and queued ones wait; jobs already accepted are kept (default {MIN_FREE_SPACE}, "
        "64 MiB; 0: only a write that fails refuses)",
    )
    p.add_argument(
        "--max-running-per-identity",
        type=int,
        default=0,
        metavar="N",
        help="jobs of one identity (token) running at once; its others wait while other identities' "
        "jobs start (default 0: no cap beyond --max-running; identities are served in turn either way)",
    )
    p.add_argument(
        "--max-queued-per-identity",
        type=int,
        default=0,
        metavar="N",
        help="jobs of one identity queued or running; a submit beyond it is 429 too_many_jobs "
        "(default 0: no cap)",
    )


def problem(args: argparse.Namespace) -> str:
    """Why these flags' values cannot serve ("" when they can)."""
    if why := job_env_problem(args.job_env):
        return why
    if args.max_connections_per_address < 1:
        return "--max-connections-per-address must be at least 1"
    if not (math.isfinite(args.unauthenticated_timeout) and args.unauthenticated_timeout > 0):
        return "--unauthenticated-timeout must be a positive number of seconds"
    if args.min_free_space < 0:
        return "--min-free-space must be 0 or more bytes"
    for flag in ("max_running_per_identity", "max_queued_per_identity"):
        if getattr(args, flag) < 0:
            return f"--{flag.replace('_', '-')} must be 0 (no cap) or more"
    return ""


def job_env_problem(names: list[str]) -> str:
    """Why a --job-env NAME cannot be passed on ("" when all can): not a variable name, or one the
    gateway keeps from jobs (its token) or krex sets itself."""
    from krex_async.gateway.command import SECRET_ENV
    from krex_async.gateway.limits import ENV_NAME, RESERVED_ENV

    for name in names:
        if not ENV_NAME.match(name):
            return f"--job-env {name!r} is not a variable name"
        if name in SECRET_ENV or name in RESERVED_ENV:
            return f"--job-env {name}: never passed to jobs (a secret of the gateway's, or set by krex)"
    return ""
