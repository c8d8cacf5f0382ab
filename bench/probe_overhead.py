"""What the probes cost: ioctl cost and launch rate with probes off, ioctl probes, launch probes.

    sudo python -m bench.probe_overhead            # CPU part (here): ioctl cost, fake-launch cost,
                                                   # lost events at 100k ioctl/s, and a flood
    sudo python -m bench.probe_overhead --gpu      # GPU part (accelerator): host ns per torch launch
    options: --reps N (interleaved repetitions per mode; --gpu: blocks), --bursts B (--gpu: bursts
             per mode per block), --launches L (--gpu: per burst), --json FILE, --rate R --seconds S (loss),
             --flood N (ioctls at full speed, 0: skip), --loss-only (skip the cost part),
             --gpu-modes M,M (--gpu: which modes, default off,ioctl,launch-all,launch-outsiders)
    sudo python -m bench.probe_overhead --uprobe-anatomy   # why a launch uprobe costs what it does

Launch probe modes and their scope (`krex serve --launch-scope`, probes/launches.py):
- `launch probes` (GPU mode `launch-all`): scope all, uprobes on the library file, as before: the timed
  worker traps on every launch (expected on the H200: about -9% launch rate).
- `launch probes, outsiders` (`launch-outsiders`): scope outsiders, the daemon's default, with the
  timed worker marked a krex command (what a command timing its kernels is): it is not probed and
  takes no trap (expected: about 0%); any other process mapping libcuda is probed per process.
- `launch probes, outsiders, worker probed` (`launch-outsider-probed`, not in the default run): the
  worker an outsider, probed per process: what an outsider's launch costs (the same trap as `all`).
The CPU part runs the scope outsiders modes through the ioctl probe's "open" event, as the daemon
does: the workload maps the fake library, opens the private device node, and is timed once the probe
had its chance to attach (a command: never; an outsider: it waits until it is probed).

Uprobe anatomy: a uprobe is an int3 at the probed address; the kernel then emulates the instruction
it replaced (nop, push, jmp, call: about 0.7 us per call on the dev VM) or, for anything else (mov,
endbr64), executes a copy of it out of line under single-step, which adds a #DB trap (about 12 us
on the dev VM, where the hypervisor intercepts #DB). A 5-byte nop at the address is patched into a
call to [uprobes-trampoline] (kernels with arch_uprobe_optimize). This mode times the launch probe
on fake libraries starting with each kind, the two traps alone (int3 vs single-step, each with a
SIGTRAP handler), and prints the first instruction of the launch symbols in the real libraries.

Loss accounting (each row must balance): `sent` ioctls plus the one open are what the kernel-side
map `counted`; the stream `delivered` the workload's events (ioctl, open); `lost` counts ring
reservation failures. delivered + lost == counted, always; at 100k/s lost must be 0. The flood
(far above what the reader drains) must lose events and count every one, and a region held during
it, through a real daemon, must come back `tainted`, while one held at 100k/s comes back clean.

The workloads run in child processes (a small C program built with gcc; torch for --gpu), the probes
in this process, as the daemon would run them. Each row is the median of the repetitions.
Goals (issue 4): launch rate < 1% lower with ioctl probes, < 3% with launch probes (for a command
timing its kernels: the `launch probes, outsiders` row, the daemon's default scope); no lost events
at 100k events/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Self

from bench.harness.output import module_prog, write_json
from bench.harness.stack import Daemon, bench_env
from krex_async.probes import CombinedProbe
from krex_async.probes.bpf_ioctl import IoctlProbe
from krex_async.probes.launches import LaunchProbe, find_libraries

C_SRC = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <time.h>
#include <dlfcn.h>
#include <unistd.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
                          return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    /* ioctl PATH N RATE  |  launch LIB N [DEV: open it, say "ready", wait for a line on stdin] */
    long n = atol(argv[3]);
    if (argv[1][0] == 'l') {
        void *h = dlopen(argv[2], RTLD_NOW); if (!h) { perror("dlopen"); return 1; }
        int (*f)(void *, unsigned) = (int (*)(void *, unsigned))dlsym(h, "cuLaunchKernel");
        if (argc > 4) {
            char line[16];
            if (open(argv[4], O_RDWR) < 0) { perror("open"); return 1; }
            printf("ready %d\n", getpid()); fflush(stdout);
            if (!fgets(line, sizeof line, stdin)) return 1;
        }
        double t0 = now(); for (long i = 0; i < n; i++) f(0, (unsigned)i);
        printf("%.3f %ld\n", (now() - t0) * 1e9 / n, n); return 0;
    }
    int fd = open(argv[2], O_RDWR); if (fd < 0) { perror("open"); return 1; }
    double rate = argc > 4 ? atof(argv[4]) : 0, t0 = now(); int x;
    for (long i = 0; i < n; i++) {
        if (rate > 0) while (now() - t0 < i / rate) ;
        ioctl(fd, 0x541B, &x);
    }
    double dt = now() - t0;
    printf("%.3f %ld %.0f %d\n", dt * 1e9 / n, n, n / dt, getpid());
    return 0;
}
"""
FAKE_LIB = "int cuLaunchKernel(void *f, unsigned gx) { return (int)gx; }\n"

