"""worker.Context.check on a CPU machine: a fake torch stands in for the device, its counters moved
the way a command can leave them."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from krex_async.ctxpool import Pool, PoolConfig
from krex_async.ctxpool.worker import Context
from krex_async.devices.base import Device
from tests.ctxpool.conftest import PY, run_pooled


class FakeCuda:
    """torch.cuda as the worker uses it: allocated / reserved bytes, a cache that empty_cache()
    gives back, and a sticky error that synchronize() raises."""

    def __init__(self) -> None:
        self.allocated, self.cached, self.pinned, self.error = 0, 0, 0, ""

    def synchronize(self) -> None:
        if self.error:
            raise RuntimeError(self.error)

    def memory_allocated(self) -> int:
        return self.allocated

    def memory_reserved(self) -> int:
        return self.allocated + self.cached + self.pinned

    def empty_cache(self) -> None:
        self.cached = 0  # free cached blocks go back; `pinned` (a segment still in use) does not


class FakeC:
    """torch._C's cuBLAS workspaces: allocated through the caching allocator, dropped on request."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda, self.workspaces = cuda, 0

    def _cuda_clearCublasWorkspaces(self) -> None:
        self.cuda.allocated -= self.workspaces
        self.cuda.cached += self.workspaces  # freed into the cache, which empty_cache() gives back
        self.workspaces = 0


class FakeTorch:
    def __init__(self) -> None:
        self.cuda = FakeCuda()
        self._C = FakeC(self.cuda)

    def ones(self, n: int, device: str) -> Any:
        self.cuda.allocated += 512  # the context's first tensor: part of the baseline
        self.cuda.cached += 1 << 20
        return object()


@pytest.fixture
def ctx(monkeypatch: pytest.MonkeyPatch) -> Context:
    monkeypatch.setitem(sys.modules, "torch", FakeTorch())
    c = Context("nvidia", 0)
    c.create()
    return c


def test_clean_context_passes_and_cached_blocks_do_not_count(ctx: Context) -> None:
    assert ctx.check() is None
    ctx.torch.cuda.cached += 64 << 20  # the command's freed tensors, cached by the allocator
    assert ctx.check() is None and ctx.torch.cuda.cached == 0  # empty_cache() gave them back


def test_the_commands_cublas_workspaces_are_dropped_not_counted(ctx: Context) -> None:
    """A command that ran a matmul leaves cuBLAS workspaces allocated: the worker's own handle
    keeps them, not the command; they are dropped, and the worker serves again."""
    ctx.torch._C.workspaces = 8 << 20
    ctx.torch.cuda.allocated += 8 << 20
    assert ctx.check() is None and ctx.torch.cuda.allocated == 512 and ctx.torch.cuda.cached == 0


def test_allocated_memory_left_retires(ctx: Context) -> None:
    ctx.torch.cuda.allocated += 4096
    assert ctx.check() == "device memory not returned: 4096 bytes"


def test_reserved_memory_that_empty_cache_cannot_free_retires(ctx: Context) -> None:
    """memory_allocated() is back at the baseline, but the allocator still reserves a segment."""
    ctx.torch.cuda.pinned += 2 << 20
    reason = ctx.check()
    assert reason is not None and "reserved" in reason and str(2 << 20) in reason, reason


def test_sticky_error_retires(ctx: Context) -> None:
    ctx.torch.cuda.error = "CUDA error: an illegal memory access was encountered"
    assert ctx.check() == "device error: CUDA error: an illegal memory access was encountered"


FAKE_TORCH = """
import types
state = {"allocated": 0, "cached": 0, "pinned": 0}
def ones(n, device):
    state["allocated"] += 512
    state["cached"] += 1 << 20
cuda = types.SimpleNamespace(
    synchronize=lambda: None,
    memory_allocated=lambda: state["allocated"],
    memory_reserved=lambda: state["allocated"] + state["cached"] + state["pinned"],
    empty_cache=lambda: state.update(cached=0))
"""


async def test_worker_retires_when_a_command_leaves_memory_reserved(tmp_path: Path) -> None:
    """Real workers with a fake torch preloaded (vendor nvidia, so the context is 'created' through
    it): a command that leaves only cached blocks is followed by reuse; one that leaves a reserved
    segment retires its worker."""
    (tmp_path / "torch.py").write_text(FAKE_TORCH)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = Pool(
        Device(index=0, key="nv0", vendor="nvidia", name="fake"),
        PoolConfig(size=1, max_uses=3, preload=["torch"]),
        env=env,
    )
    await p.start()
    try:
        cached = "import os, torch; torch.state['cached'] += 1 << 24; print(os.getpid())"
        pinned = "import os, torch; torch.state['pinned'] += 1 << 21; print(os.getpid())"
        a = await run_pooled(p, [PY, "-c", cached], str(tmp_path), p.env)
        b = await run_pooled(p, [PY, "-c", pinned], str(tmp_path), p.env)
        assert a.returncode == b.returncode == 0 and a.stdout == b.stdout, (a, b)
        await p.wait_warm(timeout=30)
        assert p.status()["retired"] == 1 and b.launched.pid not in [w.pid for w in p._workers]
    finally:
        await p.close()
