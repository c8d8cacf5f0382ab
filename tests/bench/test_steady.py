"""bench/steady.py and bench/steady_report.py: the 10-90% window, the between-round spread, failure
classes, the interleaved plan and its resumption, then a tiny stream on the cpu device through a
real `krex gateway` over real daemons, split over two calls."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from bench import jobs, jobs_sets, steady, steady_report
from tests.bench.conftest import run_script


def _ends(*ts: float, failed: tuple[float, ...] = ()) -> list[dict[str, Any]]:
    return [{"end_s": t, "ok": t not in failed} for t in ts]


def test_window_counts_succeeded_jobs_between_10_and_90_percent_of_completions() -> None:
    # 10 completions: from the 1st (10%) to the 9th (90%), 8 s; completions 2..9 counted, one failed
    w = steady_report.window_rate(_ends(*range(1, 11), failed=(5,)))
    assert (w["window_s"], w["counted"], w["ok_counted"]) == (8, 8, 7)
    assert w["jobs_per_min"] == pytest.approx(60 * 7 / 8)
    # the last wave's straggler moves nothing
    late = steady_report.window_rate(_ends(*range(1, 10), 1000, failed=(5,)))
    assert late["jobs_per_min"] == pytest.approx(w["jobs_per_min"])
    # 48 jobs: from the 5th completion to the 44th
    w48 = steady_report.window_rate(_ends(*range(48)))
    assert (w48["start_s"], w48["end_s"], w48["counted"]) == (4, 43, 39)
    assert w48["jobs_per_min"] == pytest.approx(60.0)
    # order of the records does not matter, a job without an end is not a completion
    assert steady_report.window_rate(list(reversed(_ends(*range(48)))) + [{"ok": False}])["n"] == 48
    assert steady_report.window_rate(_ends(3.0))["jobs_per_min"] is None
    assert steady_report.window_rate(_ends(3.0, 3.0))["jobs_per_min"] is None  # no length


def test_failed_jobs_are_classified_from_their_result_text() -> None:
    oom = {
        "ok": False,
        "status": "failed",
        "stderr_tail": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "error": {"reason": "command_failed", "message": "command exited with status 1"},
    }
    timeout = {"ok": False, "error": {"reason": "command_timeout", "message": "the job exceeded 300 seconds"}}
    big = {"ok": False, "error": {"reason": "output_too_large", "message": "output exceeded the limit"}}
    coloc = {
        "ok": False,
        "error": {"reason": "co_located_oom", "message": "out of memory beside co-location"},
    }
    refused = {"ok": False, "error": "ClientResponseError: HTTP 400 bad_request: nope"}
    gave_up = {"ok": False, "status": "running", "error": None}
    waited = {"ok": False, "error": "TimeoutError: "}
    got = [
        steady_report.classify(r) for r in (oom, timeout, big, coloc, refused, gave_up, waited, {"ok": True})
    ]
    assert got == ["oom", "timeout", "other", "oom", "other", "timeout", "timeout", "ok"]


def test_spread_and_whether_a_difference_exceeds_it() -> None:
    sp = steady_report.spread([30.0, 33.0])
    assert (sp["mean"], sp["min"], sp["max"]) == (31.5, 30.0, 33.0)
    assert sp["rel"] == pytest.approx(3 / 31.5)
    assert steady_report.spread([30.0])["rel"] is None
    apart = steady_report.compare([36.0, 38.0], [30.0, 33.0])
    assert apart["ratio"] == pytest.approx(37 / 31.5) and apart["beyond_spread"] is True
    assert steady_report.compare([30.0, 33.0], [36.0, 38.0])["beyond_spread"] is True  # slower, as clearly
    assert steady_report.compare([30.0, 36.0], [33.0, 38.0])["beyond_spread"] is False
    assert steady_report.compare([36.0], [30.0, 33.0])["beyond_spread"] is None
    assert steady_report.compare([], [30.0])["ratio"] is None


def test_variants_take_a_width_and_gateway_arguments() -> None:
    v = jobs.parse_variant("region-admit@12:--admit-memory on -- --max-running auto")
    assert (v.name, v.policy, v.width) == ("region-admit", "region", 12)
    assert (v.args, v.gateway_args) == (["--admit-memory", "on"], ["--max-running", "auto"])
    assert jobs.parse_variant("shared-4@4").width == 4 and jobs.parse_variant("shared").width is None
    for bad in ("shared@0", "shared@x:--a", "@4"):
        with pytest.raises(ValueError):
            jobs.parse_variant(bad)


def test_plan_interleaves_rounds_between_the_alone_rounds() -> None:
    vs = [jobs.parse_variant("shared-a"), jobs.parse_variant("region-b")]
    got = [u.name for u in steady.plan(vs, 2, 2)]
    assert got == ["alone-1", "shared-a/r1", "region-b/r1", "shared-a/r2", "region-b/r2", "alone-2"]
    assert [u.name for u in steady.plan(vs, 2, 3)][3] == "alone-2"
    js = [jobs_sets.Job({"key": k}) for k in "abcde"]
    r1, r1b, r2 = steady.stream(js, 12, 0, 1), steady.stream(js, 12, 0, 1), steady.stream(js, 12, 0, 2)
    assert [j.key for j in r1] == [j.key for j in r1b]  # every variant of a round gets the same stream
    assert [j.key for j in r1] != [j.key for j in r2] and len(r1) == 12
    assert [j.key for j in r1[:5]] == [j.key for j in r1[5:10]]  # it cycles through the set


def test_a_unit_is_planned_from_the_rounds_measured_so_far() -> None:
    a = argparse.Namespace(concurrency=8, jobs_per_round=4, seed=0)
    js = [jobs_sets.Job({"key": "k"})]
    data: dict[str, Any] = {"alone": [], "rounds": []}
    shared4, region = jobs.parse_variant("shared-4@4"), jobs.parse_variant("region")
    assert steady.estimate_s(steady.Unit("alone-1"), data, js, a) == steady.ALONE_GUESS_S
    data["alone"].append({"wall_s": 100.0, "jobs": []})
    assert steady.estimate_s(steady.Unit("alone-2"), data, js, a) == pytest.approx(110.0)
    # nothing measured but the default job seconds: 4 jobs of 10 s over 8 agents, x1.5, a stack
    assert steady.estimate_s(steady.Unit("r", region, 1), data, js, a) == 4 * 10.0 / 8 * 1.5 + jobs.STACK_S
    data["rounds"].append({"variant": "region", "width": 8, "makespan_s": 60.0, "wall_s": 70.0})
    assert steady.estimate_s(steady.Unit("r", region, 2), data, js, a) == 70.0
    # another variant at half the width: scaled up by the widths, never down
    assert steady.estimate_s(steady.Unit("s", shared4, 1), data, js, a) == 140.0
    wide = jobs.parse_variant("shared-12@12")
    assert steady.estimate_s(steady.Unit("w", wide, 1), data, js, a) == 70.0


def _job(key: str, t: float, ok: bool = True, p95: float = 2.0, regions: Any = ()) -> dict[str, Any]:
    line = {
        "key": key,
        "phases_s": {"import": 1.0},
        "timing": {"median_ms": p95, "p95_ms": p95},
        "check": {"ok": True},
    }
    return {"keys": [key], "ok": ok, "end_s": t, "lines": [line] if ok else [], "regions": list(regions)}


def _round(variant: str, policy: str, r: int, rate: float, width: int = 8, **kw: Any) -> dict[str, Any]:
    """A round of 10 jobs ending 60/rate s apart (so rate succeeded jobs/min in the window)."""
    recs = [_job("k", (i + 1) * 60.0 / rate, **kw) for i in range(10)]
    return {
        "unit": f"{variant}/r{r}",
        "variant": variant,
        "round": r,
        "policy": policy,
        "width": width,
        "args": [],
        "jobs": recs,
    }


def test_summary_judges_issue_38s_goals_against_the_spread() -> None:
    regs = [{"enter_s": 0.25, "wait_s": 0.2}, {"enter_s": 0.5, "wait_s": 0.0}]
    pool = _round("region-pool", "region", 1, 44.0, regions=regs)
    pool["args"] = ["--pool-size", "8"]
    pool2 = {**_round("region-pool", "region", 2, 46.0), "args": ["--pool-size", "8"]}
    ext = "extension modules cannot be unloaded"
    pool2["pools"] = {
        "nvidia0": {
            "launched": 10,
            "retired": 3,
            "retired_why": {ext: 2, "surplus": 1},
            "retired_last": {ext: f"{ext}: lazyext._json", "surplus": "surplus"},
        }
    }
    oom = {**_job("k", 99.0, ok=False), "stderr_tail": "CUDA out of memory"}
    region1 = _round("region", "region", 1, 30.0, p95=2.04)
    region1["jobs"].append(oom)
    data = {
        "alone": [
            {"round": "alone-1", "jobs": [_job("k", 1.0, p95=2.0)]},
            {"round": "alone-2", "jobs": [_job("k", 1.0, p95=2.0)]},
        ],
        "rounds": [
            _round("shared-8", "shared", 1, 30.0),
            _round("shared-4", "shared", 1, 33.0, width=4),
            region1,
            pool,
            _round("shared-8", "shared", 2, 32.0),
            _round("shared-4", "shared", 2, 35.0, width=4),
            _round("region", "region", 2, 31.0),
            pool2,
        ],
        "pending": ["alone-3"],
    }
    s = steady_report.summarise(data)
    v = s["variants"]
    assert [r["jobs_per_min"] for r in v["shared-8"]["rounds"]] == pytest.approx([30.0, 32.0])
    assert v["region"]["failed"] == {"oom": 1, "timeout": 0, "other": 0} and v["region"]["ok"] == 20
    assert v["region-pool"]["entry"]["p50_s"] == pytest.approx(0.275)
    assert v["shared-8"]["resolves_10pct"] is True  # 2 / 31 < 10%
    g = s["goals"]
    assert "region: jobs lost to out of memory / co-location 1 of 21, goal 0: MISSED" in g
    assert (
        "region: jobs/min vs shared-8 (same width) 0.98x, goal >= 1.00x: MISSED by 0.02x (within the spread; "
        "paired by round 1.00x 0.97x, the rounds disagree)"
    ) in g
    assert (
        "region-pool: jobs/min vs shared-8 (same width) 1.45x, goal >= 1.30x: met (beyond the spread; "
        "paired by round 1.47x 1.44x, every round the same way)"
    ) in g
    assert (
        "region-pool: jobs/min vs shared-4 (best shared) 1.32x, goal >= 1.20x: met (beyond the spread; "
        "paired by round 1.33x 1.31x, every round the same way)"
    ) in g
    assert (
        "region: p95 inflation 1-10ms +2.00% (n=20), goal <= 1.0%: MISSED by 1.00%; beyond the alone "
        "rounds' own spread (+0.00% at p95)"
    ) in g
    one = steady_report.summarise({**data, "alone": data["alone"][:1]})["goals"]
    assert (
        "region: p95 inflation 1-10ms +2.00% (n=20), goal <= 1.0%: MISSED by 1.00%; one alone round: no "
        "spread to judge it against"
    ) in one
    assert (
        "region-pool: region entry less the wait for the region before it p95 500.0 ms (n=20), "
        "goal <= 100 ms: MISSED by 400.0 ms"
    ) in g
    text = steady_report.table(s)
    assert "region vs shared-8 (same width): 0.98x, within the spread" in text
    assert "still owed (1 units, run again with --resume): alone-3" in text
    assert "failed in region (oom)" in text
    assert f"retired 3 ({ext} 2, surplus 1)" in text
    assert f"    last {ext!r}: {ext}: lazyext._json" in text and "last 'surplus'" not in text


def test_bad_command_lines_answered_clearly(tmp_path: Path) -> None:
    for args, msg in (
        (["--rounds", "0"], "must be positive"),
        (["--deadline-s", "-1"], "not negative"),
        (["--variants", "shared@0"], "positive number"),
        (["--variants", "shared", "shared"], "must differ"),
    ):
        p = run_script(
            "-m", "bench.steady", "--device", "cpu", "--out", str(tmp_path / "o.json"), *args, check=False
        )
        assert p.returncode == 2 and msg in p.stderr, (args, p.stderr)


@pytest.mark.slow
def test_a_tiny_stream_through_the_gateway_split_over_two_calls(tmp_path: Path, stack_dir: Path) -> None:
    out = tmp_path / "steady.json"
    common = [
        "-m", "bench.steady", "--device", "cpu", "--set", "tiny", "--cpu-jobs", "2", "--jobs-per-round", "4",
        "--rounds", "2", "--alone-rounds", "1", "--concurrency", "2", "--out", str(out),
        "--stack-dir", str(stack_dir),
        "--variants", "shared", "region", "region-gw@2:-- --max-running none",
    ]  # fmt: skip
    first = run_script(*common, "--units", "2", timeout=300)
    data = json.loads(out.read_text())
    assert [r["unit"] for r in data["alone"]] == ["alone-1"]
    assert [r["unit"] for r in data["rounds"]] == ["shared/r1"]
    assert data["pending"] == ["region/r1", "region-gw/r1", "shared/r2", "region/r2", "region-gw/r2"]
    assert "still owed (5 units" in first.stdout
    # another plan cannot continue this file
    p = run_script(*common, "--resume", "--concurrency", "3", check=False, timeout=60)
    assert p.returncode == 2 and "planned with other concurrency" in p.stderr, p.stderr
    second = run_script(*common, "--resume", timeout=400)
    data = json.loads(out.read_text())
    assert not list(stack_dir.iterdir()), "a stack left its state behind"
    assert [r["unit"] for r in data["rounds"]] == [
        "shared/r1", "region/r1", "region-gw/r1", "shared/r2", "region/r2", "region-gw/r2"
    ]  # fmt: skip
    assert len(data["calls"]) == 2 and data["pending"] == []
    for r in data["rounds"]:
        if r["variant"] == "region-gw":  # its gateway got its own arguments (and refused them)
            assert "--max-running" in r["error"] and not r["jobs"]
            continue
        assert len(r["jobs"]) == 4 and all(j["ok"] for j in r["jobs"]), r["jobs"]
        assert sorted(j["index"] for j in r["jobs"]) == [0, 1, 2, 3] and {j["agent"] for j in r["jobs"]} <= {
            0,
            1,
        }
    region = [g for r in data["rounds"] if r["variant"] == "region" for j in r["jobs"] for g in j["regions"]]
    assert region and all("enter_s" in g for g in region)
    for r in data["rounds"]:  # a job's times line up with the daemon's clock through stream_at
        for j in r["jobs"]:
            for g in j["regions"]:
                span = (r["stream_at"] + j["submit_s"] - 0.01, r["stream_at"] + j["end_s"] + 0.01)
                assert span[0] <= g["requested_at"] <= span[1], (span, g["requested_at"], r["started_at"])
    s = data["summary"]["variants"]
    assert len(s["region"]["rounds"]) == 2 and s["region"]["jobs_per_min"]["n"] == 2
    assert s["region"]["entry"]["n"] == len(region)
    assert "comparisons" in second.stdout and "region vs shared (same width)" in second.stdout
    assert "region-gw did not run" in second.stdout
    assert all("memory_total" in r for r in data["rounds"] if not r.get("error"))
    assert "where each round's agent time went" in second.stdout


def test_the_device_script_runs_what_is_owed_within_its_call(tmp_path: Path) -> None:
    """bench/gpu/steady_state.sh with BATCH_DRY=1: the steps it would run, with their limits."""
    import os
    import subprocess

    script = steady.ROOT / "bench" / "gpu" / "steady_state.sh"
    bad = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "usage" in bad.stdout

    def call(**env: str) -> str:
        e = {
            **os.environ,
            "OUT": str(tmp_path / "out"),
            "STATE": str(tmp_path / "state"),
            "BATCH_DRY": "1",
            **env,
        }
        p = subprocess.run(["bash", str(script), "1"], capture_output=True, text=True, timeout=60, env=e)
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout

    out = call(ADMIT="--x on -- --max-running auto", FIDELITY_FIRST="1")
    fid = out.index("== fidelity (limit")
    st = out.index("== steady (limit")
    assert fid < st  # FIDELITY_FIRST
    steps = out[st:]
    assert "python3 -m bench.steady --kernelbench .suites/KernelBench --device gpu" in steps
    assert "region-pool@8:" not in steps  # the single-use pool is no longer a default
    reuse = "--pool-size 8 --pool-preload torch --pool-max-uses 1000"
    assert f"region-pool-reuse-want@10:{reuse} --pool-size 10 --mem-guard want" in steps
    assert "region-pool-reuse@8:--pool-size 8 --pool-preload torch --pool-max-uses 1000" in steps
    assert "shared-8@8:--admission off" in steps  # unprotected sharing by default
    assert "--admit=--x on -- --max-running auto --resume --deadline-s" in steps
    # once the steady run owes nothing, the fidelity check follows it; then nothing is left
    (tmp_path / "state").mkdir(exist_ok=True)
    (tmp_path / "state" / "steady.json").write_text(json.dumps({"pending": []}))
    out = call()
    assert "== steady (limit" not in out and "== fidelity (limit" in out
    (tmp_path / "state" / "fidelity" / "check_fidelity.json").write_text("{}")
    out = call()
    assert "== steady (limit" not in out and "== fidelity (limit" not in out


def test_the_report_again_from_a_file_as_a_table_or_json(tmp_path: Path) -> None:
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"alone": [], "rounds": [_round("shared", "shared", 1, 30.0)], "pending": []}))
    p = run_script("-m", "bench.steady_report", str(f), "--json")
    assert json.loads(p.stdout)["variants"]["shared"]["rounds"][0]["jobs_per_min"] == pytest.approx(30.0)
    assert "steady state: succeeded jobs/min" in run_script("-m", "bench.steady_report", str(f)).stdout
    for args in ([], [str(tmp_path / "none.json")]):
        p = run_script("-m", "bench.steady_report", *args, check=False)
        assert p.returncode == 2 and ("usage" in p.stderr or "No such file" in p.stderr), p.stderr


def test_paired_by_round_cancels_the_rounds_job_mix() -> None:
    """Each round runs the same jobs under every variant: a's rate over b's round by round is steady
    where the rounds' own rates move by 30%, and the report says that a 10% change then stands out."""
    p = steady_report.paired({1: 30.8, 2: 41.7}, {1: 22.9, 2: 31.6})
    assert p["ratios"] == pytest.approx([30.8 / 22.9, 41.7 / 31.6])
    assert p["same_way"] is True and p["resolves_10pct"] is True and p["rel"] < 0.03
    mixed = steady_report.paired({1: 30.0, 2: 40.0, 3: 35.0}, {1: 33.0, 2: 36.0})  # round 3 has no pair
    assert len(mixed["ratios"]) == 2 and mixed["same_way"] is False and mixed["resolves_10pct"] is False
    assert steady_report.paired({1: 30.0}, {1: 20.0})["same_way"] is None
    assert steady_report.paired({1: 30.0}, {2: 20.0})["mean"] is None
    data = {
        "alone": [],
        "rounds": [
            _round("region", "region", 1, 30.8),
            _round("region-nogate", "region", 1, 22.9),
            _round("region", "region", 2, 41.7),
            _round("region-nogate", "region", 2, 31.6),
        ],
    }
    s = steady_report.summarise(data)
    (c,) = [c for c in s["comparisons"] if c["what"] == "same policy"]
    assert (c["a"], c["b"], c["beyond_spread"]) == ("region", "region-nogate", False)
    assert c["paired"]["same_way"] is True
    text = steady_report.table(s)
    assert (
        "region vs region-nogate (same policy): 1.33x, within the spread; paired by round 1.34x 1.32x" in text
    )
    assert "a 10% change is beyond it" in text