FIRST_INSNS = {
    "mov (gcc -O2)": "",
    "endbr64": "endbr64\n",
    "push %rbp": "push %rbp\npop %rbp\n",
    "nop": "nop\n",
    "nop5": ".byte 0x0f,0x1f,0x44,0x00,0x00\n",
}
TRAPS_C = r"""
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <ucontext.h>
static void h(int s, siginfo_t *si, void *uc) { ((ucontext_t *)uc)->uc_mcontext.gregs[REG_EFL] &= ~0x100L; }
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
                          return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    long n = atol(argv[1]); struct sigaction sa = {0};
    sa.sa_sigaction = h; sa.sa_flags = SA_SIGINFO; sigaction(SIGTRAP, &sa, 0);
    double t0 = now(); for (long i = 0; i < n; i++) __asm__ volatile("int3");
    double t1 = now();
    for (long i = 0; i < n; i++) __asm__ volatile("pushf; orq $0x100,(%%rsp); popf; nop" ::: "memory", "cc");
    printf("%.1f %.1f\n", (t1 - t0) * 1e9 / n, (now() - t1) * 1e9 / n); return 0;
}
"""


def uprobe_anatomy(tmp: str) -> list[dict[str, Any]]:
    """Per-call cost of the launch probe by the probed address's first instruction (x86-64)."""
    w, _, _ = build(tmp)
    rows = []
    for i, (kind, insn) in enumerate(FIRST_INSNS.items()):
        d = Path(tmp, f"v{i}")
        d.mkdir()
        src = (
            FAKE_LIB
            if not insn
            else (
                '__asm__(".globl cuLaunchKernel\\n.type cuLaunchKernel,@function\\ncuLaunchKernel:\\n'
                + insn.replace("\n", "\\n")
                + 'mov %esi,%eax\\nret\\n");\n'
            )
        )
        (d / "fake.c").write_text(src)
        subprocess.run(
            ["gcc", "-O2", "-shared", "-fPIC", "-o", f"{d}/libcuda.so.1", f"{d}/fake.c"], check=True
        )
        lib = f"{d}/libcuda.so.1"
        off = statistics.median(float(run([w, "launch", lib, "1000000"])[0]) for _ in range(3))
        with Running(LaunchProbe([lib], search=False)):
            on = statistics.median(float(run([w, "launch", lib, "50000"])[0]) for _ in range(3))
        rows.append({"first_insn": kind, "unprobed_ns": off, "probed_ns": on})
    Path(tmp, "traps.c").write_text(TRAPS_C)
    subprocess.run(["gcc", "-O2", "-o", f"{tmp}/traps", f"{tmp}/traps.c"], check=True)
    bp, db = (float(x) for x in run([f"{tmp}/traps", "200000"]))
    rows.append(
        {
            "first_insn": "(trap alone: int3 | single-step, with SIGTRAP handler)",
            "unprobed_ns": bp,
            "probed_ns": db,
        }
    )
    return rows


