"""What cuCheckpointProcessLock answers for a sibling in each driver state, and how long until it locks.

    python3 -m bench.gpu.check_lock_states [--reps 10] [--deadline 90] [--only warm,lifecycle,torch]

The open question (H200, session 9): warm pool workers that already had a CUDA context answered the
lock CUDA_ERROR_NOT_READY (600), not only processes creating theirs. Does NOT_READY mean "no context
yet" or "inside some driver call", and how long must a retry wait? The controller (this process:
libcuda by ctypes, cuInit(0) and no context, as krex_async/isolation/cudalock.py) locks a sibling
(bench/gpu/lock_states_sibling.py) while it sits inside one driver call, at offsets spread over the
call's length (measured by an unlocked calibration round first), with each --timeouts-ms in turn:

  lifecycle-exit     (a) startup: host only, cuInit, primary context creation; (d) exit with the
                     context and --teardown-gib allocated (libcuda's teardown at exit)
  lifecycle-release  (a) again; (d') cuDevicePrimaryCtxRelease of that context, then exit
  warm               one process with a context: (b) cuMemAlloc of --alloc-gib and its cuMemFree;
                     a pageable cuMemcpyHtoD of --h2d-gib; (c) cuModuleLoadData of a PTX module whose
                     JIT takes ~--module-ms; (e) a --kernel-ms kernel in flight with the host in
                     cuCtxSynchronize, and with the host asleep; (f) idle (the baseline: ~1-2 ms)
  torch              a torch job's phases in a loop (import, context, H2D, first launches of new
                     kernels: cuBLAS, cuDNN, cuFFT..., alloc/free, sync, D2H, CPU), locked every
                     ~--torch-period-ms with the daemon's 5 ms timeout

Each attempt records: the first lock's CUresult and name, its duration, cuCheckpointProcessGetState
before the lock and after it (and after the unlock), which sibling op was in flight when the lock
started, how long that call still ran after the lock returned, and, for NOT_READY or TIMEOUT, a
retry every --retry-ms until locked (how long a retry must wait) or --retry-s. A lock that is taken
is held --hold-ms (the kernel+sync case until past the kernel's end: does the sync return while
locked?) and undone. Prints a table and a verdict; writes $OUT/check_lock_states.json and .txt (OUT
defaults to /tmp/krex-check-lock-states), rewritten after every scenario, so a run cut short keeps
what it measured. No daemon, no root. Needs one NVIDIA GPU with the checkpoint API (driver 570+),
or --dry-run on a CPU machine with KREX_LIBCUDA naming tests/isolation/fakecuda.py's library
(there, --only warm,lifecycle unless a torch is importable).
Exit status 0 when every scenario ran whole and every op succeeded (the answers are measurements,
not pass/fail).
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.gpu import lock_states_sibling as sib
from bench.harness import stats
from bench.harness.output import module_prog, write_json
from krex_async.isolation.cudalock import PROCESS_STATES, Driver, open_driver

SIBLING = Path(sib.__file__).resolve()
NOT_READY, TIMEOUT = 600, 909
RETRY_RCS = (NOT_READY, TIMEOUT)  # the answers a daemon could wait out; others are final
# each scenario's share of --deadline (torch takes what is left): a call that runs far longer on the
# GPU than planned (a 48 GiB alloc of seconds) cuts its repetitions, not the later scenarios
SHARES = {"warm": 0.36, "lifecycle": 0.3}

RESULTS: dict[str, Any] = {"scenarios": {}, "attempts": [], "siblings": [], "errors": []}
LINES: list[str] = []
CHILDREN: list[subprocess.Popen[bytes]] = []
LOCKED: set[int] = set()  # pids this process holds locked right now (undone on every exit path)
DRIVER: list[Driver] = []  # the opened driver, for the exit paths' unlock


def out(line: str) -> None:
    print(line, flush=True)
    LINES.append(line)


def now() -> int:
    return time.monotonic_ns()


# ---------------------------------------------------------------- pure logic (tests/bench)


def plan(j: int, n: int, timeouts: list[int]) -> tuple[int, float]:
    """The j-th locked occurrence of a target out of n: (timeout ms, fraction of the call's length at
    which to lock). Timeouts alternate; each timeout's fractions are spread evenly over (0, 1)."""
    k = len(timeouts)
    per = max(1, math.ceil(n / k))
    return timeouts[j % k], ((j // k) % per + 0.5) / per


def where(records: list[dict[str, Any]], t: int) -> str:
    """The op in flight at time t (ns), from a sibling's op records; `before`, `between` or `after`
    when none was."""
    started = [r for r in records if r.get("t_enter")]
    if not started or t < started[0]["t_enter"]:
        return "before"
    for r in started:
        end = r.get("t_exit") or 0
        if r["t_enter"] <= t and (not end or t < end):
            return str(r["op"]).split(":")[0]
    return "after" if t >= max(r.get("t_exit") or 0 for r in started) else "between"


def q(xs: list[float], p: float) -> float | None:
    return stats.pct(xs, p / 100, "nearest") if xs else None


def fmt_ms(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{q(xs, 50):.2f}/{max(xs):.2f}"


def counts(xs: list[str]) -> str:
    c: dict[str, int] = {}
    for x in xs:
        c[x] = c.get(x, 0) + 1
    return " ".join(f"{k}:{v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1]))


def short(name: str) -> str:
    """'CUDA_ERROR_NOT_READY (600)' -> 'NOT_READY'; 'running' stays."""
    return name.replace("CUDA_ERROR_", "").split(" (")[0] if name else name


def summarize(attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (scenario, target, op in flight at the lock, timeout)."""
    groups: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    for a in attempts:
        groups.setdefault((a["scenario"], a["target"], a.get("where", "?"), a["timeout_ms"]), []).append(a)
    rows = []
    for (scen, target, wh, tmo), xs in groups.items():
        retried = [x for x in xs if x.get("retry")]
        rows.append(
            {
                "scenario": scen,
                "target": target,
                "where": wh,
                "timeout_ms": tmo,
                "n": len(xs),
                "answers": counts([short(x["name"]) for x in xs]),
                "lock_ms": fmt_ms([x["lock_ms"] for x in xs]),
                "states": counts([f"{short(x['state_before'])}>{short(x['state_after'])}" for x in xs]),
                "retried": len(retried),
                "retry_locked_ms": fmt_ms(
                    [
                        x["retry"]["until_locked_ms"]
                        for x in retried
                        if x["retry"].get("until_locked_ms") is not None
                    ]
                ),
                "retry_final": counts([short(x["retry"]["final_name"]) for x in retried]),
                "call_left_ms": fmt_ms([x["call_left_ms"] for x in xs if x.get("call_left_ms") is not None]),
                "ended_locked": sum(1 for x in xs if x.get("call_ended_while_locked")),
                "kernel_left_ms": fmt_ms([x["kernel_left_ms"] for x in xs if "kernel_left_ms" in x]),
            }
        )
    rows.sort(key=lambda r: (r["scenario"], r["target"], r["where"], r["timeout_ms"]))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as text; ms columns are p50/max, states are GetState before>after the first lock."""
    cols = [
        ("scenario", "scenario", 17),
        ("target", "target", 16),
        ("where", "in flight", 9),
        ("timeout_ms", "tmo", 4),
        ("n", "n", 3),
        ("answers", "first answer", 26),
        ("lock_ms", "lock ms", 13),
        ("states", "GetState before>after", 30),
        ("retried", "retr", 4),
        ("retry_locked_ms", "retry->locked ms", 16),
        ("call_left_ms", "call left ms", 15),
        ("ended_locked", "endL", 4),
        ("kernel_left_ms", "kernel left ms", 14),
    ]
    head = " ".join(f"{h:<{w}}" for _, h, w in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(" ".join(f"{str(r[c]):<{w}}" for c, _, w in cols))
    return "\n".join(lines) + (
        "\n(retr: first answers retried; endL: the call ended while the sibling was locked)"
    )


def verdict(attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """Where NOT_READY came from: with a context (GetState answered before the lock) or without, by
    op in flight; the longest a NOT_READY process took to become lockable."""
    nr = [a for a in attempts if a["rc"] == NOT_READY]
    ctx = [a for a in nr if a["state_before_rc"] == 0]
    noctx = [a for a in nr if a["state_before_rc"] != 0]
    waits = [
        a["retry"]["until_locked_ms"]
        for a in nr
        if a.get("retry") and a["retry"].get("until_locked_ms") is not None
    ]
    v = {
        "not_ready": len(nr),
        "attempts": len(attempts),
        "not_ready_with_context": counts([f"{a['scenario']}/{a['target']}/{a.get('where')}" for a in ctx]),
        "not_ready_without_context": counts(
            [f"{a['scenario']}/{a['target']}/{a.get('where')}" for a in noctx]
        ),
        "timeouts": counts(
            [f"{a['scenario']}/{a['target']}/{a.get('where')}" for a in attempts if a["rc"] == TIMEOUT]
        ),
        "not_ready_until_locked_ms": {"p50": q(waits, 50), "max": max(waits, default=None), "n": len(waits)},
        "never_locked_after_not_ready": sum(
            1 for a in nr if a.get("retry") and a["retry"].get("until_locked_ms") is None
        ),
    }
    return v


# ---------------------------------------------------------------- the driver side


class Locker:
    """The controller's lock attempts on one driver."""

    def __init__(self, drv: Driver, a: argparse.Namespace) -> None:
        self.drv = drv
        self.a = a

    def state(self, pid: int) -> tuple[int, str]:
        rc, st = self.drv.state(pid)
        return rc, (PROCESS_STATES.get(st, f"state {st}") if rc == 0 else self.drv.error(rc))

    def attempt(
        self, pid: int, t_at: int, timeout_ms: int, hold_ms: float, alive: Any = lambda: True
    ) -> dict[str, Any]:
        """GetState, lock at monotonic ns `t_at` (now if past), GetState; on NOT_READY/TIMEOUT
        retry every --retry-ms up to --retry-s; a lock taken is held `hold_ms`, then undone."""
        r: dict[str, Any] = {"pid": pid, "timeout_ms": timeout_ms}
        while (d := t_at - now()) > 0:
            time.sleep(d / 1e9 - 0.0002 if d > 400_000 else 0)  # sleep most of it, spin the rest
        # GetState just before the lock, so "before" describes the moment the lock lands in
        ts = now()
        r["state_before_rc"], r["state_before"] = self.state(pid)
        r["state_before_ms"] = (now() - ts) / 1e6
        t0 = now()
        rc = self.drv.lock(pid, timeout_ms)
        t1 = now()
        if rc == 0:
            LOCKED.add(pid)
        r.update(
            rc=rc,
            name=self.drv.error(rc) if rc else "locked",
            t_lock_start=t0,
            t_lock_end=t1,
            lock_ms=(t1 - t0) / 1e6,
        )
        r["state_after_rc"], r["state_after"] = self.state(pid)
        t_ok = t1 if rc == 0 else 0
        if rc in RETRY_RCS and self.a.retry_s > 0:
            tries, last = 1, rc
            while last != 0 and now() - t0 < self.a.retry_s * 1e9 and alive():
                time.sleep(self.a.retry_ms / 1000)
                last = self.drv.lock(pid, timeout_ms)
                tries += 1
                if last == 0:
                    LOCKED.add(pid)
                    t_ok = now()
                elif last not in RETRY_RCS:
                    break
            r["retry"] = {
                "attempts": tries,
                "final_rc": last,
                "final_name": self.drv.error(last) if last else "locked",
                "until_locked_ms": (t_ok - t0) / 1e6 if last == 0 else None,
            }
        if t_ok:
            r["t_locked"] = t_ok
            time.sleep(hold_ms / 1000)
            u0 = now()
            urc = self.drv.unlock(pid)
            LOCKED.discard(pid)
            r.update(t_unlock=u0, unlock_ms=(now() - u0) / 1e6, unlock=self.drv.error(urc) if urc else "ok")
            r["state_unlocked_rc"], r["state_unlocked"] = self.state(pid)
        return r


def unlock_all(drv: Driver | None) -> None:
    for pid in list(LOCKED):
        if drv is not None:
            drv.unlock(pid)
        LOCKED.discard(pid)


class Sibling:
    """One sibling process, its shared file and the time it was reaped."""

    def __init__(self, tmp: str, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.path = os.path.join(tmp, f"{name}.bin")
        with open(self.path, "wb") as f:
            f.write(b"\0" * sib.SIZE)
        self.m = mmap.mmap(os.open(self.path, os.O_RDWR), sib.SIZE)
        self.log = os.path.join(tmp, f"{name}.log")
        self.logf = open(self.log, "wb")
        # -P: bench/gpu is not put on the sibling's sys.path (none of its files may shadow a module)
        self.p = subprocess.Popen(
            [sys.executable, "-P", str(SIBLING), self.path, *argv],
            env=env,
            stdout=self.logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        CHILDREN.append(self.p)
        self.reaped = 0
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self) -> None:
        self.p.wait()
        self.reaped = now()

    def alive(self) -> bool:
        return self.p.poll() is None

    def i(self, off: int) -> int:
        return int(struct.unpack_from("q", self.m, off)[0])

    def wait(self, cond: Any, timeout: float, what: str) -> None:
        """Poll `cond` (~0.1 ms) until true; raises when the sibling dies or `timeout` passes."""
        end = time.monotonic() + timeout
        dead = 0.0
        while not cond():
            if not self.alive():
                dead = dead or time.monotonic() + 0.5  # the reaper thread stamps the exit just after
            if dead and time.monotonic() > dead:
                raise RuntimeError(f"{self.name} exited ({self.p.returncode}) before {what}: {self.tail()}")
            if time.monotonic() > end:
                raise RuntimeError(f"{self.name}: no {what} in {timeout:.0f} s: {self.tail()}")
            time.sleep(0.0001)

    def record(self, i: int) -> tuple[int, int, int, int]:
        return struct.unpack_from("qqqq", self.m, sib.HEADER + sib.REC * i)  # type: ignore[return-value]

    def tail(self, n: int = 600) -> str:
        try:
            return Path(self.log).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.alive():
            try:
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.logf.close()


# ---------------------------------------------------------------- scenarios


def sib_env(a: argparse.Namespace, **extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e.pop("KREX_SOCKET", None)  # a bare process, not a krex command
    e["PYTHONUNBUFFERED"] = "1"
    if a.dry_run:
        e["KREX_LOCK_STATES_DRY"] = "1"
        e.setdefault("FAKE_CUDA_CTX_MS", "150")
    e.update(extra)
    return e


def lifecycle_ops(a: argparse.Namespace, variant: str, cal: bool) -> list[dict[str, Any]]:
    ops: list[dict[str, Any]] = [
        {"op": "sleep:30", "gate": True, "target": "startup", "span": 3, "cal": cal},
        {"op": "init"},
        {"op": "ctx"},
        {"op": f"alloc:{a.teardown_gib}"},
    ]
    if variant == "release":
        ops += [
            {"op": "release", "gate": True, "target": "teardown-release", "cal": cal},
            {"op": "sleep:20"},
            {"op": "exit"},
        ]
    else:
        ops += [{"op": "exit", "gate": True, "target": "teardown-exit", "cal": cal}]
    return ops


def warm_ops(a: argparse.Namespace) -> list[dict[str, Any]]:
    k = a.kernel_ms
    ops: list[dict[str, Any]] = [
        {"op": "init"},
        {"op": "ctx"},
        {"op": "alloc:0.001"},
        {"op": f"hostbuf:{a.h2d_gib}"},
        {"op": "spinmod"},
        {"op": f"bigptx:{a.module_ms}"},
    ]
    for rep in range(a.reps + 1):
        cal = rep == 0
        ops += [
            {"op": f"alloc:{a.alloc_gib}", "gate": True, "target": "alloc", "cal": cal},
            {"op": "free", "gate": True, "target": "free", "cal": cal},
            {"op": "h2d", "gate": True, "target": "h2d", "cal": cal},
            {"op": "module", "gate": True, "target": "module-load", "cal": cal},
            {"op": "unload"},
            {"op": f"spin:{k}"},
            {"op": "sync", "gate": True, "target": "kernel+sync", "cal": cal, "hold_ms": k + 50},
            {"op": f"spin:{k}"},
            {
                "op": f"sleep:{k + 100}",
                "gate": True,
                "target": "kernel+host-idle",
                "cal": cal,
                "window_ms": k,
            },
            {"op": "sleep:100", "gate": True, "target": "idle", "cal": cal},
        ]
    return ops


class Runner:
    def __init__(self, a: argparse.Namespace, drv: Driver, tmp: str, t_end: float) -> None:
        self.a = a
        self.locker = Locker(drv, a)
        self.tmp = tmp
        self.t_end = t_end
        self.windows: dict[str, float] = {}  # target -> calibrated call length, ns
        self.seen: dict[str, int] = {}  # target -> locked occurrences so far
        self.n = 0
        self.stop_at = t_end  # the current scenario's share of the deadline

    def left(self) -> float:
        return self.t_end - time.monotonic()

    def run_ops(self, scenario: str, ops: list[dict[str, Any]], n_planned: int, env: dict[str, str]) -> None:
        """One ops-mode sibling: at each gated target, lock inside the call (calibration ops: just
        measure), then record every op and classify each attempt."""
        self.n += 1
        s = Sibling(
            self.tmp,
            f"{scenario}-{self.n}",
            [
                "ops",
                json.dumps([{"op": o["op"], "gate": bool(o.get("gate"))} for o in ops]),
                str(max(5.0, self.left())),
            ],
            env,
        )
        mine: list[dict[str, Any]] = []
        cut = False
        try:
            s.wait(lambda: s.i(sib.PID) != 0, min(60.0, self.left()), "start")
            pid = s.i(sib.PID)
            for i, o in enumerate(ops):
                if not o.get("gate"):
                    continue
                if time.monotonic() > self.stop_at:
                    # its share of the deadline is spent: keep what was measured, stop the sibling
                    out(f"INFO {scenario}: time share spent at op {i} of {len(ops)}; stopping it")
                    RESULTS.setdefault("cut", []).append(f"{scenario} at op {i} of {len(ops)}")
                    cut = True
                    break
                self.calibrate(ops, s)
                struct.pack_into("q", s.m, sib.GO, i)
                s.wait(lambda i=i: s.record(i)[0] != 0, min(60.0, self.left()), f"op {i} {o['op']}")
                if o.get("cal") or not o.get("target"):
                    continue
                target = o["target"]
                win = o.get("window_ms", 0) * 1e6 or self.windows.get(target, 50e6)
                j = self.seen.get(target, 0)
                self.seen[target] = j + 1
                tmo, frac = plan(j, n_planned, self.a.timeouts)
                t_at = s.record(i)[0] + int(frac * win)
                r = self.locker.attempt(pid, t_at, tmo, o.get("hold_ms", self.a.hold_ms), s.alive)
                r.update(
                    scenario=scenario,
                    target=target,
                    op_index=i,
                    occurrence=j,
                    fraction=frac,
                    window_ms=win / 1e6,
                )
                mine.append(r)
            last = len(ops) - 1
            if cut:
                pass
            elif ops[last]["op"] == "exit":
                s.wait(lambda: not s.alive() and s.reaped != 0, min(30.0, self.left()), "exit")
            else:
                s.wait(lambda: s.record(last)[3] == 1, min(60.0, self.left()), "the last op")
        except Exception as e:  # a stuck or dead sibling costs its scenario, not the check
            RESULTS["errors"].append(f"{scenario}: {e!r}")
            out(f"ERROR {scenario}: {e}")
        finally:
            unlock_all(self.locker.drv)
            s.stop()
        recs = self.records(ops, s)
        self.calibrate(ops, s)
        for r in mine:
            self.classify(r, ops, recs)
        failed = [f"{x['op']} rc {x['rc']}" for x in recs if x["t_exit"] and x["rc"] != 0]
        if failed:  # a call that failed did not put the sibling in the state it names
            RESULTS["errors"].append(f"{s.name}: ops failed: {', '.join(failed[:6])}")
            out(f"ERROR {s.name}: ops failed: {', '.join(failed[:6])}: {s.tail(400)!r}")
        RESULTS["attempts"].extend(mine)
        RESULTS["siblings"].append(
            {
                "scenario": scenario,
                "name": s.name,
                "returncode": s.p.returncode,
                "ops": recs,
                "log_tail": s.tail(2000),
            }
        )

    def records(self, ops: list[dict[str, Any]], s: Sibling) -> list[dict[str, Any]]:
        recs = []
        for i, o in enumerate(ops):
            t_in, t_out, rc, done = s.record(i)
            if o["op"] == "exit" and t_in and s.reaped:
                t_out = s.reaped  # an exit ends when the process is reaped
            recs.append(
                {
                    "op": o["op"],
                    "t_enter": t_in,
                    "t_exit": t_out if (done or o["op"] == "exit") else 0,
                    "rc": rc,
                    "ms": (t_out - t_in) / 1e6 if t_in and t_out else None,
                }
            )
        return recs

    def calibrate(self, ops: list[dict[str, Any]], s: Sibling) -> None:
        """Each calibration target's measured length (ns) once its span has ended."""
        recs = self.records(ops, s)
        for i, o in enumerate(ops):
            if not o.get("cal") or not o.get("target") or o["target"] in self.windows:
                continue
            span_end = recs[min(len(recs) - 1, i + o.get("span", 1) - 1)]
            if recs[i]["t_enter"] and span_end["t_exit"]:
                self.windows[o["target"]] = float(span_end["t_exit"] - recs[i]["t_enter"])
                out(f"INFO calibrated {o['target']}: {self.windows[o['target']] / 1e6:.1f} ms")

    def classify(self, r: dict[str, Any], ops: list[dict[str, Any]], recs: list[dict[str, Any]]) -> None:
        """Which op was in flight at the lock; how long the target call (its span) still ran after
        the lock returned; whether it ended while the sibling was locked."""
        r["where"] = where(recs, r["t_lock_start"])
        o = ops[r["op_index"]]
        end = recs[min(len(recs) - 1, r["op_index"] + o.get("span", 1) - 1)]["t_exit"]
        start = recs[r["op_index"]]["t_enter"]
        r["in_target"] = bool(start and start <= r["t_lock_start"] < (end or 1 << 62))
        r["call_left_ms"] = (end - r["t_lock_end"]) / 1e6 if end else None
        if r.get("t_locked") and end:
            r["call_ended_while_locked"] = r["t_locked"] <= end < r["t_unlock"]
        prev = recs[r["op_index"] - 1] if r["op_index"] > 0 else None
        if prev and prev["op"].startswith("spin:") and prev["t_exit"]:
            # the kernel launched just before: about how much of it was still to run at the lock
            # (assumes it started at once on an idle GPU)
            k_end = prev["t_exit"] + float(prev["op"].split(":")[1]) * 1e6
            r["kernel_left_ms"] = (k_end - r["t_lock_start"]) / 1e6

    def run_torch(self) -> None:
        a = self.a
        s = Sibling(
            self.tmp, "torch", ["torch", str(a.torch_seconds), str(max(5.0, self.left()))], sib_env(a)
        )
        rng = random.Random(1)
        mine: list[dict[str, Any]] = []
        try:
            s.wait(lambda: s.i(sib.PID) != 0, min(60.0, self.left()), "start")
            pid = s.i(sib.PID)
            end = time.monotonic() + min(a.torch_seconds + 20, self.left() - 2)
            while s.alive() and time.monotonic() < end:
                time.sleep(rng.uniform(0.5, 1.5) * a.torch_period_ms / 1000)
                r = self.locker.attempt(pid, 0, a.timeouts[0], a.hold_ms, s.alive)
                r.update(scenario="torch", target="job", op_index=-1, occurrence=len(mine))
                mine.append(r)
        except Exception as e:
            RESULTS["errors"].append(f"torch: {e!r}")
            out(f"ERROR torch: {e}")
        finally:
            unlock_all(self.locker.drv)
            s.stop()
        if s.p.returncode not in (0, -signal.SIGKILL):
            RESULTS["errors"].append(f"torch sibling exited {s.p.returncode}: {s.tail(400)}")
            out(f"ERROR torch sibling exited {s.p.returncode}: {s.tail(600)}")
        n = min(s.i(sib.RING_N), sib.RING)
        ring = sorted(struct.unpack_from("qq", s.m, sib.HEADER + 16 * k) for k in range(n))
        for r in mine:
            before = [c for t, c in ring if t <= r["t_lock_start"]]
            r["where"] = sib.LABELS[before[-1]] if before else "start"
            after = [c for t, c in ring if t <= r["t_lock_end"]]
            r["where_end"] = sib.LABELS[after[-1]] if after else "start"
        RESULTS["attempts"].extend(mine)
        RESULTS["siblings"].append(
            {
                "scenario": "torch",
                "name": s.name,
                "returncode": s.p.returncode,
                "labels": [(t, sib.LABELS[c]) for t, c in ring][-200:],
                "log_tail": s.tail(3000),
            }
        )


def op_ms(siblings: list[dict[str, Any]]) -> dict[str, str]:
    """How long each kind of call took in the siblings (ms, p50/max): what a retry may have to wait."""
    by: dict[str, list[float]] = {}
    for s in siblings:
        for o in s.get("ops", []):
            if o.get("ms") is not None:
                by.setdefault(str(o["op"]).split(":")[0], []).append(o["ms"])
    return {k: f"{fmt_ms(v)} (n={len(v)})" for k, v in sorted(by.items())}


def save(outdir: str) -> None:
    RESULTS["op_ms"] = op_ms(RESULTS["siblings"])
    RESULTS["rows"] = summarize(RESULTS["attempts"])
    RESULTS["verdict"] = verdict(RESULTS["attempts"])
    write_json(os.path.join(outdir, "check_lock_states.json"), RESULTS)
    with open(os.path.join(outdir, "check_lock_states.txt"), "w") as f:
        f.write("\n".join(LINES) + "\n")


def run(a: argparse.Namespace, outdir: str) -> None:
    t0 = time.monotonic()
    drv, why = open_driver()
    RESULTS["driver"] = {
        "ok": drv is not None,
        "why": why,
        "path": drv.path if drv else "",
        "version": drv.version if drv else 0,
    }
    if drv is None:
        out(f"FAIL the driver lock does not open: {why}")
        RESULTS["errors"].append(f"driver: {why}")
        return
    DRIVER.append(drv)
    out(f"INFO driver {drv.path} API {drv.version}; timeouts {a.timeouts} ms, {a.reps} reps")
    tmp = tempfile.mkdtemp(prefix="krex-lockstates-")
    r = Runner(a, drv, tmp, t0 + a.deadline - 3)
    # rough seconds per scenario: one is skipped when less than min(that, 8 s) of the deadline is left
    env_mod = sib_env(a, CUDA_CACHE_DISABLE="1")  # every module load a real JIT, not a cache hit
    lifecycle_n = a.lifecycle_reps
    plan_s = {
        "warm": 6 + (a.reps + 1) * (1.0 + 3 * a.kernel_ms / 1000 + a.module_ms / 1000),
        "lifecycle": 2 * (lifecycle_n + 1) * 1.5,
        "torch": a.torch_seconds + 12,
    }
    for name in a.only:
        t_s = time.monotonic()
        if r.left() < min(plan_s[name], 8):
            RESULTS["scenarios"][name] = {"skipped": f"{r.left():.0f} s left, ~{plan_s[name]:.0f} needed"}
            RESULTS["errors"].append(f"{name} skipped: {RESULTS['scenarios'][name]['skipped']}")
            out(f"SKIP {name}: {RESULTS['scenarios'][name]['skipped']}")
            continue
        share = a.deadline * SHARES.get(name, 1.0)
        if name == "warm":
            r.stop_at = time.monotonic() + share
            r.run_ops("warm", warm_ops(a), a.reps, env_mod)
        elif name == "lifecycle":
            for half, variant in enumerate(("exit", "release")):
                r.stop_at = t_s + share * (half + 1) / 2
                for k in range(lifecycle_n + 1):  # the first process only calibrates
                    if r.left() < 4 or time.monotonic() > r.stop_at:
                        RESULTS.setdefault("cut", []).append(f"lifecycle-{variant} after {k} processes")
                        out(f"INFO lifecycle-{variant}: time share spent after {k} processes")
                        break
                    r.run_ops(
                        f"lifecycle-{variant}", lifecycle_ops(a, variant, cal=k == 0), lifecycle_n, sib_env(a)
                    )
        elif name == "torch":
            r.stop_at = r.t_end
            r.run_torch()  # in a dry run too: without torch its sibling fails, and says so
        RESULTS["scenarios"][name] = {"seconds": round(time.monotonic() - t_s, 1)}
        out(f"INFO {name} took {time.monotonic() - t_s:.1f} s")
        RESULTS["windows_ms"] = {k: v / 1e6 for k, v in r.windows.items()}
        save(outdir)


def main() -> int:
    ap = argparse.ArgumentParser(prog=module_prog(__spec__), description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10, help="locked repetitions per warm target")
    ap.add_argument(
        "--lifecycle-reps",
        type=int,
        default=8,
        help="processes per lifecycle variant (each one startup and one teardown lock)",
    )
    ap.add_argument(
        "--timeouts-ms", default="5,1000", help="lock timeouts taken in turn (5: the daemon's --lock-timeout)"
    )
    ap.add_argument("--hold-ms", type=float, default=20.0, help="how long a taken lock is held")
    ap.add_argument("--retry-ms", type=float, default=1.0)
    ap.add_argument("--retry-s", type=float, default=2.0, help="retry NOT_READY/TIMEOUT this long")
    ap.add_argument("--alloc-gib", type=float, default=48.0)
    ap.add_argument("--h2d-gib", type=float, default=2.0)
    ap.add_argument("--teardown-gib", type=float, default=8.0)
    ap.add_argument("--module-ms", type=float, default=300.0, help="JIT length of the big module")
    ap.add_argument("--kernel-ms", type=float, default=300.0, help="length of the spinning kernel")
    ap.add_argument("--torch-seconds", type=float, default=15.0, help="the torch job's loop")
    ap.add_argument("--torch-period-ms", type=float, default=80.0, help="mean gap between its locks")
    ap.add_argument("--only", default="warm,lifecycle,torch", help="scenarios, in this order")
    ap.add_argument("--deadline", type=float, default=90.0, help="seconds for the whole check")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="no GPU: KREX_LIBCUDA names tests/isolation/fakecuda.py's library",
    )
    a = ap.parse_args()
    try:
        a.timeouts = [int(x) for x in a.timeouts_ms.split(",") if x]
    except ValueError:
        ap.error(f"--timeouts-ms {a.timeouts_ms!r}: expected numbers like 5,1000")
    a.only = [x for x in a.only.split(",") if x]
    bad = [x for x in a.only if x not in ("warm", "lifecycle", "torch")]
    if bad or not a.timeouts or a.reps < 1:
        ap.error(f"--only: unknown {bad}" if bad else "--timeouts-ms and --reps must be non-empty")
    if a.dry_run and not os.environ.get("KREX_LIBCUDA"):
        ap.error("--dry-run needs KREX_LIBCUDA (tests/isolation/fakecuda.py builds one)")
    outdir = os.environ.get("OUT") or "/tmp/krex-check-lock-states"
    os.makedirs(outdir, exist_ok=True)
    RESULTS["config"] = {k: v for k, v in vars(a).items()}
    t0 = time.monotonic()

    def watchdog() -> None:
        # a driver call that never returns must not lose the results: save, unlock, kill, exit
        time.sleep(a.deadline + 15)
        out(f"FAIL watchdog: still running {a.deadline + 15:.0f} s after the start")
        RESULTS["errors"].append("watchdog fired")
        unlock_all(DRIVER[0] if DRIVER else None)
        for p in CHILDREN:
            if p.poll() is None:
                p.kill()
        try:
            save(outdir)
        finally:
            os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        run(a, outdir)
    except Exception as e:
        RESULTS["errors"].append(f"run: {e!r}")
        out(f"ERROR {e!r}")
    finally:
        unlock_all(DRIVER[0] if DRIVER else None)
        for p in CHILDREN:
            if p.poll() is None:
                p.kill()
    RESULTS["seconds"] = round(time.monotonic() - t0, 1)
    save(outdir)
    out(table(RESULTS["rows"]))
    out("INFO call lengths ms p50/max: " + "; ".join(f"{k} {v}" for k, v in RESULTS["op_ms"].items()))
    v = RESULTS["verdict"]
    out(
        f"VERDICT NOT_READY {v['not_ready']} of {v['attempts']} first answers; with a context (GetState "
        f"answered): {v['not_ready_with_context'] or 'none'}; without: "
        f"{v['not_ready_without_context'] or 'none'}; TIMEOUT: {v['timeouts'] or 'none'}; "
        f"NOT_READY to locked ms {v['not_ready_until_locked_ms']}; never locked in --retry-s: "
        f"{v['never_locked_after_not_ready']}"
    )
    ok = not RESULTS["errors"] and not RESULTS.get("cut")
    out(
        json.dumps(
            {
                "ok": ok,
                "errors": RESULTS["errors"][:5],
                "cut": RESULTS.get("cut", []),
                "seconds": RESULTS["seconds"],
            }
        )
    )
    save(outdir)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
