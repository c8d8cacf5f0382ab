"""Which device a submitted command runs on: the one it names, none, or (`auto`) the least loaded
that has the memory it asks for, read live. A device the node does not have is a RequestError."""

from __future__ import annotations

from krex_async import logs
from krex_async import protocol as P
from krex_async.daemon.commands.access import RequestError
from krex_async.daemon.commands.admission import Admission
from krex_async.daemon.commands.devmemory import gib
from krex_async.daemon.model.core import Core
from krex_async.devices import NoDevice, place
from krex_async.devices.base import Device

log = logs.get("krex.daemon")


def choose(core: Core, spec: P.Submit, uid: int, admission: Admission | None = None) -> Device | None:
    """The device for `spec` run as `uid` (None for device=none). Raises RequestError for a device
    this node does not have, or when no device can take it (`auto`)."""
    want = spec.device
    if want == "none":
        return None
    if want == "auto":
        load = {k: len(q.commands) for k, q in core.scheduler.devices.items()}
        if admission is not None and any(admission.tracks(d.key) for d in core.devices):
            return by_admission(core, spec, uid, admission, load)
        try:
            chosen = place(live_memory(core) if spec.mem > 0 else core.devices, load, spec.mem)
        except NoDevice as e:
            raise RequestError("bad_device", str(e)) from None
        return next(d for d in core.devices if d.key == chosen.key)
    for d in core.devices:
        if want == d.key or (want.isdigit() and int(want) == d.index):
            return d
    names = ", ".join(["auto", "none", *(f"{d.index} ({d.key})" for d in core.devices)])
    raise RequestError("bad_device", f"unknown device {want!r}; this node has: {names}")


def live_memory(core: Core) -> list[Device]:
    """The devices with their free memory read now, for a placement by memory: the figure
    read at start-up is long stale on a busy node. A library call per device (NVML, amdsmi,
    /proc/meminfo: well under a millisecond), on the loop; on failure, the last figures."""
    if core.node is None:
        return core.devices
    try:
        live = {d.key: d for d in core.node.refresh()}
    except Exception as e:  # noqa: BLE001 - a placement goes on with what it knew
        log.warning("device_refresh_failed", error=repr(e))
        return core.devices
    return [live.get(d.key, d) for d in core.devices]


def by_admission(core: Core, spec: P.Submit, uid: int, admission: Admission, load: dict[str, int]) -> Device:
    """`auto` where memory admission tracks the devices: the least loaded of those where the command
    fits now (as admission counts it), else of those it fits alone (it then waits for memory
    there); RequestError where it fits on none."""
    need, source = admission.need(spec, uid)
    able = [d for d in core.devices if not admission.tracks(d.key) or need <= d.memory_total_bytes]
    if not able:
        have = ", ".join(f"{d.key} has {gib(d.memory_total_bytes)}" for d in core.devices)
        raise RequestError("bad_device", f"no device is large enough: needs {gib(need)} ({source}); {have}")
    room = {d.key: admission.available(d.key) if admission.tracks(d.key) else 1 << 62 for d in able}
    now = [d for d in able if room[d.key] >= need]
    return min(now or able, key=lambda d: (load.get(d.key, 0), -room[d.key], d.index))
