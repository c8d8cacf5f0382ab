"""Is a kernel's time a property of the process that runs it? A KernelBench problem timed alone in
fresh processes, one after another, some beside an idle process that holds most of the device's
memory (no GPU work of its own).

    python3 -m bench.gpu.check_modes --kernelbench .suites/KernelBench [--problem level3/37_LSTMCn]
        [--procs 8] [--hog-gib 50] [--out DIR]

Why: in the steady-state benchmark (issue 38) LSTMCn's p95 alone was 30.0-33.6 ms on one H100
invocation and 44.0-50.4 ms on another, and under region its median moved between 31 and 48 ms
from one job to the next with no stray driver call in its regions. If the time is chosen per
process (the library's kernel choice at its first call), the alone rounds' p95 is a draw of one
mode, and "inflation" against it measures which mode the alone rounds drew, not co-location. The
hog half tests whether the choice follows the memory free when the process plans its kernels.

Each process: the problem's Model and inputs on the GPU (KernelBench's seed), 10 warm-up calls,
100 trials timed with CUDA events (median, p95), then the names of the three CUDA kernels that
took the most time over 3 profiled calls. Alternate processes run with the hog (when --hog-gib > 0
and the device has room). Prints one row per process and the modes; writes $OUT/check_modes.json
(OUT defaults to /tmp/krex-check-modes). Needs one NVIDIA GPU with torch; no daemon, no root.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

CHILD = r"""
import json, sys, time
import torch
path, seed = sys.argv[1], 42
ns = {"__name__": "kb_problem"}
exec(compile(open(path).read(), path, "exec"), ns)
torch.manual_seed(seed); torch.cuda.manual_seed(seed)
init = ns["get_init_inputs"]()
model = ns["Model"](*init).cuda().eval()
torch.manual_seed(seed); torch.cuda.manual_seed(seed)
xs = [x.cuda() if isinstance(x, torch.Tensor) else x for x in ns["get_inputs"]()]
free0, total = torch.cuda.mem_get_info()
with torch.no_grad():
    for _ in range(10):
        model(*xs)
    torch.cuda.synchronize()
    times = []
    for _ in range(100):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); model(*xs); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            model(*xs)
        torch.cuda.synchronize()
rows = sorted(
    ((e.key, e.device_time_total) for e in prof.key_averages() if e.device_time_total > 0),
    key=lambda r: -r[1],
)
times.sort()
print(json.dumps({
    "median_ms": times[len(times) // 2],
    "p95_ms": times[int(len(times) * 0.95) - 1],
    "free_gib_at_start": round(free0 / 2**30, 1),
    "top": [k[:90] for k, _ in rows[:3]],
    "cudnn": torch.backends.cudnn.version(),
}))
"""

HOG = r"""
import sys, time, torch
x = torch.empty(int(float(sys.argv[1]) * 2**30), dtype=torch.uint8, device="cuda")
x.fill_(1); torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.read()
"""


def one(problem: str) -> dict[str, Any]:
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", CHILD, problem], capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        return {"error": res.stderr[-1500:], "seconds": time.monotonic() - t0}
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernelbench", required=True, help="a KernelBench checkout")
    ap.add_argument("--problem", default="level3/37_LSTMCn")
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--hog-gib", type=float, default=50.0, help="0: no hog")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/krex-check-modes"))
    a = ap.parse_args()
    path = os.path.join(a.kernelbench, "KernelBench", a.problem + ".py")
    if not os.path.isfile(path):
        print(f"no problem file {path}", file=sys.stderr)
        return 2
    rows = []
    for i in range(a.procs):
        hog = None
        if a.hog_gib > 0 and i % 2 == 1:
            hog = subprocess.Popen(
                [sys.executable, "-c", HOG, str(a.hog_gib)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            assert hog.stdout is not None
            if hog.stdout.readline().strip() != "ready":
                hog.kill()
                hog = None
        try:
            r = one(path)
        finally:
            if hog is not None:
                hog.communicate("")
        r["hog_gib"] = a.hog_gib if hog is not None else 0
        rows.append(r)
        if "error" in r:
            print(f"proc {i}: failed: {r['error']}")
            continue
        print(
            f"proc {i} hog {r['hog_gib']:>4} GiB free {r['free_gib_at_start']:>6} GiB "
            f"median {r['median_ms']:8.3f} p95 {r['p95_ms']:8.3f} ms  top: {'; '.join(r['top'])}",
            flush=True,
        )
    ok = [r for r in rows if "error" not in r]
    if ok:
        meds = sorted(float(r["median_ms"]) for r in ok)
        print(
            f"medians {meds[0]:.2f}..{meds[-1]:.2f} ms ({(meds[-1] / meds[0] - 1) * 100:.1f}% apart), "
            f"overall median {statistics.median(meds):.2f}"
        )
        kinds: set[tuple[str, ...]] = {tuple(r["top"]) for r in ok}
        print(f"distinct top-kernel sets: {len(kinds)}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "check_modes.json"), "w") as f:
        json.dump({"problem": a.problem, "rows": rows}, f, indent=1)
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
