"""Auto-regions: wrappers around do_bench / torch Timer enter and leave krex_async.region.

`region` itself is the lead's (krex_async/region.py); here a recording context manager stands in
for it through krex_async.region, the name the wrappers look up. What is under test is the
wrapping: the hook, idempotence, signatures, return values and no nesting.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import krex_async
from krex_async import integrations

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "krex_async" / "runtime"

FAKE_TRITON_TESTING = '''
CALLS = []
def do_bench(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None, return_mode="mean"):
    """triton's signature"""
    CALLS.append("do_bench")
    fn()
    return 1.25
def do_bench_cudagraph(fn, rep=20, grad_to_none=None, quantiles=None, return_mode="mean"):
    CALLS.append("do_bench_cudagraph")
    return do_bench(fn)  # nested: must not open a second region
'''

RECORDER = """
import contextlib, krex_async
EVENTS = []
@contextlib.contextmanager
def region(name, **kw):
    EVENTS.append(("enter", name))
    try:
        yield None
    finally:
        EVENTS.append(("exit", name))
krex_async.region = region
"""


@pytest.fixture
def fake_triton(tmp_path: Path) -> Path:
    pkg = tmp_path / "triton"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "testing.py").write_text(FAKE_TRITON_TESTING)
    (tmp_path / "krex_recorder.py").write_text(RECORDER)
    return tmp_path


def test_auto_region_hook_wraps_do_bench_at_import(fake_triton: Path) -> None:
    code = (
        "import krex_recorder\n"
        "from triton.testing import do_bench, do_bench_cudagraph\n"  # bound after the patch
        "import inspect, triton.testing as tt\n"
        "r = do_bench(lambda: krex_recorder.EVENTS.append(('body', '')), rep=5)\n"
        "r2 = do_bench_cudagraph(lambda: None)\n"
        "print(r, r2, list(inspect.signature(do_bench).parameters)[:3], tt.do_bench is do_bench)\n"
        "print(krex_recorder.EVENTS)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KREX_")}
    # krex_async is found beside the runtime directory: REPO is deliberately not on the path
    env.update(KREX_AUTO_REGION="1", PYTHONPATH=os.pathsep.join([str(RUNTIME), str(fake_triton), str(REPO)]))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=fake_triton
    )
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first == "1.25 1.25 ['fn', 'warmup', 'rep'] True"
    assert second == str(
        [
            ("enter", "triton.do_bench"),
            ("body", ""),
            ("exit", "triton.do_bench"),
            ("enter", "triton.do_bench_cudagraph"),
            ("exit", "triton.do_bench_cudagraph"),
        ]
    )


def test_without_the_flag_nothing_is_wrapped(fake_triton: Path) -> None:
    code = "import triton.testing as tt; print(hasattr(tt.do_bench, '__krex_region__'))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KREX_")}
    env.update(PYTHONPATH=os.pathsep.join([str(RUNTIME), str(fake_triton)]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout == "False\n", out.stderr


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str, dict[str, Any]]]]:
    log: list[tuple[str, str, dict[str, Any]]] = []

    @contextlib.contextmanager
    def region(name: str, **kw: Any) -> Iterator[None]:
        log.append(("enter", name, kw))
        try:
            yield None
        finally:
            log.append(("exit", name, kw))

    monkeypatch.setattr(krex_async, "region", region, raising=False)
    yield log


def test_wrapping_is_idempotent_and_preserves_values(
    events: list, fake_triton: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(fake_triton))
    import importlib

    tt = importlib.import_module("triton.testing")
    original = tt.do_bench
    assert integrations.wrap_triton_testing(tt) == ["do_bench", "do_bench_cudagraph"]
    wrapped = tt.do_bench
    assert integrations.wrap_triton_testing(tt) == []  # second time: nothing
    assert integrations.wrap_module("triton.testing", tt) == []
    assert tt.do_bench is wrapped and wrapped.__wrapped__ is original
    assert inspect.signature(wrapped) == inspect.signature(original)
    assert wrapped.__doc__ == "triton's signature"
    assert wrapped(lambda: None, rep=3) == 1.25
    assert [e[:2] for e in events] == [("enter", "triton.do_bench"), ("exit", "triton.do_bench")]
    sys.modules.pop("triton.testing", None)
    sys.modules.pop("triton", None)


def test_decorator_exceptions_and_nesting(events: list) -> None:
    @integrations.timed_region("outer", warm_ms=5)
    def outer(x: int) -> int:
        return inner(x) + 1

    @integrations.timed_region("inner")
    def inner(x: int) -> int:
        if x < 0:
            raise ValueError("negative")
        return x * 2

    assert outer(3) == 7
    assert events == [("enter", "outer", {"warm_ms": 5}), ("exit", "outer", {"warm_ms": 5})]
    events.clear()
    with pytest.raises(ValueError, match="negative"):
        inner(-1)
    assert [e[0] for e in events] == ["enter", "exit"]  # the region is left before it propagates
    events.clear()
    assert inner(2) == 4 and len(events) == 2  # not stuck "inside" after the exception


def test_torch_timer_methods_wrapped_on_the_class(events: list) -> None:
    class FakeTimerModule:
        class Timer:
            def __init__(self, stmt: str = "pass") -> None:
                self.stmt = stmt

            def timeit(self, number: int = 1000000) -> str:
                return f"timeit {number}"

            def blocked_autorange(self, callback: Any = None, min_run_time: float = 0.2) -> str:
                return "blocked"

            def adaptive_autorange(self, threshold: float = 0.1) -> str:
                return self.blocked_autorange()  # nested inside the outer region

    mod = FakeTimerModule
    assert integrations.wrap_module("torch.utils.benchmark.utils.timer", mod) == [
        "timeit",
        "blocked_autorange",
        "adaptive_autorange",
    ]
    assert integrations.wrap_torch_timer(mod) == []
    t = mod.Timer()
    assert t.timeit(5) == "timeit 5" and t.adaptive_autorange() == "blocked"
    assert [e[:2] for e in events] == [
        ("enter", "torch.Timer.timeit"),
        ("exit", "torch.Timer.timeit"),
        ("enter", "torch.Timer.adaptive_autorange"),
        ("exit", "torch.Timer.adaptive_autorange"),
    ]
    assert list(inspect.signature(mod.Timer.blocked_autorange).parameters) == [
        "self",
        "callback",
        "min_run_time",
    ]


# A package of kernelbench.timing's shape: the four timing functions, handed out by name from
# get_timing_function(method) at call time, and the do_bench method calling triton's do_bench.
FAKE_KERNELBENCH_INIT = "import os  # the real one imports its utils (LLM clients): not needed here\n"
FAKE_KERNELBENCH_TIMING = '''
import krex_recorder
def _loop(tag, kernel_fn, args, num_trials):
    krex_recorder.EVENTS.append(("body", tag))
    return [float(kernel_fn(*args)) for _ in range(num_trials)]
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
    """events"""
    return _loop("cuda_event", kernel_fn, args, num_trials)
