"""The CUDA driver lock as regions use it (`--hold lock`), through a real daemon on the accelerator.

    python3 -m bench.gpu.check_lock [--regions 20] [--sibling torch|driver] [--deadline 170]

Writes $OUT/check_lock.json and $OUT/check_lock.txt (OUT defaults to /tmp/krex-check-lock); exit
status 0 when every check passes. Needs root (cgroups), one NVIDIA GPU and a driver with the
checkpoint API (`krex doctor`: "driver lock"). About 60-90 s; bounded by --deadline.

What a sibling is: a krex command that launches a small kernel and synchronises in a loop (torch
`a.add_(1)`, or with `--sibling driver` cuMemsetD32 through libcuda by ctypes, which needs no torch
and also runs against a stand-in library named by KREX_LIBCUDA for a dry run without a GPU), with a
pure-Python thread counting CPU work units. Both counters, and the monotonic time of the last
completed iteration, live in a small shared file the owner and this script read.

1. driver     cuCheckpointProcessLock/Unlock/GetState open in this process (the daemon's path).
2. regions    `krex serve --hold lock --freeze all`: one owner enters --regions regions of 0.3 s
              beside the sibling. Per region: the sibling is `locked` (no fallback), no iteration
              of it completes between the grant and the exit, its CPU thread keeps >= 80% of its
              rate outside regions; lock_s, lock_max_s, unlock_s, enter_s and the drain are
              recorded (p50/p99/max printed).
3. timeout    a second sibling with --timeout 3 s, locked in a 9 s region, ends `timeout` while
              the region is still held (a locked command still dies).
4. sigkill    SIGKILL of the daemon mid-region: 1 s later the sibling reads RUNNING
              (cuCheckpointProcessGetState) and its cgroup is not frozen, and it completes
              iterations again.
5. info       a lock taken while the sibling synchronises on ~0.2 s of queued work: how long it
              took and what it returned (does the lock wait for a synchronise in flight? it decides
              whether --lock-timeout 0.005 makes such siblings fall back to the freezer).
What could hide a cost: the owner times nothing here (issue 22's jobs/min and timing goals are the
real-jobs benchmark's); a sibling that never synchronises would show no completions either way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import stats
from bench.harness.output import module_prog, write_json
from bench.harness.stack import Daemon
from krex_async import Client
from krex_async.isolation.cudalock import LOCKED, open_driver

REPO = Path(__file__).resolve().parents[2]

# The sibling: argv[1] the shared file (pid, iterations, last completion ns, cpu units), argv[2]
# torch|driver, argv[3] seconds of queued work to synchronise on at once when the file's flag
# byte 32 is set (the info check), else 0.
SIBLING = r"""
import ctypes, mmap, os, struct, sys, threading, time
path, mode = sys.argv[1], sys.argv[2]
f = open(path, "r+b")
m = mmap.mmap(f.fileno(), 64)
if mode == "torch":
    import torch
    a = torch.zeros(1 << 16, device="cuda")
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    def step():
        a.add_(1.0)
        torch.cuda.synchronize()
    def backlog():
        for _ in range(130):
            big @ big
        torch.cuda.synchronize()
else:
    if os.path.exists("/dev/nvidia0"):
        gpu_file = os.open("/dev/nvidia0", os.O_RDONLY)  # a dry run's stand-in (--dry-run)
    lib = ctypes.CDLL(os.environ.get("KREX_LIBCUDA") or "libcuda.so.1")
    ctx, dev, ptr = ctypes.c_void_p(), ctypes.c_int(0), ctypes.c_uint64()
    assert lib.cuInit(0) == 0
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert lib.cuCtxSetCurrent(ctx) == 0
    assert lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 20)) == 0
    n = [0]
    def step():
        n[0] += 1
        assert lib.cuMemsetD32_v2(ptr, ctypes.c_uint(n[0]), ctypes.c_size_t(1 << 18)) == 0
        assert lib.cuCtxSynchronize() == 0
    def backlog():
        for _ in range(2000):
            lib.cuMemsetD32_v2(ptr, ctypes.c_uint(1), ctypes.c_size_t(1 << 18))
        lib.cuCtxSynchronize()
def cpu():
    units = 0
    while True:
        s = 0
        for i in range(2000):
            s += i
        units += 1
        struct.pack_into("q", m, 24, units)
