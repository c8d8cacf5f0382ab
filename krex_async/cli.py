"""`krex`: the command line for people and shell-driven agents.

    krex serve  [--socket PATH] [--policy region|command|shared] [--isolation auto|cgroup|signal] ...
    krex run    [--socket PATH] [--device D] [--timeout S] [--report FILE] -- CMD ...
    krex status [--socket PATH] [--json] [--all] [--watch [SECONDS]]
    krex trace  [--socket PATH] [--json] [--no-probes] [--command ID] [--pid N] [--device KEY] ...
    krex export --perfetto FILE|-
    krex demo   [-n N]
    krex fleet demo [--nodes N] | status [--address A]

`krex run` behaves like running CMD directly: its stdout and stderr, and its exit code (128+N when a
signal N ended it, 124 when krex's timeout did, 125 when krex itself could not run it, 127 when the
program was not found).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import json
import os
import signal
import sys
from typing import Any

import msgspec

from krex_async.cliargs import int_in, ray_address, text_up_to, timeout
from krex_async.daemon.config import ServeConfig
from krex_async.protocol import MAX_NAME, default_socket
from krex_async.scheduler import Policy


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the daemon")
    fields = {f.name: f for f in msgspec.structs.fields(ServeConfig)}
    p.add_argument("--socket", help=f"socket path (default: {default_socket()})")
    p.add_argument("--socket-group", help="group that may connect besides the owner")
    p.add_argument(
        "--policy",
        choices=[x.value for x in Policy],
        help="what a region means: region (exclusive, default), command (a command "
        "holds its device start to end), shared (nothing protected)",
    )
    p.add_argument(
        "--isolation",
        choices=["auto", "cgroup", "signal"],
        help="how commands are frozen and fenced: auto (default: cgroup where a cgroup "
        "tree is writable, else signal), cgroup, signal (SIGSTOP, affinity)",
    )
    p.add_argument("--cgroup-root", help="a delegated cgroup v2 directory for command cgroups")
    p.add_argument("--devices", help="auto, none, cpu:N (N logical cpu devices), nvidia, amd")
    p.add_argument(
        "--freeze",
        choices=["all", "device-holders", "auto"],
        help="who a region holds: every sibling on the device, those holding a GPU "
        "device file (the others run on, fenced, and are held when they open one), "
        "or auto (default): device-holders where the hold locks and the probes "
        "run, all otherwise",
    )
    p.add_argument(
        "--hold",
        choices=["auto", "lock", "freeze"],
        help="how a held sibling is held: lock (its CUDA processes through the NVIDIA "
        "driver's process lock: its other threads run on; frozen where a lock "
        "cannot serve), freeze (the cgroup freezer), auto (default): lock where "
        "the driver offers it",
    )
    p.add_argument(
        "--lock-timeout",
        type=float,
        help="seconds one driver lock may take before the region waits for that sibling "
        "(default 0.005; a lock takes 0.4-2.1 ms)",
    )
    p.add_argument(
        "--lock-wait",
        type=float,
        help="seconds a region waits, before its grant, for a sibling inside a CUDA call to "
        "leave it and be locked; still inside: it is frozen (default 0.5)",
    )
    p.add_argument(
        "--exit-wait",
        type=float,
        help="seconds a region waits, before its grant, for a sibling's exit to end; one still in "
        "user space after that (Python's finalisation, the CUDA library's teardown) is frozen until "
        "the region ends, one in the kernel's exit up to --lock-wait at least (default: --lock-wait)",
    )
    p.add_argument(
        "--quiesce",
        choices=["auto", "all"],
        help="whose runtime a region asks to stop and synchronise before freezing: "
        "auto (default) those holding a GPU device file, none on the cpu device; "
        "all: every runtime",
    )
    for name in (
        "region_timeout",
        "quiesce_timeout",
        "drain_timeout",
        "drain_window",
        "freeze_timeout",
        "kill_grace",
        "retention",
        "read_timeout",
    ):
        p.add_argument(
            "--" + name.replace("_", "-"), type=float, help=f"seconds (default {fields[name].default})"
        )
    p.add_argument(
        "--warm-ms",
        type=float,
        help="ms a region's owner warms its GPU before its timed loop (default: none "
        "when the clock has settled, 20 when it idles low, 200 where the clock "
        "cannot be read; 0 on cpu)",
    )
    p.add_argument(
        "--settle-fraction",
        type=float,
        help="a GPU clock counts as settled at this fraction of its applications clock "
        "(default 0.97: cleaner 1 ms timings than 0.9 for ~40 ms more per settle)",
    )
    p.add_argument(
        "--settle-ms",
        type=float,
        help="at most this long before a grant, wait for a GPU clock held down by the "
        "power cap (after a heavy neighbour) to recover (default 300; 0: off)",
    )
    p.add_argument(
        "--region-cores",
        type=int,
        help="cores reserved for a region's owner (default 1 on a 2-core machine, else 2)",
    )
    p.add_argument("--max-frame", type=int, help="largest accepted frame in bytes")
    p.add_argument(
        "--max-inbound-bytes",
        type=int,
        help="bytes of frame bodies read at once over all connections; a frame beyond "
        "waits for room within --read-timeout (default 256 MiB)",
    )
    p.add_argument(
        "--max-buffered-total",
        type=int,
        help="unsent bytes over all connections after which the peer adding to them "
        "is dropped (default 512 MiB)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        help="open connections beyond which new ones are refused (default 4096)",
    )
    p.add_argument(
        "--max-commands",
        type=int,
        help="commands queued, running or with a kept result beyond which a submit "
        "is refused with 'busy' (default 4096)",
    )
    p.add_argument(
        "--max-connections-per-user",
        type=int,
        help="open connections of one user beyond which their new ones are refused; "
        "root and --admin-group are exempt (default 1024)",
    )
    p.add_argument(
        "--max-commands-per-user",
        type=int,
        help="commands of one user queued, running or with a kept result beyond which "
        "their submit is refused with 'busy'; root and --admin-group are exempt "
        "(default 1024)",
    )
    p.add_argument("--max-conn-buffer", type=int, help="unsent bytes after which a slow client is dropped")
    p.add_argument("--output-tail", type=int, help="bytes of each output stream kept per command")
    p.add_argument(
        "--spool-limit",
        type=int,
        help="bytes of each output stream written to <state-dir>/spool (default 64 MiB; 0: off)",
    )
    p.add_argument("--admin-group", help="group whose members may act on every command")
    p.add_argument(
        "--state-dir",
        help="intent records, spooled output and recovery state "
        "(default /run/krex as root, else krex-state beside the "
        "socket)",
    )
    p.add_argument(
        "--log-format",
        choices=["auto", "json", "console"],
        help="auto (default): console at a terminal, JSON lines otherwise",
    )
    p.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="default info: one line per command and per region",
    )
    p.add_argument(
        "--probes",
        choices=["auto", "off", "ioctl", "launches", "tracefs"],
        help="GPU driver probes (default auto: bcc, else tracefs, else none)",
    )
    p.add_argument(
        "--probe-prefixes",
        help="comma-separated device path prefixes to watch (default /dev/nvidia,/dev/kfd,/dev/dri/renderD)",
    )
    p.add_argument("--launch-libs", help="comma-separated libraries for --probes launches")
    p.add_argument(
        "--launch-scope",
        choices=["outsiders", "all"],
        help="processes the launch uprobes trap (each trapped launch costs ~0.7 us): "
        "outsiders (default) only processes outside krex's commands, attached "
        "per process; all: every process, commands included",
    )
    p.add_argument("--pool-size", type=int, help="warm context workers per device (default 0: off)")
    p.add_argument("--pool-max-uses", type=int, help="commands a worker runs before it is replaced")
    p.add_argument("--pool-preload", help="comma-separated modules workers import, e.g. torch")
    p.add_argument(
        "--pool-wait",
        type=float,
        help="seconds an interpreter waits for a warming worker before it runs without the pool (default 10)",
    )
    p.add_argument(
        "--pool-user",
        help="user (name or uid) the warm workers run as, whose commands "
        "they serve (default: the daemon's; e.g. the gateway's --run-as)",
    )
    p.add_argument(
        "--pool-init",
        help="comma-separated modules a worker imports once its context "
        "exists, as part of creating it (one at a time per node, "
        "never while a region holds the device), e.g. to warm cuBLAS",
    )
    p.add_argument("--metrics", help="serve Prometheus metrics on HOST:PORT (e.g. 127.0.0.1:9464)")
    p.add_argument("--config", help="TOML file of options (default /etc/krex/krex.toml, if present)")
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the merged options (file < KREX_* env < flags) as TOML and exit",
    )
    _name_env_vars(p)


def _serve(args: argparse.Namespace) -> int:
    from krex_async.daemon import server
    from krex_async.daemon.config import ConfigError, check_here, load_config_with_sources, print_config

    given = {k: v for k, v in vars(args).items() if v is not None and k in ServeConfig.__struct_fields__}
    try:
        cfg, sources = load_config_with_sources(args.config, os.environ, given)
        notes = [] if args.print_config else check_here(cfg, sources)
    except ConfigError as e:
        print(f"krex serve: {e}", file=sys.stderr)
        return 2
    for note in notes:  # valid options that do nothing here
        print(f"krex serve: warning: {note}", file=sys.stderr)
    if args.print_config:
        print(print_config(cfg.resolved(), sources), end="")
        return 0
    return server.run(cfg)


def _name_env_vars(p: argparse.ArgumentParser) -> None:
    """Append to each serve option's help the KREX_* variable that also sets it (config.py)."""
    fields = set(ServeConfig.__struct_fields__)
    for a in p._actions:
        if a.dest in fields and a.help is not argparse.SUPPRESS:
            env = f"KREX_{a.dest.upper()}"
            a.help = f"{a.help}; env {env}" if a.help else f"env {env}"