def time_execution_with_do_bench_interface(kernel_fn, args, num_warmup=3, num_trials=10,
                                           discard_first=1, verbose=True, device=None):
    from triton import testing as triton_testing
    return [triton_testing.do_bench(lambda: kernel_fn(*args), return_mode="all")]
def time_execution_with_do_bench_impl(kernel_fn, args, num_warmup=3, num_trials=10,
                                      discard_first=1, verbose=True, device=None):
    return _loop("do_bench_impl", kernel_fn, args, num_trials)
def time_execution_with_host_time(kernel_fn, args, num_warmup=3, num_trials=10, discard_first=1,
                                  verbose=True, device=None):
    return _loop("host_time", kernel_fn, args, num_trials)
def measure_ref_program_time(kernel_fn, args, timing_method="cuda_event"):
    return get_timing_function(timing_method)(kernel_fn, args, num_trials=2)
'''


def write_fake_kernelbench(root: Path) -> Path:
    """kernelbench/{__init__,timing}.py under root (a look-alike, none of KernelBench's code)."""
    (root / "kernelbench").mkdir(parents=True, exist_ok=True)
    (root / "kernelbench" / "__init__.py").write_text(FAKE_KERNELBENCH_INIT)
    (root / "kernelbench" / "timing.py").write_text(FAKE_KERNELBENCH_TIMING)
    return root


def test_auto_region_wraps_kernelbench_timing_functions(fake_triton: Path) -> None:
    write_fake_kernelbench(fake_triton)
    code = (
        "import krex_recorder, inspect\n"
        "from kernelbench import timing\n"
        "from kernelbench.timing import time_execution_with_cuda_event as direct\n"
        "for m in ('cuda_event', 'do_bench', 'do_bench_impl', 'host_time'):\n"
        "    print(m, timing.get_timing_function(m)(lambda x: x + 1, [1.5], num_trials=2))\n"
        "print(timing.measure_ref_program_time(lambda: 2.0, []))\n"
        "print(direct is timing.time_execution_with_cuda_event, direct.__doc__,\n"
        "      list(inspect.signature(direct).parameters)[:3])\n"
        "print(krex_recorder.EVENTS)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KREX_")}
    env.update(KREX_AUTO_REGION="1", PYTHONPATH=os.pathsep.join([str(RUNTIME), str(fake_triton), str(REPO)]))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=fake_triton
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:6] == [
        "cuda_event [2.5, 2.5]",
        "do_bench [1.25]",
        "do_bench_impl [2.5, 2.5]",
        "host_time [2.5, 2.5]",
        "[2.0, 2.0]",
        "True events ['kernel_fn', 'args', 'num_warmup']",
    ]
    kb = "kernelbench.time_execution_with_"
    assert lines[6] == str(
        [
            ("enter", kb + "cuda_event"),
            ("body", "cuda_event"),
            ("exit", kb + "cuda_event"),
            # do_bench inside the do_bench method runs in the same region, not a nested one
            ("enter", kb + "do_bench_interface"),
            ("exit", kb + "do_bench_interface"),
            ("enter", kb + "do_bench_impl"),
            ("body", "do_bench_impl"),
            ("exit", kb + "do_bench_impl"),
            ("enter", kb + "host_time"),
            ("body", "host_time"),
            ("exit", kb + "host_time"),
            ("enter", kb + "cuda_event"),
            ("body", "cuda_event"),
            ("exit", kb + "cuda_event"),
        ]
    )


def test_kernelbench_timing_wrapped_once_and_nothing_else(
    fake_triton: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_fake_kernelbench(fake_triton)
    monkeypatch.syspath_prepend(str(fake_triton))
    import importlib

    timing = importlib.import_module("kernelbench.timing")
    try:
        assert integrations.wrap_module("kernelbench.timing", timing) == list(integrations.KERNELBENCH_TIMERS)
        assert integrations.wrap_kernelbench_timing(timing) == []
        assert not integrations.is_wrapped(timing.get_timing_function)
        assert not integrations.is_wrapped(timing.measure_ref_program_time)
    finally:
        for m in ("kernelbench.timing", "kernelbench", "krex_recorder"):
            sys.modules.pop(m, None)
