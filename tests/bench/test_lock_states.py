"""bench/gpu/check_lock_states.py without a GPU: its offsets, classification and summary, and a dry
run end to end against tests/isolation/fakecuda.py's library (NOT_READY while the context is
created, TIMEOUT on a call in flight with a short timeout, a lock on an idle process at once)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu import check_lock_states as cls
from tests.bench.conftest import run_script
from tests.isolation.fakecuda import build


def test_plan_alternates_timeouts_and_spreads_offsets() -> None:
    got = [cls.plan(j, 6, [5, 1000]) for j in range(6)]
    assert [t for t, _ in got] == [5, 1000] * 3
    assert sorted(f for t, f in got if t == 5) == [1 / 6, 0.5, 5 / 6]
    assert all(0 < f < 1 for _, f in got)
    assert cls.plan(7, 6, [5, 1000]) == cls.plan(1, 6, [5, 1000])  # wraps past n


def test_where_names_the_op_in_flight() -> None:
    recs = [{"op": "sleep:30", "t_enter": 100, "t_exit": 200},
            {"op": "init", "t_enter": 200, "t_exit": 300},
            {"op": "alloc:8", "t_enter": 350, "t_exit": 400},
            {"op": "exit", "t_enter": 500, "t_exit": 0}]
    assert cls.where(recs, 50) == "before"
    assert cls.where(recs, 150) == "sleep"
    assert cls.where(recs, 250) == "init"
    assert cls.where(recs, 320) == "between"
    assert cls.where(recs, 360) == "alloc"
    assert cls.where(recs, 900) == "exit"  # an exit not yet reaped is still in flight


def attempt(scenario: str, target: str, where: str, rc: int, before_rc: int = 0,
            until: float | None = None) -> dict[str, object]:
    a: dict[str, object] = {"scenario": scenario, "target": target, "where": where, "timeout_ms": 5,
                            "rc": rc, "name": "locked" if rc == 0 else f"CUDA_ERROR_X ({rc})",
                            "lock_ms": 0.5, "state_before_rc": before_rc, "state_before": "running",
                            "state_after": "locked" if rc == 0 else "running"}
    if rc in cls.RETRY_RCS:
        a["retry"] = {"attempts": 3, "final_rc": 0 if until else rc,
                      "final_name": "locked" if until else "x", "until_locked_ms": until}
    return a


def test_summary_and_verdict_tell_context_from_no_context() -> None:
    xs = [attempt("warm", "alloc", "alloc", 600, 0, 12.0),
          attempt("warm", "alloc", "alloc", 0),
          attempt("lifecycle-exit", "startup", "ctx", 600, 1, 200.0),
          attempt("lifecycle-exit", "startup", "ctx", 600, 1, None),
          attempt("warm", "h2d", "h2d", 909, 0, 40.0)]
    rows = cls.summarize(xs)
    alloc = next(r for r in rows if r["target"] == "alloc")
    assert alloc["n"] == 2 and alloc["retried"] == 1 and alloc["retry_locked_ms"] == "12.00/12.00"
    v = cls.verdict(xs)
    assert v["not_ready"] == 3
    assert v["not_ready_with_context"] == "warm/alloc/alloc:1"
    assert v["not_ready_without_context"] == "lifecycle-exit/startup/ctx:2"
    assert v["timeouts"] == "warm/h2d/h2d:1"
    assert v["never_locked_after_not_ready"] == 1
    assert v["not_ready_until_locked_ms"]["max"] == 200.0
    assert "alloc" in cls.table(rows)


@pytest.mark.slow  # about 6 s: two dozen sibling processes
def test_dry_run_against_the_fake_driver(tmp_path: Path) -> None:
    (tmp_path / "fake").mkdir()
    fake = build(tmp_path / "fake")
    out = tmp_path / "out"
    p = run_script("-m", "bench.gpu.check_lock_states", "--dry-run", "--reps", "2",
                   "--lifecycle-reps", "2", "--kernel-ms", "60", "--deadline", "60",
                   env={**fake.env(FAKE_CUDA_CTX_MS="120"), "OUT": str(out)}, timeout=120)
    assert "VERDICT" in p.stdout
    data = json.loads((out / "check_lock_states.json").read_text())
    assert not data["errors"], data["errors"]
    by = {(a["target"], a["timeout_ms"]): a for a in data["attempts"]}
    # the fake answers NOT_READY while the context is being created, then locks after a retry
    startup = [a for a in data["attempts"] if a["target"] == "startup" and a["where"] == "ctx"]
    assert startup and all(a["rc"] == cls.NOT_READY for a in startup)
    assert all(a["retry"]["until_locked_ms"] is not None for a in startup)
    # a 5 ms lock on a process inside an 80 ms call times out; a 1 s one waits for its end
    assert by[("alloc", 5)]["rc"] == cls.TIMEOUT and by[("alloc", 1000)]["rc"] == 0
    assert by[("idle", 5)]["rc"] == 0 and by[("idle", 5)]["lock_ms"] < 50
    assert {"alloc", "free", "h2d", "module-load", "kernel+sync", "kernel+host-idle", "idle",
            "teardown-exit", "teardown-release"} <= {a["target"] for a in data["attempts"]}
    assert data["scenarios"]["torch"]["skipped"]
    assert (out / "check_lock_states.txt").read_text().count("VERDICT") == 1
