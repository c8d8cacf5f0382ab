"""torch's process-wide settings, put back in a reused worker after each command.

A fresh interpreter starts with torch's defaults. A command that sets TF32 on, a matmul precision,
cuDNN's benchmark mode, deterministic algorithms, a default dtype, grad mode, its thread count or a
seed changes them for the rest of the process: in a reused worker (--pool-max-uses > 1), for the
next command too, whose numerics and timings would then differ from a fresh start's. So the worker
takes them once warm (snapshot) and puts them back after each command (restore); one it cannot put
back retires it.

What is not here stays with the worker: caches keyed by shape (cuDNN's and cuBLAS's algorithm
choices, compiled kernels). They do not change what a command computes, but they can change which
kernel it times: an algorithm a command's predecessor chose (e.g. a smaller workspace, the device
being full then) is the one the next command of that shape runs.
"""

from __future__ import annotations

import sys
from typing import Any

# (object path under torch, attribute): plain attributes, put back with setattr
FLAGS = (
    ("backends.cudnn", "benchmark"),
    ("backends.cudnn", "deterministic"),
    ("backends.cudnn", "enabled"),
    ("backends.cudnn", "allow_tf32"),
    ("backends.cuda.matmul", "allow_tf32"),
    ("backends.cuda.matmul", "allow_fp16_reduced_precision_reduction"),
    ("backends.cuda.matmul", "allow_bf16_reduced_precision_reduction"),
)
# (getter, setter) of torch's own functions
CALLS = (
    ("get_default_dtype", "set_default_dtype"),
    ("get_float32_matmul_precision", "set_float32_matmul_precision"),
    ("is_grad_enabled", "set_grad_enabled"),
    ("get_num_threads", "set_num_threads"),
    ("get_rng_state", "set_rng_state"),
)


def _at(torch: Any, path: str) -> Any:
    obj = torch
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def snapshot() -> dict[str, Any] | None:
    """torch's settings now (the worker's, once warm); None where torch is not imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    snap: dict[str, Any] = {}
    for path, name in FLAGS:
        obj = _at(torch, path)
        if obj is not None and hasattr(obj, name):
            snap[f"{path}.{name}"] = getattr(obj, name)
    for get, _set in CALLS:
        if callable(fn := getattr(torch, get, None)):
            snap[get] = fn()
    if callable(fn := getattr(torch, "are_deterministic_algorithms_enabled", None)):
        warn = getattr(torch, "is_deterministic_algorithms_warn_only_enabled", lambda: False)
        snap["deterministic_algorithms"] = (fn(), warn())
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and callable(getattr(cuda, "is_initialized", None)) and cuda.is_initialized():
        snap["cuda.get_rng_state_all"] = cuda.get_rng_state_all()
    return snap


def restore(snap: dict[str, Any] | None) -> str | None:
    """Put `snap`'s settings back; why the worker must retire instead, or None."""
    if snap is None:
        return None
    torch = sys.modules.get("torch")
    if torch is None:
        return "torch left sys.modules"
    try:
        for path, name in FLAGS:
            if (key := f"{path}.{name}") in snap:
                setattr(_at(torch, path), name, snap[key])
        for get, put in CALLS:
            if get in snap:
                getattr(torch, put)(snap[get])
        if "deterministic_algorithms" in snap:
            on, warn_only = snap["deterministic_algorithms"]
            torch.use_deterministic_algorithms(on, warn_only=warn_only)
        if "cuda.get_rng_state_all" in snap:
            torch.cuda.set_rng_state_all(snap["cuda.get_rng_state_all"])
    except Exception as e:  # noqa: BLE001 - any failure: the next command would not start as fresh
        return f"torch settings not restored: {type(e).__name__}: {e}"
    return None
