"""Regions around the timing loops agents already call, so they need no code change.

    wrap_triton_testing(module)    triton.testing.do_bench, do_bench_cudagraph
    wrap_torch_timer(module)       torch.utils.benchmark Timer.timeit / blocked_autorange /
                                   adaptive_autorange (patched on the class)
    wrap_kernelbench_timing(mod)   kernelbench.timing's time_execution_with_* (what its
                                   get_timing_function(method) hands out)
    timed_region(name, **kw)       decorator for any function
    wrap_module(name, module)      dispatch used by the KREX_AUTO_REGION import hook
    install()                      wrap what is imported now and hook the rest (runtime/autoregion)

Every wrapper enters `krex_async.region(name, ...)` around the call and returns the call's value;
signatures are preserved (functools.wraps sets __wrapped__, which inspect.signature follows).
Wrapping is idempotent: a wrapped function is marked and never wrapped twice. Calls nest without
nesting regions: inside a region (a contextvar, per thread and per task) wrappers call straight
through. Exceptions from the wrapped call propagate after the region is left.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
_inside: contextvars.ContextVar[bool] = contextvars.ContextVar("krex_region_inside", default=False)
_MARK = "__krex_region__"


def _region_factory() -> Callable[..., AbstractContextManager[Any]]:
    """krex_async.region, looked up at call time (so a command that never times pays nothing)."""
    import krex_async

    return krex_async.region  # type: ignore[no-any-return]


def _wrap(fn: F, name: str, region_kwargs: dict[str, Any]) -> F:
    if getattr(fn, _MARK, None) is not None:
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _inside.get():
            return fn(*args, **kwargs)
        token = _inside.set(True)
        try:
            with _region_factory()(name, **region_kwargs):
                return fn(*args, **kwargs)
        finally:
            _inside.reset(token)

    setattr(wrapper, _MARK, name)
    return wrapper  # type: ignore[return-value]


def timed_region(name: str = "timing", **region_kwargs: Any) -> Callable[[F], F]:
    """Decorator: run the function inside `region(name, **region_kwargs)` (e.g. warm_ms=...)."""
    return lambda fn: _wrap(fn, name, region_kwargs)


def is_wrapped(fn: Any) -> bool:
    return getattr(fn, _MARK, None) is not None


def wrap_triton_testing(module: Any) -> list[str]:
    """Wrap do_bench and do_bench_cudagraph of a triton.testing module in place; returns what
    was wrapped now (empty when already wrapped or absent)."""
    done = []
    for attr in ("do_bench", "do_bench_cudagraph"):
        fn = getattr(module, attr, None)
        if callable(fn) and not is_wrapped(fn):
            setattr(module, attr, _wrap(fn, f"triton.{attr}", {}))
            done.append(attr)
    return done


def wrap_torch_timer(module: Any) -> list[str]:
    """Wrap the measuring methods of `module.Timer` (torch.utils.benchmark.utils.timer or
    torch.utils.benchmark) on the class, so every import path sees them."""
    timer = getattr(module, "Timer", None)
    done: list[str] = []
    if timer is None:
        return done
    for attr in ("timeit", "blocked_autorange", "adaptive_autorange"):
        fn = timer.__dict__.get(attr)
        if callable(fn) and not is_wrapped(fn):
            setattr(timer, attr, _wrap(fn, f"torch.Timer.{attr}", {}))
            done.append(attr)
    return done


# KernelBench's timing functions, by the method name get_timing_function(method) maps them from.
# nsight_python_time is left out: it profiles under ncu, which is not a timing loop to protect.
KERNELBENCH_TIMERS = (
    "time_execution_with_cuda_event",
    "time_execution_with_do_bench_interface",
    "time_execution_with_do_bench_impl",
    "time_execution_with_host_time",
)


def wrap_kernelbench_timing(module: Any) -> list[str]:
    """Wrap KernelBench's timing functions on its kernelbench.timing module in place.

    get_timing_function(method) returns them by global name at call time, so replacing the module
    attributes covers it, measure_ref_program_time and later `from kernelbench.timing import ...`.
    Each call is one region (named kernelbench.<function>); do_bench inside the do_bench method
    calls straight through instead of nesting. Returns what was wrapped now."""
    done = []
    for attr in KERNELBENCH_TIMERS:
        fn = getattr(module, attr, None)
        if callable(fn) and not is_wrapped(fn):
            setattr(module, attr, _wrap(fn, f"kernelbench.{attr}", {}))
            done.append(attr)
    return done


def wrap_module(name: str, module: Any) -> list[str]:
    """Wrap a known module by its import name; unknown names are left alone (returns [])."""
    if name == "triton.testing":
        return wrap_triton_testing(module)
    if name == "kernelbench.timing":
        return wrap_kernelbench_timing(module)
    if name in ("torch.utils.benchmark.utils.timer", "torch.utils.benchmark"):
        return wrap_torch_timer(module)
    return []


def install() -> None:
    """Wrap the known modules already imported and hook the import of the others (idempotent).

    Uses the runtime's import hook (krex_async/runtime/autoregion.py), the same one that
    KREX_AUTO_REGION=1 installs at interpreter start.
    """
    import sys

    module = sys.modules.get("_krex_autoregion")
    if module is None:
        import importlib.util
        import os

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runtime", "autoregion.py")
        spec = importlib.util.spec_from_file_location("_krex_autoregion", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["_krex_autoregion"] = module
        spec.loader.exec_module(module)
    module.install()
