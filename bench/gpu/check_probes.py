"""Self-check of the probes on the accelerator machine (NVIDIA, torch, root). Exit status 0 = all pass.

    source .bcc/activate.sh && python -m bench.gpu.check_probes [--launches N] [--deadline S]

(`--prefixes P,P` replaces the GPU device prefixes the ioctl probe watches: for a dry run of the
script itself on a machine without a GPU, with a stand-in `torch` on PYTHONPATH.)

1. ioctl probe, fresh process: a process outside krex that initialises CUDA and allocates 256 MiB
   is seen opening /dev/nvidia* and making RM and UVM ioctls, with its pid; counts == delivered.
2. ioctl probe, seeded: a process that opened the device files before the probe started is seen
   when it allocates 1 GiB afterwards (its fds came from /proc/<pid>/fd).
3. launch probe, scope all (uprobes on the file): uprobes on the libcuda that torch loads (path from
   the child's /proc/<pid>/maps) count exactly N launches for N `a.add_(1.0)` calls (counts read
   while the child waits, before and after its loop).
4. launch probe, scope outsiders (the daemon's default), as the daemon runs it: the ioctl probe and
   the launch probe together, started before two fresh torch processes, with no rescan (an hour), so
   only the ioctl probe's "open" events can get a process probed:
   4a. an outsider is probed after it opens /dev/nvidia* (how many ms after its first open is
       printed; CUDA init takes ~300 ms more before a launch can happen) and its N launches are
       counted exactly;
   4b. a process the predicate marks a krex command is seen opening the device, is never probed,
       and none of its N launches is counted.
   The host time per launch of both is printed (informational: the command's should be ~0.66 us
   lower, the trap it does not take).
Each check prints PASS or FAIL and its details (INFO lines say more); the last line is a JSON
summary. A check that raises is a FAIL with the error, and the next check still runs. The whole run
is bounded by --deadline (default 110 s): past it, the children are killed, the unfinished checks
are FAIL, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

from bench.harness.output import module_prog
from krex_async.probes import CombinedProbe
from krex_async.probes.base import ProbeEvent
from krex_async.probes.bpf_ioctl import IoctlProbe
from krex_async.probes.launches import LaunchProbe

ALLOC = """
import os, torch
x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
print(os.getpid(), flush=True)
"""
STEPPED = """
import os, sys, time, torch
a = torch.zeros(1, device="cuda")
for _ in range(100): a.add_(1.0)
torch.cuda.synchronize()
lib = [l.split()[-1] for l in open("/proc/self/maps") if "libcuda.so" in l][0]
print(os.getpid(), lib, flush=True); sys.stdin.readline()
mode, n = sys.argv[1], int(sys.argv[2])
t0 = time.perf_counter_ns()
if mode == "alloc":
    y = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
else:
    for _ in range(n): a.add_(1.0)