threading.Thread(target=cpu, daemon=True).start()
step()
struct.pack_into("q", m, 0, os.getpid())
it = 0
while True:
    if m[40] == 1:
        m[40] = 2
        backlog()
        m[40] = 3
    step()
    t = time.monotonic_ns()
    it += 1
    struct.pack_into("qq", m, 8, it, t)
"""

# The owner: argv[1] the sibling's shared file, argv[2] regions, argv[3] seconds held, argv[4]
# seconds between. Waits for the sibling to have started. Prints one JSON object per region.
OWNER = r"""
import json, mmap, struct, sys, time, msgspec
try:
    import torch
    torch.zeros(1, device="cuda")  # a context, so the owner can verify the drain
except Exception:
    pass
from krex_async import region
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 64)
read = lambda: struct.unpack_from("qqqq", m, 0)
while read()[0] == 0:
    time.sleep(0.02)
for i in range(int(sys.argv[2])):
    b = read()
    t_b = time.monotonic_ns()
    time.sleep(float(sys.argv[4]))
    o = read()
    t_o = time.monotonic_ns()
    with region("lockcheck") as r:
        g = read(); t_g = time.monotonic_ns()
        time.sleep(float(sys.argv[3]))
        e = read(); t_e = time.monotonic_ns()
    print(json.dumps({"report": msgspec.to_builtins(r.report), "grant": g, "exit": e,
                      "t_grant": t_g, "t_exit": t_e, "before": b, "t_before": t_b,
                      "outside": o, "t_outside": t_o}), flush=True)
"""

RESULTS: dict[str, Any] = {"checks": {}, "regions": [], "info": {}}
LINES: list[str] = []
CHILDREN: list[subprocess.Popen[bytes]] = []


def out(line: str) -> None:
    print(line, flush=True)
    LINES.append(line)


def check(name: str, ok: bool, detail: Any = "") -> bool:
    RESULTS["checks"][name] = {"ok": ok, "detail": detail}
    out(f"{'PASS' if ok else 'FAIL'} {name} {detail}")
    return ok


DRY = False  # --dry-run: siblings hold a stand-in /dev/nvidia0 (a tmpfs file in their own mounts)


def sibling_argv(sib_py: str, path: str, mode: str) -> list[str]:
    argv = [sys.executable, sib_py, path, mode]
    if not DRY:
        return argv
    return [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        'mount -t tmpfs krex-dry /dev && : > /dev/nvidia0 && exec "$@"',
        "sh",
        *argv,
    ]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.pop("KREX_SOCKET", None)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


class Shared:
    """A sibling's counters file: (pid, iterations, last completion ns, cpu units), flag at 40."""

    def __init__(self, d: str, name: str) -> None:
        self.path = os.path.join(d, f"{name}.bin")
        with open(self.path, "wb") as f:
            f.write(b"\0" * 64)
        os.chmod(self.path, 0o666)
        self.m = mmap.mmap(os.open(self.path, os.O_RDWR), 64)

    def read(self) -> tuple[int, int, int, int]:
        return struct.unpack_from("qqqq", self.m, 0)  # type: ignore[return-value]

    async def started(self, timeout: float = 60) -> int:
        end = time.monotonic() + timeout
        while self.read()[0] == 0:
            if time.monotonic() > end:
                raise RuntimeError(f"sibling {self.path} did not start in {timeout} s")
            await asyncio.sleep(0.05)
        return self.read()[0]


def start_daemon(tmp: str, cgroup_root: str, extra: list[str]) -> Daemon:
    """A lock-holding daemon; every part's daemon shares one state dir and appends to one log in
    `tmp` (a later daemon's start-up sees what an earlier one recorded, as on a node)."""
    return Daemon(
        [
            "--state-dir",
            os.path.join(tmp, "state"),
            "--cgroup-root",
            cgroup_root,
            "--probes",
            "off",
            "--hold",
            "lock",
            "--freeze",
            "all",
            "--log-format",
            "json",
            *extra,
        ],
        log=Path(tmp) / "daemon.log",
        log_mode="ab",
        parent=tmp,
        env=env(),
        grace=20.0,
    ).start()


def q(xs: list[float], p: float) -> float:
    return stats.pct(xs, p / 100, "nearest") or 0.0


