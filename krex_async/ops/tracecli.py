"""`krex trace`: the daemon's live events, one a line, read like bcc's tools (opensnoop, execsnoop).

    krex trace [--json] [--no-probes] [--command ID] [--pid N] [--device KEY] [--kind K[,K]]

    krex trace ... [--strays summary|lines|off] [--duration S]

A header, then fixed columns: TIME, KIND (STRAY in capitals for GPU activity of a non-owner during a
region), DEVICE, COMMAND (the command the process belongs to; '-' outside krex), PID, REGION (the
region it happened in), then the event's own fields: the region's name (region_name=timing), the
commands a freeze or thaw held (frozen=...), a starting command's label and argv; fields named
`*_s` or `seconds` in seconds. A stray names the region's owner (owner=...) and the process
(comm=...); by default strays are summed, one STRAYS line per (region, command, comm) just before
the region's release (--strays lines: one line each, as --json always). When the daemon stops, a
line says so and the exit status is 1; --duration ends the trace after S seconds (exit 0).
--json: one object a line with the event's fields only (ts, kind, device, command, region, pid,
detail).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

from krex_async.cliargs import int_in, names_from, timeout
from krex_async.ops.statustable import printable
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
    t.add_argument(
        "--strays",
        choices=("summary", "lines", "off"),
        help="strays summed per (region, command, comm) at the region's release (summary, the "
        "default), one line each (lines; --json's default), or not shown (off)",
    )
    t.add_argument(
        "--duration", type=timeout, metavar="S", help="stop after S seconds (exit 0), like timeout(1)"
    )


def wanted(ev: Any, args: argparse.Namespace) -> bool:
    """Whether `ev` passes the command-line filters (an event passes a filter not given)."""
    kinds = {k.strip() for spec in args.kind for k in spec.split(",") if k.strip()}
    if args.no_probes and ev.kind in PROBE_KINDS:
        return False
    if kinds and ev.kind not in kinds:
        return False
    if args.command and not (set(args.command) & _commands_of(ev)):
        return False
    if args.pid and ev.pid not in args.pid:
        return False
    return not args.device or ev.device in args.device


def _commands_of(ev: Any) -> set[str]:
    """The commands an event is about: its own, a stray's region owner, those a freeze held."""
    out = {ev.command, str(ev.detail.get("owner", ""))}
    frozen = ev.detail.get("frozen")
    if ev.kind in ("freeze", "thaw") and isinstance(frozen, list):
        out.update(str(x) for x in frozen)
    return out - {""}


def seconds(v: float) -> str:
    """A value in seconds as seconds, to the microsecond: 0.000514s, 1.50057s."""
    text = f"{v:.6f}".rstrip("0").rstrip(".")
    return f"{text if text not in ('', '-0') else '0'}s"


def _value(key: str, v: Any) -> str:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and (key.endswith("_s") or key == "seconds"):
        return seconds(float(v))
    if isinstance(v, float):
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
    if detail.get("region_name"):  # the name the code gave, first: `timing` beside its id
        parts.append(f"region_name={detail.pop('region_name')}")
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


@dataclass
class _Strays:
    """Strays of one (region, command, comm): counted, their first time and the calls' names."""

    first: Any
    count: int = 0
    names: Counter[str] = field(default_factory=Counter)
    pids: set[int] = field(default_factory=set)
    last_ts: float = 0.0


