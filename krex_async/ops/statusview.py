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
import json
import shutil
import sys
import time
from typing import Any

from krex_async.cliargs import interval
from krex_async.ops.statustable import (
    SORTS,
    WIDTH,
    View,
    command_table,
    matches,
    ms,
    select_rows,
)
from krex_async.ops.statustable import age as age
from krex_async.ops.statustable import printable as printable
from krex_async.ops.statustable import size as size
from krex_async.protocol import default_socket


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
        help="only commands in this state: running, queued, starting, frozen, locked, gated, ended, or how "
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
    gets WIDTH). In --watch, the header above the status takes a line, and the cursor after the
    last line another (a full screen would scroll its first line away)."""
    cols, lines = shutil.get_terminal_size((WIDTH, 24))
    return View(
        show_all=args.all,
        state=args.state,
        device=args.device,
        uid=args.user,
        label=args.label,
        sort=args.sort,
        width=cols,
        height=lines - 2 if watch else None,  # the header line, and the last line's newline
    )


def filter_json(st: dict[str, Any], v: View) -> dict[str, Any]:
    """The status tree with only the commands the filters match (--json with filters)."""
    if not v.filtered:
        return st
    return dict(st, commands=[c for c in st["commands"] if matches(c, v)])


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
    if st.get("state_disk_full"):
        head.append("state disk FULL: region records use the reserve (free space in the state dir)")
    elif st.get("state_disk_reserve_unavailable"):
        head.append(f"state disk: no reserve for region records ({st['state_disk_reserve_unavailable']})")
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


def _memory(m: dict[str, Any]) -> str:
    """One device's line of memory admission: what its commands hold, what is left, who waits."""
    waiting = m.get("waiting") or []
    return (
        f"{'':<9} memory: reserved {size(m['reserved_bytes'])}, used {size(m['used_bytes'])}, "
        f"pool {size(m['pool_bytes'])}, headroom {size(m['headroom_bytes'])}, "
        f"free for commands {size(m['free_for_commands_bytes'])}"
        + (
            f"; {len(waiting)} queued for memory: {', '.join(w['command'] for w in waiting)}"
            if waiting
            else ""
        )
        + (f"; {len(m['gated'])} started, admitted at their first CUDA use" if m.get("gated") else "")
    )


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
            if r is not None and r.get("share_for"):  # its turn come, its siblings run first
                holds = f"waits for the share of {', '.join(r['share_for'])}"
            queued = f"queued: {', '.join(d['queued'])}" if d["queued"] else ""
            out.append(_wrap(f"{'':<9} " + "; ".join(x for x in (holds, queued) if x), width))
        if m := d.get("memory"):  # memory-aware admission
            out.append(_wrap(_memory(m), width))
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
            f"{ms(lat.get('p50')):<10} {ms(lat.get('p95'))}"
            + ("  (paused)" if p.get("paused") else "")
            + (f"  adopted {p['adopted']}" if p.get("adopted") else "")
            + (f"  declined {_reasons(p['declined'])}" if p.get("declined") else "")
            + (f"  retired: {_reasons(p['retired_why'])}" if p.get("retired_why") else "")
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
    rows, notes = select_rows(st["commands"], str(st.get("boot") or ""), v)
    other = int(st.get("other_commands") or 0)
    if other:  # a user who is not an admin: other users' commands are counted, never listed
        notes.append(f"({other} command{'s' if other > 1 else ''} of other users not shown)")
    table = command_table(rows, time.time())
    if not rows:
        table = [table[0], "(no commands match)" if v.filtered else "(no commands)"]
    if v.height is not None:
        room = v.height - len(top) - 1 - len(notes) - 1  # the blank line and the header
        if len(table) - 1 > room:  # a row and the lines under it (why it waits, its re-runs)
            keep = max(0, room - 1)
            shown = sum(1 for line in table[1 : 1 + keep] if not line.startswith(" "))
            notes.insert(0, f"+{len(rows) - shown} more (krex status --state/--device/--label to narrow)")
            table = table[: 1 + keep]
    # Settings lines arrive wrapped: each line is fitted on its own, so only table rows are cut.
    return "\n".join(_fit(line, width) for line in [*top, "", *table, *notes])
