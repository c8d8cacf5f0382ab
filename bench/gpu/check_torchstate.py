"""Does a reused pool worker put torch's process-wide settings back? krex_async.ctxpool.torchstate
with real torch on a GPU: the settings once CUDA is up (snapshot), then what a command might set
(TF32, cuDNN benchmark, matmul precision, default dtype, grad mode, seed, threads), then restore:
every setting must read as before.

    python3 -m bench.gpu.check_torchstate          # prints each setting after the restore, PASS/FAIL

The tests check the same with a stand-in torch (tests/ctxpool/test_torchstate.py): the dev and CI
machines have no torch. Session 23 ran these steps on the H100 (bench/RESULTS.md). Exit 0 PASS,
1 FAIL, 2 no torch or no CUDA device here.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def same(a: Any, b: Any) -> bool:
    """Equal, element-wise for tensors and lists of them (the RNG states)."""
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape"):
        return hasattr(b, "shape") and a.shape == b.shape and bool((a == b).all())
    return bool(a == b)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)  # no options
    try:
        import torch
    except ImportError:
        print("check_torchstate: torch is not importable here", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("check_torchstate: no CUDA device here", file=sys.stderr)
        return 2
    from krex_async.ctxpool import torchstate

    torch.zeros(1, device="cuda")  # the worker's state once warm: CUDA up
    snap = torchstate.snapshot()
    assert snap is not None
    torch.backends.cuda.matmul.allow_tf32 = not torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    torch.set_float32_matmul_precision("medium")
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.manual_seed(1234)
    torch.set_num_threads(max(1, torch.get_num_threads() // 2))
    torch.rand(1, device="cuda")  # the CUDA generator moves too
    err = torchstate.restore(snap)
    after = torchstate.snapshot()
    assert after is not None
    differ = sorted(k for k in snap if not same(snap[k], after.get(k)))
    for k in sorted(snap):
        shown = "(tensor state)" if hasattr(snap[k], "shape") or isinstance(snap[k], list) else snap[k]
        print(f"{k:60s} {shown!s:20s} {'DIFFERS' if k in differ else 'back'}")
    print(f"restore error: {err}; settings that differ after the restore: {differ}")
    ok = err is None and not differ
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