def test_a_rounds_agent_time_is_split_and_its_memory_occupancy_taken() -> None:
    from bench import steady_time

    GiB = 1 << 30
    job = {
        "submit_s": 0.0,
        "end_s": 10.0,
        "krex": {"queued_s": 3.0, "gate_s": 1.0, "mem_peak": 8 * GiB},
        "lines": [{"phases_s": {"import": 1.0, "inputs": 2.0, "check": 0.5, "timing": 1.5}}],
        "regions": [{"wait_s": 0.2, "enter_s": 0.1}],
    }
    rnd = {"unit": "v/r1", "makespan_s": 10.0, "memory_total": {"nvidia0": 80 * GiB}, "jobs": [job, job]}
    t = steady_time.round_time(rnd)
    assert (t["latency"], t["queued"], t["gate"], t["phases"]) == (20.0, 6.0, 2.0, 10.0)
    # the gate's wait is in the import phase: the rest is what neither queue nor phases hold
    assert t["other"] == pytest.approx(4.0) and t["region"] == pytest.approx(0.6)
    # two jobs of 8 GiB, each from its inputs on (4 s), on 80 GiB for 10 s
    assert t["memory"] == pytest.approx(2 * 8 * 4 / (80 * 10))
    (row,) = steady_time.rows([rnd, {"unit": "v/r2", "error": "refused"}])
    assert row[0] == "v/r1" and row[2:5] == ["6 (30%)", "10 (50%)", "4 (20%)"] and row[-1] == "8%"
    # a round recorded before jobs carried their peak: no occupancy, not 0%
    old = {**rnd, "jobs": [{**job, "krex": {"queued_s": 3.0}}]}
    assert steady_time.round_time(old)["memory"] is None and steady_time.rows([old])[0][-1] == "-"
