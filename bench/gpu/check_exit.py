"""When does a torch process's exit disturb another process's timing, and how long is that part?

    python3 -m bench.gpu.check_exit [--gib 1,6.4,20] [--reps 2] [--timer-gib 1] [--out DIR]

Session 12 on the H200: a region waits (up to --lock-wait) for every exiting process on its device
to end, because the driver frees an exiting process's GPU memory beside the timing (a memory-bound
kernel's trials 11% slow). Those waits were 0.4-0.5 s each and, once the pool had removed the
imports, 15 s of a 58 s run. If the disturbing part is only the end of the exit (the driver's free
as the files close), and most of the 0.4-0.5 s is Python's finalisation before it, the region could
wait for less. This check measures it, without krex:

- a timer process copies a --timer-gib buffer on the GPU back to back (a memory-bound kernel),
  recording each copy's CUDA-event time and the host time it ended;
- meanwhile exiter processes, one at a time, allocate --gib GiB, touch it, then exit by
  sys.exit; each records the start of its exit hooks (`atexit`) and a module global's finaliser
  during Python's finalisation (`final`); the parent records when it entered the kernel's exit
  (`kernel`: PF_EXITING first seen, polled every 0.5 ms, after the C-level teardown of the CUDA
  libraries) and its end (pidfd: every file closed, `end`).

For each exit it prints, per phase (python: atexit to final; teardown: final to kernel; kernel:
kernel to end; after: the second after the end), the timer's copies, those slower than the median
by more than --factor, and how many of those the copies outside every exit would have had (the
noise to subtract), with the time lost; then when the first and last slow copies ended relative to
the marks. A window without any copy (the timer stopped) fails the check. Writes
$OUT/check_exit.json (OUT defaults to /tmp/krex-check-exit). Needs one NVIDIA GPU with torch; no
daemon, no root. Exit status 0 when every exit was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness.output import module_prog, write_json
from krex_async.linux.procfs import exiting_in_kernel

TIMER = r"""
import json, os, sys, time, torch
n = int(float(sys.argv[1]) * 2**30) // 4
a = torch.ones(n, device="cuda"); b = torch.empty_like(a)
for _ in range(20):
    b.copy_(a)
torch.cuda.synchronize()
print("running", flush=True)
rows, stop = [], time.time() + float(sys.argv[3])
while time.time() < stop and not os.path.exists(sys.argv[4]):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); b.copy_(a); e.record(); e.synchronize()
    rows.append((time.time(), s.elapsed_time(e)))