class StraySummary:
    """--strays summary: strays held per (region, command, comm) and printed as one line each
    when the region is released (or the trace ends), in place of one line per ioctl."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, str, str], _Strays] = {}

    def add(self, ev: Any) -> None:
        key = (ev.region, ev.command, str(ev.detail.get("comm", "")))
        s = self.held.setdefault(key, _Strays(first=ev))
        s.count += 1
        s.names[str(ev.detail.get("name") or ev.detail.get("probe") or "?")] += 1
        s.pids.add(ev.pid)
        s.last_ts = ev.ts

    def flush(self, region: str | None = None) -> list[str]:
        """Summary lines of `region`'s strays (every region's: None), forgotten once said."""
        keys = [k for k in self.held if region is None or k[0] == region]
        return [summary_line(self.held.pop(k)) for k in keys]


def summary_line(s: _Strays) -> str:
    ev = s.first
    lt = time.localtime(ev.ts)
    when = time.strftime("%H:%M:%S", lt) + f".{int(ev.ts * 1e3) % 1000:03d}"
    top = ",".join(f"{n}:{c}" for n, c in s.names.most_common(4))
    more = f",+{len(s.names) - 4}" if len(s.names) > 4 else ""
    pid = ev.pid if len(s.pids) == 1 else f"{len(s.pids)}p"
    detail = [
        f"count={s.count}",
        f"over={seconds(s.last_ts - ev.ts)}",
        f"comm={ev.detail.get('comm', '')}",
        f"owner={ev.detail.get('owner', '')}",
        f"calls={top}{more}",
    ]
    if ev.detail.get("region_name"):
        detail.insert(0, f"region_name={ev.detail['region_name']}")
    return printable(
        f"{when:<12} {'STRAYS':<14} {ev.device or '-':<8} {ev.command or '-':<14} "
        f"{pid!s:>7} {ev.region or '-':<17} {' '.join(detail)}"
    )


async def _refuse_unknown(client: Any, args: argparse.Namespace) -> str | None:
    """Why a --device or --command given would match nothing (it is not on this node), or None."""
    if not args.device and not args.command:
        return None
    st = await client.status()
    known = [str(d.get("key")) for d in st.get("devices", [])]
    if unknown := [k for k in args.device if k not in known]:
        return f"--device {', '.join(unknown)}: no such device here (this node has: {', '.join(known)})"
    ids = {str(c.get("command")) for c in st.get("commands", [])}
    if unknown := [c for c in args.command if c not in ids]:
        return f"--command {', '.join(unknown)}: no such command of yours here (krex status --all lists them)"
    return None


async def trace(args: argparse.Namespace) -> int:
    """Stream until Ctrl-C or --duration (exit 0) or until the daemon goes away (a line saying so,
    exit 1)."""
    from krex_async.client.submit import Client, KrexError
    from krex_async.linux.fsutil import quiet_stdout

    if args.json and args.strays == "summary":  # a JSON reader sums the lines itself
        print("krex trace: --strays summary is for the text view (--json: lines or off)", file=sys.stderr)
        return 2
    try:
        client = await Client.connect(args.socket)
    except KrexError as e:
        print(f"krex trace: {e.message}", file=sys.stderr)
        return 1
    mode = args.strays or ("lines" if args.json else "summary")
    strays = StraySummary()
    async with client:
        try:
            if why := await _refuse_unknown(client, args):
                print(f"krex trace: {why}", file=sys.stderr)
                return 2
            if not args.json:
                pol = client.welcome.policy if client.welcome else "?"
                print(f"Tracing krex at {client.path} (policy {pol})... Ctrl-C to stop.", file=sys.stderr)
                print(HEADER, flush=True)
            try:
                async with asyncio.timeout(args.duration):
                    async for ev in client.trace(probes=not args.no_probes):
                        _show(ev, args, mode, strays)
            except TimeoutError:  # --duration: the trace's end, as a Ctrl-C
                _say(strays.flush())
                return 0
            except (KeyboardInterrupt, asyncio.CancelledError):
                _say(strays.flush())
                raise
        except KrexError as e:
            print(f"krex trace: {e.message}", file=sys.stderr)
            return 1
        except BrokenPipeError:  # its reader left (| head): done, as for any stream
            quiet_stdout()
            return 0
    _say(strays.flush())
    print(f"krex trace: the daemon at {client.path} closed the connection (it stopped)", file=sys.stderr)
    return 1


def _say(lines: list[str]) -> None:
    for text in lines:
        print(text, flush=True)


def _show(ev: Any, args: argparse.Namespace, mode: str, strays: StraySummary) -> None:
    """Print `ev` if the filters want it; a stray in summary mode is held for its region's end."""
    if ev.kind == "region_release" and not args.json:
        _say(strays.flush(ev.region))  # before the release line: they happened inside it
    if not wanted(ev, args):
        return
    if ev.kind == "stray" and mode != "lines":
        if mode == "summary" and not args.json:
            strays.add(ev)
        return
    print(as_json(ev) if args.json else line(ev), flush=True)
