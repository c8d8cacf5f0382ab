"""gen_trace: byte-identical output per seed, the profile knobs honoured, every profile valid."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

import pytest

from bench import gen_trace
from bench.trace_format import BUCKETS, PHASES, read_trace, validate_line
from tests.bench.conftest import run_script

PROFILES = sorted(p.stem for p in (Path(gen_trace.__file__).parent / "profiles").glob("*.json"))


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    outs = []
    for i, seed in enumerate((7, 7, 8)):
        out = tmp_path / f"t{i}.jsonl"
        run_script(
            "-m",
            "bench.gen_trace",
            "--profile",
            "default",
            "--sessions",
            "12",
            "--seed",
            str(seed),
            "-o",
            str(out),
        )
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]
    lines = read_trace(tmp_path / "t0.jsonl")
    assert len({c["session"] for c in lines}) == 12


@pytest.mark.parametrize("name", PROFILES)
def test_every_profile_generates_valid_lines(name: str) -> None:
    prof = gen_trace.load_profile(name)
    lines = gen_trace.generate(prof, 5, seed=1)
    assert lines
    for line in lines:
        assert validate_line(line) == []
        assert set(line["phases"]) == set(PHASES)
        assert line["target"] == prof["target"]
    for cmds in (lambda by: by.values())(__import__("bench.trace_format").trace_format.sessions(lines)):
        assert [c["order"] for c in cmds] == list(range(len(cmds)))


def test_command_share_follows_the_profile() -> None:
    """The commands' share of session time, averaged over seeds, lands near the profile's knob, and
    moves when the knob moves."""
    for share in (0.193, 0.5):
        prof = dict(gen_trace.load_profile("default"), command_share=share)
        got = [gen_trace.summary(gen_trace.generate(prof, 40, seed=s))["command_share"] for s in range(20)]
        assert abs(statistics.mean(got) - share) < 0.015, (share, statistics.mean(got))


def test_timing_share_and_bucket_mix_follow_the_profile() -> None:
    prof = dict(
        gen_trace.load_profile("default"),
        timing_share=0.05,
        bucket_mix={">10ms": 0.6, "1-10ms": 0.2, "0.1-1ms": 0.2},
    )
    lines = gen_trace.generate(prof, 600, seed=3)
    ts = gen_trace.summary(lines)["timing_share"]
    assert 0.035 < ts < 0.07, ts  # reps are whole numbers clamped to [min_reps, max_reps]
    first = {}
    for c in lines:
        first.setdefault(c["session"], c["kernel"]["bucket"])
    frac = {b: n / len(first) for b, n in Counter(first.values()).items()}
    assert abs(frac[">10ms"] - 0.6) < 0.06, frac
    assert set(frac) <= set(BUCKETS)


def test_validation_names_each_problem() -> None:
    line = gen_trace.generate(gen_trace.load_profile("quick"), 1, seed=0)[0]
    bad = json.loads(json.dumps(line))
    bad["phases"]["timing"]["method"] = "stopwatch"
    del bad["phases"]["check"]
    bad["think_s"] = -1
    errs = validate_line(bad)
    assert any("timing.method" in e for e in errs)
    assert any("missing ['check']" in e for e in errs)
    assert any("think_s" in e for e in errs)
    assert validate_line([]) != []


def test_read_trace_rejects_a_bad_line(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"v": 1}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:1"):
        read_trace(p)


def test_replay_plan_runs_nothing_and_sizes_the_trace(tmp_path: Path) -> None:
    p = run_script(
        "-m",
        "bench.replay",
        "--profile",
        "gpu-10min",
        "--seed",
        "2",
        "--cores",
        "16",
        "--plan",
        "--out",
        str(tmp_path / "x.json"),
    )
    plan = json.loads(p.stdout)
    assert plan["commands"] == 40 and plan["concurrency"] == 40
    assert plan["ideal_trace"]["ratio"] > 4.0
    assert plan["estimated_total_s"] < 480  # the one-call budget the profile is sized for
    assert not (tmp_path / "x.json").exists()
