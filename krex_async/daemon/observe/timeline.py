"""Chrome-trace JSON timelines of commands, regions, freezes and probe events (open in Perfetto).

Input: trace records, dicts with these keys (missing ones default to "" / 0 / {}):
    ts       float  wall-clock time, unix seconds
    kind     str    command_start | command_end | region_request (or region_queued) | region_grant |
                    region_release | freeze | thaw | probe | stray
    device   str    device key ("nvidia:0", "cpu"); one Perfetto process per device
    command  str    command id (the command that starts/ends, requests/holds a region, whose region
                    froze or thawed its siblings (a late freeze: the command frozen), or that a
                    probe event's process belongs to; "" when unattributed)
    region   str    region id (region_* records; on freeze/thaw the region that caused it; on a
                    probe or stray the region it happened in)
    pid      int    process id (command_start: the command's main pid; probe/stray: the tgid)
    detail   dict   free-form; shown as the event's args. A region's name (the code's) is
                    `detail["region_name"]`, shown after its id; a command_start's `label` and `argv`
                    name the command's track. For probe/stray records `detail["name"]`
                    (e.g. "NV_ESC_RM_CONTROL", "cuLaunchKernel") names the instant; a probe record
                    with detail["stray"] true counts as a stray.

Output layout, per device process (events of no device under a process named "no device"):
    track "regions"           one slice per granted region: "<command>:<region> <name>" (grant..release)
    track "probes"            instants for probe events; strays are named "STRAY <name>"
    track "command <id> <label>: <argv>"
                              the command's slice (start..end), and inside it slices for
                              "wait <region>" (request..grant), "<region>" (grant..release) and,
                              on each command a region held, "frozen" / "locked" / "fenced" (from
                              the freeze that began entering the region to its thaw)
Who a region held comes from its region_grant record's detail: `frozen` (command ids), and where
present `locked`, `fenced` (ids) or `held` (a list of {"command": id, "mode": "lock"|"freeze"|...}
or [id, mode] pairs); a freeze record with detail["late"] holds its own command from then on.
Slices on one track always nest: one that would overlap the end of its enclosing slice is cut
there (args.clipped). A slice whose end record is missing ends at the last timestamp of the trace,
with args.unfinished.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

import msgspec

_REGIONS_TID, _PROBES_TID, _FIRST_COMMAND_TID = 1, 2, 10

E = TypeVar("E")


class TraceRing(Generic[E]):
    """The daemon's recent trace events, kept encoded (msgpack) so that `max_bytes` is what they
    cost, oldest dropped first beyond it or beyond `max_events`; iterating decodes them. A count
    alone did not bound memory: a region's grant lists every frozen command, and a 64-agent
    soak's events grew the daemon by ~21 MiB in 5 minutes towards a 100k-event cap of about
    100 MiB as Python objects."""

    def __init__(self, kind: type[E], max_bytes: int = 16 << 20, max_events: int = 100_000) -> None:
        self.max_bytes, self.max_events = max_bytes, max_events
        self._decoder = msgspec.msgpack.Decoder(kind)
        self._encoder = msgspec.msgpack.Encoder()
        self._items: collections.deque[bytes] = collections.deque()
        self.bytes = 0
        self.dropped = 0

    def append(self, ev: E) -> None:
        raw = self._encoder.encode(ev)
        self._items.append(raw)
        self.bytes += len(raw)
        while self._items and (self.bytes > self.max_bytes or len(self._items) > self.max_events):
            self.bytes -= len(self._items.popleft())
            self.dropped += 1

    def __iter__(self) -> Iterator[E]:
        return (self._decoder.decode(raw) for raw in list(self._items))

    def __len__(self) -> int:
        return len(self._items)


def _us(ts: float) -> float:
    return round(ts * 1e6, 3)


class _Builder:
    def __init__(self) -> None:
        self.out: list[dict[str, Any]] = []
        self.pids: dict[str, int] = {}
        self.tids: dict[tuple[str, str], int] = {}
        self.open: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        self.about: dict[str, str] = {}  # command id -> "label: argv", from its command_start

    def pid(self, device: str) -> int:
        if device not in self.pids:
            p = self.pids[device] = len(self.pids) + 1
            self.meta(p, 0, "process_name", f"device {device}" if device else "no device")
            self.meta(p, _REGIONS_TID, "thread_name", "regions")
            self.meta(p, _PROBES_TID, "thread_name", "probes")
        return self.pids[device]

    def tid(self, device: str, command: str) -> int:
        key = (device, command)
        if key not in self.tids:
            n = sum(1 for d, _ in self.tids if d == device)
            t = self.tids[key] = _FIRST_COMMAND_TID + n
            about = self.about.get(command, "")
            self.meta(
                self.pid(device),
                t,
                "thread_name",
                f"command {command or '?'}" + (f" {about}" if about else ""),
            )
        return self.tids[key]

    def meta(self, pid: int, tid: int, what: str, name: str) -> None:
        self.out.append({"ph": "M", "pid": pid, "tid": tid, "name": what, "args": {"name": name}})

    def begin(
        self, key: tuple[str, ...], rec: dict[str, Any], name: str, pid: int, tid: int, cat: str
    ) -> None:
        ev = {
            "ph": "X",
            "name": name,
            "cat": cat,
            "pid": pid,
            "tid": tid,
            "ts": _us(rec["ts"]),
            "dur": 0.0,
            "args": dict(rec["detail"]),
        }
        self.open.setdefault(key, []).append(ev)
        self.out.append(ev)

    def end(self, key: tuple[str, ...], rec: dict[str, Any]) -> dict[str, Any] | None:
        stack = self.open.get(key)
        if not stack:
            return None
        ev = stack.pop()
        ev["dur"] = max(0.0, round(_us(rec["ts"]) - ev["ts"], 3))
        if rec["detail"]:
            ev["args"].update(rec["detail"])
        return ev


def _named(r: dict[str, Any]) -> str:
    """A region's slice name: its id, and the name the code gave it (`83fb149b-2.1 timing`)."""
    name = str(r["detail"].get("region_name") or "")
    return f"{r['region']} {name}" if name else r["region"]


