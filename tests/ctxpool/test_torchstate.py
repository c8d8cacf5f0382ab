"""A reused worker puts torch's process-wide settings back after each command (ctxpool/torchstate.py).

The dev and CI machines have no torch: a stand-in module named torch, with the same functions and
attributes holding their values in module state, is preloaded by a real pool of real workers."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from krex_async.ctxpool import Pool, PoolConfig
from tests.ctxpool.conftest import CPU, PY, run_pooled

STAND_IN = textwrap.dedent("""
    import types
    _s = {"dtype": "float32", "prec": "highest", "grad": True, "threads": 4, "rng": "seed-0"}
    _s["det"] = (False, False)
    backends = types.SimpleNamespace(
        cudnn=types.SimpleNamespace(benchmark=False, deterministic=False, enabled=True, allow_tf32=True),
        cuda=types.SimpleNamespace(matmul=types.SimpleNamespace(
            allow_tf32=False, allow_fp16_reduced_precision_reduction=True,
            allow_bf16_reduced_precision_reduction=True)),
    )
    def get_default_dtype(): return _s["dtype"]
    def set_default_dtype(d): _s["dtype"] = d
    def get_float32_matmul_precision(): return _s["prec"]
    def set_float32_matmul_precision(p): _s["prec"] = p
    def is_grad_enabled(): return _s["grad"]
    def set_grad_enabled(b): _s["grad"] = b
    def get_num_threads(): return _s["threads"]
    def set_num_threads(n): _s["threads"] = n
    def get_rng_state(): return _s["rng"]
    def set_rng_state(r): _s["rng"] = r
    def manual_seed(n): _s["rng"] = f"seed-{n}"
    def are_deterministic_algorithms_enabled(): return _s["det"][0]
    def is_deterministic_algorithms_warn_only_enabled(): return _s["det"][1]
    def use_deterministic_algorithms(on, warn_only=False): _s["det"] = (on, warn_only)
""")

SETS = """
import torch
torch.backends.cudnn.benchmark = True
torch.backends.cuda.matmul.allow_tf32 = True
torch.set_default_dtype("float64"); torch.set_float32_matmul_precision("high"); torch.set_grad_enabled(False)
torch.set_num_threads(1); torch.manual_seed(5); torch.use_deterministic_algorithms(True, warn_only=True)
print("set")
"""

SHOWS = """
import torch
print(torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.get_default_dtype(),
      torch.get_float32_matmul_precision(), torch.is_grad_enabled(), torch.get_num_threads(),
      torch.get_rng_state(), torch.are_deterministic_algorithms_enabled())
"""
FRESH = b"False False float32 highest True 4 seed-0 False\n"


async def test_a_command_that_sets_torchs_settings_leaves_the_next_one_torchs_defaults(
    tmp_path: Path,
) -> None:
    """TF32, matmul precision, cuDNN benchmark, default dtype, grad mode, threads, the seed and
    deterministic algorithms set by one command are back to the warm worker's for the next,
    in the same worker: what a fresh interpreter would see."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "torch.py").write_text(STAND_IN)
    env = dict(os.environ, PYTHONPATH=f"{mods}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = Pool(CPU, PoolConfig(size=1, max_uses=3, preload=["torch"]), env=env)
    await p.start()
    try:
        before = await run_pooled(p, [PY, "-c", SHOWS], str(tmp_path), env)
        first = await run_pooled(p, [PY, "-c", SETS], str(tmp_path), env)
        second = await run_pooled(p, [PY, "-c", SHOWS], str(tmp_path), env)
    finally:
        await p.close()
    assert before.stdout == FRESH and first.stdout == b"set\n", (before, first)
    assert before.launched.pid == first.launched.pid == second.launched.pid
    assert (second.returncode, second.stdout, second.stderr) == (0, FRESH, b"")


async def test_what_restoring_torchs_settings_imports_does_not_retire_the_worker(tmp_path: Path) -> None:
    """torch may import a module the first time a setting is put back (here the stand-in's
    set_num_threads imports an extension module). The worker puts its settings back once before it
    takes its baseline, so that module is the worker's own: three commands run in one worker.
    Before, it was new at the second command's end, and an extension cannot be unloaded: retired."""
    import importlib
    import importlib.machinery

    # a stdlib extension module's file, copied into a package of ours: a foreign extension module
    files = [getattr(importlib.import_module(n), "__file__", None) for n in ("_json", "_csv", "_bisect")]
    name, so = next(((Path(f).name.split(".")[0], f) for f in files if f and f.endswith(".so")), (None, None))
    if so is None:
        pytest.skip("no stdlib extension module here is a file to copy")
    mods = tmp_path / "mods"
    (mods / "lazyext").mkdir(parents=True)
    (mods / "lazyext" / "__init__.py").write_text("")
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    (mods / "lazyext" / f"{name}{suffix}").write_bytes(Path(so).read_bytes())  # PyInit_<name> inside
    lazy = STAND_IN.replace(
        'def set_num_threads(n): _s["threads"] = n',
        f'def set_num_threads(n):\n    import lazyext.{name}\n    _s["threads"] = n',
    )
    assert lazy != STAND_IN
    (mods / "torch.py").write_text(lazy)
    env = dict(os.environ, PYTHONPATH=f"{mods}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = Pool(CPU, PoolConfig(size=1, max_uses=4, preload=["torch"]), env=env)
    await p.start()
    try:
        runs = [await run_pooled(p, [PY, "-c", SHOWS], str(tmp_path), env) for _ in range(3)]
        st = p.status()
    finally:
        await p.close()
    assert [r.stdout for r in runs] == [FRESH] * 3, runs
    assert len({r.launched.pid for r in runs}) == 1 and st["retired"] == 0, (st["retired_last"], runs)
