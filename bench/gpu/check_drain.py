"""Does drain work, and is it needed? Run on the accelerator (one NVIDIA GPU, torch, pynvml):

    PYTHONPATH=. python3 -m bench.gpu.check_drain [--quick]

This script plays the daemon (a unix socket speaking krex's frames to the sibling's runtime) and
the region owner (timing a fixed fp16 matmul with CUDA events at ~0.1, ~1.6 and ~13 ms). The
sibling (bench/gpu/sibling.py, a real krex command runtime) queues seconds of matmuls and keeps
launching. Conditions, each after the sibling has rebuilt its backlog:
  alone        no sibling at all (three times; the medians of each kernel are the baseline)
  a-freeze     SIGSTOP only: its queued work still runs inside our timed loop
  b-quiesce    Quiesce -> its runtime synchronises -> QuiesceAck -> SIGSTOP
  c-verify     SIGSTOP, then the owner's devicework.idle_verify() until the device is idle
  b-settle     b-quiesce, then wait for the SM clock to recover as the daemon does before a grant
               (daemon/regions/clock.py): krex's path for a sibling that acknowledges (--regions times)
  d-settle     c-verify, then the same settle: krex's path for one that does not (--regions times)
  alone-i      interleaved with those: the sibling stopped, its queue waited out, 1.5 s of rest,
               then the same timings (the GPU alone, in the same stretch of the run); the baseline
               is the median over these and the three rounds alone at the start
none with any warming (krex's default once the clock has settled). The goals are checked on the
production paths: the p95 over regions of each region's median against the p95 over the alone
rounds of theirs (like for like: the alone rounds spread too, by the printed floor); the p95 of each
region's inflation against the alone median is printed beside it. Also: NVML fields, and that a
CUDA process frozen with kernels in flight (SIGSTOP, cgroup freeze, and quiesce-then-freeze) completes
with exact results after thaw. Prints PASS/FAIL lines and a table; writes $OUT/check_drain.json
when OUT is set.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import torch

from bench.harness.output import module_prog, write_json
from bench.harness.stack import module_argv
from bench.harness.stats import quantile
from krex_async.daemon.config import ServeConfig
from krex_async.devices import discover, open_node
from krex_async.runtime import devicework, quiesce

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SIZES = {"0.1ms": 3072, "1ms": 8192, "10ms": 16384}
GOAL_P95 = {"0.1ms": 2.5, "1ms": 1.0, "10ms": 0.2}  # percent inflation allowed (issue 5)
REPS = {"0.1ms": 500, "1ms": 200, "10ms": 60}
results: dict[str, Any] = {"checks": {}, "timings": {}}
failures: list[str] = []


def check(name: str, ok: bool, detail: object = "") -> None:
    results["checks"][name] = {"ok": ok, "detail": detail}  # type: ignore[index]
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        failures.append(name)


# ------------------------------------------------------------------------------ the mini daemon


class MiniDaemon:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kxd")
        self.path = os.path.join(self.dir, "s")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(4)

    def accept(self, timeout: float = 60.0) -> Conn:
        self.sock.settimeout(timeout)
        conn, _ = self.sock.accept()
        return Conn(conn)


class Conn:
    def __init__(self, s: socket.socket) -> None:
        self.s = s
        self.hello = self.recv(30)
        self.s.sendall(
            quiesce.frame(
                {
                    "type": "welcome",
                    "id": self.hello["id"],
                    "version": 1,
                    "server": "check_drain",
                    "policy": "region",
                }
            )
        )
        self.ready = self.recv(30)

    def recv(self, timeout: float) -> dict:
        self.s.settimeout(timeout)
        head = self._exact(4)
        return quiesce.unpack(self._exact(int.from_bytes(head, "big")))

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.s.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("runtime closed")
            buf += chunk
        return buf

    def send(self, msg: dict) -> None:
        self.s.sendall(quiesce.frame(msg))


def start_sibling(daemon: MiniDaemon, mode: str) -> tuple[subprocess.Popen, Conn]:
    path = [str(REPO / "krex_async" / "runtime"), str(REPO), os.environ.get("PYTHONPATH", "")]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in path if p),
        KREX_SOCKET=daemon.path,
        KREX_COMMAND=f"sib-{mode}",
        KREX_TOKEN="t",
    )
    proc = subprocess.Popen(
        module_argv("bench.gpu.sibling", mode), env=env, stdout=subprocess.PIPE, text=True, cwd=str(REPO)
    )
    conn = daemon.accept()
    return proc, conn


def stdout_of(proc: subprocess.Popen[str]) -> IO[str]:
    assert proc.stdout is not None  # every sibling is started with stdout=PIPE
    return proc.stdout


# ---------------------------------------------------------------------------------- the owner


def make_kernel(n: int):  # type: ignore[no-untyped-def]
    a = torch.randn(n, n, device="cuda", dtype=torch.float16)
    out = torch.empty_like(a)
    return lambda: torch.matmul(a, a, out=out)


def time_kernel(fn, reps: int, warmup: int = 3) -> dict[str, float]:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    t0 = time.perf_counter()
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ms = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return {
        "median_ms": statistics.median(ms),
        "p95_ms": ms[int(0.95 * (len(ms) - 1))],
        "wall_per_rep_ms": wall * 1000 / reps,
    }


def time_all(kernels: dict, warm_ms: float, reps: dict) -> dict:  # type: ignore[type-arg]
    out = {}
    for label, fn in kernels.items():
        used, spent = devicework.warm(warm_ms)
        out[label] = time_kernel(fn, reps[label])
    return out


def nvml_checks(sibling_pid: int | None) -> None:
    devices, notes = discover("nvidia")
    d = devices[0]
    check(
        "nvml.discover",
        bool(d.uuid.startswith("GPU-") and d.memory_total_bytes > 0 and d.cpus),
        {
            "key": d.key,
            "name": d.name,
            "uuid": d.uuid,
            "mem_total": d.memory_total_bytes,
            "mem_free": d.memory_free_bytes,
            "numa": d.numa_node,
            "ncpus": len(d.cpus),
            "env": d.env,
        },
    )
    check(
        "nvml.clocks",
        set(d.clocks_mhz) == {"sm", "mem", "graphics"} and all(d.clocks_mhz.values()),
        d.clocks_mhz,
    )
    node = open_node("nvidia")
    try:
        procs = node.processes(node.devices[0])
        util = node.utilisation(node.devices[0])
        pids = [p.pid for p in procs]
        check(
            "nvml.processes",
            len(procs) >= 1,
            {
                "pids": pids,
                "self": os.getpid(),
                "sibling": sibling_pid,
                "same_pid_namespace": os.getpid() in pids,
            },
        )
        check("nvml.utilisation", util is not None, util)
    finally:
        node.close()


def thaw_checks(daemon: MiniDaemon) -> None:
    """A CUDA process frozen with kernels in flight completes exactly after thaw."""
    cg = Path("/sys/fs/cgroup/krex-check-drain")
    for how in ("sigstop", "cgroup", "quiesce+sigstop"):
        proc, conn = start_sibling(daemon, "verify")
        try:
            line = stdout_of(proc).readline().strip()
            assert line == "launched", line
            if how == "cgroup":
                try:
                    cg.mkdir(exist_ok=True)
                    (cg / "cgroup.procs").write_text(str(proc.pid))
                    (cg / "cgroup.freeze").write_text("1")
                    end = time.monotonic() + 2
                    while "frozen 1" not in (cg / "cgroup.events").read_text() and time.monotonic() < end:
                        time.sleep(0.001)
                except OSError as e:
                    check(f"thaw.{how}", True, f"skipped: {e}")
                    proc.kill()
                    continue
                time.sleep(1)
                (cg / "cgroup.freeze").write_text("0")
            elif how == "quiesce+sigstop":
                t0 = time.perf_counter()
                conn.send({"type": "quiesce", "id": 1, "region": "v"})
                ack = conn.recv(60)
                q_s = time.perf_counter() - t0
                os.kill(proc.pid, signal.SIGSTOP)
                time.sleep(1)
                os.kill(proc.pid, signal.SIGCONT)
                conn.send({"type": "resume", "id": 2, "region": "v"})
            else:
                os.kill(proc.pid, signal.SIGSTOP)
                time.sleep(1)
                os.kill(proc.pid, signal.SIGCONT)
            result = stdout_of(proc).readline().strip()
            rc = proc.wait(120)
            detail = {"result": result, "rc": rc}
            if how == "quiesce+sigstop":
                detail.update(ack=ack, quiesce_s=round(q_s, 3))
            check(f"thaw.{how}", rc == 0 and result.startswith("OK"), detail)
        finally:
            if proc.poll() is None:
                proc.kill()
            conn.s.close()
    try:
        cg.rmdir()
    except OSError:
        pass


SETTLE_FRACTION = [ServeConfig().settle_fraction]


def settle(node, gpu) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """What the daemon's clock settle (daemon/regions/clock.py) does before a grant (--settle-ms 300)."""
    t_s = time.perf_counter()
    st = first = node.clock(gpu)
    while (
        st is not None
        and not st.settled(SETTLE_FRACTION[0])
        and not st.idle
        and time.perf_counter() < t_s + 0.3
    ):
        time.sleep(0.002)
        st = node.clock(gpu) or st
    return {"settle_s": time.perf_counter() - t_s, "clock_first": repr(first), "clock_at_grant": repr(st)}


