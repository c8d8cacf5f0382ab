"""`krex status`: the node at a glance, as a table that fits the terminal (80 columns and up).

    krex status [--json] [--all] [--state S] [--device D] [--user U] [--label GLOB] [--sort KEY]
                [--watch [SECONDS]]

The daemon's settings, then one row per device (memory, utilisation, commands, the region held and
queued), the warm pools, and one row per command: live ones first, the last few ended ones, the
rest counted (--all lists them, and the commands of a previous daemon, reported `lost`). --watch
redraws every SECONDS (2 by default) until Ctrl-C, like `nvidia-smi -l`, keeping the settings
and devices on screen and cutting the command list to the terminal's height ("+N more").
"""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from krex_async.cliargs import interval
from krex_async.protocol import default_socket

WIDTH = 100


def add_parser(sub: Any) -> None:
    s = sub.add_parser(
        "status",
        help="devices, commands, the region held and queued, what is frozen",
        description="Running commands first; ended ones beyond the last few are counted (--all "
        "lists them). Filters combine (all must match); the table fits the terminal's width.",
    )
    s.add_argument("--socket", help=f"the daemon's socket (default: {default_socket()})")
    s.add_argument("--json", action="store_true", help="the daemon's whole status tree as JSON")
    s.add_argument(
        "--all",
        action="store_true",
        help="list every ended command, and the commands of an earlier daemon (reported lost)",
    )
    s.add_argument(
        "--state",
        type=_state_name,
        help="only commands in this state: running, queued, starting, frozen, locked, ended, or how "
        "one ended (exited, failed, cancelled, timeout, lost, ...)",
    )
    s.add_argument("--device", help="only commands on this device (its key: cpu, nvidia0)")
    s.add_argument("--user", type=_uid, help="only commands of this user (a name or a uid)")
    s.add_argument("--label", help="only commands whose label matches this glob (agent-*)")
    s.add_argument(
        "--sort",
        choices=SORTS,
        default="state",
        help="row order (default state: live commands first, each group oldest first; "
        "age, rss and wait biggest first)",
    )
    s.add_argument(
        "--watch",
        nargs="?",
        const=2.0,
        type=interval,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2, at least 0.1) until Ctrl-C; with --json, one status a line",
    )


def _state_name(text: str) -> str:
    """argparse type for --state: a word (the daemon's results may grow, so any word is taken)."""
    if not text.isalpha():
        raise argparse.ArgumentTypeError(f"expected a state such as running or ended, got {text!r}")
    return text.lower()


def _uid(text: str) -> int:
    """argparse type for --user: a user name, or a uid."""
    import pwd

    if text.isdigit():
        return int(text)
    try:
        return pwd.getpwnam(text).pw_uid
    except KeyError:
        raise argparse.ArgumentTypeError(f"no user {text!r}") from None


def view_of(args: argparse.Namespace, watch: bool) -> View:
    """The table's view from the flags and the terminal (COLUMNS/LINES or the tty's size; a pipe
    gets WIDTH). In --watch, one line goes to the header above the status."""
    cols, lines = shutil.get_terminal_size((WIDTH, 24))
    return View(
        show_all=args.all,
        state=args.state,
        device=args.device,
        uid=args.user,
        label=args.label,
        sort=args.sort,
        width=cols,
        height=lines - 1 if watch else None,
    )


def filter_json(st: dict[str, Any], v: View) -> dict[str, Any]:
    """The status tree with only the commands the filters match (--json with filters)."""
    if not v.filtered:
        return st
    return dict(st, commands=[c for c in st["commands"] if _matches(c, v)])


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
                v = view_of(args, args.watch is not None)  # a resized terminal redraws to fit
                if args.json and args.watch is not None:  # JSON lines: one status a line, no header
                    print(json.dumps(filter_json(st, v)), flush=True)
                elif args.watch is None:
                    print(json.dumps(filter_json(st, v), indent=2) if args.json else render(st, view=v))
                    return 0
                else:
                    head = f"every {args.watch:g} s, Ctrl-C to stop    {time.strftime('%H:%M:%S')}"
                    text = render(st, view=v)
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


def _fit(line: str, width: int = WIDTH) -> str:
    """A table row cut to `width` (its last column, the command line, is what gets cut)."""
    return line if len(line) <= width else line[: width - 1] + "…"


def _wrap(line: str, width: int = WIDTH) -> str:
    """A settings line wrapped to `width` (nothing of a reason is lost), continued indented."""
    import textwrap

    return "\n".join(textwrap.wrap(line, width, subsequent_indent="    ", break_on_hyphens=False))


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


