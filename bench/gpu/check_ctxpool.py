"""Self-check of the ctxpool's GPU paths, on a machine with an NVIDIA GPU and torch (exit 0: all held).

    python -m bench.gpu.check_ctxpool

1. torch-preloaded workers: a CUDA command prints the same as a plain process, and its traceback too.
2. driver-initialised workers (no torch preload: cuInit + primary context via ctypes) run torch code.
3. reuse (max_uses=3): device memory a command held in its globals is returned and the worker is
   reused; memory it parked on a baseline module is not, and the worker is retired.
4. a sticky device error (device-side assert) retires the worker; the next command runs elsewhere.
5. pause(): no context is created until resume().
The process running this never touches the GPU itself.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import tempfile
import time

from krex_async.ctxpool import Pool, PoolConfig
from krex_async.devices.base import Device
from krex_async.linux.spawn import LaunchSpec, spawn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GPU = Device(index=0, key="nvidia0", vendor="nvidia", name="gpu0")
PY = sys.executable
FAILED: list[str] = []


def check(name: str, ok: bool, detail: object = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}" + ("" if ok else f": {detail}"), flush=True)
    if not ok:
        FAILED.append(name)


async def run(pool: Pool | None, code: str, cwd: str) -> tuple[int, bytes, bytes, int]:
    fds = [os.pipe(), os.pipe()]
    null = os.open(os.devnull, os.O_RDONLY)
    spec = LaunchSpec(
        argv=[PY, "-c", code],
        cwd=cwd,
        env=dict(os.environ),
        stdin_fd=null,
        stdout_fd=fds[0][1],
        stderr_fd=fds[1][1],
    )
    launched = await pool.launch(spec) if pool else spawn(spec)
    if launched is None:
        raise RuntimeError(f"no warm worker: {pool.status() if pool else ''}")
    for fd in (null, fds[0][1], fds[1][1]):
        os.close(fd)
    loop = asyncio.get_running_loop()
    out, err = await asyncio.gather(*(loop.run_in_executor(None, _read_all, r) for r, _ in fds))
    status = await asyncio.wait_for(launched.wait(), 120)
    return status.returncode, out, err, launched.pid


def _read_all(fd: int) -> bytes:
    chunks = []
    while data := os.read(fd, 65536):
        chunks.append(data)
    os.close(fd)
    return b"".join(chunks)


def norm(b: bytes) -> str:
    return re.sub(r"0x[0-9a-f]+", "0x...", b.decode())


async def main() -> int:
    cwd = tempfile.mkdtemp()
    info = (
        "import os, sys, torch; x = torch.ones(3, device='cuda') * 2; torch.cuda.synchronize(); "
        "print(x.sum().item(), x.device, torch.cuda.device_count(), sys.argv, os.getcwd())"
    )
    boom = (
        "import torch\ndef f():\n    return torch.ones(2, device='cuda') @ torch.ones(3, device='cuda')\nf()"
    )

    pool = Pool(GPU, PoolConfig(size=2, preload=["torch"]))
    await pool.start()
    t = time.monotonic()
    await pool.wait_warm(timeout=300)
    print(f"2 torch workers warm in {time.monotonic() - t:.1f} s")
    for name, code in (("cuda command", info), ("cuda traceback", boom)):
        plain, pooled = await run(None, code, cwd), await run(pool, code, cwd)
        check(
            f"1. {name} same as plain",
            (plain[0], norm(plain[1]), norm(plain[2])) == (pooled[0], norm(pooled[1]), norm(pooled[2])),
            (plain[:3], pooled[:3]),
        )
    st = pool.status()
    check("1. start latency recorded", st["start_latency_s"]["n"] == 2, st)
    await pool.close()

    pool = Pool(GPU, PoolConfig(size=1, preload=[]))
    await pool.start()
    await pool.wait_warm(timeout=300)
    rc, out, err, _ = await run(pool, info, cwd)
    check(
        "2. driver-initialised worker runs torch", rc == 0 and out.startswith(b"6.0 cuda:0"), (rc, out, err)
    )
    await pool.close()

    pool = Pool(GPU, PoolConfig(size=1, max_uses=3, preload=["torch"]))
    await pool.start()
    await pool.wait_warm(timeout=300)
    a = await run(pool, "import torch; big = torch.empty(256 << 20, dtype=torch.uint8, device='cuda')", cwd)
    await pool.wait_warm(timeout=300)
    b = await run(pool, "import torch; torch._krex_leak = torch.empty(1 << 20, device='cuda')", cwd)
    await pool.wait_warm(timeout=300)
    c = await run(pool, "import os; print(os.getpid())", cwd)
    check("3. memory returned: worker reused", a[0] == b[0] == 0 and a[3] == b[3], (a, b))
    check(
        "3. memory parked: worker retired", c[3] != b[3] and pool.status()["retired"] >= 1, (c, pool.status())
    )
    sticky = (
        "import torch; a = torch.zeros(1, device='cuda'); a[torch.tensor([10], device='cuda')] = 1; "
        "torch.cuda.synchronize()"
    )
    d = await run(pool, sticky, cwd)
    await pool.wait_warm(timeout=300)
    e = await run(pool, info, cwd)
    check("4. sticky error reported", d[0] == 1 and b"CUDA" in d[2], d)
    check("4. sticky error retires the worker", e[0] == 0 and e[3] != d[3], (d[3], e))
    await pool.close()

    pool = Pool(GPU, PoolConfig(size=1, preload=["torch"]))
    pool.pause()
    await pool.start()
    await asyncio.sleep(15)  # torch imported by now, the worker waits for the lock and the pause
    st = pool.status()
    check("5. paused: no context created", st["warm"] == 0 and st["starting"] == 1, st)
    pool.resume()
    await pool.wait_warm(timeout=300)
    check("5. resumed: warm", pool.status()["warm"] == 1, pool.status())
    await pool.close()
    print("all checks held" if not FAILED else f"FAILED: {FAILED}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
