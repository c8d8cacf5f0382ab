"""Chrome-trace export: slices per device track, nesting, strays, unfinished slices."""

from __future__ import annotations

import json
from pathlib import Path

from krex_async.daemon.observe.timeline import chrome_trace, write_chrome_trace

T = 1_700_000_000.0


def recs() -> list[dict]:
    return [
        {"ts": T + 0.0, "kind": "command_start", "device": "nvidia:0", "command": "c1", "pid": 100},
        {"ts": T + 0.1, "kind": "command_start", "device": "nvidia:0", "command": "c2", "pid": 200},
        {"ts": T + 0.2, "kind": "region_request", "device": "nvidia:0", "command": "c1", "region": "timing"},
        {
            "ts": T + 0.25,
            "kind": "freeze",
            "device": "nvidia:0",
            "command": "c1",
            "region": "timing",
            "detail": {"seconds": 0.05, "groups": 1},
        },
        {
            "ts": T + 0.3,
            "kind": "region_grant",
            "device": "nvidia:0",
            "command": "c1",
            "region": "timing",
            "detail": {"frozen": ["c2"]},
        },
        {
            "ts": T + 0.4,
            "kind": "probe",
            "device": "nvidia:0",
            "command": "c1",
            "pid": 100,
            "detail": {"name": "NV_ESC_RM_CONTROL"},
        },
        {
            "ts": T + 0.5,
            "kind": "stray",
            "device": "nvidia:0",
            "command": "",
            "pid": 999,
            "region": "timing",
            "detail": {"name": "NV_ESC_RM_ALLOC"},
        },
        {
            "ts": T + 0.9,
            "kind": "region_release",
            "device": "nvidia:0",
            "command": "c1",
            "region": "timing",
            "detail": {"strays": 1},
        },
        {"ts": T + 0.85, "kind": "thaw", "device": "nvidia:0", "command": "c1", "region": "timing"},
        {
            "ts": T + 1.0,
            "kind": "command_end",
            "device": "nvidia:0",
            "command": "c1",
            "detail": {"returncode": 0},
        },
        {"ts": T + 0.05, "kind": "command_start", "device": "cpu", "command": "c3"},
    ]


def slices(tr: dict) -> dict[str, dict]:
    return {e["name"]: e for e in tr["traceEvents"] if e["ph"] == "X"}


def test_layout() -> None:
    tr = chrome_trace(recs())
    json.dumps(tr)  # serialisable
    s = slices(tr)
    assert s["command c1"]["dur"] == 1_000_000.0 and s["command c1"]["args"]["returncode"] == 0
    assert s["wait timing"]["dur"] == 100_000.0
    assert s["timing"]["ts"] == (T + 0.3) * 1e6 and s["timing"]["dur"] == 600_000.0
    assert s["c1:timing"]["args"]["strays"] == 1
    # the sibling is frozen from the start of the freeze (0.25 - 0.05) to the thaw, on its track
    assert s["frozen"]["ts"] == (T + 0.2) * 1e6 and s["frozen"]["dur"] == 650_000.0
    assert s["frozen"]["args"]["region"] == "timing" and s["frozen"]["args"]["by"] == "c1"
    # same device process; command slices on the command's track, region on the regions track
    assert s["command c1"]["pid"] == s["timing"]["pid"] == s["c1:timing"]["pid"]
    assert s["command c1"]["tid"] == s["timing"]["tid"] != s["c1:timing"]["tid"]
    assert s["frozen"]["tid"] == s["command c2"]["tid"]
    assert s["command c3"]["pid"] != s["command c1"]["pid"]
    inst = [e for e in tr["traceEvents"] if e["ph"] == "i"]
    assert [(e["name"], e["cat"], e["args"]["pid"]) for e in inst] == [
        ("NV_ESC_RM_CONTROL", "probe", 100),
        ("STRAY NV_ESC_RM_ALLOC", "stray", 999),
    ]
    names = {e["args"]["name"] for e in tr["traceEvents"] if e["ph"] == "M"}
    assert {"device nvidia:0", "device cpu", "regions", "probes", "command c1"} <= names


def test_unfinished_and_unmatched(tmp_path: Path) -> None:
    tr = chrome_trace(recs())
    s = slices(tr)
    assert s["command c2"]["args"]["unfinished"] is True  # no command_end: closed at the last ts
    assert s["command c2"]["dur"] == 900_000.0
    odd = chrome_trace(
        [{"ts": T, "kind": "region_release", "command": "x", "region": "r"}, {"ts": T, "kind": "bogus"}]
    )
    assert [e for e in odd["traceEvents"] if e["ph"] != "M"] == []
    assert chrome_trace([]) == {"traceEvents": [], "displayTimeUnit": "ms"}
    out = tmp_path / "t.json"
    write_chrome_trace(str(out), recs())
    assert json.loads(out.read_text())["traceEvents"]


