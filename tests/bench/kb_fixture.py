"""Tiny look-alikes of a KernelBench checkout and an Atrex-Bench checkout, written by the tests.

Plain-Python problems (no torch), so they run on the cpu device; a src/kernelbench package whose
__init__ fails the way the real one does without its LLM clients, and whose timing module has the
real one's shape (get_timing_function by method name, time_execution_with_* signatures). Nothing of
either suite is copied.
"""

from __future__ import annotations

import json
from pathlib import Path

KB_L1 = """
import random


class Model:
    def __init__(self, scale):
        self.scale = scale

    def __call__(self, xs, ys):
        return [self.scale * x + y for x, y in zip(xs, ys)]


def get_inputs():
    return [[random.random() for _ in range(3000)], [1.0] * 3000]


def get_init_inputs():
    return [2.0]
"""

KB_L2 = """
import random


class Model:
    def __init__(self):
        pass

    def __call__(self, xs):
        return sum(x * x for x in xs)


def get_inputs():
    return [[random.random() for _ in range(20000)]]


def get_init_inputs():
    return []
"""

# A candidate whose check fails: its output differs run to run.
KB_BAD = """
import random


class Model:
    def __call__(self, xs):
        return [x + random.random() for x in xs]


def get_inputs():
    return [[1.0] * 100]


def get_init_inputs():
    return []
"""

KB_INIT = "from . import utils  # the real package pulls its LLM clients in here\n"
KB_UTILS = "import an_llm_client_not_installed  # noqa: F401\n"
KB_TIMING = """
import time


def get_timing_function(method="cuda_event"):
    match method:
        case "cuda_event":
            return time_execution_with_cuda_event
        case "do_bench":
            return time_execution_with_do_bench_interface
        case "do_bench_impl":
            return time_execution_with_do_bench_impl
        case "host_time":
            return time_execution_with_host_time
        case _:
            raise ValueError(f"Unsupported timing method: {method}")


def time_execution_with_cuda_event(kernel_fn, args, num_warmup=3, num_trials=10, discard_first=1,
                                   verbose=True, device=None):
    raise RuntimeError("needs CUDA")


time_execution_with_do_bench_interface = time_execution_with_do_bench_impl = time_execution_with_cuda_event


def time_execution_with_host_time(kernel_fn, args, num_warmup=3, num_trials=10, discard_first=1,
                                  verbose=True, device=None):
    for _ in range(num_warmup):
        kernel_fn(*args)
    out = []
    for trial in range(num_trials + discard_first):
        t0 = time.perf_counter()
        kernel_fn(*args)
        if trial >= discard_first:
            out.append((time.perf_counter() - t0) * 1e3)
    return out
"""

ATREX_REF = """
class Model:
    def __init__(self, n):
        self.n = n

    def __call__(self, x):
        s = sum(v * v for v in x) ** 0.5 + 1e-6
        return [v / s for v in x]
"""

ATREX_INPUT = """
def _make_inputs(length):
    return {"x": [float(i % 7) for i in range(length)]}
"""


def write_kernelbench(root: Path, timing: bool = True, bad: bool = False) -> Path:
    """root/KernelBench/level{1,2}/*.py (+ level1/3_bad.py) and, with `timing`, root/src/kernelbench."""
    for level, name, text in ((1, "1_scale_add", KB_L1), (2, "7_sum_squares", KB_L2)):
        d = root / "KernelBench" / f"level{level}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{name}.py").write_text(text)
    if bad:
        (root / "KernelBench" / "level1" / "3_bad.py").write_text(KB_BAD)
    if timing:
        pkg = root / "src" / "kernelbench"
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text(KB_INIT)
        (pkg / "utils.py").write_text(KB_UTILS)
        (pkg / "timing.py").write_text(KB_TIMING)
    return root


def write_atrex(root: Path) -> Path:
    op = root / "data" / "l2norm"
    op.mkdir(parents=True, exist_ok=True)
    (op / "reference.py").write_text(ATREX_REF)
    (op / "input.py").write_text(ATREX_INPUT)
    (op / "shapes.json").write_text(
        json.dumps({"s1": {"init_kwargs": {"n": 2000}, "input_kwargs": {"length": 2000}}})
    )
    return root
