"""`krex status`'s command table: which commands it lists (filters, the ended ones collapsed, the
earlier daemon's left out), in what order, in columns as wide as their cells; and the formatting
the status and trace views share (durations, sizes, escaped text)."""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WIDTH = 100


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


def ms(seconds: float | None) -> str:
    """A latency in milliseconds for the tables; '-' where there is none (a plain start)."""
    return "-" if seconds is None else f"{seconds * 1e3:.1f}ms"


def printable(text: str) -> str:
    """TEXT with control and other unprintable characters escaped (`\x1b`, `\n`), as ps shows
    them: argv, labels and region names are any user's, and an admin's terminal must not run them."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


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
    """A command's STATE cell: its result once ended, `frozen`/`locked` while a region holds it,
    `gated` while its CUDA start waits for memory admission (--mem-gate)."""
    if c["state"] == "ended":
        return str(c.get("result") or "ended")
    if c.get("held"):
        return str(c["held"])
    if c.get("gate") == "asked" and c["state"] == "running":
        return "gated"
    return "frozen" if c.get("frozen") else str(c["state"])


def matches(c: dict[str, Any], v: View) -> bool:
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


def select_rows(rows: list[dict[str, Any]], boot: str, v: View) -> tuple[list[dict[str, Any]], list[str]]:
    """The command rows to list, and notes on those left out (earlier daemon, older ended)."""
    notes: list[str] = []
    earlier = [c for c in rows if _earlier(c, boot)]
    if not v.show_all:
        rows = [c for c in rows if not _earlier(c, boot)]
    rows = [c for c in rows if matches(c, v)]
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


def command_table(rows: list[dict[str, Any]], now: float) -> list[str]:
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
                ms(c.get("start_latency_s")),
                size(c.get("rss_bytes")),
                what,
            ]
        )
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(COLUMNS)]

    def line(values: list[str]) -> str:
        parts = [v.rjust(w) if h in RIGHT else v.ljust(w) for h, v, w in zip(COLUMNS, values[:-1], widths)]
        return " ".join(parts) + "  " + values[-1]

    out = [line([*COLUMNS, "LABEL: ARGV"])]
    for c, r in zip(rows, cells):
        out.append(line(r))
        if c.get("waiting_for"):  # memory admission: why it has not started
            out.append(f"{'':<4}{printable(c['waiting_for'])}")
        if c.get("reruns"):
            out.append(f"{'':<4}re-run {c['reruns']}x after a co-located CUDA out-of-memory")
    return out
