"""A test vendor: GPUs with no hardware, whose memory the tests control (`--devices fake:N`).

Memory-aware admission (daemon/commands/admission.py) needs per-process device memory and an allocator that
fails as CUDA's does; on a machine without a GPU this module stands in for both. Nothing here is
for production: it is named `fake` in status and its devices' keys are fake0..fakeN-1.

    KREX_FAKE_GPU_DIR   a directory (required): <dir>/<key>/<pid> holds what process <pid> has
                        allocated on device <key>, in bytes (a process that is gone holds nothing)
    KREX_FAKE_GPU_MEM   each device's total memory in bytes (default 1 GiB)
    KREX_FAKE_GPU_PID_OFFSET  added to every pid the vendor reports: pids that are not the
                        daemon's, as NVML's are for a daemon in a container (default 0)

A command on a fake device gets KREX_FAKE_GPU_DIR, _MEM and _DEVICE in its environment, and
`python -m krex_async.devices.fake SIZE [SIZE ...]` allocates there: it sets its usage to each
SIZE in turn (after --gate FILE exists between steps), then holds it (--hold S, or until
--release FILE exists). Under the daemon's --mem-gate it first asks for memory admission, as a
torch job does when it starts CUDA (runtime/cudagate.py), unless --no-cuda-gate. An allocation
beyond the device's free memory prints CUDA's "torch.OutOfMemoryError: CUDA out of memory" and
exits 1, as a PyTorch job does.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import sys
import time
from pathlib import Path

from krex_async.devices.base import Device, DeviceProcess, Unavailable, Vendor, parse_size
from krex_async.linux import procfs

DIR_VAR = "KREX_FAKE_GPU_DIR"
MEM_VAR = "KREX_FAKE_GPU_MEM"
DEVICE_VAR = "KREX_FAKE_GPU_DEVICE"
OFFSET_VAR = "KREX_FAKE_GPU_PID_OFFSET"
DEFAULT_MEM = 1 << 30


def _alive(pid: int) -> bool:
    return procfs.exists(pid)


def usage(root: Path) -> dict[int, int]:
    """pid -> bytes held on the device whose directory is `root` (live processes only)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return out
    for name in names:
        if not name.isdigit() or not _alive(int(name)):
            continue
        try:
            out[int(name)] = int((root / name).read_text() or 0)
        except (OSError, ValueError):  # removed meanwhile, or being written
            continue
    return out


class FakeVendor(Vendor):
    name = "fake"

    def __init__(self, count: int) -> None:
        self.count = count
        self.dir = Path(os.environ.get(DIR_VAR, ""))
        self.total = DEFAULT_MEM

    def open(self) -> list[Device]:
        if not os.environ.get(DIR_VAR):
            raise Unavailable(f"fake devices need {DIR_VAR} (a directory for their memory files)")
        try:
            self.total = parse_size(os.environ.get(MEM_VAR) or str(DEFAULT_MEM))
        except ValueError as e:
            raise Unavailable(f"{MEM_VAR}: {e}") from None
        cpus = frozenset(os.sched_getaffinity(0))
        devices = []
        for i in range(self.count):
            key = f"fake{i}"
            (self.dir / key).mkdir(parents=True, exist_ok=True)
            devices.append(
                Device(
                    index=i,
                    key=key,
                    vendor="fake",
                    name=f"fake GPU {i} (test vendor)",
                    memory_total_bytes=self.total,
                    memory_free_bytes=self.total - sum(usage(self.dir / key).values()),
                    cpus=cpus,
                    env={DIR_VAR: str(self.dir), DEVICE_VAR: key, MEM_VAR: str(self.total)},
                )
            )
        return devices

    def processes(self, device: Device) -> list[DeviceProcess]:
        offset = int(os.environ.get(OFFSET_VAR) or 0)
        return [DeviceProcess(pid + offset, used) for pid, used in usage(self.dir / device.key).items()]

    def refresh(self, device: Device) -> Device:
        from dataclasses import replace

        used = sum(usage(self.dir / device.key).values())
        return replace(device, memory_free_bytes=max(0, device.memory_total_bytes - used))


# ------------------------------------------------------------------------ the allocator (commands)


def _wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.02)


OOM_MESSAGES = {  # torch's as its caching allocator words it (sizes as c10's format_size gives them)
    "torch": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {more}. GPU 0 has a total "
    "capacity of {total} of which {free} is free. Including non-PyTorch memory, this process has "
    "{held} memory in use. ({device})",
    "cublas": "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
}


def format_size(n: int) -> str:
    """A size as torch's out-of-memory message gives it (c10's format_size)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n > scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def allocate(root: Path, total: int, size: int) -> bool:
    """Set this process's usage on the device to `size`; False (nothing changed) where the others'
    usage leaves less than that free. Under a lock, so two allocations never both fit."""
    with open(root / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        others = sum(n for pid, n in usage(root).items() if pid != os.getpid())
        if others + size > total:
            return False
        tmp = root / f".{os.getpid()}.tmp"
        tmp.write_text(str(size))
        tmp.replace(root / str(os.getpid()))
        return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m krex_async.devices.fake", description=__doc__)
    p.add_argument("sizes", nargs="+", type=parse_size, help="usage to reach, step by step")
    p.add_argument("--gate", help="before each step after the first, wait for this file")
    p.add_argument("--hold", type=float, default=0.0, help="seconds to hold the last step")
    p.add_argument("--release", help="hold until this file exists")
    p.add_argument("--exit", type=int, default=0, help="exit status once done")
    p.add_argument("--ready", help="create this file once started, before the first allocation")
    p.add_argument(
        "--oom",
        choices=sorted(OOM_MESSAGES),
        default="torch",
        help="what an allocation that does not fit prints: torch's allocator's message, or a CUDA "
        "library's that could not get its own memory (cuBLAS creating its handle)",
    )
    p.add_argument(
        "--no-cuda-gate",
        action="store_true",
        help="allocate without asking the daemon's --mem-gate first (as a program without torch)",
    )
    args = p.parse_args(argv)
    root = Path(os.environ[DIR_VAR]) / os.environ[DEVICE_VAR]
    total = parse_size(os.environ.get(MEM_VAR) or str(DEFAULT_MEM))
    mine = root / str(os.getpid())
    if args.ready:
        Path(args.ready).touch()
    gate = sys.modules.get("_krex_cudagate")  # the runtime's, under --mem-gate on (cudagate.py)
    if gate is not None and not args.no_cuda_gate:
        gate.ask()  # where a torch job starts CUDA
    held = 0
    try:
        for i, size in enumerate(args.sizes):
            if i and args.gate:
                _wait_for(args.gate)
            if not allocate(root, total, size):
                free = total - sum(usage(root).values())
                sizes = {"more": size - held, "total": total, "free": max(0, free), "held": held}
                words = {k: format_size(v) for k, v in sizes.items()}
                msg = OOM_MESSAGES[args.oom].format(device=os.environ[DEVICE_VAR], **words)
                print(msg, file=sys.stderr, flush=True)
                return 1
            held = size
            print(f"allocated {size}", flush=True)
        if args.release:
            _wait_for(args.release)
        time.sleep(args.hold)
        return args.exit
    finally:
        mine.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