@dataclass
class View:
    """What the command table shows: filters (None: any), the sort key, whether ended commands
    and those of an earlier daemon are listed in full (`--all`), and the terminal's size (None
    height: no limit, as for a pipe)."""

    show_all: bool = False
    state: str | None = None
    device: str | None = None
    uid: int | None = None
    label: str | None = None
    sort: str = "state"
    width: int = WIDTH
    height: int | None = None

    @property
    def filtered(self) -> bool:
        return any(x is not None for x in (self.state, self.device, self.uid, self.label))


def _state(c: dict[str, Any]) -> str:
    """A command's STATE cell: its result once ended, `frozen`/`locked` while a region holds it."""
    if c["state"] == "ended":
        return str(c.get("result") or "ended")
    if c.get("held"):
        return str(c["held"])
    return "frozen" if c.get("frozen") else str(c["state"])


def _matches(c: dict[str, Any], v: View) -> bool:
    if v.state is not None and v.state not in (c["state"], _state(c)):
        return False
    if v.device is not None and c["device"] != v.device:
        return False
    if v.uid is not None and c.get("uid") != v.uid:
        return False
    return v.label is None or fnmatch.fnmatchcase(str(c.get("label") or ""), v.label)


SORTS = ("state", "age", "command", "device", "rss", "wait", "label")


def _sort_key(key: str) -> Callable[[dict[str, Any]], Any]:
    """Rows in `key` order; `state` (the default): live commands first, then ended ones, each in
    submission order (oldest first); `age`, `rss` and `wait` biggest first, as top shows."""
    live = {"running": 0, "starting": 1, "queued": 2}
    if key == "state":
        return lambda c: (live.get(c["state"], 3), -(c.get("age_s") or 0.0))
    if key in ("age", "rss", "wait"):
        field = {"age": "age_s", "rss": "rss_bytes", "wait": "start_latency_s"}[key]
        return lambda c: -(c.get(field) or 0.0)
    return lambda c: str(c.get(key) or "")


ENDED_SHOWN = 3  # the most recent ended commands listed without --all; the rest are counted


def _select(rows: list[dict[str, Any]], boot: str, v: View) -> tuple[list[dict[str, Any]], list[str]]:
    """The command rows to list, and notes on those left out (earlier daemon, older ended)."""
    notes: list[str] = []
    earlier = [c for c in rows if _earlier(c, boot)]
    if not v.show_all:
        rows = [c for c in rows if not _earlier(c, boot)]
    rows = [c for c in rows if _matches(c, v)]
    if not v.show_all and not v.filtered:
        ended = sorted((c for c in rows if c["state"] == "ended"), key=lambda c: c.get("age_s") or 0.0)
        hidden = {id(c) for c in ended[ENDED_SHOWN:]}
        if hidden:
            results: dict[str, int] = {}
            for c in ended[ENDED_SHOWN:]:
                results[_state(c)] = results.get(_state(c), 0) + 1
            counts = ", ".join(f"{k} {n}" for k, n in sorted(results.items(), key=lambda kv: -kv[1]))
            notes.append(f"(+{len(hidden)} older ended: {counts}; krex status --all or --state ended)")
            rows = [c for c in rows if id(c) not in hidden]
    if earlier and not v.show_all:
        lost = sum(1 for c in earlier if c.get("result") == "lost")
        notes.append(
            f"({len(earlier)} commands of an earlier daemon, {lost} of them lost: krex status --all)"
        )
    return sorted(rows, key=_sort_key(v.sort)), notes


def _started(c: dict[str, Any], now: float) -> str:
    """When a command was submitted, as ps's START: HH:MM:SS today, else the month and day."""
    if c.get("age_s") is None:
        return "?"
    t = now - float(c["age_s"])
    same_day = time.localtime(t)[:3] == time.localtime(now)[:3]
    return time.strftime("%H:%M:%S" if same_day else "%b%d", time.localtime(t))


COLUMNS = ("COMMAND", "STATE", "DEVICE", "PID", "STARTED", "AGE", "WAIT", "RSS")
RIGHT = {"AGE", "WAIT", "RSS"}


