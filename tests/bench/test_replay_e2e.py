"""A tiny replay end to end: real daemons (one per policy), real agent commands on the cpu device."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.bench.conftest import ROOT, run_script

pytestmark = pytest.mark.slow


def _daemon_available() -> str | None:
    try:
        from krex_async import Client  # noqa: F401
    except ImportError as e:
        return f"krex_async.Client not importable yet: {e}"
    if not (ROOT / "krex_async" / "__main__.py").exists():
        return "no `python -m krex_async serve` in this checkout yet"
    return None


def test_two_sessions_all_policies(tmp_path: Path) -> None:
    why = _daemon_available()
    if why:
        pytest.skip(why)
    if sys.platform != "linux":
        pytest.skip("krex runs on Linux")
    prof = tmp_path / "tiny.json"
    prof.write_text(
        json.dumps(
            {
                "name": "tiny",
                "base": "quick",
                "sessions": 2,
                "concurrency": 2,
                "commands_per_session": {"mean": 2, "min": 2, "max": 2},
                "timing": {"min_reps": 5, "max_reps": 40, "warmup_ms": 2},
                "phases": {
                    n: {"expect_s": 0.05, "cpu_s": 0.02} for n in ("import", "compile", "inputs", "check")
                },
            }
        )
    )
    out = tmp_path / "res" / "tiny.json"
    p = run_script(
        "-m",
        "bench.replay",
        "--profile",
        str(prof),
        "--seed",
        "5",
        "--think-scale",
        "0.05",
        "--repeats",
        "1",
        "--out",
        str(out),
        timeout=120,
        env={"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    assert "throughput region/command" in p.stdout
    assert "[region" in p.stderr  # the progress line
    data = json.loads(out.read_text())
    assert set(data["passes"]) == {"region", "command", "shared"}
    for name, ps in data["passes"].items():
        assert len(ps["commands"]) == 4, name
        bad = [r for r in ps["commands"] if not r["ok"]]
        assert not bad, (name, bad[:1])
        for r in ps["commands"]:
            assert r["report"]["policy"] == name
            assert r["result"]["timing"]["n"] >= 5
    regs = [g for r in data["passes"]["region"]["commands"] for g in r["report"]["regions"]]
    assert len(regs) == 4 and all(g["outcome"] == "released" for g in regs)
    s = data["summary"]
    assert s["policies"]["region"]["regions"]["enter_p50_s"] is not None
    assert set(s["ratios"]) == {"region/command", "shared/command"}
    assert s["ideal_trace"]["ratio"] >= 1.0 and s["ideal_measured"]["ratio"] > 0
    # --repeats 1 before the policies and 1 after them (--isolated-after, the default)
    assert s["baselines"] and all(b["repeats"] == 2 for b in s["baselines"].values())
    assert data["isolated_after"]["repeats"] == 1 and s["isolated_floor"]
    assert any(s["policies"][p]["inflation"]["by_bucket"] for p in s["policies"])


def test_plot_from_a_results_file(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="pip install -e '.[bench]'")
    from bench import analysis, plot

    iso = [{"key": "k|do_bench", "timing": {"median_ms": 2.0, "p95_ms": 2.2}}]
    cmd = {
        "ok": True,
        "session": "s0",
        "order": 0,
        "client_s": 5.0,
        "result": {"key": "k|do_bench", "method": "do_bench", "timing": {"median_ms": 2.1, "p95_ms": 2.3}},
        "report": {},
    }
    data = {
        "config": {"commands": 1, "concurrency": 1, "cores": 2, "think_scale": 1.0},
        "isolated": {"results": iso},
        "passes": {p: {"makespan_s": 10.0, "commands": [cmd]} for p in ("region", "command", "shared")},
    }
    data["summary"] = analysis.summarise(data, [])
    paths = plot.plot(data, tmp_path, "x")
    assert [p.name for p in paths] == ["x-throughput.png", "x-inflation-cdf.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
