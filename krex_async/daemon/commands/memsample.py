"""One memory sample for admission (admission.py), read on a thread: per device, what is used in
all, what each command's process tree holds, and what the pool's workers outside commands hold,
from the vendor's per-process figures (NVML's; see devices/nvidia.py on pids in containers)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from krex_async.devices.base import Device
from krex_async.isolation.base import Backend

if TYPE_CHECKING:
    from krex_async.devices import Node


def read(node: Node | None, backend: Backend, devices: list[Device], snap: dict[str, Any]) -> dict[str, Any]:
    """`snap` (taken on the loop): {"groups": {command: (device key, group)}, "pools": {device
    key: pool worker pids}}. Returns used, held (per command), pool (per device), mapped (devices
    where some listed process is one of ours), sampled (snap's groups) and at (monotonic: a
    command admitted after it is not in these figures)."""
    at = time.monotonic()
    used: dict[str, int] = {}
    held: dict[str, int] = {}
    pool: dict[str, int] = {}
    mapped: set[str] = set()
    owner: dict[int, str] = {}
    for cid, (_key, group) in snap["groups"].items():
        for pid in backend.pids(group):
            owner[pid] = cid
    for device in devices:
        if node is None:  # no vendor library open: nothing to read
            break
        key = device.key
        fresh = node.vendor(device)
        dev = fresh.refresh(device) if fresh is not None else device
        used[key] = max(0, dev.memory_total_bytes - dev.memory_free_bytes)
        workers = snap["pools"].get(key, set())
        for proc in node.processes(device):
            n = proc.used_memory_bytes or 0
            if proc.pid in owner:
                held[owner[proc.pid]] = held.get(owner[proc.pid], 0) + n
                mapped.add(key)
            elif proc.pid in workers:
                pool[key] = pool.get(key, 0) + n
                mapped.add(key)
    return {"used": used, "held": held, "pool": pool, "mapped": mapped, "sampled": snap["groups"], "at": at}


def lone_use(dm: Any) -> int:
    """Where NVML's pids are not ours (a daemon in a container without the host's pid namespace
    sees none of them), the use of a command running alone on its device (`dm`, admission's
    DeviceMemory): what is used beyond the device's idle baseline and the pool."""
    return max(0, dm.used - dm.baseline - dm.pool)
