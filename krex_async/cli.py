"""`krex`: the command line for people and shell-driven agents.

    krex serve  [--socket PATH] [--policy region|command|shared] [--isolation auto|cgroup|signal] ...
    krex run    [--socket PATH] [--device D] [--timeout S] [--report FILE] -- CMD ...
    krex status [--socket PATH] [--json] [--all] [--watch [SECONDS]]
    krex trace  [--socket PATH] [--json] [--no-probes] [--command ID] [--pid N] [--device KEY] ...
    krex export --perfetto FILE|-
    krex demo   [-n N]
    krex fleet demo [--nodes N] | status [--address A]

`krex run` behaves like running CMD directly: its stdout and stderr, and its exit code (128+N when a
signal N ended it, 124 when krex's timeout did, 125 when krex itself could not run it, 126 when the
program was found but cannot be executed, 127 when it was not found).
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
from collections.abc import Coroutine
from typing import Any

import msgspec

from krex_async.cliargs import int_in, ray_address, text_up_to, timeout
from krex_async.linux import interrupt
from krex_async.protocol import MAX_NAME, default_socket


def _check_writable(path: str) -> str | None:
    """Why `path` cannot be written (before anything runs), or None."""
    if not path:
        return "an empty path"
    try:
        parent = os.path.dirname(os.path.abspath(path))
    except FileNotFoundError:  # getcwd() of a directory that was removed
        return "a relative path, and the current directory was removed"
    if os.path.isdir(path):
        return "is a directory"
    if not os.path.isdir(parent):
        return f"no directory {parent}"
    if not os.access(parent, os.W_OK | os.X_OK) and not os.access(path, os.W_OK):
        return f"{parent} is not writable"
    return None


def _not_started_code(message: str) -> int:
    """As the shell: 127 for a program not found, 126 for one found but not executable, else 125
    (krex itself could not run it)."""
    return 127 if "not found" in message else 126 if "cannot be executed" in message else 125


def _exit_code(rep: Any) -> int:
    """A command's report as `krex run`'s exit status (the module docstring's table)."""
    if rep.state == "timeout":
        print(f"krex run: {rep.error}", file=sys.stderr)
        return 124
    if rep.state in ("failed", "shutdown"):
        print(f"krex run: {rep.error}", file=sys.stderr)
        return _not_started_code(rep.error) if rep.state == "failed" else 125
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
                mem=args.mem,
            )
        except KrexError as e:
            print(f"krex run: {e.message}", file=sys.stderr)
            return _not_started_code(e.message)
        loop = asyncio.get_running_loop()

        sent: set[int] = set()

        def forward(sig: int) -> None:
            sent.add(sig)
            asyncio.ensure_future(h.cancel(sig))

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, forward, sig)
        feeder = loop.create_task(feed_stdin(h)) if stream_stdin else None
        out, err = _buffer(sys.stdout), _buffer(sys.stderr)
        err_tail = b""
        try:
            async for stream, data in h.output():
                f = out if stream == "stdout" else err
                if stream == "stderr":
                    err_tail = (err_tail + data)[-4096:]
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
    if rep.state == "cancelled" and rep.signal and rep.signal not in sent:
        # the daemon ended it otherwise than asked (SIGKILL: it was frozen by a region): say why
        print(f"krex run: {rep.error}", file=sys.stderr)
    code = _exit_code(rep)
    if code != 0 and b"No module named 'krex_async'" in err_tail:
        print(_import_hint(argv), file=sys.stderr)
    if args.report:
        try:
            with open(args.report, "wb") as f:
                f.write(msgspec.json.format(msgspec.json.encode(rep), indent=2) + b"\n")
        except OSError as e:  # the command ran: its exit status still stands
            print(f"krex run: cannot write the report to {args.report}: {e.strerror or e}", file=sys.stderr)
    return code


def _import_hint(argv: list[str]) -> str:
    """Why a command's `from krex_async import region` failed: its interpreter is not the one krex is
    installed in (a system python3 beside krex's venv, say), which the traceback alone does not say."""
    return (
        f"krex run: the command's Python ({argv[0]}) cannot import krex_async, which region() needs: "
        f"run it with the interpreter krex is installed in ({sys.executable}), or install krex into "
        f"that interpreter (pip install krex)"
    )


async def _export(args: argparse.Namespace) -> int:
    """Write the daemon's recent timeline as Chrome-trace JSON (opens in Perfetto); `-` is stdout."""
    from krex_async.client.submit import Client, KrexError
    from krex_async.daemon.observe.timeline import chrome_trace

    to_stdout = args.perfetto == "-"
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


