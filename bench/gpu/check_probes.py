"""Self-check of the probes on the accelerator machine (NVIDIA, torch, root). Exit status 0 = all pass.

    source .bcc/activate.sh && python bench/gpu/check_probes.py [--launches N]

1. ioctl probe, fresh process: a process outside krex that initialises CUDA and allocates 256 MiB
   is seen opening /dev/nvidia* and making RM and UVM ioctls, with its pid; counts == delivered.
2. ioctl probe, seeded: a process that opened the device files before the probe started is seen
   when it allocates 1 GiB afterwards (its fds came from /proc/<pid>/fd).
3. launch probe: uprobes on the libcuda that torch loads (path from the child's /proc/<pid>/maps)
   count exactly N launches for N `a.add_(1.0)` calls (counts read while the child waits, before and
   after its loop).
Prints one line per check and a JSON summary on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from krex_async.probes.base import ProbeEvent  # noqa: E402
from krex_async.probes.bpf_ioctl import IoctlProbe  # noqa: E402
from krex_async.probes.launches import LaunchProbe  # noqa: E402

ALLOC = """
import os, torch
x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
print(os.getpid(), flush=True)
"""
STEPPED = """
import os, sys, torch
a = torch.zeros(1, device="cuda")
for _ in range(100): a.add_(1.0)
torch.cuda.synchronize()
lib = [l.split()[-1] for l in open("/proc/self/maps") if "libcuda.so" in l][0]
print(os.getpid(), lib, flush=True); sys.stdin.readline()
mode, n = sys.argv[1], int(sys.argv[2])
if mode == "alloc":
    y = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
else:
    for _ in range(n): a.add_(1.0)
torch.cuda.synchronize()
print("done", flush=True); sys.stdin.readline()
"""


class Stepped:
    def __init__(self, mode: str, n: int = 0) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", STEPPED, mode, str(n)], text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.p.stdout is not None and self.p.stdin is not None
        pid, self.lib = self.p.stdout.readline().split()
        self.pid = int(pid)

    def step(self) -> None:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        assert self.p.stdout.readline().strip() == "done"

    def finish(self) -> None:
        if self.p.poll() is None:
            self.p.communicate("bye\n", timeout=60)


async def main(n_launches: int) -> int:
    loop = asyncio.get_running_loop()
    results: dict[str, object] = {}
    ok = True

    def check(name: str, cond: bool, detail: object) -> None:
        nonlocal ok
        ok = ok and cond
        results[name] = {"ok": cond, "detail": detail}
        print(f"{'PASS' if cond else 'FAIL'} {name}: {detail}", flush=True)

    events: list[ProbeEvent] = []
    probe = IoctlProbe()
    t = time.monotonic()
    probe.start(loop, events.extend)
    print(f"ioctl probe started in {time.monotonic() - t:.2f} s", flush=True)
    try:
        # 1. fresh process allocating GPU memory
        pid = int(subprocess.run([sys.executable, "-c", ALLOC], capture_output=True, text=True,
                                 check=True).stdout.split()[-1])
        await asyncio.sleep(0.5)
        mine = [e for e in events if e.tgid == pid]
        opens = sorted({e.name for e in mine if e.kind == "open"})
        names = {e.name for e in mine if e.kind == "ioctl"}
        want = {"NV_ESC_RM_ALLOC", "NV_ESC_RM_CONTROL", "UVM_INITIALIZE"}
        check("fresh process seen", bool(opens) and want <= names and
              probe.counts().get(pid) == len(mine) and probe.lost() == 0,
              {"pid": pid, "opens": opens, "ioctls": len(mine), "counted": probe.counts().get(pid),
               "lost": probe.lost(), "names": sorted(names)[:20]})
    finally:
        probe.stop()

    # 2. seeded: device files opened before the probe started
    child = Stepped("alloc")
    events.clear()
    probe = IoctlProbe()
    probe.start(loop, events.extend)
    try:
        child.step()
        await asyncio.sleep(0.5)
        mine = [e for e in events if e.tgid == child.pid]
        check("seeded process seen", len(mine) > 0 and all(e.kind == "ioctl" for e in mine),
              {"pid": child.pid, "ioctls": len(mine),
               "names": sorted({e.name for e in mine})[:20]})
    finally:
        probe.stop()
        child.finish()

    # 3. launch counting
    child = Stepped("launch", n_launches)
    launches = LaunchProbe([child.lib], search=False)
    launches.start(loop, lambda b: None)
    try:
        before = launches.by_symbol()
        c0 = sum(v for (tg, _), v in before.items() if tg == child.pid)
        child.step()
        after = launches.by_symbol()
        c1 = sum(v for (tg, _), v in after.items() if tg == child.pid)
        check("launches counted exactly", c1 - c0 == n_launches,
              {"lib": child.lib, "attached": launches.attached, "expected": n_launches,
               "counted": c1 - c0, "by_symbol": {s: v for (tg, s), v in after.items()
                                                 if tg == child.pid}})
    finally:
        launches.stop()
        child.finish()
    print(json.dumps({"ok": ok, **results}))
    return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", type=int, default=100_000)
    sys.exit(asyncio.run(main(ap.parse_args().launches)))
