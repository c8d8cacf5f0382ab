"""On the accelerator only: bench/gpu/check_drain.py must report ALL PASS (run: pytest -m gpu)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _cuda() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not _cuda(), reason="needs an NVIDIA GPU with torch")
def test_check_drain_passes() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu" / "check_drain.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(out.stdout[-6000:])
    assert out.returncode == 0 and "ALL PASS" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
