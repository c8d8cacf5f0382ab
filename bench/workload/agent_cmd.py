"""One agent command, as a replay trace line describes it: import, compile, inputs, check, timing.

    python -m bench.workload.agent_cmd --spec '<trace line JSON>'
    python -m bench.workload.agent_cmd --spec-file line.json
    python -m bench.workload.agent_cmd --isolated kernels.jsonl --repeats 3

It does real work: on a CUDA machine it imports torch and triton, compiles fresh Triton kernels (a
constant unique to the command, so every compile misses the cache), builds inputs on the GPU, checks
the kernel against a reference and times it inside `with region("timing"):` by the line's method. On
the `cpu` device (KREX_DEVICE=cpu, or no CUDA) it imports numpy (pure Python if missing) and does host
work in place of the GPU's. Outside krex `region` is a no-op, so the command runs standalone.

Its last stdout line is one JSON object with "krex_bench": 1: the per-rep timings (median, p95, and the
samples), each phase's seconds, the check and the region report. `--isolated` times each kernel of a
file alone, `repeats` times over, and prints one such line per kernel and repeat. Exit code 0 when
every check passed, 3 when a check failed, 2 for a bad spec.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.output import module_prog
from bench.harness.stats import quantile

MAX_SAMPLES = 2000


def _use_gpu() -> bool:
    if os.environ.get("KREX_DEVICE", "").startswith("cpu") or os.environ.get("KREX_BENCH_DEVICE") == "cpu":
        return False
    try:
        import torch
    except ImportError:
        return False
    if os.environ.get("KREX_BENCH_TORCH_DEVICE") == "cpu":  # smoke test of the torch paths, no GPU
        return True
    return bool(torch.cuda.is_available())


def _region(name: str) -> Any:
    """krex's region when krex is importable (itself a no-op outside a krex command), else a no-op."""
    try:
        from krex_async import region
    except ImportError:
        return contextlib.nullcontext(None)
    return region(name)


def _report(r: Any) -> dict[str, Any] | None:
    rep = getattr(r, "report", None)
    if rep is None:
        return None
    try:
        import msgspec

        return msgspec.to_builtins(rep)  # type: ignore[no-any-return]
    except Exception:
        return {"repr": repr(rep)}


