"""Helpers: run one command line through a Pool and as a plain process (spawn), capture everything."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from krex_async.ctxpool import Pool, PoolConfig
from krex_async.devices.base import Device
from krex_async.linux.spawn import Launched, LaunchSpec, spawn

CPU = Device(index=0, key="cpu", vendor="cpu", name="cpu", cpus=frozenset(range(os.cpu_count() or 1)))


@dataclass
class Run:
    returncode: int
    stdout: bytes
    stderr: bytes
    launched: Launched


def make_spec(
    argv: list[str], cwd: str, env: dict[str, str] | None = None, stdin: bytes = b""
) -> tuple[LaunchSpec, list[int]]:
    """A LaunchSpec with fresh pipes; returns the spec and our ends [stdin_w, stdout_r, stderr_r]."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    os.write(in_w, stdin)  # small inputs fit the pipe buffer
    os.close(in_w)
    spec = LaunchSpec(
        argv=argv,
        cwd=cwd,
        env=dict(os.environ if env is None else env),
        stdin_fd=in_r,
        stdout_fd=out_w,
        stderr_fd=err_w,
    )
    return spec, [out_r, err_r]


async def _drain(fd: int) -> bytes:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, _read_all, fd)


def _read_all(fd: int) -> bytes:
    chunks = []
    while data := os.read(fd, 65536):
        chunks.append(data)
    os.close(fd)
    return b"".join(chunks)


async def finish(spec: LaunchSpec, ours: list[int], launched: Launched) -> Run:
    for fd in (spec.stdin_fd, spec.stdout_fd, spec.stderr_fd):
        os.close(fd)
    out, err = await asyncio.gather(*(_drain(fd) for fd in ours))
    status = await asyncio.wait_for(launched.wait(), 30)
    return Run(status.returncode, out, err, launched)


async def run_plain(argv: list[str], cwd: str, env: dict[str, str] | None = None, stdin: bytes = b"") -> Run:
    spec, ours = make_spec(argv, cwd, env, stdin)
    return await finish(spec, ours, spawn(spec))


async def run_pooled(
    pool: Pool, argv: list[str], cwd: str, env: dict[str, str] | None = None, stdin: bytes = b""
) -> Run:
    await pool.wait_warm(1, timeout=30)
    spec, ours = make_spec(argv, cwd, env, stdin)
    launched = await pool.launch(spec)
    assert launched is not None, pool.status()
    assert launched.via == "pool"
    return await finish(spec, ours, launched)


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    p = Pool(CPU, PoolConfig(size=2, preload=["json", "decimal"]))
    await p.start()
    await p.wait_warm(timeout=30)
    yield p
    await p.close()


@pytest.fixture
async def reuse_pool() -> AsyncIterator[Pool]:
    p = Pool(CPU, PoolConfig(size=1, max_uses=3, preload=["json"]))
    await p.start()
    await p.wait_warm(timeout=30)
    yield p
    await p.close()


PY = sys.executable
