"""Admission's memory samples (admission.py): the loop that takes one every SAMPLE_S while commands
run or wait, and starts what then fits; the sample itself, read on a thread: per device, what is
used in all, what each command's process tree holds, and what the pool's workers outside commands
hold, from the vendor's per-process figures (NVML's; see devices/nvidia.py on pids in containers);
and what it tells admission."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from krex_async import logs
from krex_async.daemon.model.command import Command, CommandState
from krex_async.devices.base import Device
from krex_async.isolation.base import Backend

if TYPE_CHECKING:
    from krex_async.devices import Node

# `adm` below is admission.Admission, untyped here: it imports this module
Admission = Any

log = logs.get("krex.daemon")
SAMPLE_S = 0.5  # while commands run on a device whose memory is tracked
IDLE_SAMPLE_S = 2.0  # otherwise: the pool's memory and outsiders, for status


async def loop(adm: Admission, start: Callable[[Command], None]) -> None:
    """Read each tracked device's memory and its processes' on a thread, every SAMPLE_S while
    commands run or wait there (IDLE_SAMPLE_S otherwise); start what now fits. Errors are logged
    and cost one sample."""
    ev = asyncio.get_running_loop()
    core = adm.core
    while adm.devices:
        busy = any(dm.running or dm.waiting or dm.gated for dm in adm.devices.values())
        try:
            snap = snapshot(adm)
            devices = [dm.device for dm in adm.devices.values()]
            seen = await ev.run_in_executor(None, read, core.node, core.backend, devices, snap)
            apply(adm, seen)
            for key in adm.devices:
                for cmd in adm.pump(key):
                    start(cmd)
        except Exception as e:  # noqa: BLE001 - a vendor or /proc error (or a bug) costs one sample
            log.warning("memory_sample_failed", error=repr(e))
        adm.wake.clear()
        try:
            await asyncio.wait_for(adm.wake.wait(), SAMPLE_S if busy else IDLE_SAMPLE_S)
            await asyncio.sleep(0.05)  # a moment for its process to start
        except TimeoutError:
            pass


def snapshot(adm: Admission) -> dict[str, Any]:
    """What the thread reads against, taken on the loop: each running (or gated) command's group and
    the pool's pids per device."""
    groups = {}
    for dm in adm.devices.values():
        for cid in dm.running | dm.gated:
            c = adm.core.commands.get(cid)
            if c is not None and c.group is not None and c.state is CommandState.RUNNING:
                groups[cid] = (dm.device.key, c.group)
    pools = {k: p.pids() for k, p in adm.core.pools.items() if k in adm.devices}
    return {"groups": groups, "pools": pools}


def apply(adm: Admission, seen: dict[str, Any]) -> None:
    """A sample's figures into admission: each device's use, the pool's, each command's now and
    peak; a gated command seen on the device without asking is counted from now on."""
    commands = adm.core.commands
    for key, dm in adm.devices.items():
        if key in seen["used"]:
            dm.used, dm.sampled_at = seen["used"][key], seen["at"]
            dm.mapped = dm.mapped or key in seen["mapped"]
            dm.pool = seen["pool"].get(key, 0)
            if dm.pool:
                for c in dm.running:
                    commands[c].co_located = True
    for cid, (key, group) in seen["sampled"].items():
        # the run sampled (its group, set once a run), not one since: a sample read before a re-run
        # was put back in line put the failed run's figures back on it (its guard taken as reached)
        if (cmd := commands.get(cid)) is not None and cmd.group is group:
            dm = adm.devices[key]
            # alone: no other command started there (one that allocates without asking at its gate
            # holds memory uncounted: it would be taken for this one's, and learned as its need)
            lone = key not in seen["mapped"] and dm.running | dm.gated == {cid}
            cmd.mem_now = seen["held"].get(cid, 0) or (lone_use(dm) if lone else 0)
            cmd.mem_peak = max(cmd.mem_peak, cmd.mem_now)
            if cmd.mem_now and cmd.gate == "open":  # on the device without asking (no torch)
                adm.bypassed(cmd, dm)
    for dm in adm.devices.values():
        if not dm.running and not dm.gated and dm.device.key in seen["used"]:
            dm.baseline = dm.used
        adm.reserved_metric(dm)


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


async def others_hold(adm: Admission, cmd: Command) -> bool:
    """Whether, now that `cmd` failed, something else holds memory on its device while another
    command was started there: the device's use, read now, above its idle baseline and the pool's
    workers. A command that allocates without asking at its gate (a program without torch) is
    counted only once a sample sees it (never where NVML's pids are not ours), so a collision it
    causes before that would otherwise be judged the failed command's own ("oom: alone")."""
    dm = adm.devices.get(cmd.device_key or "")
    if dm is None or not (dm.running | dm.gated) - {cmd.id}:
        return False
    ev = asyncio.get_running_loop()
    snap = {"groups": {}, "pools": {k: p.pids() for k, p in adm.core.pools.items() if k == dm.device.key}}
    seen = await ev.run_in_executor(None, read, adm.core.node, adm.core.backend, [dm.device], snap)
    used = seen["used"].get(dm.device.key)
    return used is not None and used - dm.baseline - seen["pool"].get(dm.device.key, 0) > 0


def lone_use(dm: Any) -> int:
    """Where NVML's pids are not ours (a daemon in a container without the host's pid namespace
    sees none of them), the use of a command running alone on its device (`dm`, admission's
    DeviceMemory): what is used beyond the device's idle baseline and the pool."""
    return max(0, dm.used - dm.baseline - dm.pool)