def _command_table(rows: list[dict[str, Any]], now: float) -> list[str]:
    """The command rows, columns as wide as their widest cell (ps's way); the last column,
    LABEL: ARGV, takes what is left of the line (and is what _fit cuts)."""
    cells = []
    for c in rows:
        what = printable(" ".join(c["argv"]))
        if c.get("label"):
            what = f"{printable(c['label'])}: {what}"
        cells.append(
            [
                str(c["command"]),
                _state(c),
                str(c["device"]),
                str(c["pid"] or "-"),
                _started(c, now),
                age(c["age_s"]) if c["age_s"] is not None else "?",
                _ms(c.get("start_latency_s")),
                size(c.get("rss_bytes")),
                what,
            ]
        )
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(COLUMNS)]

    def line(values: list[str]) -> str:
        parts = [v.rjust(w) if h in RIGHT else v.ljust(w) for h, v, w in zip(COLUMNS, values[:-1], widths)]
        return " ".join(parts) + "  " + values[-1]

    return [line([*COLUMNS, "LABEL: ARGV"]), *(line(r) for r in cells)]


def _head(st: dict[str, Any]) -> list[str]:
    """The daemon's settings: policy, isolation, hold, exits, probes (wrapped later, never cut)."""
    head: list[str] = []
    iso = st["isolation"]
    ver = f"krex {st['version']}  " if st.get("version") else ""
    head.append(
        f"{ver}daemon pid {st.get('pid', '?')}  policy {st['policy']}  freeze {st['freeze']}  "
        f"region cores {st['region_cores']}"
    )
    head.append(f"isolation {iso['backend']}: {iso['reason']}")
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
            why = str(dv["why"] or "")
            if ho.get("reason") and str(ho["reason"]) in why:  # the hold line above says it once
                why = why.replace(str(ho["reason"]), "as above")
            head.append(f"  {key}: {dv['hold']} {dv['freeze']}" + (f" ({why})" if why else ""))
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
    for key in ("devices_error", "host_error"):  # said once, not per device
        if st.get(key):
            head.append(f"{key.replace('_', ' ')}: {st[key]}")
    return head


def _devices(st: dict[str, Any], width: int) -> list[str]:
    """One row per device; CMDS counts every command on it, other users' too (a user who is not
    an admin sees their number, not who they are)."""
    out = [f"{'DEVICE':<9} {'NAME':<14} {'MEM USED/TOTAL':<15} {'UTIL':>5} {'CMDS':>4}  REGION"]
    for d in st["devices"]:
        total, free = d.get("memory_total_bytes") or 0, d.get("memory_free_bytes")
        mem = f"{size(total - free)}/{size(total)}" if total and free is not None else "-"
        util = d.get("utilisation_pct")
        r = d["region"]
        held = "-" if r is None else f"{printable(repr(r['name']))} by {r['command']} ({r['state']})"
        name = str(d.get("name") or d["vendor"])[:14]
        cmds = len(d["commands"]) + int(d.get("other_commands") or 0)
        out.append(
            f"{d['key']:<9} {name:<14} {mem:<15} "
            f"{'-' if util is None else f'{util:.0f}%':>5} {cmds:>4}  {held}"
        )
        if r is not None or d["queued"]:  # the region's holds on a line of their own
            holds = f"holds {_holds(r)}, cores {r['cores']}" if r is not None else ""
            queued = f"queued: {', '.join(d['queued'])}" if d["queued"] else ""
            out.append(_wrap(f"{'':<9} " + "; ".join(x for x in (holds, queued) if x), width))
    return out


def _pools(st: dict[str, Any]) -> list[str]:
    if not st.get("pools"):
        return []
    out = ["", "POOL      SIZE  WARM  BUSY  RETIRED  START_P50  START_P95"]
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
    return out


def render(st: dict[str, Any], show_all: bool = False, view: View | None = None) -> str:
    """The status tree as text, no line over the view's width; with a height (--watch), the
    settings and device rows always shown and the command list cut to fit, with a "+N more" line."""
    v = view or View(show_all=show_all)
    width = max(40, v.width)
    top = [_wrap(x, width) for x in _head(st)] + [""] + _devices(st, width) + _pools(st)
    top = [line for item in top for line in item.split("\n")]
    rows, notes = _select(st["commands"], str(st.get("boot") or ""), v)
    other = int(st.get("other_commands") or 0)
    if other:  # a user who is not an admin: other users' commands are counted, never listed
        notes.append(f"({other} command{'s' if other > 1 else ''} of other users not shown)")
    table = _command_table(rows, time.time())
    if not rows:
        table = [table[0], "(no commands match)" if v.filtered else "(no commands)"]
    if v.height is not None:
        room = v.height - len(top) - 1 - len(notes) - 1  # the blank line and the header
        if len(rows) > room:
            keep = max(0, room - 1)
            notes.insert(0, f"+{len(rows) - keep} more (krex status --state/--device/--label to narrow)")
            table = table[: 1 + keep]
    # Settings lines arrive wrapped: each line is fitted on its own, so only table rows are cut.
    return "\n".join(_fit(line, width) for line in [*top, "", *table, *notes])
