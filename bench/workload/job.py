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
one failed, 2 for a bad spec. Standard library only, besides torch/triton on a GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import os
import random
import sys
import time
import types
from typing import Any, Callable

TRIAL_FLUSH_BYTES = 4 << 20  # the cpu protocol's stand-in for KernelBench's 256 MB L2 flush


def region(name: str) -> Any:
    """krex's region (a no-op with one warning outside krex), or nothing where krex is missing."""
    try:
        from krex_async import region as r
    except ImportError:
        return contextlib.nullcontext(None)
    return r(name)


def wrapped(fn: Any) -> bool:
    """True when KREX_AUTO_REGION=1 has made fn a region already."""
    return getattr(fn, "__krex_region__", None) is not None


def report_of(r: Any) -> dict[str, Any] | None:
    rep = getattr(r, "report", None)
    if rep is None:
        return None
    return {k: getattr(rep, k) for k in ("wait_s", "enter_s", "freeze_s", "drain", "frozen")
            if hasattr(rep, k)}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def summary(samples: list[float]) -> dict[str, Any]:
    return {"n": len(samples), "median_ms": pct(samples, 0.5), "p95_ms": pct(samples, 0.95),
            "min_ms": min(samples), "max_ms": max(samples),
            "samples_ms": [round(x, 6) for x in samples[:2000]]}


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


def kb_timing(src: str | None) -> tuple[Any, str]:
    """The checkout's kernelbench.timing, through the normal import system (so KREX_AUTO_REGION's hook
    sees it): as its package, or, when the package's __init__ fails (it imports LLM clients the
    timing does not need), as a module of a bare package at the same path. (None, why) otherwise."""
    if not src:
        return None, "own protocol (no kernelbench src/ given)"
    sys.path.insert(0, src)
    try:
        return importlib.import_module("kernelbench.timing"), "kernelbench.timing"
    except Exception as e:  # noqa: BLE001 - any failure of the package's own imports
        first = f"{type(e).__name__}: {e}"
    for m in [m for m in sys.modules if m == "kernelbench" or m.startswith("kernelbench.")]:
        del sys.modules[m]
    pkg = types.ModuleType("kernelbench")
    pkg.__path__ = [os.path.join(src, "kernelbench")]
    sys.modules["kernelbench"] = pkg
    try:
        return importlib.import_module("kernelbench.timing"), "kernelbench.timing (bare package)"
    except Exception as e:  # noqa: BLE001
        del sys.modules["kernelbench"]
        return None, f"own protocol ({first}; {type(e).__name__}: {e})"


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


# ------------------------------------------------------------------------------- kernelbench

def kb_load(path: str) -> tuple[Any, Any, Any]:
    """Model, get_init_inputs, get_inputs of a problem file (run as KernelBench runs its source)."""
    ns: dict[str, Any] = {"__name__": "kb_problem"}
    with open(path, encoding="utf-8") as f:
        exec(compile(f.read(), path, "exec"), ns)
    return ns["Model"], ns["get_init_inputs"], ns["get_inputs"]


