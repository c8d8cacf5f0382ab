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
with `gateway.add_parser(sub)` and runs it with `gateway.main(args)`: the command line is cli.py, the
wiring of a running gateway (state, store, runner, app, listener) wiring.py; this re-exports them.
"""

from __future__ import annotations

from krex_async.gateway.cli import (
    LIMITS,
    QUEUE_TIMEOUT_ENV,
    RETENTION_ENV,
    TOKEN_IN_ARGV,
    add_parser,
    is_loopback,
    job_retention,
    limits_problem,
    main,
    queue_timeout_s,
)
from krex_async.gateway.wiring import TOKEN_ENV, parse_listen, serve

__all__ = [
    "LIMITS",
    "QUEUE_TIMEOUT_ENV",
    "RETENTION_ENV",
    "TOKEN_ENV",
    "TOKEN_IN_ARGV",
    "add_parser",
    "is_loopback",
    "job_retention",
    "limits_problem",
    "main",
    "parse_listen",
    "queue_timeout_s",
    "serve",
]
