"""Chrome-trace export: slices per device track, nesting, strays, unfinished slices."""

from __future__ import annotations

import json
from pathlib import Path

from krex_async.timeline import chrome_trace, write_chrome_trace

T = 1_700_000_000.0


def recs() -> list[dict]:
    return [
        {"ts": T + 0.0, "kind": "command_start", "device": "nvidia:0", "command": "c1", "pid": 100},
        {"ts": T + 0.1, "kind": "command_start", "device": "nvidia:0", "command": "c2", "pid": 200},
        {"ts": T + 0.2, "kind": "region_request", "device": "nvidia:0", "command": "c1",
         "region": "timing"},
        {"ts": T + 0.25, "kind": "freeze", "device": "nvidia:0", "command": "c2",
         "region": "timing", "detail": {"freeze_s": 0.001}},
        {"ts": T + 0.3, "kind": "region_grant", "device": "nvidia:0", "command": "c1",
         "region": "timing"},
        {"ts": T + 0.4, "kind": "probe", "device": "nvidia:0", "command": "c1", "pid": 100,
         "detail": {"name": "NV_ESC_RM_CONTROL"}},
        {"ts": T + 0.5, "kind": "stray", "device": "nvidia:0", "command": "", "pid": 999,
         "region": "timing", "detail": {"name": "NV_ESC_RM_ALLOC"}},
        {"ts": T + 0.9, "kind": "region_release", "device": "nvidia:0", "command": "c1",
         "region": "timing", "detail": {"strays": 1}},
        {"ts": T + 0.95, "kind": "thaw", "device": "nvidia:0", "command": "c2"},
        {"ts": T + 1.0, "kind": "command_end", "device": "nvidia:0", "command": "c1",
         "detail": {"returncode": 0}},
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
    assert s["frozen"]["dur"] == 700_000.0 and s["frozen"]["args"]["region"] == "timing"
    # same device process; command slices on the command's track, region on the regions track
    assert s["command c1"]["pid"] == s["timing"]["pid"] == s["c1:timing"]["pid"]
    assert s["command c1"]["tid"] == s["timing"]["tid"] != s["c1:timing"]["tid"]
    assert s["frozen"]["tid"] == s["command c2"]["tid"]
    assert s["command c3"]["pid"] != s["command c1"]["pid"]
    inst = [e for e in tr["traceEvents"] if e["ph"] == "i"]
    assert [(e["name"], e["cat"], e["args"]["pid"]) for e in inst] == [
        ("NV_ESC_RM_CONTROL", "probe", 100), ("STRAY NV_ESC_RM_ALLOC", "stray", 999)]
    names = {e["args"]["name"] for e in tr["traceEvents"] if e["ph"] == "M"}
    assert {"device nvidia:0", "device cpu", "regions", "probes", "command c1"} <= names


def test_unfinished_and_unmatched(tmp_path: Path) -> None:
    tr = chrome_trace(recs())
    s = slices(tr)
    assert s["command c2"]["args"]["unfinished"] is True  # no command_end: closed at the last ts
    assert s["command c2"]["dur"] == 900_000.0
    odd = chrome_trace([{"ts": T, "kind": "region_release", "command": "x", "region": "r"},
                        {"ts": T, "kind": "bogus"}])
    assert [e for e in odd["traceEvents"] if e["ph"] != "M"] == []
    assert chrome_trace([]) == {"traceEvents": [], "displayTimeUnit": "ms"}
    out = tmp_path / "t.json"
    write_chrome_trace(str(out), recs())
    assert json.loads(out.read_text())["traceEvents"]


def test_trace_ring_bounds_its_bytes_and_keeps_the_newest() -> None:
    from krex_async import protocol as P
    from krex_async.timeline import TraceRing
    ring = TraceRing(P.TraceEvent, max_bytes=64 << 10)
    frozen = [f"c{i:05d}" for i in range(63)]  # a grant with 63 siblings frozen: ~0.5 KiB
    for i in range(2000):
        ring.append(P.TraceEvent(id=0, ts=T + i, kind="region_grant", command=f"k{i}",
                                 detail={"frozen": frozen}))
    assert ring.bytes <= 64 << 10 and ring.dropped > 0
    kept = list(ring)
    assert kept[-1].command == "k1999" and len(kept) == len(ring) == 2000 - ring.dropped
    assert [e.ts for e in kept] == sorted(e.ts for e in kept)
    assert kept[-1].detail == {"frozen": frozen}, "an event must come back as it went in"
    counted = TraceRing(P.TraceEvent, max_events=10)
    for i in range(25):
        counted.append(P.TraceEvent(id=0, ts=T + i, kind="thaw"))
    assert [e.ts - T for e in counted] == list(range(15, 25))