def kb_gpu(spec: dict[str, Any], timing: Any, route: str, times: dict[str, float]) -> dict[str, Any]:
    import torch
    dev = torch.device("cuda", torch.cuda.current_device())

    def seed(n: int) -> None:
        torch.manual_seed(n)
        torch.cuda.manual_seed(n)

    def move(xs: list[Any]) -> list[Any]:
        return [x.to(dev) if isinstance(x, torch.Tensor) else x for x in xs]

    t0 = time.perf_counter()
    Model, get_init_inputs, get_inputs = kb_load(spec["problem"])
    seed(42)
    init = move(get_init_inputs())
    seed(42)
    ref = Model(*init).to(dev)
    seed(42)
    cand = Model(*init).to(dev)
    seed(42)
    inputs = move(get_inputs())
    torch.cuda.synchronize()
    times["inputs"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    with torch.no_grad():
        def outs(v: Any) -> list[Any]:  # a tensor, or a tuple of tensors and numbers
            return [torch.as_tensor(x, device=dev) for x in (v if isinstance(v, (tuple, list)) else [v])]
        a, b = outs(ref(*inputs)), outs(cand(*inputs))
        ok = len(a) == len(b) and all(x.shape == y.shape and torch.allclose(x, y, atol=1e-2, rtol=1e-2)
                                      for x, y in zip(a, b))
        err = max((float((x.float() - y.float()).abs().max()) for x, y in zip(a, b) if x.numel()),
                  default=0.0)
    torch.cuda.synchronize()
    times["check"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    kw = dict(num_warmup=spec.get("warmup", 3), num_trials=spec.get("trials", 100),
              discard_first=1, verbose=False, device=dev)
    rep = None
    with torch.no_grad():
        if timing is not None:
            fn = timing.get_timing_function(spec.get("method", "cuda_event"))
            if wrapped(fn):
                samples = fn(cand, inputs, **kw)
                route += " / auto-region"
            else:
                with region("timing") as r:
                    samples = fn(cand, inputs, **kw)
                rep, route = report_of(r), route + " / explicit region"
        else:
            with region("timing") as r:
                samples = cuda_event_protocol(cand, inputs, dev, kw["num_warmup"], kw["num_trials"])
            rep = report_of(r)
    times["timing"] = time.perf_counter() - t0
    return {"check": {"ok": bool(ok), "max_abs_err": err}, "samples": samples, "route": route,
            "region": rep}


def cuda_event_protocol(fn: Any, args: list[Any], dev: Any, warmup: int, trials: int) -> list[float]:
    """KernelBench's default protocol, for checkouts without kernelbench.timing: synchronised
    warm-ups, then per trial a sync, a 256 MB fill to flush L2, and CUDA events around one call;
    the first trial is dropped."""
    import torch
    for _ in range(warmup):
        fn(*args)
        torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    out = []
    for i in range(trials + 1):
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.empty((32, 1024, 1024), dtype=torch.int64, device=dev).fill_(42)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize(dev)
        if i:
            out.append(start.elapsed_time(end))
    return out


def host_protocol(fn: Callable[..., Any], args: list[Any], warmup: int, trials: int) -> list[float]:
    """The same protocol with the host clock (the cpu device): warm-ups, a cache-sized write before
    each trial, the first trial dropped."""
    for _ in range(warmup):
        fn(*args)
    flush = bytearray(TRIAL_FLUSH_BYTES)
    out = []
    for i in range(trials + 1):
        flush[:] = bytes(len(flush))
        t0 = time.perf_counter()
        fn(*args)
        if i:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def flat(x: Any) -> list[float]:
    if isinstance(x, (list, tuple)):
        return [v for e in x for v in flat(e)]
    if isinstance(x, dict):
        return [v for k in sorted(x) for v in flat(x[k])]
    return [float(x)]


def close(a: list[float], b: list[float]) -> tuple[bool, float]:
    err = max((abs(p - q) for p, q in zip(a, b)), default=0.0)
    ok = len(a) == len(b) and all(math.isfinite(p) and abs(p - q) <= 1e-2 + 1e-2 * abs(q)
                                  for p, q in zip(a, b))
    return ok, err


def kb_cpu(spec: dict[str, Any], timing: Any, route: str, times: dict[str, float]) -> dict[str, Any]:
    """A plain-Python KernelBench-format problem on the host; timing by the checkout's host_time
    method where its module imports, else by host_protocol in an explicit region."""
    t0 = time.perf_counter()
    Model, get_init_inputs, get_inputs = kb_load(spec["problem"])
    random.seed(42)
    init = get_init_inputs()
    ref, cand = Model(*init), Model(*init)
    random.seed(42)
    inputs = get_inputs()
    times["inputs"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ok, err = close(flat(ref(*inputs)), flat(cand(*inputs)))
    times["check"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    warmup, trials, rep = spec.get("warmup", 3), spec.get("trials", 100), None
    if timing is not None:
        fn = timing.get_timing_function(spec.get("method", "host_time"))
        call = lambda: fn(cand, inputs, num_warmup=warmup, num_trials=trials,  # noqa: E731
                          discard_first=1, verbose=False, device=None)
    else:
        call = lambda: host_protocol(cand, inputs, warmup, trials)  # noqa: E731
    if timing is not None and wrapped(fn):
        samples, route = call(), route + " / auto-region"
    else:
        with region("timing") as r:
            samples = call()
        rep, route = report_of(r), route + " / explicit region"
    times["timing"] = time.perf_counter() - t0
    return {"check": {"ok": ok, "max_abs_err": err}, "samples": samples, "route": route, "region": rep}


# ------------------------------------------------------------------------- triton and atrex

TRITON_SRC = '''
import triton
import triton.language as tl


@triton.jit
def scale_add(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * {const} + 1.0, mask=mask)
'''


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
    err = float((y[:1 << 20].double() - (x[:1 << 20].double() * const + 1.0)).abs().max())
    times["check"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    samples, route, rep = do_bench_timed(lambda: launch(x, y), "triton do_bench")
    times["timing"] = time.perf_counter() - t0
    return {"check": {"ok": err < 1e-5, "max_abs_err": err}, "samples": samples, "route": route,
            "region": rep}


def atrex_job(spec: dict[str, Any], gpu: bool, times: dict[str, float]) -> dict[str, Any]:
    import suites  # uploaded beside this file: bench/suites.py
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
    return {"check": {"ok": bool(ok), "max_abs_err": float(err)}, "samples": samples, "route": route,
            "region": rep}


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
    return {"check": {"ok": err <= 1e-9 * len(xs), "max_abs_err": err}, "samples": samples,
            "route": "cpu host protocol / explicit region", "region": report_of(r)}


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
        print(json.dumps({"krex_job": 1, "key": spec["key"], "kind": spec["kind"], **res,
                          "phases_s": {k: round(v, 6) for k, v in times.items()},
                          "job_s": round(time.perf_counter() - t0 + imported, 6),
                          "timing": summary([float(x) for x in samples]), "pid": os.getpid()},
                         separators=(",", ":")), flush=True)
    return rc


def main(argv: list[str]) -> int:
    t_start = time.perf_counter()
    try:
        with open(argv[1] if len(argv) > 1 else "spec.json", encoding="utf-8") as f:
            spec = json.load(f)
        specs = spec["batch"] if "batch" in spec else [spec]
        if not specs or any(s.get("kind") not in ("kernelbench", "triton", "atrex", "cpu")
                            or "key" not in s for s in specs):
            raise ValueError("every job needs a kind (kernelbench|triton|atrex|cpu) and a key")
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"job: bad spec: {e}", file=sys.stderr)
        return 2
    return run(specs, t_start)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main(sys.argv))
