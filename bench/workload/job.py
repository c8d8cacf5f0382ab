"""One real agent job, as bench/jobs.py submits it through `krex gateway`: import, inputs, check, timing.

    python job.py spec.json            # what the gateway runs (files uploaded beside it)

The spec names the job's kind:
- kernelbench: a KernelBench problem (uploaded as problem.py): Model, get_init_inputs, get_inputs. The
  reference and a candidate (the same Model, built with the same seed, as KernelBench's eval builds
  ModelNew) run on the same inputs and are compared (atol = rtol = 1e-2, fp32); then the candidate is
  timed by KernelBench's own harness: the checkout's kernelbench.timing, get_timing_function(method),
  100 trials after 3 warm-ups, per-trial CUDA events with its L2 flush. Under KREX_AUTO_REGION=1 that
  call is a region with no change (krex_async.integrations). Where the checkout's module cannot be
  imported, the job runs the same protocol itself inside an explicit `region("timing")`.
- triton: a fresh Triton kernel (a constant unique to the job: a cache miss), checked against torch,
  timed with triton.testing.do_bench (an auto-region).
- atrex: an Atrex-Bench operator (bench/suites.py loads it from the checkout), timed with do_bench.
- cpu: a stand-in for machines without a GPU: real work in every phase (stdlib imports, building
  inputs, a checked pure-Python kernel, per-trial host timing in an explicit region).
On the cpu device the kernelbench and atrex kinds run plain-Python problems with the host clock.

A spec with "batch": [spec, ...] runs the imports once and then each job in turn (the alone pass).
One JSON line per job on stdout, {"krex_job": 1, ...}: phases_s, the timing samples, the check, how
it was timed (route) and, for an explicit region, its report. Exit 0 when every check passed, 3 when
one failed, 2 for a bad spec. Standard library only, besides torch/triton on a GPU; jobutil.py and
job_kb.py (KernelBench) are uploaded beside it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import random
import sys
import time
import types
from collections.abc import Callable
from typing import Any


def _beside(name: str) -> types.ModuleType:
    """A module uploaded beside this script, loaded from this folder by path (a pool worker running
    the script as __main__ may not put its folder on sys.path); registered so that the others'
    `from jobutil import ...` finds it."""
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


for _name in ("bench_stats", "jobutil", "job_kb"):  # each after the ones it imports
    _beside(_name)
from job_kb import kb_cpu, kb_gpu, kb_timing  # noqa: E402
from jobutil import host_protocol, region, report_of, summary, wrapped  # noqa: E402

# ------------------------------------------------------------------------------------ imports


def import_gpu(kinds: set[str], kb_src: str | None) -> tuple[Any, str]:
    """torch (and triton where a kind needs it), the CUDA context, KernelBench's timing module."""
    import torch

    if kinds & {"triton", "atrex"}:
        import triton  # noqa: F401
        import triton.testing  # noqa: F401
    torch.cuda.init()
    torch.empty(1, device="cuda")
    return kb_timing(kb_src) if "kernelbench" in kinds else (None, "")


def import_cpu() -> None:
    """Real import work of a fresh interpreter: modules an agent's script pulls in."""
    import asyncio  # noqa: F401
    import decimal  # noqa: F401
    import email.parser  # noqa: F401
    import fractions  # noqa: F401
    import http.client  # noqa: F401
    import statistics  # noqa: F401
    import xml.dom.minidom  # noqa: F401

    with contextlib.suppress(ImportError):
        import numpy  # noqa: F401


# ------------------------------------------------------------------------- triton and atrex

TRITON_SRC = """
import triton
import triton.language as tl


@triton.jit
def scale_add(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * {const} + 1.0, mask=mask)
"""


def do_bench_timed(fn: Callable[[], Any], route: str) -> tuple[list[float], str, Any]:
    """triton.testing.do_bench(return_mode="all"): an auto-region under KREX_AUTO_REGION=1, else an
    explicit one."""
    import triton.testing

    bench = lambda: list(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="all"))  # noqa: E731
    if wrapped(triton.testing.do_bench):
        return bench(), route + " / auto-region", None
    with region("timing") as r:
        samples = bench()
    return samples, route + " / explicit region", report_of(r)