def ms(xs: list[float]) -> str:
    return (
        f"p50 {q(xs, 50) * 1e3:.3f} p99 {q(xs, 99) * 1e3:.3f} max {max(xs, default=0) * 1e3:.3f}"
        f" ms (n={len(xs)})"
    )


def kill_commands(root: str) -> None:
    """cgroup.kill every command cgroup a killed daemon left under `root`."""
    base = os.path.join(root, "krex")
    for name in os.listdir(base) if os.path.isdir(base) else []:
        try:
            with open(os.path.join(base, name, "cgroup.kill"), "w") as f:
                f.write("1")
        except OSError:
            pass


def frozen(pid: int) -> bool | None:
    """Whether the cgroup v2 of `pid` reads `frozen 1` (None: unreadable)."""
    try:
        rel = next(
            line.split(":", 2)[2].strip() for line in open(f"/proc/{pid}/cgroup") if line.startswith("0::")
        )
        mount = (
            "/sys/fs/cgroup/unified"
            if os.path.exists("/sys/fs/cgroup/unified/cgroup.procs")
            else "/sys/fs/cgroup"
        )
        return "frozen 1" in open(f"{mount}{rel}/cgroup.events").read()
    except (OSError, StopIteration):
        return None


async def regions_part(a: argparse.Namespace, tmp: str, sib_py: str, owner_py: str) -> None:
    d = start_daemon(tmp, a.cgroup_root, [])
    try:
        async with await Client.connect(d.socket) as c:
            st = (await c.status())["hold"]
            out(f"INFO hold {json.dumps(st)}")
            if not check("daemon lock available", st["lock_available"], st["reason"]):
                return
            sh = Shared(tmp, "sib")
            h = await c.submit(sibling_argv(sib_py, sh.path, a.sibling), env=env())
            pid = await sh.started()
            await asyncio.sleep(1.0)
            res = await c.run([sys.executable, owner_py, sh.path, str(a.regions), "0.3", "0.2"], env=env())
            await h.cancel(9)
        if not check("owner ran", res.returncode == 0, res.stderr.decode()[-1500:]):
            return
        regs = [json.loads(x) for x in res.stdout.decode().splitlines() if x.startswith("{")]
        RESULTS["regions"] = regs
        bad_lock, completed, cpu_in, cpu_out = [], [], [], []
        for x in regs:
            rep = x["report"]
            if rep.get("locked") != [h.command] or rep.get("hold_fallback"):
                bad_lock.append((rep["region"], rep.get("locked"), rep.get("hold_fallback")))
            gi, ei = x["grant"][1], x["exit"][1]
            # completions inside (grant, exit): more than one step, or one whose time is after it
            done = ei - gi if ei - gi != 1 else int(x["exit"][2] > x["t_grant"])
            completed.append(done)
            dt_in = (x["t_exit"] - x["t_grant"]) / 1e9
            dt_out = (x["t_outside"] - x["t_before"]) / 1e9
            cpu_in.append((x["exit"][3] - x["grant"][3]) / dt_in)
            cpu_out.append((x["outside"][3] - x["before"][3]) / dt_out)
        check("every region locked the sibling, no fallback", not bad_lock, bad_lock[:3])
        check(
            "0 GPU iterations completed during locks",
            sum(completed) == 0,
            f"{sum(completed)} in {len(completed)} regions; per region {completed}",
        )
        ratio = statistics.median(cpu_in) / max(1e-9, statistics.median(cpu_out))
        check(
            "CPU thread kept its rate while locked",
            ratio >= 0.8,
            f"median {statistics.median(cpu_in):.0f} units/s locked vs "
            f"{statistics.median(cpu_out):.0f} outside (x{ratio:.2f})",
        )
        reps = [x["report"] for x in regs]
        RESULTS["latency"] = {
            k: [r.get(k, 0.0) for r in reps]
            for k in ("lock_s", "lock_max_s", "unlock_s", "enter_s", "exit_s", "drain_s")
        }
        for k, v in RESULTS["latency"].items():
            out(f"INFO {k:10} {ms(v)}")
        out(
            f"INFO drains {sorted({r.get('drain') for r in reps})}; lock step per region "
            f"{[round(r.get('lock_s', 0) * 1e3, 2) for r in reps]} ms"
        )
        check(
            "lock_max_s p99 under 5 ms",
            q(RESULTS["latency"]["lock_max_s"], 99) < 0.005,
            ms(RESULTS["latency"]["lock_max_s"]),
        )
        check(
            "the sibling runs again after the regions", sh.read()[1] > regs[-1]["exit"][1] if regs else False
        )
        del pid
    finally:
        d.stop()


