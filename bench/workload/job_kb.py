"""KernelBench jobs for bench/workload/job.py: load a problem as KernelBench does, build the
reference and a candidate with the same seed, check them against each other, and time the candidate
with the checkout's own kernelbench.timing (an auto-region under KREX_AUTO_REGION=1) or, where that
module cannot be imported, the same protocol in an explicit region."""

from __future__ import annotations

import importlib
import os
import random
import sys
import time
import types
from typing import Any

from jobutil import close, flat, host_protocol, region, report_of, wrapped


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
        ok = len(a) == len(b) and all(
            x.shape == y.shape and torch.allclose(x, y, atol=1e-2, rtol=1e-2) for x, y in zip(a, b)
        )
        err = max(
            (float((x.float() - y.float()).abs().max()) for x, y in zip(a, b) if x.numel()), default=0.0
        )
    torch.cuda.synchronize()
    times["check"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    kw = dict(
        num_warmup=spec.get("warmup", 3),
        num_trials=spec.get("trials", 100),
        discard_first=1,
        verbose=False,
        device=dev,
    )
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
    return {"check": {"ok": bool(ok), "max_abs_err": err}, "samples": samples, "route": route, "region": rep}


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

        def call() -> Any:
            return fn(
                cand,
                inputs,
                num_warmup=warmup,
                num_trials=trials,
                discard_first=1,
                verbose=False,
                device=None,
            )
    else:

        def call() -> Any:
            return host_protocol(cand, inputs, warmup, trials)

    if timing is not None and wrapped(fn):
        samples, route = call(), route + " / auto-region"
    else:
        with region("timing") as r:
            samples = call()
        rep, route = report_of(r), route + " / explicit region"
    times["timing"] = time.perf_counter() - t0
    return {"check": {"ok": ok, "max_abs_err": err}, "samples": samples, "route": route, "region": rep}