def _check_output(verb: str, flag: str, path: str | None) -> None:
    """A file `krex VERB` would write that cannot be written is a usage error (exit 2), said before
    anything runs."""
    if path is not None and path != "-" and (why := _check_writable(path)):
        then = "; the command was not run" if verb == "run" else ""
        _SUBPARSERS[verb].error(f"{flag} {path or repr('')}: {why}{then}")


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
    from krex_async.ops import servecli, statusview, tracecli

    ap = argparse.ArgumentParser(prog="krex", description="region-granular GPU exclusivity")
    ap.add_argument("--version", action="version", version=f"krex {__version__}")
    sub = ap.add_subparsers(dest="verb", metavar="VERB", required=True)
    servecli.add_parser(sub)
    r = sub.add_parser(
        "run",
        help="run a command under the daemon, like running it directly",
        usage="krex run [options] -- CMD [ARG ...]",
        description="Run CMD under the daemon as if run directly: its stdout, stderr and exit status "
        "(128+N when signal N ended it, 124 for --timeout, 125 when krex could not run it, 126 not "
        "executable, 127 not found).",
    )
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
    r.add_argument(
        "--mem",
        type=_mem_size,
        default=0,
        metavar="SIZE",
        help="device memory the command needs (e.g. 12G): memory admission reserves it, and waits "
        "to start it until it fits beside what runs on the device",
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
    r.add_argument(
        "cmd",
        nargs=argparse.REMAINDER,
        metavar="-- CMD ...",
        help="the command to run and its arguments, after `--` (krex run --label x -- python3 bench.py)",
    )
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
    fleet_cli.add_token_file(gp)
    fleet_cli.add_parser(sub)
    dm = sub.add_parser("demo", help="start a daemon and run a small concurrent workload with regions")
    dm.add_argument("-n", type=int_in(1, 64), default=6, help="concurrent commands (default 6, 1-64)")
    from krex_async.ops import cleanup, doctor

    doctor.add_parser(sub)
    cleanup.add_parser(sub)
    _SUBPARSERS.update(sub.choices)
    if not (sys.argv[1:] if argv is None else argv):  # bare `krex`: what it can do, as git does
        ap.print_help()
        return 0
    args = _parse(ap, argv)
    try:
        if args.verb == "serve" and not args.print_config:
            # a Ctrl-C so far stops it as a later one would; its EarlyStop takes the held SIGINT
            return 0 if interrupt.came() else servecli.main(args)
        interrupt.release()  # a Ctrl-C held while krex started raises here: nothing has run yet
        return _dispatch(args)
    except KeyboardInterrupt:  # in a verb's own imports, or before its own handling: as the shell
        return 130


def _mem_size(text: str) -> int:
    """--mem: a size (512M, 12G, bytes); argparse names the flag in its error."""
    from krex_async.devices.base import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _arun(coro: Coroutine[Any, Any, int]) -> int:
    """asyncio.run, for a Ctrl-C at its very start too: one that cancels the task before its first
    step comes out of asyncio.Runner as CancelledError (made KeyboardInterrupt here), one before the
    task exists leaves the coroutine unawaited (closed here: no warning on the way out)."""
    try:
        return asyncio.run(coro)
    except asyncio.CancelledError:
        raise KeyboardInterrupt from None
    finally:
        coro.close()


def _dispatch(args: argparse.Namespace) -> int:
    from krex_async import gateway
    from krex_async.fleet import cli as fleet_cli
    from krex_async.ops import cleanup, doctor, servecli, statusview, tracecli

    if args.verb == "serve":
        return servecli.main(args)
    if args.verb == "doctor":
        return doctor.main(args)
    if args.verb == "cleanup":
        return cleanup.cleanup_main(args)
    if args.verb == "demo":
        from krex_async.ops import demo

        return demo.main(args.n)
    if args.verb == "run":
        if not _command(args):  # a usage error, not a command krex could not run (125)
            _SUBPARSERS["run"].error("no command given (krex run [options] -- CMD ...)")
        _check_output("run", "--report", args.report)
        return _arun(_run(args))
    if args.verb == "gateway":
        return gateway.main(args)
    if args.verb == "fleet":
        return fleet_cli.main(args)
    if args.verb == "export":
        _check_output("export", "--perfetto", args.perfetto)
        return _arun(_export(args))
    try:  # Ctrl-C is how a trace or a watch ends: no traceback
        return _arun(tracecli.trace(args) if args.verb == "trace" else statusview.status(args))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