def _about(detail: dict[str, Any]) -> str:
    """A command track's description from its command_start: `label: argv` (either may be absent)."""
    label, argv = str(detail.get("label") or ""), str(detail.get("argv") or "")
    return f"{label}: {argv}" if label and argv else label or argv


def _norm(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "ts": float(r.get("ts", 0.0)),
        "kind": str(r.get("kind", "")),
        "device": str(r.get("device", "") or ""),
        "command": str(r.get("command", "") or ""),
        "region": str(r.get("region", "") or ""),
        "pid": int(r.get("pid", 0) or 0),
        "detail": dict(r.get("detail") or {}),
    }


_MODES = {
    "freeze": "frozen",
    "frozen": "frozen",
    "lock": "locked",
    "locked": "locked",
    "fence": "fenced",
    "fenced": "fenced",
}


def _held(detail: dict[str, Any]) -> list[tuple[str, str]]:
    """(command, slice name) for everyone a region held, from its grant's detail (any of the forms
    the module docstring lists; unknown shapes are skipped, never raised on)."""
    out: list[tuple[str, str]] = []
    for key in ("frozen", "locked", "fenced"):
        v = detail.get(key)
        if isinstance(v, list):
            out += [(str(c), _MODES[key]) for c in v if isinstance(c, (str, int))]
    for item in detail.get("held") or []:
        if isinstance(item, dict):
            cmd, mode = item.get("command"), str(item.get("mode", "frozen"))
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            cmd, mode = item
        else:
            continue
        if cmd:
            out.append((str(cmd), _MODES.get(str(mode), str(mode))))
    seen: set[tuple[str, str]] = set()
    return [x for x in out if not (x in seen or seen.add(x))]  # type: ignore[func-returns-value]


def _nest(out: list[dict[str, Any]]) -> None:
    """Cut every slice that would end after the slice enclosing it on its track (Perfetto and
    Chrome draw partly overlapping slices wrongly)."""
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for ev in out:
        if ev.get("ph") == "X":
            tracks.setdefault((ev["pid"], ev["tid"]), []).append(ev)
    for evs in tracks.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[float] = []  # end times of the open enclosing slices
        for ev in evs:
            while stack and ev["ts"] >= stack[-1]:
                stack.pop()
            end = ev["ts"] + ev["dur"]
            if stack and end > stack[-1]:
                ev["dur"] = round(stack[-1] - ev["ts"], 3)
                ev["args"]["clipped"] = True
                end = stack[-1]
            stack.append(end)