def first_insns(libs: list[str]) -> list[str]:
    """The first instruction of each launch symbol in these libraries (objdump), as text."""
    from krex_async.probes.launches import SYMBOLS

    out = []
    for lib in libs:
        dyn = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True).stdout
        for line in dyn.splitlines():
            addr, _, name = (line.split() + ["", "", ""])[:3]
            if name.split("@")[0] in SYMBOLS:
                a = int(addr, 16)
                dis = subprocess.run(
                    ["objdump", "-d", f"--start-address={a}", f"--stop-address={a + 16}", lib],
                    capture_output=True,
                    text=True,
                ).stdout.splitlines()
                insn = [ln.split("\t")[-1].strip() for ln in dis if ln.strip().startswith(f"{a:x}:")]
                out.append(f"{lib} {name}: {insn[0] if insn else '?'}")
    return out


TORCH_WORKER = r"""
import os, statistics, sys, time, torch
os.sched_setaffinity(0, {int(sys.argv[1])})
a = torch.zeros(1, device="cuda")
for _ in range(5000): a.add_(1.0)
torch.cuda.synchronize()
print([l.split()[-1] for l in open("/proc/self/maps") if "libcuda.so" in l][0], flush=True)
for line in sys.stdin:  # "n k": k bursts of n launches; per launch: host enqueue ns, median of k
    n, k = map(int, line.split())
    per = []
    for _ in range(k):
        torch.cuda.synchronize()  # an empty queue: the n launches never wait for the device
        t0 = time.perf_counter_ns()
        for _ in range(n): a.add_(1.0)
        per.append((time.perf_counter_ns() - t0) / n)
    torch.cuda.synchronize()
    print(statistics.median(per), min(per), flush=True)
"""


def build(tmp: str) -> tuple[str, str, str]:
    """Build the C workload and a fake libcuda; make a private device node. Returns their paths."""
    if shutil.which("gcc") is None:
        raise RuntimeError("gcc is needed for the CPU part and the loss test")
    Path(tmp, "w.c").write_text(C_SRC)
    Path(tmp, "fake.c").write_text(FAKE_LIB)
    subprocess.run(["gcc", "-O2", "-o", f"{tmp}/w", f"{tmp}/w.c", "-ldl"], check=True)
    subprocess.run(
        ["gcc", "-O2", "-shared", "-fPIC", "-o", f"{tmp}/libcuda.so.1", f"{tmp}/fake.c"], check=True
    )
    os.mknod(f"{tmp}/null0", 0o20666, os.makedev(1, 3))
    return f"{tmp}/w", f"{tmp}/libcuda.so.1", f"{tmp}/null0"


class Running:
    """A probe started on a private event loop (not running: pump() delivers); events are counted."""

    def __init__(self, probe: Any) -> None:
        self.probe = probe
        self.loop = asyncio.new_event_loop()
        self.events = 0

    def __enter__(self) -> Self:
        if self.probe is not None:
            self.probe.start(self.loop, self._on)
        return self

    def _on(self, batch: list) -> None:
        self.events += len(batch)

    def pump(self) -> None:
        """Run the loop briefly so batches handed over with call_soon_threadsafe are counted."""
        self.loop.run_until_complete(asyncio.sleep(0.05))

    def __exit__(self, *exc: object) -> None:
        if self.probe is not None:
            self.probe.stop()
        self.pump()
        self.loop.close()