async def timeout_part(a: argparse.Namespace, tmp: str, sib_py: str, owner_py: str) -> None:
    """The owner (started beside the sibling, so both import at once) enters one region as soon as
    the sibling runs and holds it for longer than the sibling's whole timeout."""
    d = start_daemon(tmp, a.cgroup_root, ["--kill-grace", "1"])
    try:
        async with await Client.connect(d.socket) as c:
            sh = Shared(tmp, "tsib")
            hold = a.startup + 8.0
            ho = await c.submit([sys.executable, owner_py, sh.path, "1", str(hold), "0.5"], env=env())
            t_sub = time.monotonic()
            h = await c.submit(sibling_argv(sib_py, sh.path, a.sibling), env=env(), timeout=a.startup + 5.0)
            sib_done, owner_done = asyncio.ensure_future(h.wait()), asyncio.ensure_future(ho.wait())
            pid = await sh.started()
            locked = False
            drv, _ = open_driver()
            while not locked and not sib_done.done() and time.monotonic() - t_sub < a.startup + 5:
                await asyncio.sleep(0.02)
                locked = drv is not None and drv.state(pid) == (0, LOCKED)
            res = await asyncio.wait_for(sib_done, a.startup + 20)
            ended = time.monotonic() - t_sub
            owner_running = not owner_done.done()
            await ho.cancel(9)
            await owner_done
        check(
            "a locked command dies at its timeout",
            res.report.state == "timeout" and owner_running and locked,
            f"state {res.report.state} {ended:.1f} s after submit (timeout "
            f"{a.startup + 5.0:.0f} s), locked before {locked}, the region's owner still "
            f"running {owner_running}, pid {pid} alive {os.path.exists(f'/proc/{pid}')}",
        )
    finally:
        d.stop()


async def sigkill_part(a: argparse.Namespace, tmp: str, sib_py: str, owner_py: str) -> None:
    drv, why = open_driver()
    d = start_daemon(tmp, a.cgroup_root, [])
    sib_pid = 0
    try:
        c = await Client.connect(d.socket)
        sh = Shared(tmp, "ksib")
        h = await c.submit(sibling_argv(sib_py, sh.path, a.sibling), env=env(), on_disconnect="keep")
        sib_pid = await sh.started()
        own_run = asyncio.ensure_future(
            c.run([sys.executable, owner_py, sh.path, "1", "30", "0"], env=env(), on_disconnect="keep")
        )
        t_end = time.monotonic() + a.startup + 20
        locked = False
        while time.monotonic() < t_end and not locked:
            await asyncio.sleep(0.05)
            locked = drv is not None and drv.state(sib_pid) == (0, LOCKED)
        check("sigkill: the sibling was locked before the kill", locked, why)
        assert d.proc is not None
        d.proc.kill()  # SIGKILL: what the watchdog must clean up after
        d.proc.wait()
        t_kill = time.monotonic()
        await asyncio.gather(own_run, return_exceptions=True)  # its connection died with it
        await c.close()
        await asyncio.sleep(1.0)
        state = drv.state(sib_pid) if drv is not None else (-1, -1)
        fz = frozen(sib_pid)
        it0 = sh.read()[1]
        await asyncio.sleep(0.3)
        it1 = sh.read()[1]
        check(
            "sigkill: 1 s later nothing locked or frozen, and the sibling runs",
            state == (0, 0) and fz is False and it1 > it0,
            f"GetState {state} (0 = running), cgroup frozen {fz}, {it1 - it0} iterations in "
            f"0.3 s; {time.monotonic() - t_kill:.2f} s after the kill",
        )
        with open(d.log, errors="replace") as f:
            out(f"INFO daemon log tail: {f.read()[-600:]!r}")
        del h
    finally:
        if sib_pid:
            try:
                os.kill(sib_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        d.stop()
        kill_commands(a.cgroup_root)  # the owner, orphaned by the kill


async def info_part(a: argparse.Namespace, tmp: str, sib_py: str) -> None:
    """A lock taken while the sibling synchronises on a backlog (no daemon)."""
    drv, why = open_driver()
    if drv is None:
        return
    sh = Shared(tmp, "isib")
    p = subprocess.Popen(sibling_argv(sib_py, sh.path, a.sibling), env=env())
    CHILDREN.append(p)
    try:
        pid = await sh.started(a.startup + 30)
        sh.m[40] = 1
        while sh.m[40] != 2:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)  # now queueing and then synchronising
        t0 = time.perf_counter()
        rc = drv.lock(pid, 5)
        dt = time.perf_counter() - t0
        state = drv.state(pid)
        if rc == 0:
            drv.unlock(pid)
        t1 = time.perf_counter()
        rc2 = drv.lock(pid, 2000)
        dt2 = time.perf_counter() - t1
        if rc2 == 0:
            drv.unlock(pid)
        RESULTS["info"]["lock_during_sync"] = {
            "timeout_5ms": {"rc": drv.error(rc) if rc else 0, "seconds": dt, "state": state},
            "timeout_2s": {"rc": drv.error(rc2) if rc2 else 0, "seconds": dt2},
            "backlog_phase_after": int(sh.m[40]),
        }
        out(
            f"INFO lock during a synchronise on a backlog: timeout 5 ms -> rc {rc} in "
            f"{dt * 1e3:.2f} ms; timeout 2 s -> rc {rc2} in {dt2 * 1e3:.2f} ms"
        )
    finally:
        p.kill()
        p.wait()


