"""Self-check of the GPU side of the replay workload, for the accelerator machine (no krex needed).

    python3 -m bench.gpu.check_workload [--reps 20]

Runs agent_cmd's isolated mode on every GPU catalogue kernel with every timing method, then one full
command with a fresh Triton compile and one with torch.compile, and prints a table: measured median,
expected and measured bucket, check result. Exit 0 when every check passed and every kernel landed in
its expected bucket; 1 when a check failed; 3 when only buckets were off (the catalogue's size
estimates then need tuning, see bench/gen_trace.py CATALOGUE). Exits 77 (skip) without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench import gen_trace
from bench.harness.output import module_prog
from bench.harness.stack import ROOT, bench_env, module_argv
from bench.trace_format import METHODS, bucket_of

AGENT_CMD = "bench.workload.agent_cmd"


def _results(out: str) -> list[dict]:
    return [json.loads(x) for x in out.splitlines() if x.startswith("{") and '"krex_bench"' in x]


def main() -> int:
    ap = argparse.ArgumentParser(
        prog=module_prog(__spec__),
    )
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    try:
        import torch

        if not torch.cuda.is_available():
            raise ImportError("no CUDA device")
    except ImportError as e:
        print(f"skip: {e}")
        return 77
    prof = gen_trace.load_profile("default")
    base = gen_trace.generate(prof, 1, seed=0)[0]
    lines = []
    for k in gen_trace.CATALOGUE["gpu"]:
        for m in METHODS:
            line = json.loads(json.dumps(base))
            line["kernel"] = k
            line["session"], line["order"] = f"chk-{k['id']}-{m}", 0
            line["phases"]["timing"].update(method=m, reps=a.reps)
            line["phases"]["compile"]["gpu"]["count"] = 1
            line["phases"]["compile"]["tag"] = f"check-{time.time_ns()}-{k['id']}-{m}"
            lines.append(line)
    env = bench_env()
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("".join(json.dumps(x) + "\n" for x in lines))
    t0 = time.monotonic()
    p = subprocess.run(
        module_argv(AGENT_CMD, "--isolated", f.name), capture_output=True, text=True, env=env, cwd=str(ROOT)
    )
    os.unlink(f.name)
    res = _results(p.stdout)
    print(f"isolated mode: rc {p.returncode}, {len(res)} results in {time.monotonic() - t0:.1f}s")
    if p.returncode not in (0, 3):
        print(p.stderr[-4000:])
        return 1
    rc = 0
    print(f"{'key':<28} {'median_ms':>10} {'p95_ms':>9} {'n':>5} {'expected':>9} {'measured':>9} check")
    for r in res:
        exp = next(k["bucket"] for k in gen_trace.CATALOGUE["gpu"] if k["id"] == r["kernel"])
        got = bucket_of(r["timing"]["median_ms"])
        flag = "" if got == exp else "  <- bucket"
        print(
            f"{r['key']:<28} {r['timing']['median_ms']:>10.4f} {r['timing']['p95_ms']:>9.4f} "
            f"{r['timing']['n']:>5} {exp:>9} {got:>9} {r['check']['ok']} "
            f"{r['check']['max_abs_err']:.2e}{flag}"
        )
        if not r["check"]["ok"]:
            rc = 1
        elif got != exp and rc == 0:
            rc = 3
    for how in ("triton", "torch_compile"):
        line = json.loads(json.dumps(lines[0]))
        line["phases"]["compile"]["gpu"]["compile"] = how
        line["phases"]["compile"]["tag"] = f"check-full-{how}-{time.time_ns()}"
        p = subprocess.run(
            module_argv(AGENT_CMD, "--spec", json.dumps(line)),
            capture_output=True,
            text=True,
            env=env,
            cwd=str(ROOT),
        )
        full = _results(p.stdout)
        if p.returncode != 0 or not full:
            print(f"full command ({how}): rc {p.returncode}\n{p.stderr[-3000:]}")
            rc = 1
        else:
            print(f"full command ({how}): phases {r[0]['phases_s']}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