def run(cmd: list[str]) -> list[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()


def outsiders_probe(tmp: str, lib: str, is_command: Any) -> CombinedProbe:
    """The daemon's probes with launch scope outsiders: the ioctl probe on the private node, whose
    "open" events get a new outsider probed, and the launch probe (no rescan during a run)."""
    return CombinedProbe(
        IoctlProbe([tmp + "/"]),
        LaunchProbe([lib], search=False, scope="outsiders", rescan_s=3600, is_command=is_command),
    )


def launch_after_open(
    r: Running, w: str, lib: str, dev: str, n: int, probed: bool
) -> tuple[float, int, bool]:
    """The workload maps `lib`, opens `dev` and waits; the loop delivers its open event; once the
    launch probe has attached (probed) or had ten times what an attach takes (a command), it makes
    n timed launches. Returns (ns per launch, its pid, whether it was probed)."""
    p = subprocess.Popen(
        [w, "launch", lib, str(n), dev], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert p.stdin is not None and p.stdout is not None
    pid = int(p.stdout.readline().split()[1])
    launch = r.probe.parts[-1]
    end = time.monotonic() + (5.0 if probed else 0.3)
    while time.monotonic() < end and pid not in launch.watched():
        r.loop.run_until_complete(asyncio.sleep(0.01))
    seen = pid in launch.watched()
    out, _ = p.communicate("go\n", timeout=120)
    return float(out.split()[0]), pid, seen


def cpu_part(reps: int, tmp: str) -> list[dict[str, Any]]:
    w, lib, dev = build(tmp)
    modes: dict[str, tuple[Any, str]] = {
        "off": (lambda: None, "-"),
        "ioctl probes": (lambda: IoctlProbe([tmp + "/"]), "-"),
        "launch probes": (lambda: LaunchProbe([lib], search=False), "all: workload trapped"),
        "launch probes, outsiders": (
            lambda: outsiders_probe(tmp, lib, lambda tgid: True),
            "outsiders: workload a command, not probed",
        ),
        "launch probes, outsiders, workload probed": (
            lambda: outsiders_probe(tmp, lib, lambda tgid: False),
            "outsiders: workload an outsider, probed at its open",
        ),
    }
    res: dict[str, dict[str, list[float]]] = {m: {"ioctl_ns": [], "launch_ns": []} for m in modes}
    counted: dict[str, list[tuple[int, int]]] = {m: [] for m in modes}
    for _ in range(reps):
        for m, (make, _) in modes.items():
            with Running(make()) as r:
                res[m]["ioctl_ns"].append(float(run([w, "ioctl", dev, "200000"])[0]))
                if ", outsiders" not in m:
                    res[m]["launch_ns"].append(float(run([w, "launch", lib, "200000"])[0]))
                    continue
                ns, pid, seen = launch_after_open(r, w, lib, dev, 200000, "probed" in m)
                res[m]["launch_ns"].append(ns)
                counted[m].append((200000 if "probed" in m else 0, r.probe.parts[-1].counts().get(pid, 0)))
    rows = []
    for m, v in res.items():
        row: dict[str, Any] = {
            "mode": m,
            "launch_scope": modes[m][1],
            "ioctl_ns": statistics.median(v["ioctl_ns"]),
            "fake_launch_ns": statistics.median(v["launch_ns"]),
        }
        if counted[m]:
            want, n_seen = map(sum, zip(*counted[m]))
            row["launches_counted"] = f"{n_seen} (expected {want})"
        rows.append(row)
    return rows


class Counting(Running):
    """Running, counting the delivered events of one process by kind."""

    def __init__(self, probe: Any) -> None:
        super().__init__(probe)
        self.by_pid: dict[int, dict[str, int]] = {}

    def _on(self, batch: list) -> None:
        self.events += len(batch)
        for ev in batch:
            kinds = self.by_pid.setdefault(ev.tgid, {})
            kinds[ev.kind] = kinds.get(ev.kind, 0) + 1


def stream_row(w: str, dev: str, tmp: str, n: int, rate: float) -> dict[str, Any]:
    """n ioctls at `rate` (0: full speed) under a fresh probe; the accounting of their events."""
    probe = IoctlProbe([tmp + "/"])
    with Counting(probe) as r:
        out = run([w, "ioctl", dev, str(n), str(rate)])
        pid = int(out[3])
        time.sleep(0.3)
        r.pump()
    # After stop: the ring is drained to the end and the counters are final.
    got = r.by_pid.get(pid, {})
    counted, lost = probe.counts().get(pid, 0), probe.lost()
    delivered = got.get("ioctl", 0) + got.get("open", 0)
    return {
        "requested_rate": rate or "max",
        "achieved_rate": float(out[2]),
        "sent": n,
        "counted": counted,
        "delivered": delivered,
        "delivered_ioctl": got.get("ioctl", 0),
        "lost": lost,
        "balanced": delivered + lost == counted == n + 1,
    }


def consumer_cost(w: str, dev: str, tmp: str) -> tuple[float, str]:
    """Reader CPU per event: fill the ring while paused, then time one drain on this thread."""
    probe = IoctlProbe([tmp + "/"])  # the default ring holds the 100000 records
    with Running(probe):
        assert probe.poller is not None
        probe.poller.paused.set()
        time.sleep(0.05)
        run([w, "ioctl", dev, "100000"])
        t0 = time.thread_time()
        got = len(probe.poller._drain())
        per_event = (time.thread_time() - t0) * 1e9 / max(got, 1)
        reader = probe.poller.reader
        probe.poller.paused.clear()
    return per_event, reader


def loss_part(rate: float, seconds: float, flood: int, tmp: str) -> list[dict[str, Any]]:
    w, _, dev = build(tmp) if not os.path.exists(f"{tmp}/w") else (f"{tmp}/w", "", f"{tmp}/null0")
    rows = [stream_row(w, dev, tmp, int(rate * seconds), rate)]
    if flood:
        rows.append(stream_row(w, dev, tmp, flood, 0))
    per_event, reader = consumer_cost(w, dev, tmp)
    for r in rows:
        r["consumer_ns_per_event"] = per_event
        r["reader"] = reader
    return rows


OWNER = """
import subprocess, sys
from krex_async import region
w, dev, n, rate, flood = sys.argv[1:6]
with region("paced"):
    subprocess.run([w, "ioctl", dev, n, rate], check=True, stdout=subprocess.DEVNULL)
with region("flood"):
    subprocess.run([w, "ioctl", dev, flood, "0"], check=True, stdout=subprocess.DEVNULL)
"""


def daemon_part(rate: float, seconds: float, flood: int, tmp: str) -> list[dict[str, Any]]:
    """The owner's own ioctls in two regions through a real daemon (--probes ioctl): one at
    `rate`, one flood. Neither has strays; the flood's must come back tainted (events lost)."""
    from krex_async import Client

    w, dev = f"{tmp}/w", f"{tmp}/null0"
    Path(tmp, "owner.py").write_text(OWNER)
    env = bench_env()
    with Daemon(
        ["--isolation", "signal", "--probes", "ioctl", "--probe-prefixes", tmp + "/", "--log-format", "json"],
        log=Path(tmp) / "daemon.log",
        parent=tmp,
        grace=15.0,
    ) as d:
        sock = d.socket

        async def go() -> Any:
            async with await Client.connect(sock) as c:
                res = await c.run(
                    [
                        sys.executable,
                        f"{tmp}/owner.py",
                        w,
                        dev,
                        str(int(rate * seconds)),
                        str(rate),
                        str(flood),
                    ],
                    env=env,
                )
                return res, (await c.status()).get("probes")

        res, probes = asyncio.run(go())
    if res.returncode != 0:
        raise RuntimeError(f"owner failed: {res.stderr.decode()[-500:]}")
    sent = {"paced": int(rate * seconds), "flood": flood}
    return [
        {
            "region": r.name,
            "sent": sent.get(r.name, 0),
            "held_s": r.held_s,
            "strays": r.strays,
            "tainted": r.tainted,
            "probes": (probes or {}).get("state"),
        }
        for r in res.report.regions
    ]


def _smt_siblings(cpu: int) -> set[int]:
    """The hardware threads that share `cpu`'s core (itself included)."""
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
    except OSError:
        return {cpu}
    out: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


GPU_MODES = {  # --gpu-modes name: (row label, what the launch probe does to the timed worker)
    "off": ("off", "-"),
    "ioctl": ("ioctl probes", "-"),
    "launch-all": ("launch probes", "all: worker trapped (uprobe on the file)"),
    "launch-outsiders": ("launch probes, outsiders", "outsiders: worker a command, not probed"),
    "launch-outsider-probed": (
        "launch probes, outsiders, worker probed",
        "outsiders: worker an outsider, probed per process",
    ),
}
DEFAULT_GPU_MODES = "off,ioctl,launch-all,launch-outsiders"


def gpu_part(
    reps: int, n: int, bursts: int = 200, modes_wanted: str = DEFAULT_GPU_MODES
) -> list[dict[str, Any]]:
    """Host cost of a torch `a.add_(1.0)` launch (the enqueue, which is what a probe can slow),
    in one long-lived worker pinned to one core whose SMT siblings are left idle (this process,
    with the probes' reader, on the other cores), so that only the probes change between
    measurements. A burst is `n` launches timed on the host from an empty queue (n below the
    driver's queue depth, so no launch waits for the device: a rate that waited would measure the
    GPU, and it did: session 4's 100k-launch bursts spread -25%..+43% between blocks). `reps`
    blocks; in each, every mode in turn (the order rotated block by block) gets its probe started,
    `bursts` bursts, and its probe stopped; a mode's figure is the median per-launch time of its
    bursts, compared with "off" block by block. Each launch probe's count of the worker's
    launches is checked against what it should be: every launch where the worker is probed, none
    where it is a command (scope outsiders)."""
    names = [m.strip() for m in modes_wanted.split(",") if m.strip()]
    bad = [m for m in names if m not in GPU_MODES]
    if bad or "off" not in names:
        raise SystemExit(
            f"--gpu-modes {modes_wanted!r}: modes are {', '.join(GPU_MODES)}, "
            "and off is needed (the others are compared with it)"
        )
    cpus = sorted(os.sched_getaffinity(0))
    worker_cpu = cpus[-1]
    rest = set(cpus) - _smt_siblings(worker_cpu)
    if not rest:
        raise RuntimeError("the GPU part needs a core for the probes apart from the worker's")
    os.sched_setaffinity(0, rest)
    w = subprocess.Popen(
        [sys.executable, "-c", TORCH_WORKER, str(worker_cpu)],
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert w.stdin is not None and w.stdout is not None
    try:
        libcuda = w.stdout.readline().strip()

        stdin, stdout = w.stdin, w.stdout  # narrowed for the closure

        def measure() -> tuple[float, float]:
            stdin.write(f"{n} {bursts}\n")
            stdin.flush()
            med, low = map(float, stdout.readline().split())
            return med, low

        def outsiders(worker_is_command: bool) -> LaunchProbe:
            return LaunchProbe(
                [libcuda],
                search=False,
                scope="outsiders",
                is_command=lambda tgid: worker_is_command and tgid == w.pid,
            )

        make = {
            "off": lambda: None,
            "ioctl": lambda: IoctlProbe(),
            "launch-all": lambda: LaunchProbe([libcuda], search=False),
            "launch-outsiders": lambda: outsiders(True),
            "launch-outsider-probed": lambda: outsiders(False),
        }
        measure()  # warm
        per_block: list[dict[str, float]] = []
        lows: dict[str, list[float]] = {m: [] for m in names}
        counted: dict[str, list[tuple[int, int]]] = {m: [] for m in names}  # (expected, counted)
        watched: dict[str, bool] = {}
        ioctls: dict[str, list[int]] = {m: [] for m in names}
        for b in range(reps):
            block: dict[str, float] = {}
            for m in names[b % len(names) :] + names[: b % len(names)]:
                with Running(make[m]()) as run:
                    time.sleep(0.2)
                    before = run.probe.counts().get(w.pid, 0) if m == "ioctl" else 0
                    block[m], low = measure()
                    if m == "ioctl":  # the worker's driver calls while it launched, lossless
                        ioctls[m].append(run.probe.counts().get(w.pid, 0) - before)
                    if m.startswith("launch"):
                        expected = 0 if m == "launch-outsiders" else n * bursts
                        counted[m].append((expected, run.probe.counts().get(w.pid, 0)))
                        if m != "launch-all":
                            watched[m] = w.pid in run.probe.watched()
                lows[m].append(low)
            per_block.append(block)
    finally:
        w.kill()
        w.wait()
        os.sched_setaffinity(0, set(cpus))
    rows = []
    for m in names:
        mine = [blk[m] for blk in per_block]
        paired = sorted(100.0 * (blk[m] - blk["off"]) / blk["off"] for blk in per_block)
        # slower enqueue = lower launch rate: rate change = off/m - 1
        rate = sorted(100.0 * (blk["off"] / blk[m] - 1) for blk in per_block)
        row: dict[str, Any] = {
            "mode": GPU_MODES[m][0],
            "launch_scope": GPU_MODES[m][1],
            "ns_per_launch": statistics.median(mine),
            "min_ns": min(lows[m]),
            "launch_rate_per_s": 1e9 / statistics.median(mine),
            "rate_vs_off_pct": statistics.median(rate),
            "rate_vs_off_min_max": f"{rate[0]:+.2f}..{rate[-1]:+.2f}",
            "ns_vs_off_pct": statistics.median(paired),
            "blocks": len(per_block),
        }
        if counted[m]:
            want, seen = map(sum, zip(*counted[m]))
            row["counted"] = f"{seen}/{want}" + ("" if seen == want else " MISMATCH")
        if m in watched:
            row["worker_probed"] = watched[m]
        if ioctls[m]:
            # What the ioctl probe can cost a launch at most: this many tracked ioctls per launch,
            # each paying the probe's per-call cost (the CPU table's ioctl_ns, probes on - off).
            row["ioctls_per_launch"] = sum(ioctls[m]) / (n * bursts * len(ioctls[m]))
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))  # every column any row has
    fmt = lambda v: (f"{v:.2e}" if 0 < abs(v) < 0.05 else f"{v:.1f}") if isinstance(v, float) else str(v)  # noqa: E731
    widths = [max(len(k), *(len(fmt(r.get(k, ""))) for r in rows)) for k in keys]
    lines = ["  ".join(k.ljust(wd) for k, wd in zip(keys, widths))]
    lines += ["  ".join(fmt(r.get(k, "")).ljust(wd) for k, wd in zip(keys, widths)) for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        prog=module_prog(__spec__), description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--gpu", action="store_true", help="torch launch rate (needs CUDA and torch)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--launches",
        type=int,
        default=500,
        help="launches per burst (--gpu; keep it under the driver's queue depth)",
    )
    ap.add_argument("--bursts", type=int, default=200, help="bursts per mode in each block (--gpu)")
    ap.add_argument(
        "--gpu-modes",
        default=DEFAULT_GPU_MODES,
        help=f"--gpu modes, comma-separated, from {', '.join(GPU_MODES)} (default {DEFAULT_GPU_MODES})",
    )
    ap.add_argument("--rate", type=float, default=100_000.0)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument(
        "--flood",
        type=int,
        default=2_000_000,
        help="ioctls at full speed for the loss-accounting check (0: skip)",
    )
    ap.add_argument("--loss-only", action="store_true", help="skip the per-call cost part")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument(
        "--uprobe-anatomy",
        action="store_true",
        help="launch-probe cost by first instruction, trap costs, real libraries' first "
        "instructions (then exit)",
    )
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (eBPF)")
    out: dict[str, Any] = {}
    tmp = tempfile.mkdtemp(prefix="krexbench-", dir="/tmp")
    try:
        if args.uprobe_anatomy:
            out["uprobe_anatomy"] = uprobe_anatomy(tmp)
            print("Launch probe cost per call (ns) by the probed address's first instruction")
            print(table(out["uprobe_anatomy"]))
            out["first_insns"] = first_insns(find_libraries(search=True))
            print("\n".join(out["first_insns"]) or "(no libcuda / libhsa-runtime64 found)")
            if args.json:
                write_json(args.json, out, indent=2)
            return
        if args.gpu:
            out["gpu"] = gpu_part(args.reps, args.launches, args.bursts, args.gpu_modes)
            print(
                "GPU: torch a.add_(1.0), host time per launch from an empty queue (median of "
                "bursts), as a launch rate\n" + table(out["gpu"]) + "\n"
            )
        try:
            if not args.loss_only:
                out["cpu"] = cpu_part(args.reps, tmp)
            else:
                build(tmp)
        except RuntimeError as e:
            print(f"CPU part and loss test skipped: {e}")
        else:
            if "cpu" in out:
                print("CPU: cost per call of the workload (ns), median of", args.reps)
                print(table(out["cpu"]) + "\n")
            out["loss"] = loss_part(args.rate, args.seconds, args.flood, tmp)
            print("Loss test: ioctls on a tracked fd (paced, then full speed), default ring buffer")
            print(table(out["loss"]) + "\n")
            if args.flood:
                out["regions"] = daemon_part(args.rate, min(args.seconds, 1.0), args.flood, tmp)
                print("Through a daemon: the owner's own ioctls in a region, paced then flood")
                print(table(out["regions"]))
        for lib in find_libraries(search=True):
            out.setdefault("libraries_found", []).append(lib)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        write_json(args.json, out, indent=2)


if __name__ == "__main__":
    main()
