"""`krex status`: the node at a glance, as a table an operator reads in an 100-column terminal.

    krex status [--json] [--all] [--watch [SECONDS]]

The daemon's settings, then one row per device (memory, utilisation, the region held and queued),
the warm pools, and one row per command of this daemon (commands of a previous daemon, those it
left running reported `lost`, only with --all). --watch redraws every SECONDS (2 by default)
until Ctrl-C, like `nvidia-smi -l`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from krex_async.cliargs import interval
from krex_async.protocol import default_socket

WIDTH = 100


def add_parser(sub: Any) -> None:
    s = sub.add_parser("status", help="devices, commands, the region held and queued, what is frozen")
    s.add_argument("--socket", help=f"the daemon's socket (default: {default_socket()})")
    s.add_argument("--json", action="store_true", help="the daemon's whole status tree as JSON")
    s.add_argument(
        "--all", action="store_true", help="also the commands of an earlier daemon (reported lost)"
    )
    s.add_argument(
        "--watch",
        nargs="?",
        const=2.0,
        type=interval,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2, at least 0.1) until Ctrl-C; with --json, one status a line",
    )


async def status(args: argparse.Namespace) -> int:
    """One status (or, with --watch, one every interval over one connection). Exit 1 when the
    daemon cannot be reached or goes away, 0 after Ctrl-C."""
    from krex_async.client.submit import Client, KrexError
    from krex_async.linux.fsutil import quiet_stdout

    try:
        client = await Client.connect(args.socket)
    except KrexError as e:
        print(f"krex status: {e.message}", file=sys.stderr)
        if args.json:  # a JSON reader gets JSON, saying why there is no status
            print(json.dumps({"error": e.code, "message": e.message}))
        return 1
    clear = sys.stdout.isatty()
    try:
        async with client:
            while True:
                try:
                    st = await client.status()
                except KrexError as e:
                    print(f"krex status: {e.message}", file=sys.stderr)
                    return 1
                if args.json and args.watch is not None:  # JSON lines: one status a line, no header
                    print(json.dumps(st), flush=True)
                elif args.watch is None:
                    print(json.dumps(st, indent=2) if args.json else render(st, show_all=args.all))
                    return 0
                else:
                    head = f"every {args.watch:g} s, Ctrl-C to stop    {time.strftime('%H:%M:%S')}"
                    text = render(st, show_all=args.all)
                    print(("\x1b[H\x1b[2J" if clear else "") + head + "\n" + text, flush=True)
                await asyncio.sleep(args.watch)
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 0
    except BrokenPipeError:  # its reader left (| head): done, as for any stream
        quiet_stdout()
        return 0


def age(seconds: float) -> str:
    """A duration with its unit, short: 850ms, 12.3s, 4m05s, 2h03m, 3d04h."""
    if seconds < 1:
        return f"{seconds * 1e3:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(seconds), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


def size(n: float | None) -> str:
    """Bytes in binary units with one decimal where it matters: 812K, 45.2M, 139.8G; '-' unknown."""
    if n is None:
        return "-"
    for unit in ("B", "K", "M", "G", "T"):
        if n < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if n >= 100 or unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return "-"


def _ms(seconds: float | None) -> str:
    """A latency in milliseconds for the tables; '-' where there is none (a plain start)."""
    return "-" if seconds is None else f"{seconds * 1e3:.1f}ms"


def printable(text: str) -> str:
    """TEXT with control and other unprintable characters escaped (`\x1b`, `\n`), as ps shows
    them: argv, labels and region names are any user's, and an admin's terminal must not run them."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def _fit(line: str) -> str:
    """A table row cut to WIDTH (its last column, the command line, is what gets cut)."""
    return line if len(line) <= WIDTH else line[: WIDTH - 1] + "…"


def _wrap(line: str) -> str:
    """A settings line wrapped to WIDTH (nothing of a reason is lost), continued indented."""
    import textwrap

    return "\n".join(textwrap.wrap(line, WIDTH, subsequent_indent="    ", break_on_hyphens=False))


def _reasons(counts: dict[str, int]) -> str:
    """Why interpreters were not adopted, most frequent first: '3 (no warm worker 2, flag -X 1)'."""
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return f"{sum(counts.values())} (" + ", ".join(f"{k} {n}" for k, n in top) + ")"


def _holds(r: dict[str, Any]) -> str:
    """Whom a region holds and how: 'frozen 2' and, where the daemon reports them, 'locked 1',
    'fenced 3' (lists of ids, or `held` as [{"command", "mode"}])."""
    counts = {"frozen": len(r.get("frozen") or [])}
    for key in ("locked", "fenced"):
        if isinstance(r.get(key), list):
            counts[key] = counts.get(key, 0) + len(r[key])
    for item in r.get("held") or []:
        mode = str(item.get("mode", "frozen")) if isinstance(item, dict) else "frozen"
        mode = {"lock": "locked", "freeze": "frozen", "fence": "fenced"}.get(mode, mode)
        counts[mode] = counts.get(mode, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in counts.items() if v or k == "frozen")


def _earlier(c: dict[str, Any], boot: str) -> bool:
    """A command that an earlier daemon ran (recovered from the state dir and reported lost)."""
    return c.get("result") == "lost" or bool(boot) and not str(c["command"]).startswith(boot + "-")


