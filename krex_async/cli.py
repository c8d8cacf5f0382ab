"""`krex`: the command line for people and shell-driven agents.

    krex serve  [--socket PATH] [--policy region|command|shared] [--isolation auto|cgroup|signal] ...
    krex run    [--socket PATH] [--device D] [--timeout S] [--report FILE] -- CMD ...
    krex status [--socket PATH] [--json]
    krex demo   [-n N]
    krex fleet demo [--nodes N] | status [--address A]

`krex run` behaves like running CMD directly: its stdout and stderr, and its exit code (128+N when a
signal N ended it, 124 when krex's timeout did, 125 when krex itself could not run it, 127 when the
program was not found).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

import msgspec

from .config import ServeConfig, default_socket


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the daemon")
    fields = {f.name: f for f in msgspec.structs.fields(ServeConfig)}
    p.add_argument("--socket", help=f"socket path (default: {default_socket()})")
    p.add_argument("--socket-group", help="group that may connect besides the owner")
    p.add_argument("--policy", choices=["region", "command", "shared"])
    p.add_argument("--isolation", choices=["auto", "cgroup", "signal"])
    p.add_argument("--cgroup-root", help="a delegated cgroup v2 directory for command cgroups")
    p.add_argument("--devices", help="auto, none, cpu:N (N logical cpu devices), nvidia, amd")
    p.add_argument("--freeze", choices=["all", "device-holders"])
    p.add_argument("--quiesce", choices=["auto", "all"],
                   help="whose runtime a region asks to stop and synchronise before freezing: "
                        "auto (default) those holding a GPU device file, none on the cpu device; "
                        "all: every runtime")
    for name in ("region_timeout", "quiesce_timeout", "drain_timeout", "freeze_timeout",
                 "kill_grace", "retention", "read_timeout"):
        p.add_argument("--" + name.replace("_", "-"), type=float,
                       help=f"seconds (default {fields[name].default})")
    p.add_argument("--warm-ms", type=float,
                   help="ms a region's owner warms its GPU before its timed loop (default: none "
                        "when the clock has settled, 20 when it idles low, 200 where the clock "
                        "cannot be read; 0 on cpu)")
    p.add_argument("--settle-fraction", type=float,
                   help="a GPU clock counts as settled at this fraction of its applications clock "
                        "(default 0.97: cleaner 1 ms timings than 0.9 for ~40 ms more per settle)")
    p.add_argument("--settle-ms", type=float,
                   help="at most this long before a grant, wait for a GPU clock held down by the "
                        "power cap (after a heavy neighbour) to recover (default 300; 0: off)")
    p.add_argument("--region-cores", type=int, help="cores reserved for a region's owner "
                                                    "(default 1 on a 2-core machine, else 2)")
    p.add_argument("--max-frame", type=int, help="largest accepted frame in bytes")
    p.add_argument("--max-inbound-bytes", type=int,
                   help="bytes of frame bodies read at once over all connections; a frame beyond "
                        "waits for room within --read-timeout (default 256 MiB)")
    p.add_argument("--max-buffered-total", type=int,
                   help="unsent bytes over all connections after which the peer adding to them "
                        "is dropped (default 512 MiB)")
    p.add_argument("--max-connections", type=int,
                   help="open connections beyond which new ones are refused (default 4096)")
    p.add_argument("--max-commands", type=int,
                   help="commands queued, running or with a kept result beyond which a submit "
                        "is refused with 'busy' (default 4096)")
    p.add_argument("--max-connections-per-user", type=int,
                   help="open connections of one user beyond which their new ones are refused; "
                        "root and --admin-group are exempt (default 1024)")
    p.add_argument("--max-commands-per-user", type=int,
                   help="commands of one user queued, running or with a kept result beyond which "
                        "their submit is refused with 'busy'; root and --admin-group are exempt "
                        "(default 1024)")
    p.add_argument("--max-conn-buffer", type=int,
                   help="unsent bytes after which a slow client is dropped")
    p.add_argument("--output-tail", type=int, help="bytes of each output stream kept per command")
    p.add_argument("--spool-limit", type=int, help="bytes of each output stream written to "
                                                   "<state-dir>/spool (default 64 MiB; 0: off)")
    p.add_argument("--admin-group", help="group whose members may act on every command")
    p.add_argument("--state-dir")
    p.add_argument("--log-format", choices=["auto", "json", "console"])
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--probes", choices=["auto", "off", "ioctl", "launches", "tracefs"],
                   help="GPU driver probes (default auto: bcc, else tracefs, else none)")
    p.add_argument("--probe-prefixes", help="comma-separated device path prefixes to watch "
                                            "(default /dev/nvidia,/dev/kfd,/dev/dri/renderD)")
    p.add_argument("--launch-libs", help="comma-separated libraries for --probes launches")
    p.add_argument("--launch-scope", choices=["outsiders", "all"],
                   help="processes the launch uprobes trap (each trapped launch costs ~0.7 us): "
                        "outsiders (default) only processes outside krex's commands, attached "
                        "per process; all: every process, commands included")
    p.add_argument("--pool-size", type=int, help="warm context workers per device (default 0: off)")
    p.add_argument("--pool-max-uses", type=int, help="commands a worker runs before it is replaced")
    p.add_argument("--pool-preload", help="comma-separated modules workers import, e.g. torch")
    p.add_argument("--pool-init", help="comma-separated modules a worker imports once its context "
                                       "exists, as part of creating it (one at a time per node, "
                                       "never while a region holds the device), e.g. to warm cuBLAS")
    p.add_argument("--metrics", help="serve Prometheus metrics on HOST:PORT (e.g. 127.0.0.1:9464)")
    p.add_argument("--config", help="TOML file of options (default /etc/krex/krex.toml, if present)")
    p.add_argument("--print-config", action="store_true",
                   help="print the merged options (file < KREX_* env < flags) as TOML and exit")


def _serve(args: argparse.Namespace) -> int:
    from . import server

    from .configfile import ConfigError, load_config_with_sources, print_config

    given = {k: v for k, v in vars(args).items()
             if v is not None and k in ServeConfig.__struct_fields__}
    try:
        cfg, sources = load_config_with_sources(args.config, os.environ, given)
    except ConfigError as e:
        print(f"krex serve: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(print_config(cfg.resolved(), sources), end="")
        return 0
    return server.run(cfg)


async def _run(args: argparse.Namespace) -> int:
    from .client import Client, KrexError

    argv = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    if not argv:
        print("krex run: no command given (krex run [options] -- CMD ...)", file=sys.stderr)
        return 125
    stdin = sys.stdin.buffer.read() if args.stdin else None
    try:
        client = await Client.connect(args.socket)
    except KrexError as e:
        print(f"krex run: {e.message}", file=sys.stderr)
        return 125
    async with client:
        try:
            h = await client.submit(argv, device=args.device, timeout=args.timeout, stdin=stdin,
                                    label=args.label or "")
        except KrexError as e:
            print(f"krex run: {e.message}", file=sys.stderr)
            return 127 if "not found" in e.message else 125
        loop = asyncio.get_running_loop()
        def forward(sig: int) -> None:
            asyncio.ensure_future(h.cancel(sig))

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, forward, sig)
        out, err = sys.stdout.buffer, sys.stderr.buffer
        try:
            async for stream, data in h.output():
                f = out if stream == "stdout" else err
                f.write(data)
                f.flush()
        except KrexError as e:
            print(f"krex run: {e.message}", file=sys.stderr)
            return 125
        res = await h.wait()
    rep = res.report
    if args.report:
        with open(args.report, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(rep), indent=2) + b"\n")
    if rep.state == "timeout":
        print(f"krex run: {rep.error}", file=sys.stderr)
        return 124
    if rep.state in ("failed", "shutdown"):
        print(f"krex run: {rep.error}", file=sys.stderr)
        return 125
    if rep.signal:
        return 128 + rep.signal
    return rep.exit_code if rep.exit_code is not None else 125


async def _status(args: argparse.Namespace) -> int:
    from .client import Client, KrexError

    try:
        async with await Client.connect(args.socket) as c:
            st = await c.status()
    except KrexError as e:
        print(f"krex status: {e.message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    iso = st["isolation"]
    print(f"policy {st['policy']}   isolation {iso['backend']} ({iso['reason']})   "
          f"freeze {st['freeze']}   region cores {st['region_cores']}")
    if "probes" in st:  # a daemon from before probes were reported has no such key
        pr = st["probes"]
        print(f"probes {pr['state']}" + (f" {pr['backend']}" if pr.get("backend") else "")
              + (f" ({pr['reason']})" if pr.get("reason") else ""))
        la = pr.get("launches")
        if la:
            print(f"launch uprobes: scope {la['scope']}" + (
                f", {la['watched']} processes probed" if "watched" in la else "")
                + (f" on {', '.join(la['libraries'])}" if la.get("libraries") else ""))
    print("\nDEVICE    VENDOR  COMMANDS  REGION")
    for d in st["devices"]:
        r = d["region"]
        held = "-" if r is None else (f"{r['region']} {r['name']!r} by {r['command']} ({r['state']}, "
                                      f"frozen {len(r['frozen'])}, cores {r['cores']})")
        queued = f"  queued: {', '.join(d['queued'])}" if d["queued"] else ""
        print(f"{d['key']:<9} {d['vendor']:<7} {len(d['commands']):<9} {held}{queued}")
    if st.get("pools"):
        print("\nPOOL      SIZE  WARM  BUSY  RETIRED  START_P50  START_P95")
        for key, p in st["pools"].items():
            lat = p.get("start_latency_s") or {}
            print(f"{key:<9} {p['size']:<5} {p['warm']:<5} {p['busy']:<5} {p['retired']:<8} "
                  f"{_ms(lat.get('p50')):<10} {_ms(lat.get('p95'))}"
                  + ("  (paused)" if p.get("paused") else "")
                  + (f"  last error: {p['last_error'].strip().splitlines()[-1]}" if p.get("last_error") else ""))
    print("\nCOMMAND       STATE     DEVICE  PID      AGE      START     FROZEN  ARGV")
    for c in st["commands"]:
        state = c["result"] if c["state"] == "ended" else c["state"]
        print(f"{c['command']:<13} {state:<9} {c['device']:<7} {c['pid'] or '-'!s:<8} "
              f"{c['age_s']:<8.1f} {_ms(c.get('start_latency_s')):<9} "
              f"{'yes' if c['frozen'] else 'no':<7} {' '.join(c['argv'])[:60]}")
    return 0


def _ms(seconds: float | None) -> str:
    """A latency in milliseconds for the status tables; '-' where there is none (a plain start)."""
    return "-" if seconds is None else f"{seconds * 1e3:.1f}ms"


async def _trace(args: argparse.Namespace) -> int:
    """Stream region boundaries, freezes and probe events; strays are marked."""
    from .client import Client, KrexError

    try:
        client = await Client.connect(args.socket)
    except KrexError as e:
        print(f"krex trace: {e.message}", file=sys.stderr)
        return 1
    async with client:
        try:
            async for ev in client.trace(probes=not args.no_probes):
                if args.json:
                    print(msgspec.json.encode(ev).decode(), flush=True)
                    continue
                mark = "STRAY " if ev.kind == "stray" else ""
                when = time.strftime("%H:%M:%S", time.localtime(ev.ts)) + f".{int(ev.ts * 1e3) % 1000:03d}"
                extra = " ".join(f"{k}={v}" for k, v in ev.detail.items())
                print(f"{when} {mark}{ev.kind:<15} dev={ev.device or '-':<7} cmd={ev.command or '-':<10} "
                      f"region={ev.region or '-':<12} pid={ev.pid or '-'} {extra}", flush=True)
        except KrexError as e:
            print(f"krex trace: {e.message}", file=sys.stderr)
            return 1
    return 0


async def _export(args: argparse.Namespace) -> int:
    """Write the daemon's recent timeline as Chrome-trace JSON (opens in Perfetto)."""
    from .client import Client, KrexError
    from .timeline import chrome_trace

    try:
        async with await Client.connect(args.socket) as c:
            events = await c.timeline()
    except KrexError as e:
        print(f"krex export: {e.message}", file=sys.stderr)
        return 1
    records = [msgspec.to_builtins(e) for e in events]
    with open(args.perfetto, "w") as f:
        json.dump(chrome_trace(records), f)
    print(f"krex export: {len(records)} events written to {args.perfetto}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="krex", description="region-granular GPU exclusivity")
    sub = ap.add_subparsers(dest="verb", required=True)
    _serve_parser(sub)
    r = sub.add_parser("run", help="run a command under the daemon, like running it directly")
    r.add_argument("--socket")
    r.add_argument("--device", default="auto", help="auto, an index, a key (cpu, nvidia0), or none")
    r.add_argument("--timeout", type=float, help="seconds before the command's tree is killed")
    r.add_argument("--report", help="write the command's report as JSON to this file")
    r.add_argument("--label", help="a label shown in status and reports")
    r.add_argument("--stdin", action="store_true", help="pass this process's stdin to the command")
    r.add_argument("cmd", nargs=argparse.REMAINDER)
    s = sub.add_parser("status", help="devices, commands, the region held and queued, what is frozen")
    s.add_argument("--socket")
    s.add_argument("--json", action="store_true")
    t = sub.add_parser("trace", help="live stream of regions, freezes and probe events (strays marked)")
    t.add_argument("--socket")
    t.add_argument("--json", action="store_true", help="one JSON object a line")
    t.add_argument("--no-probes", action="store_true", help="only region and command events")
    x = sub.add_parser("export", help="write the daemon's recent timeline for Perfetto")
    x.add_argument("--socket")
    x.add_argument("--perfetto", required=True, metavar="FILE", help="Chrome-trace JSON output")
    from . import gateway
    from .fleet import cli as fleet_cli

    gp = gateway.add_parser(sub)
    gp.add_argument("--fleet", metavar="ADDRESS",
                    help="run jobs on a Ray fleet of krex nodes (a Ray address, or auto; needs "
                         "krex[fleet]) instead of the local daemon")
    fleet_cli.add_parser(sub)
    dm = sub.add_parser("demo", help="start a daemon and run a small concurrent workload with regions")
    dm.add_argument("-n", type=int, default=6, help="concurrent commands (default 6)")
    from . import cleanup, doctor

    doctor.add_parser(sub)
    cleanup.add_parser(sub)
    args = ap.parse_args(argv)
    if args.verb == "doctor":
        return doctor.main(args)
    if args.verb == "cleanup":
        return cleanup.cleanup_main(args)
    if args.verb == "demo":
        from . import demo

        return demo.main(args.n)
    if args.verb == "serve":
        return _serve(args)
    if args.verb == "run":
        return asyncio.run(_run(args))
    if args.verb == "gateway":
        return gateway.main(args)
    if args.verb == "fleet":
        return fleet_cli.main(args)
    if args.verb == "trace":
        return asyncio.run(_trace(args))
    if args.verb == "export":
        return asyncio.run(_export(args))
    return asyncio.run(_status(args))


if __name__ == "__main__":
    sys.exit(main())