# Conditions: how the owner's region begins after the sibling had its backlog rebuilt.
#   a-freeze      SIGSTOP only (no drain): must miss the goals, or drain would not be needed
#   b-quiesce     quiesce (ack after sync), SIGSTOP; no settle: shows what the clock does
#   c-verify      SIGSTOP, idle check; no settle
#   b-settle      b, then the daemon's clock settle: krex's path for siblings that answer
#   d-settle      c, then the clock settle: krex's path for siblings that do not answer
ONCE = ("a-freeze", "b-quiesce", "c-verify")
PRODUCTION = ("b-settle", "d-settle")


def main() -> None:
    ap = argparse.ArgumentParser(
        prog=module_prog(__spec__),
    )
    ap.add_argument("--quick", action="store_true", help="fewer reps (a smoke run)")
    ap.add_argument("--regions", type=int, default=5, help="regions per production condition")
    ap.add_argument(
        "--settle-fraction",
        type=float,
        default=ServeConfig().settle_fraction,
        help="settled once the SM clock is this fraction of its target",
    )
    ap.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["nvml", "thaw"],
        help="leave out a part (for smoke runs off the accelerator)",
    )
    args = ap.parse_args()
    SETTLE_FRACTION[0] = args.settle_fraction
    reps = {k: max(10, v // 5) for k, v in REPS.items()} if args.quick else REPS
    torch.backends.cuda.matmul.allow_tf32 = False
    kernels = {label: make_kernel(n) for label, n in SIZES.items()}
    torch.cuda.synchronize()
    t = results["timings"]
    assert isinstance(t, dict)

    alone = []
    for _ in range(3):  # each after a rest: the previous round's 10 ms matmuls hit the power cap
        time.sleep(1.5)
        alone.append(time_all(kernels, 0, reps))
    t["alone"] = {
        k: {
            "median_ms": statistics.median(a[k]["median_ms"] for a in alone),
            "p95_ms": statistics.median(a[k]["p95_ms"] for a in alone),
        }
        for k in SIZES
    }
    iv_alone = devicework.idle_verify(2.0)
    check("idle_verify.alone", iv_alone[0] == "idle-verified", iv_alone)

    daemon = MiniDaemon()
    proc, conn = start_sibling(daemon, "load")
    drains: dict[str, dict[str, Any]] = {}
    node = open_node("auto")
    gpu = next(dv for dv in node.devices if dv.vendor != "cpu")
    try:
        assert stdout_of(proc).readline().strip() == "ready"
        time.sleep(2)  # backlog: 2 batches of 50 x 16384^3 (~1.3 s) in flight
        if "nvml" not in args.skip:
            nvml_checks(proc.pid)
        region = 0
        plan = [(c, 0) for c in ONCE] + [
            (c, k) for k in range(args.regions) for c in (*PRODUCTION, "alone-i")
        ]
        for cond, k in plan:
            region += 1
            name, key = f"r{region}", f"{cond}/{k}"
            t0 = time.perf_counter()
            d: dict[str, Any] = {}
            if cond.startswith("b-"):
                conn.send({"type": "quiesce", "id": region, "region": name})
                d["ack"] = conn.recv(60)
            os.kill(proc.pid, signal.SIGSTOP)
            if cond in ("c-verify", "d-settle", "alone-i"):
                d["idle_verify"], d["seconds"] = devicework.idle_verify(10.0)
            if cond == "alone-i":
                time.sleep(1.5)
            if cond.endswith("-settle"):
                d.update(settle(node, gpu))
            d["enter_s"] = time.perf_counter() - t0
            drains[key] = d
            t[key] = time_all(kernels, 0, reps)
            if cond == "alone-i":
                alone.append(t.pop(key))
            os.kill(proc.pid, signal.SIGCONT)
            if cond.startswith("b-"):
                conn.send({"type": "resume", "id": region, "region": name})
            time.sleep(2)  # let it rebuild its backlog
        iv_busy_status = devicework.idle_verify(0.5)  # sibling running: must not say idle
        check("idle_verify.busy_neighbour_times_out", iv_busy_status[0] == "timeout", iv_busy_status)
    finally:
        proc.kill()
        proc.wait()
        conn.s.close()
        node.close()
    results["drains"] = drains
    # The baseline: every round alone, the three at the start and those interleaved.
    results["alone_first3"] = t["alone"]
    t["alone"] = {
        k: {
            "median_ms": statistics.median(a[k]["median_ms"] for a in alone),
            "p95_ms": statistics.median(a[k]["p95_ms"] for a in alone),
        }
        for k in SIZES
    }
    results["alone_rounds"] = {k: [a[k]["median_ms"] for a in alone] for k in SIZES}
    print(
        "alone medians (ms) per round: "
        + "; ".join(f"{k}: " + " ".join(f"{a[k]['median_ms']:.4f}" for a in alone) for k in SIZES)
    )
    for key, d in drains.items():
        if key.startswith("alone-i"):
            continue
        if key.startswith("b-"):
            check(f"quiesce.ack.{key}", d["ack"].get("synced") == "torch", d)
        elif "idle_verify" in d:
            check(f"idle_verify.{key}", d["idle_verify"] == "idle-verified", d)

    # Inflation of each region's median against the kernel's median alone (as bench/replay.py
    # compares each command's median), and of the reps' p95 for information.
    print(
        f"\n{'region':<14}{'size':>7}{'median ms':>11}{'p95 ms':>9}{'median infl %':>15}"
        f"{'p95 infl %':>12}{'goal %':>8}"
    )
    table = []
    base = t["alone"]
    for key, sizes in t.items():
        if key == "alone":
            continue
        for label in SIZES:
            r, b = sizes[label], base[label]
            row = {
                "condition": key.split("/")[0],
                "region": key,
                "size": label,
                **r,
                "median_inflation_pct": 100 * (r["median_ms"] / b["median_ms"] - 1),
                "p95_inflation_pct": 100 * (r["p95_ms"] / b["p95_ms"] - 1),
            }
            table.append(row)
            print(
                f"{key:<14}{label:>7}{r['median_ms']:>11.4f}{r['p95_ms']:>9.4f}"
                f"{row['median_inflation_pct']:>15.2f}{row['p95_inflation_pct']:>12.2f}"
                f"{GOAL_P95[label]:>8.1f}"
            )
    results["table"] = table

    def column(cond: str, label: str, field: str) -> list[float]:
        return [row[field] for row in table if row["condition"] == cond and row["size"] == label]

    def p95_over_regions(cond: str) -> dict[str, float]:
        return {k: round(quantile(column(cond, k, "median_inflation_pct"), 0.95, "rank"), 3) for k in SIZES}

    # The alone rounds are themselves spread: on the H200 the 10 ms fp16 matmul's round medians
    # are two-valued (13.07 and 13.21 ms in run 9), so the p95 above is at least the alone rounds'
    # own p95 against their median (the floor) even for a region that changes nothing. The goal is
    # checked like for like: the p95 over regions of the region medians against the p95 over the
    # alone rounds of theirs (a shift of the distribution, which is what sharing would cause).
    rounds = results["alone_rounds"]
    alone_p95 = {k: quantile(rounds[k], 0.95, "rank") for k in SIZES}
    floor = {k: round(100 * (alone_p95[k] / statistics.median(rounds[k]) - 1), 3) for k in SIZES}
    results["alone_floor_pct"] = floor
    print(f"\nalone rounds' own p95 against their median (the floor), %: {floor}")
    for cond in PRODUCTION:
        worst = p95_over_regions(cond)
        matched = {
            k: round(100 * (quantile(column(cond, k, "median_ms"), 0.95, "rank") / alone_p95[k] - 1), 3)
            for k in SIZES
        }
        results.setdefault("p95_matched_pct", {})[cond] = matched
        results.setdefault("p95_of_inflation_pct", {})[cond] = worst
        print(
            f"{cond}: p95 of inflation against the alone median {worst}; "
            f"p95 against the alone rounds' p95 {matched}"
        )
        check(
            f"goal.{cond} (p95 over {args.regions} regions of the median, against the p95 of "
            f"{len(alone)} alone rounds)",
            all(matched[k] < GOAL_P95[k] for k in SIZES),
            {"matched": matched, "against_median": worst, "floor": floor},
        )
    a = p95_over_regions("a-freeze")
    check("drain_needed.a-freeze_misses_goal", any(a[s] >= GOAL_P95[s] for s in SIZES), a)

    if "thaw" not in args.skip:
        thaw_checks(daemon)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        write_json(Path(out, "check_drain.json"), results, default=str)
    print(f"\n{'ALL PASS' if not failures else 'FAILED: ' + ', '.join(failures)}")
    sys.exit(0 if not failures else 1)


if __name__ == "__main__":
    main()