async def main_async(a: argparse.Namespace) -> None:
    tmp = tempfile.mkdtemp(prefix="krex-lock-")
    os.chmod(tmp, 0o755)
    sib_py = os.path.join(tmp, "sibling.py")
    owner_py = os.path.join(tmp, "owner.py")
    Path(sib_py).write_text(SIBLING)
    Path(owner_py).write_text(OWNER)
    drv, why = open_driver()
    check("driver lock opens", drv is not None, why or f"{drv.path} API {drv.version}" if drv else why)
    if drv is None:
        return
    for name, part in (
        ("regions", regions_part(a, tmp, sib_py, owner_py)),
        ("timeout", timeout_part(a, tmp, sib_py, owner_py)),
        ("sigkill", sigkill_part(a, tmp, sib_py, owner_py)),
        ("info", info_part(a, tmp, sib_py)),
    ):
        t0 = time.monotonic()
        try:
            await part
        except Exception as e:  # a part that raises is a FAIL; the next one still runs
            check(f"{name} ran", False, repr(e))
        out(f"INFO {name} took {time.monotonic() - t0:.1f} s")


def main() -> int:
    ap = argparse.ArgumentParser(prog=module_prog(__spec__), description=__doc__.splitlines()[0])
    ap.add_argument("--regions", type=int, default=20)
    ap.add_argument("--sibling", choices=["torch", "driver"], default="torch")
    ap.add_argument(
        "--startup",
        type=float,
        default=8.0,
        help="seconds a sibling may take to import and create its context",
    )
    ap.add_argument("--cgroup-root", default="/sys/fs/cgroup/krexlock")
    ap.add_argument("--deadline", type=float, default=170.0)
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="on a machine without a GPU, with KREX_LIBCUDA naming a stand-in library "
        "(tests/isolation/fakecuda.py) and --sibling driver",
    )
    a = ap.parse_args()
    global DRY
    DRY = a.dry_run
    os.makedirs(a.cgroup_root, exist_ok=True)
    outdir = os.environ.get("OUT") or "/tmp/krex-check-lock"
    os.makedirs(outdir, exist_ok=True)
    t0 = time.monotonic()
    try:
        asyncio.run(asyncio.wait_for(main_async(a), a.deadline))
    except TimeoutError:
        check("finished within the deadline", False, f"{a.deadline} s")
    finally:
        for p in CHILDREN:
            if p.poll() is None:
                p.kill()
    failed = [k for k, v in RESULTS["checks"].items() if not v["ok"]]
    RESULTS["seconds"] = time.monotonic() - t0
    RESULTS["ok"] = not failed
    summary = {"ok": not failed, "failed": failed, "seconds": round(RESULTS["seconds"], 1)}
    out(json.dumps(summary))
    write_json(os.path.join(outdir, "check_lock.json"), RESULTS)
    with open(os.path.join(outdir, "check_lock.txt"), "w") as f:
        f.write("\n".join(LINES) + "\n")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
