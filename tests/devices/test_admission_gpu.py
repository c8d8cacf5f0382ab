"""Memory admission on a real NVIDIA GPU (skipped without one, torch and NVML): the per-process
figures NVML gives (nvmlDeviceGetComputeRunningProcesses) reach each command's peak, and a torch
job that runs out of memory beside another is re-run (guarded, then alone) and succeeds; a torch
job started beside another that holds the memory waits at its CUDA start (--mem-gate).

Run on the GPU machine: `python -m pytest -q -p no:cacheprovider tests/devices/test_admission_gpu.py`.
"""

from __future__ import annotations

import pytest

from ..conftest import PY, py_env, run_daemon
from .test_admission import eventually, released, row

torch = pytest.importorskip("torch")
pynvml = pytest.importorskip("pynvml")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

GiB = 1 << 30

# Allocate argv[1] bytes, wait for argv[2] to exist, then grow to argv[3] bytes (0: no growth),
# then wait for argv[4] (or not, where "-"). torch's own out-of-memory error ends it (exit 1).
ALLOC = """
import os, sys, time
import torch
def wait(path):
    while path != "-" and not os.path.exists(path):
        time.sleep(0.02)
first = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
print("first", flush=True)
wait(sys.argv[2])
if int(sys.argv[3]):
    more = torch.empty(int(sys.argv[3]), dtype=torch.uint8, device="cuda")
    print("grown", flush=True)
wait(sys.argv[4])
"""


def nvml_pids() -> set[int]:
    """The pids NVML lists on device 0 (each holds a CUDA context there)."""
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    finally:
        pynvml.nvmlShutdown()


def total_bytes() -> int:
    return int(torch.cuda.get_device_properties(0).total_memory)


async def test_nvml_per_process_peaks_and_a_co_located_oom_re_run(script, tmp_path) -> None:
    alloc = script("alloc.py", ALLOC)
    env = py_env()
    total = total_bytes()
    gate, rb, done = (str(tmp_path / n) for n in ("gate", "rb", "done"))
    released(done)
    async with run_daemon(
        "--devices", "nvidia", "--policy", "shared", "--mem-headroom", "0.02", env=env
    ) as d:
        c = await d.client()
        dev = (await c.status())["devices"][0]["key"]
        # one alone: NVML's per-process memory for its pid reaches its allocation (and its context)
        rs = str(tmp_path / "rs")
        solo = await c.submit([PY, alloc, str(2 * GiB), "-", "0", rs], env=env, device=dev, label="solo")
        await eventually(lambda: row(c, solo.command), lambda s: s["mem_peak"] >= 2 * GiB, "its NVML figure")
        released(rs)
        res = await solo.wait()
        assert res.report.exit_code == 0, res
        # A (declares 1 GiB, takes 1) and B (takes half the card) run together; A then grows by 60%
        # of the card: out of memory beside B, though it fits alone
        a = await c.submit(
            [PY, alloc, str(GiB), gate, str(int(total * 0.6)), "-"],
            env=env,
            device=dev,
            mem=2 * GiB,
            rerun_on_oom=True,
            label="grower",
        )
        await eventually(lambda: row(c, a.command), lambda s: s["mem_peak"] >= GiB, "A's NVML figure")
        b = await c.submit(
            [PY, alloc, str(total // 2), done, "0", rb],
            env=env,
            device=dev,
            mem=total // 2 + GiB,
            label="half",
        )
        assert not b.queued
        await eventually(lambda: row(c, b.command), lambda s: s["mem_peak"] >= total // 2, "B's NVML figure")
        released(gate)
        # its first re-run is guarded (its declared 2 GiB fits beside B's peak) and meets out of
        # memory again as it grows; the second runs alone, once B ends
        await eventually(lambda: row(c, a.command), lambda s: s["reruns"] == 2, "A re-run a second time")
        assert "waits to run alone" in (await row(c, a.command))["waiting_for"]
        released(rb)
        ra = await a.wait()
        assert ra.report.exit_code == 0 and ra.report.reruns == 2, (ra.report, ra.stderr[-2000:])
        assert ra.report.mem_peak >= int(total * 0.6), ra.report
        assert (await b.wait()).report.exit_code == 0
        await c.close()


# The CPU part of a job (argv[1] touched once torch is imported and its input made on the CPU),
# then its CUDA start and a copy of argv[2] bytes to the device, held until argv[3] exists.
TORCH_JOB = """
import os, sys, time
from pathlib import Path
import torch
x = torch.ones(int(sys.argv[2]), dtype=torch.uint8)
Path(sys.argv[1]).touch()
y = x.to("cuda")
torch.cuda.synchronize()
print("on the device", flush=True)
while not os.path.exists(sys.argv[3]):
    time.sleep(0.02)
"""


async def test_a_torch_jobs_cuda_start_waits_at_the_gate(script, tmp_path) -> None:
    """--mem-gate on (the default), real torch and NVML: B starts at once and makes its input on
    the CPU while A holds most of the card; its CUDA start waits (no NVML memory for it) until A
    ends, then it runs; its report says how long it waited at the gate."""
    job = script("job.py", TORCH_JOB)
    env = py_env()
    total = total_bytes()
    ra, rb, b_ready = (str(tmp_path / n) for n in ("ra", "rb", "b-ready"))
    async with run_daemon(
        "--devices", "nvidia", "--policy", "shared", "--mem-commit", "peak", "--mem-headroom", "0.02", env=env
    ) as d:
        c = await d.client()
        dev = (await c.status())["devices"][0]["key"]
        a = await c.submit(
            [PY, job, str(tmp_path / "a-ready"), str(GiB), ra], env=env, device=dev, mem=total // 2
        )
        await eventually(lambda: row(c, a.command), lambda s: s["gate"] == "passed", "A passed its gate")
        b = await c.submit([PY, job, b_ready, str(GiB), rb], env=env, device=dev, mem=total // 2)
        assert not b.queued
        st = await eventually(
            lambda: row(c, b.command), lambda s: s["gate"] == "asked", "B waits at its gate"
        )
        assert (tmp_path / "b-ready").exists(), "B imported torch and made its input first"
        assert "waiting for memory" in st["waiting_for"], st
        assert st["pid"] not in nvml_pids(), "B has no CUDA context while it waits"
        released(ra)
        assert (await a.wait()).report.exit_code == 0
        await eventually(lambda: row(c, b.command), lambda s: s["mem_peak"] >= GiB, "B on the device")
        released(rb)
        rep = (await b.wait()).report
        assert rep.exit_code == 0 and rep.gate == "passed" and rep.gate_s > 0, rep
        await c.close()
