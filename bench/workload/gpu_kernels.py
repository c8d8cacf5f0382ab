"""Kernels, inputs, references, fresh Triton compiles and timing methods for a CUDA device (torch and
triton). Imported only on GPU machines. Tensors live on the current CUDA device and are freed with the
process; compiled kernels' sources are written to a temporary directory that is removed at exit.

KREX_BENCH_TORCH_DEVICE=cpu runs the same torch code on the host (no Triton, no CUDA events): only
for smoke-testing these code paths without a GPU; its timings mean nothing.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

try:
    import triton
except ImportError:  # only the smoke test on torch-cpu runs without it
    triton = None

DEVICE = os.environ.get("KREX_BENCH_TORCH_DEVICE", "cuda")

_SRC_DIR = Path(tempfile.mkdtemp(prefix="krex-agent-"))
atexit.register(shutil.rmtree, _SRC_DIR, True)

# One elementwise kernel; `{const}` makes each command's source, and so its cache key, unique.
_TRITON_SRC = """
import triton
import triton.language as tl


@triton.jit
def scale_add(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, x * {const} + 1.0, mask=mask)
"""

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _const(tag: str, i: int) -> float:
    """A constant unique to (tag, i), close to 1.5 so results stay comparable."""
    h = sum((j + 1) * ord(c) for j, c in enumerate(f"{tag}/{i}")) % 99991
    return 1.5 + h * 1e-9


def compile_fresh(tag: str, count: int, how: str = "triton") -> list[tuple[Callable[..., Any], float]]:
    """Compile `count` kernels nobody compiled before (Triton cache misses, or torch.compile) and run
    each once on a small tensor so the compile happens here. Returns (launch(x, y), constant) pairs."""
    out: list[tuple[Callable[..., Any], float]] = []
    small = torch.randn(4096, device=DEVICE)
    for i in range(count):
        c = _const(tag, i)
        if how == "torch_compile":
            f = torch.compile(lambda x, c=c: x * c + 1.0, dynamic=False)
            f(small)

            def launch(x: Any, y: Any, f: Any = f) -> None:
                y.copy_(f(x))
        else:
            path = _SRC_DIR / f"k_{abs(hash((tag, i)))}_{i}.py"
            path.write_text(_TRITON_SRC.format(const=repr(c)))
            spec = importlib.util.spec_from_file_location(path.stem, path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            kern = mod.scale_add

            def launch(x: Any, y: Any, f: Any = kern) -> None:
                n = x.numel()
                f[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024)

            launch(small, torch.empty_like(small))
        out.append((launch, c))
    sync()
    return out


def make(
    kernel: dict[str, Any], seed: int, compiled: list[tuple[Callable[..., Any], float]]
) -> tuple[Callable[[], Any], Callable[[], tuple[bool, float]]]:
    """(fn, check): fn launches the kernel once (asynchronously); check compares one run against a
    reference computed another way (in float32/float64) and returns (ok, max_abs_error)."""
    kind, size = kernel["kind"], list(kernel["size"])
    dt = DTYPES[kernel.get("dtype") or "float32"]
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device=DEVICE, dtype=dt, generator=g)  # noqa: E731
    if kind == "matmul":
        m, n, k = size
        a, b = rnd(m, k), rnd(k, n)
        c = torch.empty(m, n, device=DEVICE, dtype=dt)
        fn = lambda: torch.mm(a, b, out=c)  # noqa: E731
        got = lambda: fn()[:64].double()  # noqa: E731
        ref = lambda: a[:64].double() @ b.double()  # noqa: E731
        tol = 2e-2 * (k**0.5) if dt != torch.float32 else 1e-2 * (k**0.5)
    elif kind == "elementwise":
        x = rnd(size[0]).float()
        y = torch.empty_like(x)
        launch, const = compiled[0]
        fn = lambda: launch(x, y)  # noqa: E731

        def got() -> Any:
            fn()
            return y[: 1 << 20].double()

        ref = lambda: x[: 1 << 20].double() * const + 1.0  # noqa: E731
        tol = 1e-5
    elif kind == "reduction":
        x = rnd(*size)
        fn = lambda: torch.sum(x, dim=-1)  # noqa: E731
        got = lambda: fn()[:64].double()  # noqa: E731
        ref = lambda: x[:64].double().sum(dim=-1)  # noqa: E731
        tol = 1e-3 * size[-1] ** 0.5
    elif kind == "softmax":
        x = rnd(*size)
        fn = lambda: torch.softmax(x, dim=-1)  # noqa: E731
        got = lambda: fn()[:16].double()  # noqa: E731
        ref = lambda: torch.exp(x[:16].double() - torch.logsumexp(x[:16].double(), -1, keepdim=True))  # noqa: E731
        tol = 1e-4
    elif kind == "conv":
        nb, cin, h, w, cout, ks = size
        x, wt = rnd(nb, cin, h, w), rnd(cout, cin, ks, ks) / (cin * ks * ks) ** 0.5
        fn = lambda: torch.nn.functional.conv2d(x, wt, padding=ks // 2)  # noqa: E731
        got = lambda: fn()[:1].double()  # noqa: E731
        ref = lambda: torch.nn.functional.conv2d(x[:1].double(), wt.double(), padding=ks // 2)  # noqa: E731
        tol = 5e-2
    else:
        raise ValueError(f"no GPU kernel kind {kind!r}")

    def check() -> tuple[bool, float]:
        err = float((got() - ref()).abs().max().item())
        return bool(err == err and err < tol), err

    return fn, check


def time_calls(fn: Callable[[], Any], method: str, reps: int, warmup_ms: float, rep_ms: float) -> list[float]:
    """Per-call milliseconds by `method`, after warming up for `warmup_ms` (clocks up, caches hot):
    cuda_events: an event pair around each call, read after one final synchronise;
    do_bench: triton.testing.do_bench(return_mode="all") for `rep_ms`;
    host_sync: perf_counter around each call followed by torch.cuda.synchronize()."""
    if method == "do_bench":
        try:
            return [
                float(v)
                for v in triton.testing.do_bench(
                    fn, warmup=max(1, int(warmup_ms)), rep=max(1, int(rep_ms)), return_mode="all"
                )
            ]
        except (TypeError, AssertionError, ValueError):  # a triton without return_mode="all": one median
            return [
                float(
                    triton.testing.do_bench(
                        fn, warmup=max(1, int(warmup_ms)), rep=max(1, int(rep_ms)), return_mode="median"
                    )
                )
            ]
    sync()
    end = time.perf_counter() + warmup_ms / 1000.0
    n = 0
    while n < 3 or time.perf_counter() < end:
        fn()
        n += 1
        if n % 8 == 0:
            sync()
    sync()
    if method == "cuda_events":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        sync()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]
    out: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


def sync() -> str:
    if DEVICE != "cpu":
        torch.cuda.synchronize()
    return "torch"


def median(xs: list[float]) -> float:
    return statistics.median(xs)