def summarise(samples: list[float]) -> dict[str, Any]:
    """Median, p95, mean, min, max and the samples (evenly thinned past MAX_SAMPLES), in ms."""
    s = sorted(samples)
    kept = samples if len(samples) <= MAX_SAMPLES else samples[:: -(-len(samples) // MAX_SAMPLES)]
    return {
        "n": len(samples),
        "median_ms": quantile(s, 0.5, "round"),
        "p95_ms": quantile(s, 0.95, "round"),
        "mean_ms": sum(s) / len(s),
        "min_ms": s[0],
        "max_ms": s[-1],
        "samples_ms": [round(x, 6) for x in kept],
        "samples_thinned": len(kept) < len(samples),
    }


def cpu_seconds() -> float:
    """CPU seconds this process and its waited-for children (a Triton compile's ptxas) have used."""
    import resource

    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ch.ru_utime + ch.ru_stime


def mark() -> tuple[float, float]:
    """A phase's start: (wall clock, CPU seconds)."""
    return time.perf_counter(), cpu_seconds()


def pad_to(
    start: tuple[float, float],
    phase: dict[str, Any],
    tag: str,
    pace: str,
    padded: dict[str, float],
    name: str,
) -> None:
    """Pacing: make a phase cost the trace's `expect_s` on any machine (real work first, then more
    host work of the same kind for what is left; a phase whose real work cost more is never cut).

    trace: the phase costs expect_s of CPU time. CPU time does not advance while the process is
    frozen or waits for a core, so the padding owed is the same however long a freeze lasted and a
    frozen phase ends that much later, as a real job's does. `padded` gets the CPU seconds added.
    wall (before issue 21): the phase lasts expect_s of wall-clock time. A freeze inside it is
    absorbed (less padding afterwards), so a replay cannot see what a region costs its siblings;
    kept to compare runs. none: no padding."""
    if pace == "none":
        return
    from bench.workload import cpu_kernels

    if pace == "wall":
        end = start[0] + float(phase.get("expect_s", 0.0))
        left = end - time.perf_counter()
        if left <= 0:
            return
        while time.perf_counter() < end:
            cpu_kernels.host_work(cpu_kernels.UNIT_S * 16, tag + "/pace")
    else:
        target = start[1] + float(phase.get("expect_s", 0.0))
        left = target - cpu_seconds()
        if left <= 0:
            return
        while cpu_seconds() < target:
            cpu_kernels.host_work(cpu_kernels.UNIT_S * 16, tag + "/pace")
    padded[name] = round(left, 6)


def run_one(
    line: dict[str, Any], gpu: bool, imported_s: float, seed: int, pace: str = "none"
) -> dict[str, Any]:
    """Compile, inputs, check and timing for one trace line (imports already done). Returns the
    result object; raises what the kernel raises (the caller reports it). With a `pace`, each phase
    but timing costs at least its expect_s (pad_to)."""
    ph, kernel = line["phases"], line["kernel"]
    times: dict[str, float] = {"import": imported_s}
    padded: dict[str, float] = {}
    tag = ph["compile"].get("tag") or f"{line['session']}-{line['order']}"
    m0 = mark()
    t0 = m0[0]
    from bench.workload import cpu_kernels as K_cpu

    K: Any = K_cpu
    compiled: list[Any] = []
    if gpu:
        from bench.workload import gpu_kernels

        K = gpu_kernels
        g = ph["compile"].get("gpu") or {}
        compiled = K.compile_fresh(tag, int(g.get("count", 1)), g.get("compile", "triton"))
    K_cpu.host_work(float(ph["compile"].get("cpu_s", 0.0)), tag)
    pad_to(m0, ph["compile"], tag, pace, padded, "compile")
    times["compile"] = time.perf_counter() - t0

    m0 = mark()
    t0 = m0[0]
    if kernel["kind"] == "suite":
        from bench import suites

        fn, check = suites.make_callable(kernel["source"], gpu, seed)
    elif gpu:
        fn, check = K.make(kernel, seed, compiled)
    else:
        fn, check = K.make(kernel, seed)
    K_cpu.host_work(float(ph["inputs"].get("cpu_s", 0.0)), tag + "/inputs")
    if gpu:
        K.sync()
    pad_to(m0, ph["inputs"], tag, pace, padded, "inputs")
    times["inputs"] = time.perf_counter() - t0

    m0 = mark()
    t0 = m0[0]
    ok, err = check()
    K_cpu.host_work(float(ph["check"].get("cpu_s", 0.0)), tag + "/check")
    pad_to(m0, ph["check"], tag, pace, padded, "check")
    times["check"] = time.perf_counter() - t0

    t = ph["timing"]
    expected = float(kernel.get("expected_ms") or 1.0)
    rep_ms = float(t.get("rep_ms") or max(1.0, t["reps"] * expected))
    reps = int(t["reps"])
    if kernel["kind"] == "suite":  # its duration is unknown to the trace: keep the loop's time budget
        one_ms = _one_call_ms(fn, K if gpu else None)
        reps = max(3, min(reps, int(rep_ms / max(one_ms, 1e-3))))
    if gpu:
        K.sync()
    t0 = time.perf_counter()
    with _region("timing") as r:
        entered = time.perf_counter()
        samples = K.time_calls(fn, t["method"], reps, float(t.get("warmup_ms", 25)), rep_ms)
        held = time.perf_counter() - entered
    times["timing"] = time.perf_counter() - t0
    return {
        "krex_bench": 1,
        "session": line["session"],
        "order": line["order"],
        "kernel": kernel["id"],
        "key": f"{kernel['id']}|{t['method']}",
        "method": t["method"],
        "bucket_expected": kernel.get("bucket"),
        "reps": reps,
        "device": os.environ.get("KREX_BENCH_TORCH_DEVICE", "cuda") if gpu else "cpu",
        "backend": "torch" if gpu else K_cpu.BACKEND,
        "check": {"ok": bool(ok), "max_abs_err": float(err)},
        "phases_s": {k: round(v, 6) for k, v in times.items()},
        "padded_s": padded,
        "region_held_s": round(held, 6),
        "region": _report(r),
        "timing": summarise(samples),
        "pid": os.getpid(),
    }


def _one_call_ms(fn: Any, gpu_mod: Any) -> float:
    """Milliseconds of one call, synchronised (a first estimate, as do_bench makes one)."""
    if gpu_mod is not None:
        gpu_mod.sync()
    t0 = time.perf_counter()
    fn()
    if gpu_mod is not None:
        gpu_mod.sync()
    return (time.perf_counter() - t0) * 1000.0


def _imports(gpu: bool, modules: list[str]) -> float:
    t0 = time.perf_counter()
    if gpu:
        import torch

        on_host = os.environ.get("KREX_BENCH_TORCH_DEVICE") == "cpu"
        try:
            import triton  # noqa: F401
        except ImportError:
            if not on_host:
                raise
        if not on_host:
            torch.cuda.init()
    else:
        with contextlib.suppress(ImportError):
            import numpy  # noqa: F401
    for m in modules:
        if m not in ("torch", "triton", "numpy"):
            with contextlib.suppress(ImportError):
                __import__(m)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=module_prog(__spec__), description="one replayed agent command")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--spec", help="one trace line, as JSON")
    src.add_argument("--spec-file", help="a file holding one trace line")
    src.add_argument("--isolated", help="JSON lines of trace lines: time each alone")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--pace",
        choices=["none", "trace", "wall"],
        default="none",
        help="trace: each phase but timing costs at least the trace's expect_s of CPU "
        "time, padded with real host work (what bench/replay.py asks by default); "
        "wall: at least expect_s of wall-clock time (absorbs freezes)",
    )
    a = ap.parse_args(argv)
    m0 = mark()
    t0 = m0[0]
    from bench.trace_format import validate_line

    if a.isolated:
        lines = [json.loads(x) for x in Path(a.isolated).read_text().splitlines() if x.strip()]
    else:
        lines = [json.loads(a.spec if a.spec else Path(a.spec_file).read_text())]
    for line in lines:
        errs = validate_line(line)
        if errs:
            print("bad spec: " + "; ".join(errs), file=sys.stderr)
            return 2
    gpu = _use_gpu()
    modules = lines[0]["phases"]["import"].get("modules", [])
    imported = _imports(gpu, modules)
    from bench.workload import cpu_kernels

    cpu_kernels.host_work(float(lines[0]["phases"]["import"].get("cpu_s", 0.0)), "import")
    pace = a.pace
    import_padded: dict[str, float] = {}
    pad_to(m0, lines[0]["phases"]["import"], "import", pace, import_padded, "import")
    imported = time.perf_counter() - t0
    rc = 0
    for rep in range(a.repeats):
        for line in lines:
            res = run_one(line, gpu, imported, a.seed, pace)
            res["padded_s"].update(import_padded)
            res["repeat"] = rep
            res["wall_s"] = round(time.perf_counter() - t0, 6)
            if not res["check"]["ok"]:
                rc = 3
            print(json.dumps(res, separators=(",", ":")), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