ns = (time.perf_counter_ns() - t0) / max(n, 1)
torch.cuda.synchronize()
print("done", ns, flush=True); sys.stdin.readline()
"""
CHILDREN: list[subprocess.Popen[str]] = []
PREFIXES: list[str] | None = None  # None: the ioctl probe's GPU defaults
RESULTS: dict[str, object] = {}


def info(msg: str) -> None:
    print(f"INFO {msg}", flush=True)


class Stepped:
    """A torch child: started at once (its pid is known before it touches CUDA); ready() waits
    until it has initialised CUDA (run it on a thread: the loop must keep delivering events)."""

    def __init__(self, mode: str, n: int = 0) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-c", STEPPED, mode, str(n)],
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        CHILDREN.append(self.p)
        self.pid = self.p.pid
        self.lib = ""

    def ready(self) -> Stepped:
        assert self.p.stdout is not None
        line = self.p.stdout.readline().split()
        if len(line) != 2:
            raise RuntimeError(
                f"child {self.pid} did not initialise CUDA (exit {self.p.poll()}; its stderr is above)"
            )
        assert int(line[0]) == self.pid
        self.lib = line[1]
        return self

    def step(self) -> float:
        """Run its step (the allocation, or the N launches); ns per launch."""
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        out = self.p.stdout.readline().split()
        if not out or out[0] != "done":
            raise RuntimeError(f"child {self.pid} failed its step (exit {self.p.poll()})")
        return float(out[1])

    def finish(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.communicate("bye\n", timeout=30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def check(name: str, cond: bool, detail: object) -> bool:
    RESULTS[name] = {"ok": cond, "detail": detail}
    print(f"{'PASS' if cond else 'FAIL'} {name}: {detail}", flush=True)
    return cond


def failed_with(name: str, e: BaseException) -> None:
    traceback.print_exc()
    check(name, False, f"raised {e!r}")


async def ioctl_checks(loop: asyncio.AbstractEventLoop) -> None:
    events: list[ProbeEvent] = []
    # 1. fresh process allocating GPU memory
    try:
        probe = IoctlProbe(PREFIXES)
        t = time.monotonic()
        probe.start(loop, events.extend)
        info(f"ioctl probe started in {time.monotonic() - t:.2f} s")
        try:
            out = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-c", ALLOC],
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
            )
            pid = int(out.stdout.split()[-1])
            await asyncio.sleep(0.5)
            mine = [e for e in events if e.tgid == pid]
            opens = sorted({e.name for e in mine if e.kind == "open"})
            names = {e.name for e in mine if e.kind == "ioctl"}
            want = {"NV_ESC_RM_ALLOC", "NV_ESC_RM_CONTROL", "UVM_INITIALIZE"}
            check(
                "fresh process seen",
                bool(opens) and want <= names and probe.counts().get(pid) == len(mine) and probe.lost() == 0,
                {
                    "pid": pid,
                    "opens": opens,
                    "ioctls": len(mine),
                    "counted": probe.counts().get(pid),
                    "lost": probe.lost(),
                    "names": sorted(names)[:20],
                },
            )
        finally:
            probe.stop()
    except Exception as e:
        failed_with("fresh process seen", e)

    # 2. seeded: device files opened before the probe started
    child = None
    try:
        child = await asyncio.to_thread(Stepped("alloc").ready)
        events.clear()
        probe = IoctlProbe(PREFIXES)
        probe.start(loop, events.extend)
        try:
            await asyncio.to_thread(child.step)
            await asyncio.sleep(0.5)
            mine = [e for e in events if e.tgid == child.pid]
            check(
                "seeded process seen",
                len(mine) > 0 and all(e.kind == "ioctl" for e in mine),
                {"pid": child.pid, "ioctls": len(mine), "names": sorted({e.name for e in mine})[:20]},
            )
        finally:
            probe.stop()
    except Exception as e:
        failed_with("seeded process seen", e)
    finally:
        if child is not None:
            child.finish()


def launches_of(probe: LaunchProbe, pid: int) -> tuple[int, dict[str, int]]:
    by = {s: v for (tg, s), v in probe.by_symbol().items() if tg == pid}
    return sum(by.values()), by


async def launch_all_check(loop: asyncio.AbstractEventLoop, n: int) -> None:
    # 3. launch counting, scope all
    name = "launches counted exactly (scope all)"
    child = None
    try:
        child = await asyncio.to_thread(Stepped("launch", n).ready)
        launches = LaunchProbe([child.lib], search=False, scope="all")
        launches.start(loop, lambda b: None)
        try:
            c0, _ = launches_of(launches, child.pid)
            ns = await asyncio.to_thread(child.step)
            c1, by = launches_of(launches, child.pid)
            info(f"scope all: {ns:.0f} ns per launch on the host (probed)")
            check(
                name,
                c1 - c0 == n,
                {
                    "lib": child.lib,
                    "attached": launches.attached,
                    "expected": n,
                    "counted": c1 - c0,
                    "by_symbol": by,
                    "ns_per_launch": round(ns),
                },
            )
        finally:
            launches.stop()
    except Exception as e:
        failed_with(name, e)
    finally:
        if child is not None:
            child.finish()


async def outsiders_checks(loop: asyncio.AbstractEventLoop, n: int) -> None:
    # 4. scope outsiders through the open events: an outsider probed and counted, a command not
    name_a = "outsider probed at its open, counted exactly"
    name_b = "command never probed or counted"
    commands: set[int] = set()
    asked: list[int] = []

    def is_command(tgid: int) -> bool:
        asked.append(tgid)
        return tgid in commands

    events: list[ProbeEvent] = []
    outsider = command = None
    launch = LaunchProbe(search=True, scope="outsiders", rescan_s=3600, is_command=is_command)
    probe = CombinedProbe(IoctlProbe(PREFIXES), launch)
    try:
        t = time.monotonic()
        probe.start(loop, events.extend)
        info(
            f"ioctl + launch probes (scope outsiders) started in {time.monotonic() - t:.2f} s; "
            f"parts {probe.name}, failed parts {probe.failed}; probed at start: {launch.watched()}"
        )
        outsider = Stepped("launch", n)
        command = Stepped("launch", n)
        commands.add(command.pid)  # before it can open anything: it is still importing torch
        info(f"outsider pid {outsider.pid}, command pid {command.pid}")
        await asyncio.gather(asyncio.to_thread(outsider.ready), asyncio.to_thread(command.ready))
        await asyncio.sleep(0.3)  # the last open events reach the loop
        info(
            f"libcuda: outsider {outsider.lib}, command {command.lib}; probed now "
            f"{launch.watched()}; attach failures {launch.describe()['launches']}"
        )
    except Exception as e:
        failed_with(name_a, e)
        failed_with(name_b, e)
        probe.stop()
        for c in (outsider, command):
            if c is not None:
                c.finish()
        return
    try:
        try:
            opens = [ev for ev in events if ev.tgid == outsider.pid and ev.kind == "open"]
            since = launch.probed_since_ns(outsider.pid)
            if opens and since is not None:
                info(
                    f"outsider probed {(since - opens[0].ts_ns) / 1e6:.1f} ms after its first "
                    f"open ({opens[0].name}; {len(opens)} opens)"
                )
            c0, _ = launches_of(launch, outsider.pid)
            if c0 == 0:
                info(
                    "WARN: none of the outsider's init launches (torch.zeros, 100 add_) was "
                    "counted: it was probed after its first launch"
                )
            else:
                info(f"outsider's init launches counted: {c0} (probed before its first launch)")
            ns_out = await asyncio.to_thread(outsider.step)
            c1, by = launches_of(launch, outsider.pid)
            check(
                name_a,
                outsider.pid in launch.watched() and c1 - c0 == n and launch.lost() == 0,
                {
                    "pid": outsider.pid,
                    "opens": len(opens),
                    "probed": launch.watched(),
                    "expected": n,
                    "counted": c1 - c0,
                    "by_symbol": by,
                    "lost": launch.lost(),
                    "ns_per_launch": round(ns_out),
                },
            )
        except Exception as e:
            failed_with(name_a, e)
            ns_out = None
        try:
            opens = [ev for ev in events if ev.tgid == command.pid and ev.kind == "open"]
            ns_cmd = await asyncio.to_thread(command.step)
            counted, by = launches_of(launch, command.pid)
            check(
                name_b,
                bool(opens) and command.pid in asked and command.pid not in launch.watched() and counted == 0,
                {
                    "pid": command.pid,
                    "opens_seen": len(opens),
                    "predicate_asked": command.pid in asked,
                    "probed": launch.watched(),
                    "launches_made": n,
                    "counted": counted,
                    "by_symbol": by,
                    "ns_per_launch": round(ns_cmd),
                },
            )
            if ns_out is not None:
                info(
                    f"host ns per launch: outsider (probed) {ns_out:.0f}, command (not probed) "
                    f"{ns_cmd:.0f}: {ns_out - ns_cmd:+.0f} ns (the trap; noisy, one run)"
                )
        except Exception as e:
            failed_with(name_b, e)
    finally:
        t = time.monotonic()
        probe.stop()
        info(f"probes stopped in {time.monotonic() - t:.2f} s")
        outsider.finish()
        command.finish()


def on_deadline(signum: int, frame: Any) -> None:
    print(f"FAIL deadline: the checks did not finish in time (done: {sorted(RESULTS)})", flush=True)
    for p in CHILDREN:
        if p.poll() is None:
            p.kill()
    print(json.dumps({"ok": False, "deadline": True, **RESULTS}), flush=True)
    os._exit(1)


async def main(n_launches: int) -> int:
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    await ioctl_checks(loop)
    await launch_all_check(loop, n_launches)
    await outsiders_checks(loop, n_launches)
    ok = len(RESULTS) == 5 and all(r["ok"] for r in RESULTS.values())  # type: ignore[index]
    info(f"{len(RESULTS)} checks in {time.monotonic() - t0:.1f} s")
    print(json.dumps({"ok": ok, **RESULTS}))
    return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        prog=module_prog(__spec__),
    )
    ap.add_argument("--launches", type=int, default=100_000)
    ap.add_argument("--deadline", type=int, default=110, help="seconds for the whole run")
    ap.add_argument("--prefixes", help="device path prefixes for the ioctl probe (default: GPUs)")
    args = ap.parse_args()
    if args.prefixes:
        PREFIXES = args.prefixes.split(",")
    if os.geteuid() != 0:
        sys.exit("run as root (eBPF)")
    signal.signal(signal.SIGALRM, on_deadline)
    signal.alarm(args.deadline)
    sys.exit(asyncio.run(main(args.launches)))