def chrome_trace(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Build a Chrome-trace JSON object (see the module docstring for the record format).

    Records are processed in time order; unknown kinds are ignored; never raises on unmatched or
    out-of-order records (an end without a start is dropped, a start without an end is closed at
    the last timestamp).
    """
    recs = sorted((_norm(r) for r in events), key=lambda r: r["ts"])
    b = _Builder()
    entering: dict[tuple[str, str], float] = {}  # (device, region) -> when its freeze began
    holding: dict[tuple[str, str], list[tuple[str, ...]]] = {}  # (device, region) -> open keys
    starts: dict[tuple[str, str], float] = {}  # (device, command) -> its command_start
    ends: dict[tuple[str, str], float] = {}  # (device, command) -> its command_end
    for r in recs:
        if r["kind"] in ("command_start", "command_end"):
            (starts if r["kind"] == "command_start" else ends).setdefault(
                (r["device"], r["command"]), r["ts"]
            )
        if r["kind"] == "command_start":
            b.about[r["command"]] = _about(r["detail"])

    def hold(dev: str, reg: str, cmd: str, name: str, r: dict[str, Any], since: float) -> None:
        key = ("held", dev, reg, cmd)
        if key in b.open and b.open[key]:
            return
        since = max(since, starts.get((dev, cmd), since))  # one that joined frozen: from its start
        start = dict(
            r,
            ts=since,
            detail={"region": reg, "by": r["command"]} if r["command"] != cmd else {"region": reg},
        )
        b.begin(key, start, name, b.pid(dev), b.tid(dev, cmd), "hold")
        holding.setdefault((dev, reg), []).append(key)

    def release(dev: str, reg: str, r: dict[str, Any]) -> None:
        for key in holding.pop((dev, reg), []):
            end = ends.get((dev, key[3]))
            b.end(key, r if end is None or end >= r["ts"] else dict(r, ts=end, detail={}))

    for r in recs:
        k, dev, cmd, reg = r["kind"], r["device"], r["command"], r["region"]
        pid = b.pid(dev)
        if k == "command_start":
            if r["pid"]:
                r["detail"].setdefault("pid", r["pid"])
            b.begin(("cmd", dev, cmd), r, f"command {cmd}", pid, b.tid(dev, cmd), "command")
        elif k == "command_end":
            b.end(("cmd", dev, cmd), r)
        elif k in ("region_request", "region_queued"):
            b.begin(("wait", dev, cmd, reg), r, f"wait {_named(r)}", pid, b.tid(dev, cmd), "region")
        elif k == "region_grant":
            b.end(("wait", dev, cmd, reg), r)
            b.begin(("hold", dev, cmd, reg), r, _named(r) or "region", pid, b.tid(dev, cmd), "region")
            b.begin(("dev", dev, cmd, reg), r, f"{cmd}:{_named(r)}", pid, _REGIONS_TID, "region")
            since = entering.pop((dev, reg), r["ts"])
            for other, name in _held(r["detail"]):
                if other != cmd:
                    hold(dev, reg, other, name, r, since)
        elif k == "region_release":
            b.end(("hold", dev, cmd, reg), r)
            b.end(("dev", dev, cmd, reg), r)
            release(dev, reg, r)
        elif k == "freeze":
            if r["detail"].get("late"):
                hold(dev, reg, cmd, "frozen", r, r["ts"])
            else:  # the owner's freeze of its siblings ended now; it began `seconds` earlier
                entering[(dev, reg)] = r["ts"] - float(r["detail"].get("seconds") or 0.0)
        elif k == "thaw":
            release(dev, reg, r)
        elif k in ("probe", "stray"):
            stray = k == "stray" or bool(r["detail"].get("stray"))
            name = str(r["detail"].get("name") or r["detail"].get("probe") or "probe")
            args = dict(r["detail"], pid=r["pid"], command=cmd, stray=stray)
            if reg:
                args["region"] = reg
            b.out.append(
                {
                    "ph": "i",
                    "s": "t",
                    "name": ("STRAY " if stray else "") + name,
                    "cat": "stray" if stray else "probe",
                    "pid": pid,
                    "tid": _PROBES_TID,
                    "ts": _us(r["ts"]),
                    "args": args,
                }
            )
    last = _us(recs[-1]["ts"]) if recs else 0.0
    for stack in b.open.values():
        for ev in stack:
            ev["dur"] = max(0.0, round(last - ev["ts"], 3))
            ev["args"]["unfinished"] = True
    _nest(b.out)
    return {"traceEvents": b.out, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, events: Iterable[dict[str, Any]]) -> None:
    """Write chrome_trace(events) to `path` as JSON (written to path.tmp, then renamed)."""
    import os

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(chrome_trace(events), f)
    os.replace(tmp, path)