json.dump(rows, open(sys.argv[2], "w"))
"""

EXITER = r"""
import atexit, os, sys, time, torch
gib, marks, go = float(sys.argv[1]), sys.argv[2], sys.argv[3]
x = torch.ones(int(gib * 2**30) // 4, device="cuda")
x.mul_(2); torch.cuda.synchronize()
fd = os.open(marks, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
def note(name, t=time.time, w=os.write, fd=fd):
    w(fd, f"{name} {t():.6f}\n".encode())
class _Final:  # a module global: finalised while Python tears its modules down
    def __del__(self, note=note):
        note("final")
_final = _Final()
atexit.register(lambda: note("atexit"))  # registered last: the first exit hook to run
note("ready")
while not os.path.exists(go):
    time.sleep(0.005)
sys.exit(0)
"""


PHASES = (  # (name, from mark, to mark, or seconds past the first mark)
    ("python", "atexit", "final", None),  # exit hooks, then Python's finalisation
    ("teardown", "final", "kernel", None),  # C-level teardown: the CUDA libraries' destructors
    ("kernel", "kernel", "end", None),  # the kernel's exit: files close, the driver frees memory
    ("after", "end", None, 1.0),
)


def exit_windows(
    rows: list[tuple[float, float]], exits: list[dict[str, float]], factor: float, after_s: float = 1.0
) -> list[dict[str, Any]]:
    """For each exit (its `atexit`, `final`, `kernel` and `end` host times; `kernel`, when PF_EXITING
    was first seen, may be missing), the timer's copies that ended from its `atexit` to `after_s` past
    its `end` and took more than `factor` x the median of the copies outside every exit: how many,
    when the first and last ended relative to each mark (ms), the time they lost in all (ms), and
    per phase of the exit (PHASES) the copies, the slow ones, and how many slow ones the copies
    outside every exit would have had in as many copies (`expected`: the noise, to subtract).
    `copies` 0 in a window means the timer was not running then: nothing was measured."""
    inside = [False] * len(rows)
    for e in exits:
        for i, (t, _) in enumerate(rows):
            if e["atexit"] - 0.2 <= t <= e["end"] + after_s:
                inside[i] = True
    quiet = [ms for (_, ms), x in zip(rows, inside) if not x]
    median = statistics.median(quiet or [ms for _, ms in rows])
    quiet_rate = sum(ms > factor * median for ms in quiet) / len(quiet) if quiet else 0.0
    out = []
    for e in exits:
        span = [(t, ms) for t, ms in rows if e["atexit"] <= t <= e["end"] + after_s]
        slow = [(t, ms) for t, ms in span if ms > factor * median]
        w: dict[str, Any] = {
            "median_ms": median,
            "copies": len(span),
            "slow": len(slow),
            "lost_ms": sum(ms - median for _, ms in slow),
            "quiet_slow_rate": quiet_rate,
        }
        w["exit_ms"] = {
            "atexit_to_final": (e["final"] - e["atexit"]) * 1e3 if "final" in e else None,
            "final_to_end": (e["end"] - e["final"]) * 1e3 if "final" in e else None,
            "atexit_to_end": (e["end"] - e["atexit"]) * 1e3,
        }
        phases = {}
        for name, a, b, secs in PHASES:
            if a not in e or (b is not None and b not in e):
                continue
            lo, hi = e[a], e[b] if b is not None else e[a] + (secs or 0.0)
            got = [ms for t, ms in rows if lo <= t < hi]
            n_slow = sum(ms > factor * median for ms in got)
            phases[name] = {
                "ms": (hi - lo) * 1e3,
                "copies": len(got),
                "slow": n_slow,
                "expected": quiet_rate * len(got),
                "lost_ms": sum(ms - median for ms in got if ms > factor * median),
            }
        w["phases"] = phases
        if slow:
            for mark in ("atexit", "final", "kernel", "end"):
                if mark in e:
                    w[f"first_after_{mark}_ms"] = (slow[0][0] - e[mark]) * 1e3
                    w[f"last_after_{mark}_ms"] = (slow[-1][0] - e[mark]) * 1e3
            w["worst_ms"] = max(ms for _, ms in slow)
        out.append(w)
    return out


def run_exiter(py: str, script: Path, gib: float, tmp: Path, n: int) -> dict[str, float]:
    marks, go = tmp / f"marks-{n}", tmp / f"go-{n}"
    p = subprocess.Popen([py, str(script), str(gib), str(marks), str(go)])
    pidfd = os.pidfd_open(p.pid)
    try:
        deadline = time.time() + 120
        while "ready" not in (marks.read_text() if marks.exists() else ""):
            if p.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"exiter {n} ({gib} GiB) did not start: rc {p.returncode}")
            time.sleep(0.01)
        time.sleep(0.5)  # the timer runs alone for a while before the exit
        go.write_text("")
        # Every half millisecond until it ended: when it entered the kernel's exit (PF_EXITING,
        # after every user-space teardown), then when it ended (its pidfd: every file closed).
        kernel, limit = None, time.time() + 60
        while True:
            ended = bool(select.select([pidfd], [], [], 0.0005)[0])
            now = time.time()
            if kernel is None and exiting_in_kernel(p.pid):
                kernel = now
            if ended or now > limit:
                end = now
                break
    finally:
        os.close(pidfd)
    p.wait(10)
    got = {k: float(v) for k, v in (ln.split() for ln in marks.read_text().split("\n") if ln)}
    return {
        "gib": gib,
        "atexit": got["atexit"],
        "end": end,
        **({"final": got["final"]} if "final" in got else {}),
        **({"kernel": kernel} if kernel is not None and kernel < end else {}),
    }


def main() -> int:
    ap = argparse.ArgumentParser(prog=module_prog(__spec__), description=__doc__.split("\n")[0])
    ap.add_argument("--gib", default="1,6.4,20", help="GiB each exiter holds (comma-separated)")
    ap.add_argument("--reps", type=int, default=2, help="exits per size")
    ap.add_argument("--timer-gib", type=float, default=1.0, help="the timer's buffer (GiB)")
    ap.add_argument("--factor", type=float, default=1.05, help="a copy this much over the median is slow")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/krex-check-exit"))
    a = ap.parse_args()
    try:
        sizes = [float(x) for x in a.gib.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--gib: comma-separated numbers, not {a.gib!r}")
    if not sizes or min(sizes) <= 0 or a.reps < 1 or a.timer_gib <= 0 or a.factor <= 1:
        ap.error("--gib sizes and --timer-gib must be positive, --reps at least 1, --factor over 1")
    tmp = Path(tempfile.mkdtemp(prefix="krex-check-exit-"))
    timer_py, exiter_py = tmp / "timer.py", tmp / "exiter.py"
    timer_py.write_text(TIMER)
    exiter_py.write_text(EXITER)
    rows_file = tmp / "rows.json"
    plan = [g for g in sizes for _ in range(a.reps)]
    budget = 20 + 12 * len(plan)  # seconds of timing: each exiter imports torch (~5 s) and exits
    timer = subprocess.Popen(
        [a.python, str(timer_py), str(a.timer_gib), str(rows_file), str(budget), str(tmp / "stop")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert timer.stdout is not None
    if timer.stdout.readline().strip() != "running":
        print("FAIL: the timer did not start (torch with a GPU?)")
        return 1
    exits = []
    for n, gib in enumerate(plan):
        exits.append(run_exiter(a.python, exiter_py, gib, tmp, n))
        print(
            f"exit {n}: {gib} GiB, atexit to end {(exits[-1]['end'] - exits[-1]['atexit']) * 1e3:.0f} ms",
            flush=True,
        )
        time.sleep(1.0)
    time.sleep(1.0)
    (tmp / "stop").write_text("")
    timer.wait(budget + 60)
    rows = [tuple(r) for r in json.loads(rows_file.read_text())]
    windows = exit_windows(rows, exits, a.factor)  # type: ignore[arg-type]
    f = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    print(
        f"\nper exit phase: ms long, copies, slow copies (the quiet copies' rate would give), lost ms;"
        f" quiet copies slow: {windows[0]['quiet_slow_rate']:.2%}"
        if windows
        else ""
    )
    print(f"{'GiB':>5} " + " ".join(f"{name:>30}" for name, *_ in PHASES))
    for e, w in zip(exits, windows):
        cells = []
        for name, *_ in PHASES:
            ph = w["phases"].get(name)
            cells.append(
                "-".rjust(30)
                if ph is None
                else f"{ph['ms']:>6.0f} {ph['copies']:>5} {ph['slow']:>4} ({ph['expected']:>4.1f}) "
                f"{ph['lost_ms']:>6.1f}"
            )
        print(f"{e['gib']:>5} " + " ".join(cells))
    print(f"\n{'GiB':>5} {'slow':>5} {'lost ms':>8} {'first/last slow after final (ms)':>33}", end="")
    print(f" {'after end (ms)':>16}")
    for e, w in zip(exits, windows):
        print(
            f"{e['gib']:>5} {w['slow']:>5} {w['lost_ms']:>8.2f} "
            f"{f(w.get('first_after_final_ms')):>16}/{f(w.get('last_after_final_ms')):<16} "
            f"{f(w.get('first_after_end_ms')):>7}/{f(w.get('last_after_end_ms'))}"
        )
    unmeasured = [n for n, w in enumerate(windows) if w["copies"] == 0]
    for n in unmeasured:
        print(f"FAIL: exit {n}: no timer copy in its window (the timer had stopped): nothing measured")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(
        out / "check_exit.json", {"exits": exits, "windows": windows, "copies": len(rows), "args": vars(a)}
    )
    print(f"\nwrote {out / 'check_exit.json'}")
    return 0 if len(windows) == len(plan) and not unmeasured else 1


if __name__ == "__main__":
    sys.exit(main())