def _check_writable(path: str) -> str | None:
    """Why `path` cannot be written (before anything runs), or None."""
    if not path:
        return "an empty path"
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a directory"
    if not os.path.isdir(parent):
        return f"no directory {parent}"
    if not os.access(parent, os.W_OK | os.X_OK) and not os.access(path, os.W_OK):
        return f"{parent} is not writable"
    return None


def _exit_code(rep: Any) -> int:
    """A command's report as `krex run`'s exit status (the module docstring's table)."""
    if rep.state == "timeout":
        print(f"krex run: {rep.error}", file=sys.stderr)
        return 124
    if rep.state in ("failed", "shutdown"):
        print(f"krex run: {rep.error}", file=sys.stderr)
        return 127 if rep.state == "failed" and "not found" in rep.error else 125
    if rep.signal:
        return 128 + int(rep.signal)
    return int(rep.exit_code) if rep.exit_code is not None else 125


def _buffer(stream: Any) -> Any:
    """The binary buffer of sys.stdout/stderr, or None where it was closed (`>&-`)."""
    return getattr(stream, "buffer", None) if stream is not None else None


def _command(args: argparse.Namespace) -> list[str]:
    """`krex run`'s CMD: what follows its options, less the `--` that may separate them."""
    return list(args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd)


async def _run(args: argparse.Namespace) -> int:
    from krex_async.client.stdinfeed import feed_stdin, stdin_usable
    from krex_async.client.submit import Client, KrexError
    from krex_async.linux.fsutil import quiet_stdout

    argv = _command(args)
    if args.report is not None and (why := _check_writable(args.report)):
        print(
            f"krex run: --report {args.report or repr('')}: {why}; the command was not run", file=sys.stderr
        )
        return 125
    for what, value in [*((f"argument {i}", a) for i, a in enumerate(argv)), ("--label", args.label or "")]:
        try:
            value.encode()
        except UnicodeEncodeError:  # bytes the shell passed through that are not UTF-8
            print(f"krex run: {what} {value!r} is not UTF-8; the command was not run", file=sys.stderr)
            return 125
    stream_stdin = not args.no_stdin and stdin_usable()
    try:
        client = await Client.connect(args.socket)
    except KrexError as e:
        print(f"krex run: {e.message}", file=sys.stderr)
        return 125
    async with client:
        try:
            h = await client.submit(
                argv,
                device=args.device,
                timeout=args.timeout,
                label=args.label or "",
                stdin_stream=stream_stdin,
            )
        except KrexError as e:
            print(f"krex run: {e.message}", file=sys.stderr)
            return 127 if "not found" in e.message else 125
        loop = asyncio.get_running_loop()

        def forward(sig: int) -> None:
            asyncio.ensure_future(h.cancel(sig))

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, forward, sig)
        feeder = loop.create_task(feed_stdin(h)) if stream_stdin else None
        out, err = _buffer(sys.stdout), _buffer(sys.stderr)
        try:
            async for stream, data in h.output():
                f = out if stream == "stdout" else err
                if f is None:
                    continue
                try:
                    f.write(data)
                    f.flush()
                except OSError as e:  # a reader that went away (| head), a full disk: as a pipe
                    # would, the command ends (SIGPIPE's status for EPIPE, else 125)
                    await h.cancel(signal.SIGPIPE if isinstance(e, BrokenPipeError) else signal.SIGTERM)
                    with contextlib.suppress(KrexError):
                        await h.wait()
                    quiet_stdout()
                    return 128 + signal.SIGPIPE if isinstance(e, BrokenPipeError) else 125
        except KrexError as e:
            print(f"krex run: {e.message}", file=sys.stderr)
            return 125
        finally:
            if feeder is not None:
                feeder.cancel()
        res = await h.wait()
    rep = res.report
    code = _exit_code(rep)
    if args.report:
        try:
            with open(args.report, "wb") as f:
                f.write(msgspec.json.format(msgspec.json.encode(rep), indent=2) + b"\n")
        except OSError as e:  # the command ran: its exit status still stands
            print(f"krex run: cannot write the report to {args.report}: {e.strerror or e}", file=sys.stderr)
    return code