def test_trace_ring_bounds_its_bytes_and_keeps_the_newest() -> None:
    from krex_async import protocol as P
    from krex_async.daemon.observe.timeline import TraceRing

    ring = TraceRing(P.TraceEvent, max_bytes=64 << 10)
    frozen = [f"c{i:05d}" for i in range(63)]  # a grant with 63 siblings frozen: ~0.5 KiB
    for i in range(2000):
        ring.append(
            P.TraceEvent(id=0, ts=T + i, kind="region_grant", command=f"k{i}", detail={"frozen": frozen})
        )
    assert ring.bytes <= 64 << 10 and ring.dropped > 0
    kept = list(ring)
    assert kept[-1].command == "k1999" and len(kept) == len(ring) == 2000 - ring.dropped
    assert [e.ts for e in kept] == sorted(e.ts for e in kept)
    assert kept[-1].detail == {"frozen": frozen}, "an event must come back as it went in"
    counted = TraceRing(P.TraceEvent, max_events=10)
    for i in range(25):
        counted.append(P.TraceEvent(id=0, ts=T + i, kind="thaw"))
    assert [e.ts - T for e in counted] == list(range(15, 25))


def test_held_modes_on_their_own_tracks_and_slices_nest() -> None:
    """A grant naming who was locked and fenced (the hold fields, in either form) puts a slice on
    each of those commands' tracks, none on the owner's; a held command killed before the thaw
    has its slice cut at its end, so every track nests; no process is named 'device ?'."""
    d = "nvidia:0"
    rs = [
        {"ts": T + i * 0.01, "kind": "command_start", "device": d, "command": c}
        for i, c in enumerate(("own", "a", "b", "c", "late"))
    ]
    rs += [
        {"ts": T + 0.1, "kind": "region_queued", "device": d, "command": "own", "region": "r1"},
        {
            "ts": T + 0.2,
            "kind": "freeze",
            "device": d,
            "command": "own",
            "region": "r1",
            "detail": {"seconds": 0.05},
        },
        {
            "ts": T + 0.3,
            "kind": "region_grant",
            "device": d,
            "command": "own",
            "region": "r1",
            "detail": {"frozen": ["a"], "held": [{"command": "b", "mode": "lock"}, ["c", "fence"]]},
        },
        {
            "ts": T + 0.4,
            "kind": "freeze",
            "device": d,
            "command": "late",
            "region": "r1",
            "detail": {"late": True},
        },
        {"ts": T + 0.5, "kind": "command_end", "device": d, "command": "b"},
        {"ts": T + 0.6, "kind": "thaw", "device": d, "command": "own", "region": "r1"},
        {"ts": T + 0.7, "kind": "region_release", "device": d, "command": "own", "region": "r1"},
        {
            "ts": T + 0.8,
            "kind": "probe",
            "device": "",
            "command": "",
            "pid": 7,
            "detail": {"name": "NV_ESC_RM_CONTROL"},
        },
    ]
    tr = chrome_trace(rs)
    ev = tr["traceEvents"]
    tracks = {
        e["args"]["name"]: e["tid"]
        for e in ev
        if e["ph"] == "M" and e["pid"] == 1 and e["name"] == "thread_name"
    }
    held = {(e["name"], e["tid"]): e for e in ev if e["ph"] == "X" and e["cat"] == "hold"}
    assert set(held) == {
        ("frozen", tracks["command a"]),
        ("locked", tracks["command b"]),
        ("fenced", tracks["command c"]),
        ("frozen", tracks["command late"]),
    }
    assert held[("frozen", tracks["command a"])]["ts"] == (T + 0.15) * 1e6
    assert held[("frozen", tracks["command a"])]["dur"] == 450_000.0  # to the thaw
    assert held[("locked", tracks["command b"])]["dur"] == 350_000.0  # to its own end
    assert not any(e["ph"] == "X" and e["cat"] == "hold" and e["tid"] == tracks["command own"] for e in ev)
    names = [e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"]
    assert "device ?" not in names and "no device" in names
    by_track: dict = {}
    for e in ev:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append(e)
    for evs in by_track.values():
        for x in evs:
            for y in evs:
                if x is not y and x["ts"] < y["ts"] < x["ts"] + x["dur"]:
                    assert y["ts"] + y["dur"] <= x["ts"] + x["dur"] + 1e-3, (x, y)


def test_slices_that_would_overlap_are_cut_to_nest() -> None:
    rs = [
        {"ts": T, "kind": "command_start", "device": "cpu", "command": "x"},
        {"ts": T + 0.1, "kind": "region_queued", "device": "cpu", "command": "x", "region": "r"},
        {"ts": T + 0.2, "kind": "command_end", "device": "cpu", "command": "x"},
        {"ts": T + 0.3, "kind": "region_grant", "device": "cpu", "command": "x", "region": "r"},
    ]
    s = slices(chrome_trace(rs))
    assert s["wait r"]["dur"] == 100_000.0 and s["wait r"]["args"]["clipped"] is True
