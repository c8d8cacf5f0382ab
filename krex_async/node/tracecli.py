"""`krex trace`: the daemon's live events, one a line, read like bcc's tools (opensnoop, execsnoop).

    krex trace [--json] [--no-probes] [--command ID] [--pid N] [--device KEY] [--kind K[,K]]

A header, then fixed columns: TIME, KIND (STRAY in capitals for GPU activity of a non-owner during a
region), DEVICE, COMMAND (the command the process belongs to; '-' outside krex), PID, REGION (the
region it happened in), then the event's own fields with durations in ms. A stray names the region's
owner (owner=...) and the process (comm=...). When the daemon stops, a line says so and the exit
status is 1. --json: one object a line with the event's fields only (ts, kind, device, command,
region, pid, detail).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import msgspec

from krex_async.cliargs import int_in, names_from
from krex_async.node.statusview import printable
from krex_async.protocol import PID_MAX, TRACE_KINDS, default_socket

# COMMAND and REGION fit ids up to a daemon's 99999th command and its 99th region ("1065bba0-123.4").
HEADER = f"{'TIME':<12} {'KIND':<14} {'DEVICE':<8} {'COMMAND':<14} {'PID':>7} {'REGION':<17} DETAIL"
PROBE_KINDS = frozenset({"probe"})
# detail keys shown in the columns already, or that say nothing to a reader
_HIDDEN = frozenset({"stray"})


def add_parser(sub: Any) -> None:
    t = sub.add_parser("trace", help="live stream of regions, freezes and probe events (strays marked)")
    t.add_argument("--socket", help=f"the daemon's socket (default: {default_socket()})")
    t.add_argument("--json", action="store_true", help="one JSON object a line")
    t.add_argument(
        "--no-probes",
        action="store_true",
        help="no plain probe events (regions, freezes, commands and strays only)",
    )
    t.add_argument(
        "--command",
        action="append",
        default=[],
        metavar="ID",
        help="only events of this command (repeatable)",
    )
    t.add_argument(
        "--pid",
        action="append",
        type=int_in(1, PID_MAX),
        default=[],
        metavar="N",
        help="only events of this process (repeatable)",
    )
    t.add_argument(
        "--device",
        action="append",
        default=[],
        metavar="KEY",
        help="only events on this device, e.g. cpu, nvidia0 (repeatable)",
    )
    t.add_argument(
        "--kind",
        action="append",
        type=names_from(TRACE_KINDS),
        default=[],
        metavar="K[,K]",
        help=f"only these kinds (repeatable): {', '.join(TRACE_KINDS)}",
    )


def wanted(ev: Any, args: argparse.Namespace) -> bool:
    """Whether `ev` passes the command-line filters (an event passes a filter not given)."""
    kinds = {k.strip() for spec in args.kind for k in spec.split(",") if k.strip()}
    if args.no_probes and ev.kind in PROBE_KINDS:
        return False
    if kinds and ev.kind not in kinds:
        return False
    if (
        args.command
        and ev.command not in args.command
        and str(ev.detail.get("owner", "")) not in args.command
    ):
        return False
    if args.pid and ev.pid not in args.pid:
        return False
    return not args.device or ev.device in args.device


def _value(key: str, v: Any) -> str:
    if isinstance(v, float):
        if key.endswith("_s") or key == "seconds":
            return f"{v * 1e3:.3f}ms"
        return f"{v:.4g}"
    if isinstance(v, list):  # ids, or held commands as {"command", "mode"}: shown id:mode
        items = [
            f"{x.get('command', '?')}:{x.get('mode', '?')}" if isinstance(x, dict) else str(x) for x in v[:8]
        ]
        return ",".join(items) + (f",+{len(v) - 8}" if len(v) > 8 else "") or "-"
    if isinstance(v, dict):
        return ",".join(f"{k}:{x}" for k, x in list(v.items())[:8]) or "-"
    return str(v)


def line(ev: Any) -> str:
    """One event in the fixed columns of HEADER."""
    lt = time.localtime(ev.ts)
    when = time.strftime("%H:%M:%S", lt) + f".{int(ev.ts * 1e3) % 1000:03d}"
    kind = "STRAY" if ev.kind == "stray" else ev.kind
    detail = dict(ev.detail)
    parts = []
    if ev.kind in ("probe", "stray"):
        name = detail.pop("name", "") or hex(int(detail.get("request", 0) or 0))
        parts.append(f"{detail.pop('probe', '')} {name}".strip())
        detail.pop("request", None)
        if detail.get("tid") == ev.pid:
            detail.pop("tid")
    parts += [
        f"{k}={_value(k, v)}"
        for k, v in detail.items()
        if k not in _HIDDEN and v != "" and not (isinstance(v, float) and v == 0.0)
    ]
    return printable(  # a stray's comm, a region's name: anyone's text, escaped
        f"{when:<12} {kind[:14]:<14} {ev.device or '-':<8} {ev.command or '-':<14} "
        f"{ev.pid or '-'!s:>7} {ev.region or '-':<17} {' '.join(parts)}"
    )


def as_json(ev: Any) -> str:
    """The event's own fields, without the protocol's (type, id)."""
    d = msgspec.to_builtins(ev)
    d.pop("type", None)
    d.pop("id", None)
    return msgspec.json.encode(d).decode()


async def trace(args: argparse.Namespace) -> int:
    """Stream until Ctrl-C (exit 0) or until the daemon goes away (a line saying so, exit 1)."""
    from krex_async.client.submit import Client, KrexError
    from krex_async.linux.fsutil import quiet_stdout

    try:
        client = await Client.connect(args.socket)
    except KrexError as e:
        print(f"krex trace: {e.message}", file=sys.stderr)
        return 1
    async with client:
        try:
            if args.device:  # a key this node does not have would match nothing, silently
                known = [str(d.get("key")) for d in (await client.status()).get("devices", [])]
                if unknown := [k for k in args.device if k not in known]:
                    print(
                        f"krex trace: --device {', '.join(unknown)}: no such device here "
                        f"(this node has: {', '.join(known)})",
                        file=sys.stderr,
                    )
                    return 2
            if not args.json:
                pol = client.welcome.policy if client.welcome else "?"
                print(f"Tracing krex at {client.path} (policy {pol})... Ctrl-C to stop.", file=sys.stderr)
                print(HEADER, flush=True)
            async for ev in client.trace(probes=not args.no_probes):
                if wanted(ev, args):
                    print(as_json(ev) if args.json else line(ev), flush=True)
        except KrexError as e:
            print(f"krex trace: {e.message}", file=sys.stderr)
            return 1
        except BrokenPipeError:  # its reader left (| head): done, as for any stream
            quiet_stdout()
            return 0
    print(f"krex trace: the daemon at {client.path} closed the connection (it stopped)", file=sys.stderr)
    return 1
