"""Kernels, inputs, references and host work for the `cpu` device: numpy when it is installed, else
pure Python (so the quick replay runs on a bare interpreter). Every function here is synchronous and
allocates only Python objects; nothing needs closing.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from typing import Any

try:
    import numpy as np
except ImportError:  # the quick replay works without numpy, with smaller sizes
    np = None  # type: ignore[assignment]  # with numpy installed, mypy types np as the module

BACKEND = "numpy" if np is not None else "python"

# Nominal seconds of one unit of host work on a reference core (this project's dev VM, 2026-12):
# the trace's cpu_s becomes a fixed number of units, so contended cores make a phase take longer,
# as they do real work, instead of the phase stopping at a wall-clock deadline.
UNIT_S = 0.00039


def host_work(seconds: float, tag: str) -> int:
    """Do `seconds` (nominal) of real host work: compile generated Python source that embeds `tag`,
    run it, and a numeric loop. Returns the number of units done."""
    units = max(0, round(seconds / UNIT_S))
    acc = 0.0
    for u in range(units):
        src = "\n".join(
            [f"def f_{u}(x):", f"    tag = {tag!r}", "    s = 0.0"]
            + [f"    s += (x * {i} + len(tag)) % {i + 7} / {i + 1}.0" for i in range(24)]
            + ["    return s"]
        )
        ns: dict[str, Any] = {}
        exec(compile(src, f"<agent-{tag}-{u}>", "exec"), ns)
        acc += ns[f"f_{u}"](u)
        acc += sum(math.sqrt(i + acc % 3) for i in range(300))
    return units


def size_of(kernel: dict[str, Any]) -> list[int]:
    size = kernel["size"]
    return list(size[BACKEND] if isinstance(size, dict) else size)


def make(kernel: dict[str, Any], seed: int) -> tuple[Callable[[], Any], Callable[[], tuple[bool, float]]]:
    """(fn, check) for a catalogue kernel: fn runs it once; check compares it with a reference
    computed another way and returns (ok, max_abs_error). Raises ValueError for an unknown kind."""
    kind, size = kernel["kind"], size_of(kernel)
    rng = random.Random(seed)
    if np is not None:
        return _make_numpy(kind, size, np.random.default_rng(seed))
    return _make_python(kind, size, rng)


def _make_numpy(
    kind: str, size: list[int], g: Any
) -> tuple[Callable[[], Any], Callable[[], tuple[bool, float]]]:
    if kind == "matmul":
        m, n, k = size
        a, b = g.standard_normal((m, k)), g.standard_normal((k, n))
        out = np.empty((m, n))
        fn = lambda: np.matmul(a, b, out=out)  # noqa: E731
        ref = lambda: np.einsum("ik,kj->ij", a[:16], b)  # noqa: E731
        got = lambda: fn()[:16]  # noqa: E731
    elif kind == "elementwise":
        x = g.standard_normal(size[0])
        y = np.empty_like(x)
        fn = lambda: np.add(np.multiply(x, 1.5, out=y), 1.0, out=y)  # noqa: E731
        ref = lambda: np.array([v * 1.5 + 1.0 for v in x[:2000].tolist()])  # noqa: E731
        got = lambda: fn()[:2000]  # noqa: E731
    elif kind == "reduction":
        x = g.standard_normal(tuple(size))
        fn = lambda: x.sum(axis=-1)  # noqa: E731
        ref = lambda: np.array([math.fsum(r) for r in x[:8].tolist()])  # noqa: E731
        got = lambda: fn()[:8]  # noqa: E731
    elif kind == "softmax":
        x = g.standard_normal(tuple(size))

        def fn() -> Any:
            e = np.exp(x - x.max(axis=-1, keepdims=True))
            return e / e.sum(axis=-1, keepdims=True)

        ref = lambda: np.exp(x[:8] - np.log(np.exp(x[:8]).sum(axis=-1, keepdims=True)))  # noqa: E731
        got = lambda: fn()[:8]  # noqa: E731
    elif kind == "conv":
        n, k = size
        x, w = g.standard_normal(n), g.standard_normal(k)
        fn = lambda: np.convolve(x, w[::-1], mode="valid")  # noqa: E731
        ref = lambda: np.correlate(x[:4096], w, mode="valid")  # noqa: E731
        got = lambda: fn()[: 4096 - k + 1]  # noqa: E731
    else:
        raise ValueError(f"cpu device has no kernel kind {kind!r}")

    def check() -> tuple[bool, float]:
        err = float(np.max(np.abs(np.asarray(got()) - np.asarray(ref()))))
        return bool(np.isfinite(err) and err < 1e-6), err

    return fn, check


def _make_python(
    kind: str, size: list[int], rng: random.Random
) -> tuple[Callable[[], Any], Callable[[], tuple[bool, float]]]:
    def vec(n: int) -> list[float]:
        return [rng.gauss(0.0, 1.0) for _ in range(n)]

    x: Any
    got: Callable[[], Any]
    ref: Callable[[], Any]
    if kind == "matmul":
        m, n, k = size
        a, b = [vec(k) for _ in range(m)], [vec(n) for _ in range(k)]
        bt = [list(col) for col in zip(*b)]
        fn = lambda: [[sum(p * q for p, q in zip(row, col)) for col in bt] for row in a]  # noqa: E731
        ref = lambda: [[math.fsum(a[i][t] * b[t][j] for t in range(k)) for j in range(n)] for i in range(2)]  # noqa: E731
        got = lambda: fn()[:2]  # noqa: E731
    elif kind == "elementwise":
        x = vec(size[0])
        fn = lambda: [v * 1.5 + 1.0 for v in x]  # noqa: E731
        ref = lambda: [[(v + v / 2.0) + 1.0 for v in x]]  # noqa: E731
        got = lambda: [fn()]  # noqa: E731
    elif kind == "reduction":
        x = [vec(size[1]) for _ in range(size[0])]
        fn = lambda: [sum(r) for r in x]  # noqa: E731
        ref = lambda: [[math.fsum(r) for r in x]]  # noqa: E731
        got = lambda: [fn()]  # noqa: E731
    elif kind == "softmax":
        x = [vec(size[1]) for _ in range(size[0])]

        def fn() -> Any:
            out = []
            for r in x:
                mx = max(r)
                e = [math.exp(v - mx) for v in r]
                s = sum(e)
                out.append([v / s for v in e])
            return out

        def ref() -> Any:
            out = []
            for r in x[:4]:
                lse = math.log(math.fsum(math.exp(u) for u in r))
                out.append([math.exp(v - lse) for v in r])
            return out

        got = lambda: fn()[:4]  # noqa: E731
    elif kind == "conv":
        n, k = size
        x, w = vec(n), vec(k)
        fn = lambda: [sum(x[i + j] * w[j] for j in range(k)) for i in range(n - k + 1)]  # noqa: E731
        ref = lambda: [[math.fsum(x[i + j] * w[j] for j in range(k)) for i in range(min(500, n - k + 1))]]  # noqa: E731
        got = lambda: [fn()[:500]]  # noqa: E731
    else:
        raise ValueError(f"cpu device has no kernel kind {kind!r}")

    def check() -> tuple[bool, float]:
        err = max((abs(p - q) for gr, rr in zip(got(), ref()) for p, q in zip(gr, rr)), default=0.0)
        return math.isfinite(err) and err < 1e-6, err

    return fn, check


def time_calls(fn: Callable[[], Any], method: str, reps: int, warmup_ms: float, rep_ms: float) -> list[float]:
    """Per-call milliseconds by the host clock. On the cpu device every method is the host clock;
    `do_bench` mimics Triton's: warm up for `warmup_ms`, then time calls until `rep_ms` passes."""
    end = time.perf_counter() + warmup_ms / 1000.0
    n = 0
    while n < 2 or time.perf_counter() < end:
        fn()
        n += 1
    out: list[float] = []
    clock = time.perf_counter
    if method == "do_bench":
        stop = clock() + rep_ms / 1000.0
        while len(out) < 5 or (clock() < stop and len(out) < 100000):
            t0 = clock()
            fn()
            out.append((clock() - t0) * 1000.0)
        return out
    for _ in range(reps):
        t0 = clock()
        fn()
        out.append((clock() - t0) * 1000.0)
    return out