def render(st: dict[str, Any], show_all: bool = False) -> str:
    """The status tree as text, no line over WIDTH characters."""
    head: list[str] = []
    iso = st["isolation"]
    ver = f"krex {st['version']}  " if st.get("version") else ""
    head.append(
        f"{ver}daemon pid {st.get('pid', '?')}  policy {st['policy']}  freeze {st['freeze']}  "
        f"region cores {st['region_cores']}"
    )
    head.append(f"isolation {iso['backend']}: {iso['reason']}")
    if st.get("state_disk_full"):
        head.append("state disk FULL: region records use the reserve (free space in the state dir)")
    if "hold" in st:  # a daemon from before the driver lock has no such key
        ho = st["hold"]
        head.append(
            f"hold {ho['mode']}: driver lock "
            + ("available" if ho["lock_available"] else "unavailable")
            + f" ({ho['reason']})"
        )
        if "exit_wait_s" in ho:  # how a region meets a sibling's exit (--exit-wait)
            ew = float(ho["exit_wait_s"])
            waited = "--lock-wait" if ew < 0 else f"{ew:g} s"
            head.append(
                "exits: one in user space frozen at once, one in the kernel waited for (--exit-wait 0)"
                if ew == 0
                else f"exits: waited for up to {waited}, then frozen (--exit-wait {ew:g})"
            )
            if "exit_starve_s" in ho:
                starve = float(ho["exit_starve_s"])
                head[-1] += f"; one begun over {starve:g} s ago waited for (--exit-starve)"
        for key, dv in ho.get("devices", {}).items():
            head.append(f"  {key}: {dv['hold']} {dv['freeze']}" + (f" ({dv['why']})" if dv["why"] else ""))
    if "probes" in st:  # a daemon from before probes were reported has no such key
        pr = st["probes"]
        head.append(
            f"probes {pr['state']}"
            + (f" {pr['backend']}" if pr.get("backend") else "")
            + (f" ({pr['reason']})" if pr.get("reason") else "")
        )
        la = pr.get("launches")
        if la:
            head.append(
                f"launch uprobes: scope {la['scope']}"
                + (f", {la['watched']} processes probed" if "watched" in la else "")
                + (f" on {', '.join(la['libraries'])}" if la.get("libraries") else "")
            )
    out = [_wrap(x) for x in head] + [""]
    out.append(f"{'DEVICE':<9} {'NAME':<14} {'MEM USED/TOTAL':<15} {'UTIL':>5} {'CMDS':>4}  REGION")
    for d in st["devices"]:
        total, free = d.get("memory_total_bytes") or 0, d.get("memory_free_bytes")
        mem = f"{size(total - free)}/{size(total)}" if total and free is not None else "-"
        util = d.get("utilisation_pct")
        r = d["region"]
        held = "-" if r is None else f"{printable(repr(r['name']))} by {r['command']} ({r['state']})"
        name = str(d.get("name") or d["vendor"])[:14]
        out.append(
            f"{d['key']:<9} {name:<14} {mem:<15} "
            f"{'-' if util is None else f'{util:.0f}%':>5} {len(d['commands']):>4}  {held}"
        )
        if r is not None or d["queued"]:  # the region's holds on a line of their own
            holds = f"holds {_holds(r)}, cores {r['cores']}" if r is not None else ""
            queued = f"queued: {', '.join(d['queued'])}" if d["queued"] else ""
            out.append(_wrap(f"{'':<9} " + "; ".join(x for x in (holds, queued) if x)))
    if st.get("pools"):
        out.append("")
        out.append("POOL      SIZE  WARM  BUSY  RETIRED  START_P50  START_P95")
        for key, p in st["pools"].items():
            lat = p.get("start_latency_s") or {}
            err = p["last_error"].strip().splitlines()[-1] if p.get("last_error") else ""
            out.append(
                f"{key:<9} {p['size']:<5} {p['warm']:<5} {p['busy']:<5} {p['retired']:<8} "
                f"{_ms(lat.get('p50')):<10} {_ms(lat.get('p95'))}"
                + ("  (paused)" if p.get("paused") else "")
                + (f"  adopted {p['adopted']}" if p.get("adopted") else "")
                + (f"  declined {_reasons(p['declined'])}" if p.get("declined") else "")
                + (f"  {p['waiting']} waiting for a warm worker" if p.get("waiting") else "")
                + (f"  last error: {err}" if err else "")
            )
    boot = str(st.get("boot") or "")
    rows = st["commands"]
    earlier = [c for c in rows if _earlier(c, boot)]
    if not show_all:
        rows = [c for c in rows if not _earlier(c, boot)]
    out.append("")
    out.append(
        f"{'COMMAND':<13} {'STATE':<9} {'DEVICE':<8} {'PID':<8} {'AGE':>7} {'START':>7} "
        f"{'RSS':>6} {'FROZEN':<6} LABEL: ARGV"
    )
    for c in rows:
        state = c["result"] if c["state"] == "ended" else c["state"]
        what = printable(" ".join(c["argv"]))
        if c.get("label"):
            what = f"{printable(c['label'])}: {what}"
        out.append(
            f"{c['command']:<13} {state:<9} {c['device']:<8} {c['pid'] or '-'!s:<8} "
            f"{age(c['age_s']) if c['age_s'] is not None else '?':>7} {_ms(c.get('start_latency_s')):>7} "
            f"{size(c.get('rss_bytes')):>6} {'yes' if c['frozen'] else 'no':<6} {what}"
        )
    if not rows:
        out.append("(no commands)")
    if earlier and not show_all:
        lost = sum(1 for c in earlier if c.get("result") == "lost")
        out.append(f"({len(earlier)} commands of an earlier daemon, {lost} of them lost: krex status --all)")
    # Settings lines arrive wrapped (several lines in one item): each line is fitted on its own,
    # so a wrapped reason is kept whole and only table rows are cut.
    return "\n".join(_fit(line) for item in out for line in item.split("\n"))