def triton_job(spec: dict[str, Any], times: dict[str, float]) -> dict[str, Any]:
    import torch
    import triton

    t0 = time.perf_counter()
    const = 1.5 + (sum((i + 1) * ord(c) for i, c in enumerate(spec.get("tag", spec["key"]))) % 99991) * 1e-9
    path = os.path.abspath(f"kernel_{os.getpid()}_{abs(hash(spec.get('tag', spec['key'])))}.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(TRITON_SRC.format(const=repr(const)))
    modspec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    assert modspec is not None and modspec.loader is not None
    mod = importlib.util.module_from_spec(modspec)
    modspec.loader.exec_module(mod)
    kern = mod.scale_add

    def launch(x: Any, y: Any) -> None:
        kern[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)

    small = torch.randn(4096, device="cuda")
    launch(small, torch.empty_like(small))
    torch.cuda.synchronize()
    times["compile"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    g = torch.Generator(device="cuda").manual_seed(spec.get("seed", 1))
    x = torch.randn(int(spec["n"]), device="cuda", generator=g)
    y = torch.empty_like(x)
    torch.cuda.synchronize()
    times["inputs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    launch(x, y)
    err = float((y[: 1 << 20].double() - (x[: 1 << 20].double() * const + 1.0)).abs().max())
    times["check"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    samples, route, rep = do_bench_timed(lambda: launch(x, y), "triton do_bench")
    times["timing"] = time.perf_counter() - t0
    return {
        "check": {"ok": err < 1e-5, "max_abs_err": err},
        "samples": samples,
        "route": route,
        "region": rep,
    }


def atrex_job(spec: dict[str, Any], gpu: bool, times: dict[str, float]) -> dict[str, Any]:
    suites: Any = _beside("suites")  # bench/suites.py, uploaded beside this file
    t0 = time.perf_counter()
    fn, check = suites.make_callable(spec["source"], gpu, spec.get("seed", 1))
    if gpu:
        import torch

        torch.cuda.synchronize()
    times["inputs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ok, err = check()
    times["check"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if gpu:
        samples, route, rep = do_bench_timed(fn, "atrex do_bench")
    else:
        with region("timing") as r:
            samples = host_protocol(lambda: fn(), [], 3, int(spec.get("trials", 100)))
        route, rep = "atrex host protocol / explicit region", report_of(r)
    times["timing"] = time.perf_counter() - t0
    return {
        "check": {"ok": bool(ok), "max_abs_err": float(err)},
        "samples": samples,
        "route": route,
        "region": rep,
    }


def cpu_job(spec: dict[str, Any], times: dict[str, float]) -> dict[str, Any]:
    """The cpu stand-in: inputs built from a seed, a sum-of-products kernel checked against math.fsum,
    timed per trial on the host in an explicit region (nothing to auto-wrap without do_bench)."""
    t0 = time.perf_counter()
    rng = random.Random(f"{spec.get('tag', spec['key'])}/{spec['n']}")
    xs = [rng.uniform(-1.0, 1.0) for _ in range(int(spec["n"]))]
    ys = [rng.uniform(-1.0, 1.0) for _ in range(int(spec["n"]))]
    times["inputs"] = time.perf_counter() - t0

    def kernel(a: list[float], b: list[float]) -> float:
        s = 0.0
        for p, q in zip(a, b):
            s += p * q
        return s

    t0 = time.perf_counter()
    got, want = kernel(xs, ys), math.fsum(p * q for p, q in zip(xs, ys))
    times["check"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with region("timing") as r:
        samples = host_protocol(kernel, [xs, ys], 3, int(spec.get("trials", 100)))
    times["timing"] = time.perf_counter() - t0
    err = abs(got - want)
    return {
        "check": {"ok": err <= 1e-9 * len(xs), "max_abs_err": err},
        "samples": samples,
        "route": "cpu host protocol / explicit region",
        "region": report_of(r),
    }


# ----------------------------------------------------------------------------------- main


def run(specs: list[dict[str, Any]], t_start: float) -> int:
    gpu = specs[0].get("device") == "gpu"
    kinds = {s["kind"] for s in specs}
    timing, route = None, ""
    if gpu:
        timing, route = import_gpu(kinds, specs[0].get("kb_src"))
    else:
        import_cpu()
        if "kernelbench" in kinds:
            timing, route = kb_timing(specs[0].get("kb_src"))
    imported = time.perf_counter() - t_start
    rc = 0
    for spec in specs:
        times: dict[str, float] = {"import": imported}
        t0 = time.perf_counter()
        if spec["kind"] == "kernelbench":
            res = (kb_gpu if gpu else kb_cpu)(spec, timing, route or "own protocol", times)
        elif spec["kind"] == "triton":
            res = triton_job(spec, times)
        elif spec["kind"] == "atrex":
            res = atrex_job(spec, gpu, times)
        else:
            res = cpu_job(spec, times)
        if not res["check"]["ok"]:
            rc = 3
        samples = res.pop("samples")
        print(
            json.dumps(
                {
                    "krex_job": 1,
                    "key": spec["key"],
                    "kind": spec["kind"],
                    **res,
                    "phases_s": {k: round(v, 6) for k, v in times.items()},
                    "job_s": round(time.perf_counter() - t0 + imported, 6),
                    "timing": summary([float(x) for x in samples]),
                    "pid": os.getpid(),
                },
                separators=(",", ":"),
            ),
            flush=True,
        )
    return rc


def main(argv: list[str]) -> int:
    t_start = time.perf_counter()
    try:
        with open(argv[1] if len(argv) > 1 else "spec.json", encoding="utf-8") as f:
            spec = json.load(f)
        specs = spec["batch"] if "batch" in spec else [spec]
        if not specs or any(
            s.get("kind") not in ("kernelbench", "triton", "atrex", "cpu") or "key" not in s for s in specs
        ):
            raise ValueError("every job needs a kind (kernelbench|triton|atrex|cpu) and a key")
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"job: bad spec: {e}", file=sys.stderr)
        return 2
    return run(specs, t_start)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
