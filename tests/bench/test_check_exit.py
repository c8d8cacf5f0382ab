"""bench.gpu.check_exit's plumbing and analysis on a machine without a GPU: the exiter's marks come
in exit order from a real process (its exit hook, then a global's finaliser, then its end seen
through a pidfd), and the slow copies are placed against them."""

from __future__ import annotations

import sys
from pathlib import Path

from bench.gpu.check_exit import EXITER, exit_windows, run_exiter

from .conftest import with_stand_in_torch

# The exiter without torch: the same marks, nothing allocated.
CPU_EXITER = EXITER.replace("import atexit, os, sys, time, torch", "import atexit, os, sys, time").replace(
    'x = torch.ones(int(gib * 2**30) // 4, device="cuda")\nx.mul_(2); torch.cuda.synchronize()\n', ""
)


def test_an_exiters_marks_come_in_exit_order(tmp_path: Path) -> None:
    assert "torch" not in CPU_EXITER
    script = tmp_path / "exiter.py"
    script.write_text(CPU_EXITER)
    e = run_exiter(sys.executable, script, 0.5, tmp_path, 0)
    assert e["gib"] == 0.5
    assert e["atexit"] <= e["final"] <= e["end"], e
    assert e["end"] - e["atexit"] < 5, e
    # PF_EXITING, polled: seen after the finaliser (the kernel's exit follows user space) when the
    # exit lasted long enough to be caught in the kernel; never before `final`
    assert "kernel" not in e or e["final"] <= e["kernel"] <= e["end"], e


def test_slow_copies_are_placed_against_the_exits_marks() -> None:
    t0 = 1000.0
    rows = [(t0 + i * 0.001, 1.0) for i in range(3000)]  # 3 s of 1 ms copies
    for i in range(1650, 1660):  # 10 slow copies 150-160 ms after `final`
        rows[i] = (rows[i][0], 1.3)
    exits = [{"atexit": t0 + 1.0, "final": t0 + 1.5, "end": t0 + 1.7}]
    [w] = exit_windows(rows, exits, 1.05)
    assert w["median_ms"] == 1.0 and w["slow"] == 10
    assert abs(w["lost_ms"] - 3.0) < 1e-6
    assert abs(w["first_after_final_ms"] - 150) < 1 and abs(w["last_after_final_ms"] - 159) < 1
    assert w["first_after_end_ms"] < 0  # before the process ended: its own teardown
    assert abs(w["exit_ms"]["atexit_to_final"] - 500) < 1e-6


def test_slow_copies_are_counted_per_phase_against_the_quiet_copies_noise() -> None:
    """1% of the quiet copies are slow: a phase of 100 copies is expected to have one; the kernel
    phase has 20 slow of 100 (19 beyond the noise), the python phase only the noise."""
    t0 = 1000.0
    rows = [(t0 + i * 0.001, 1.3 if i % 100 == 0 else 1.0) for i in range(4000)]  # 1% noise everywhere
    for i in range(1520, 1540):  # 20 slow copies inside the kernel's exit
        rows[i] = (rows[i][0], 1.5)
    e = {"atexit": t0 + 1.3, "final": t0 + 1.4, "kernel": t0 + 1.5, "end": t0 + 1.6}
    [w] = exit_windows(rows, [e], 1.05)
    assert abs(w["quiet_slow_rate"] - 0.01) < 0.002
    ph = w["phases"]
    assert ph["kernel"]["copies"] == 100 and ph["kernel"]["slow"] >= 20 and ph["kernel"]["expected"] < 1.5
    assert ph["python"]["slow"] <= 1 and ph["teardown"]["slow"] <= 1
    assert ph["after"]["copies"] == 1000 and abs(ph["after"]["expected"] - 10) < 2
    assert w["copies"] == 1301  # atexit to a second past the end, both ends included


def test_a_window_without_copies_is_said_to_have_measured_nothing() -> None:
    rows = [(10.0 + i * 0.001, 1.0) for i in range(100)]  # the timer stopped at 10.1 s
    [w] = exit_windows(rows, [{"atexit": 20.0, "final": 20.1, "end": 20.2}], 1.05)
    assert w["copies"] == 0 and w["slow"] == 0 and "kernel" not in w["phases"]


def test_an_exit_that_disturbs_nothing_has_no_slow_copies() -> None:
    rows = [(10.0 + i * 0.001, 1.0 + (i % 3) * 0.01) for i in range(2000)]
    [w] = exit_windows(rows, [{"atexit": 10.5, "final": 10.6, "end": 10.7}], 1.05)
    assert w["slow"] == 0 and w["lost_ms"] == 0 and "first_after_final_ms" not in w


# A stand-in for the few torch calls the timer and the exiter make, so that the whole check runs
# here end to end (timer, exiters, marks, analysis, JSON): only the GPU is missing.
FAKE_TORCH = """
import time
class _T:
    def __init__(self, n): self.n = n
    def copy_(self, other): time.sleep(0.0005); return self
    def mul_(self, k): return self
def ones(n, device=None): return _T(n)
def empty_like(t): return _T(t.n)
class cuda:
    @staticmethod
    def synchronize(): pass
    class Event:
        def __init__(self, enable_timing=False): self.t = 0.0
        def record(self): self.t = time.perf_counter()
        def synchronize(self): pass
        def elapsed_time(self, end): return (end.t - self.t) * 1e3
"""


def test_the_whole_check_runs_with_a_stand_in_torch(tmp_path: Path) -> None:
    import json

    out = tmp_path / "out"
    args = ("--gib", "0.01,0.02", "--reps", "1", "--out", str(out))
    with_stand_in_torch(tmp_path, FAKE_TORCH, "bench.gpu.check_exit", *args)
    data = json.loads((out / "check_exit.json").read_text())
    assert [e["gib"] for e in data["exits"]] == [0.01, 0.02] and len(data["windows"]) == 2, data
    assert data["copies"] > 100, data["copies"]
    assert all(e["atexit"] <= e["final"] <= e["end"] for e in data["exits"]), data["exits"]


def test_bad_arguments_are_refused_naming_the_flag() -> None:
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    for args, says in (
        (["--gib", "abc"], "--gib: comma-separated numbers"),
        (["--gib", "0"], "--gib sizes and --timer-gib must be positive"),
        (["--reps", "0"], "--reps at least 1"),
        (["--factor", "1"], "--factor over 1"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "bench.gpu.check_exit", *args],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and says in r.stderr, (args, r.stderr)
