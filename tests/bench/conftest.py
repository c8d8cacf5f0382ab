"""Shared helpers for the bench tests: paths and a runner for the bench scripts as real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import open_tmpdir

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def run_script(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60.0, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run a bench script with this interpreter, outside krex (no KREX_SOCKET), on the cpu device."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("KREX_")}
    e.update({"KREX_BENCH_DEVICE": "cpu", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    e.update(env or {})
    p = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=e, cwd=str(ROOT)
    )
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p


def with_stand_in_torch(
    tmp: Path, torch_src: str, module: str, *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run `python -m module args` with `torch_src` as its torch (a stand-in for the few calls a
    GPU check makes), so that the whole check runs end to end here: only the GPU is missing."""
    fake = tmp / "stand-in"
    fake.mkdir(exist_ok=True)
    (fake / "torch.py").write_text(torch_src)
    env = {"PYTHONPATH": os.pathsep.join([str(fake), str(ROOT)])}
    return run_script("-m", module, *args, env=env, timeout=120, check=check)


@pytest.fixture
def bench_root() -> Path:
    return BENCH


@pytest.fixture
def stack_dir() -> Iterator[Path]:
    """A directory of this test's own for the stacks' directories (--stack-dir): a stack that left
    its state behind is found there, never confused with another test run's stacks in /tmp.
    Short (socket paths) and traversable by the jobs' user."""
    with open_tmpdir("kxs-", 0o755) as d:
        yield d