async def _export(args: argparse.Namespace) -> int:
    """Write the daemon's recent timeline as Chrome-trace JSON (opens in Perfetto); `-` is stdout."""
    from krex_async.client.submit import Client, KrexError
    from krex_async.daemon.timeline import chrome_trace

    to_stdout = args.perfetto == "-"
    if not to_stdout and (why := _check_writable(args.perfetto)):
        print(f"krex export: --perfetto {args.perfetto or repr('')}: {why}", file=sys.stderr)
        return 1
    try:
        async with await Client.connect(args.socket) as c:
            events = await c.timeline()
    except KrexError as e:
        print(f"krex export: {e.message}", file=sys.stderr)
        return 1
    records = [msgspec.to_builtins(e) for e in events]
    text = json.dumps(chrome_trace(records))
    if to_stdout:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return 0
    try:
        with open(args.perfetto, "w") as f:
            f.write(text)
    except OSError as e:
        print(f"krex export: cannot write {args.perfetto}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(
        f"krex export: {len(records)} events written to {args.perfetto} (open it at https://ui.perfetto.dev)",
        file=sys.stderr,
    )
    return 0


def _parse(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parse_args, but an unknown option is answered by the subcommand it was given to (its usage,
    not the top level's), with the nearest option it has."""
    ns, extra = ap.parse_known_args(argv)
    if extra:
        sub = _SUBPARSERS.get(getattr(ns, "verb", "") or "", ap)
        opts = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
        hints = [
            m
            for x in extra
            if x.startswith("-")
            for m in difflib.get_close_matches(x.split("=")[0], opts, n=1)
        ]
        sub.error(
            f"unrecognized arguments: {' '.join(extra)}"
            + (f" (did you mean {', '.join(hints)}?)" if hints else "")
        )
    return ns


_SUBPARSERS: dict[str, argparse.ArgumentParser] = {}


def main(argv: list[str] | None = None) -> int:
    from krex_async import __version__
    from krex_async.node import statusview, tracecli

    ap = argparse.ArgumentParser(prog="krex", description="region-granular GPU exclusivity")
    ap.add_argument("--version", action="version", version=f"krex {__version__}")
    sub = ap.add_subparsers(dest="verb", required=True)
    _serve_parser(sub)
    r = sub.add_parser("run", help="run a command under the daemon, like running it directly")
    r.add_argument("--socket", help=f"the daemon's socket (default: {default_socket()})")
    r.add_argument(
        "--device",
        default="auto",
        type=text_up_to(MAX_NAME),
        help="auto, an index, a key (cpu, nvidia0), or none",
    )
    r.add_argument("--timeout", type=timeout, help="seconds before the command's tree is killed")
    r.add_argument("--report", help="write the command's report as JSON to this file")
    r.add_argument(
        "--label",
        type=text_up_to(MAX_NAME),
        help=f"a label shown in `krex status` and the report (up to {MAX_NAME} characters)",
    )
    stdin = r.add_mutually_exclusive_group()  # both given: which one was meant is unknown
    stdin.add_argument(
        "--stdin",
        action="store_true",
        help="pass this process's stdin to the command (the default; kept for scripts)",
    )
    stdin.add_argument(
        "--no-stdin",
        action="store_true",
        help="give the command /dev/null as stdin, like ssh -n (in a `while read` loop "
        "krex run would otherwise read ahead of the loop)",
    )
    r.add_argument("cmd", nargs=argparse.REMAINDER)
    statusview.add_parser(sub)
    tracecli.add_parser(sub)
    x = sub.add_parser("export", help="write the daemon's recent timeline for Perfetto")
    x.add_argument("--socket", help=f"the daemon's socket (default: {default_socket()})")
    x.add_argument("--perfetto", required=True, metavar="FILE", help="Chrome-trace JSON output; - for stdout")
    from krex_async import gateway
    from krex_async.fleet import cli as fleet_cli

    gp = gateway.add_parser(sub)
    gp.add_argument(
        "--fleet",
        metavar="ADDRESS",
        type=ray_address,
        help="run jobs on a Ray fleet of krex nodes (auto, HOST:PORT or ray://HOST:PORT; needs "
        "krex[fleet]) instead of the local daemon",
    )
    fleet_cli.add_parser(sub)
    dm = sub.add_parser("demo", help="start a daemon and run a small concurrent workload with regions")
    dm.add_argument("-n", type=int_in(1, 64), default=6, help="concurrent commands (default 6, 1-64)")
    from krex_async.node import cleanup, doctor

    doctor.add_parser(sub)
    cleanup.add_parser(sub)
    _SUBPARSERS.update(sub.choices)
    args = _parse(ap, argv)
    if args.verb == "doctor":
        return doctor.main(args)
    if args.verb == "cleanup":
        return cleanup.cleanup_main(args)
    if args.verb == "demo":
        from krex_async.node import demo

        return demo.main(args.n)
    if args.verb == "serve":
        return _serve(args)
    if args.verb == "run":
        if not _command(args):  # a usage error, not a command krex could not run (125)
            _SUBPARSERS["run"].error("no command given (krex run [options] -- CMD ...)")
        return asyncio.run(_run(args))
    if args.verb == "gateway":
        return gateway.main(args)
    if args.verb == "fleet":
        return fleet_cli.main(args)
    if args.verb == "export":
        return asyncio.run(_export(args))
    try:  # Ctrl-C is how a trace or a watch ends: no traceback
        return asyncio.run(tracecli.trace(args) if args.verb == "trace" else statusview.status(args))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
