"""What `krex status` and the metrics endpoint see of the daemon: a snapshot of its devices,
commands, regions, pools and probes, and (live) what the vendor libraries and /proc say now."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from krex_async import __version__, logs
from krex_async.ctxpool import adoption
from krex_async.daemon.commands import commitment
from krex_async.daemon.commands.admission import Admission
from krex_async.daemon.model.core import Core
from krex_async.daemon.observe.metrics import Metrics
from krex_async.daemon.regions.engine import Regions
from krex_async.linux import reserve
from krex_async.linux.procfs import tree_memory

log = logs.get("krex.daemon")


class _CpuUse:
    """The host's CPU use since the previous call, in percent, from its own /proc/stat readings
    (psutil's cpu_percent(None) shares one reference with `krex status`: each would reset the
    other's interval)."""

    def __init__(self) -> None:
        import psutil

        self.last = psutil.cpu_times()

    def percent(self) -> float | None:
        import psutil

        now = psutil.cpu_times()
        busy = sum(now) - now.idle - getattr(now, "iowait", 0.0)
        last_busy = sum(self.last) - self.last.idle - getattr(self.last, "iowait", 0.0)
        total = sum(now) - sum(self.last)
        self.last = now
        return None if total <= 0 else max(0.0, min(100.0, 100.0 * (busy - last_busy) / total))


class DaemonStatus:
    def __init__(
        self,
        core: Core,
        regions: Regions,
        adoptions: dict[str, adoption.Tally],
        boot: str,
        admission: Admission | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.core = core
        self.metrics = metrics if metrics is not None else Metrics()  # sample_metrics writes it
        self.admission = admission  # what memory admission counts per device, and who waits
        self.regions = regions  # who holds each device, and how a region there would hold
        self.adoptions = adoptions  # command id -> interpreters adopted or declined
        self.boot = boot
        self._cpu_primed = False  # psutil's first cpu_percent has no interval to measure

    async def sample_metrics(self, every_s: float = 5.0) -> None:
        """While --metrics serves: every few seconds, the pools' sizes and each device's utilisation
        and memory (a GPU's from the vendor library, a CPU device's from the host, as `krex status`
        shows them), read on a thread (vendor queries and /proc reads block). Errors are logged,
        never fatal."""
        loop = asyncio.get_running_loop()
        cpu = _CpuUse()
        while True:
            self.metrics.state_disk_full(self.state_disk_full())
            for key, pool in self.core.pools.items():
                st = pool.status()
                self.metrics.pool(key, st.get("warm", 0), st.get("busy", 0), st.get("retired", 0))
            try:
                samples = await loop.run_in_executor(None, self._device_samples, cpu)
            except Exception as e:  # a vendor library error costs one sample
                log.warning("metrics_sample_failed", error=repr(e))
                samples = []
            for key, pct, used, total in samples:
                if pct is not None:
                    self.metrics.device_util(key, pct)
                if total:
                    self.metrics.device_memory(key, used, total)
            await asyncio.sleep(every_s)

    def _device_samples(self, cpu: _CpuUse) -> list[tuple[str, float | None, int, int]]:
        """(key, utilisation %, memory used, memory total) of each device, now (blocks)."""
        import psutil

        node = self.core.node
        any_gpu = any(d.vendor != "cpu" for d in self.core.devices)
        fresh = {d.key: d for d in (node.refresh() if node is not None and any_gpu else [])}
        out: list[tuple[str, float | None, int, int]] = []
        for d in self.core.devices:
            if d.vendor == "cpu":
                vm = psutil.virtual_memory()
                out.append((d.key, cpu.percent(), int(vm.total - vm.available), int(vm.total)))
                continue
            g = fresh.get(d.key, d)
            total, free = g.memory_total_bytes or 0, g.memory_free_bytes
            used = total - free if total and free is not None else 0
            out.append((d.key, node.utilisation(g) if node is not None else None, used, total))
        return out

    async def live(self) -> dict[str, Any]:
        """snapshot() with each GPU's current memory, clocks, utilisation and context holders, read
        from the vendor libraries on a thread (their calls block)."""
        st = self.snapshot()
        await self._host(st)
        node = self.core.node
        if node is None or all(d.vendor == "cpu" for d in self.core.devices):
            return st

        def query() -> list[dict[str, Any]]:
            out = []
            for d in node.refresh():
                procs = node.processes(d)
                out.append(
                    {
                        "memory_free_bytes": d.memory_free_bytes,
                        "clocks_mhz": d.clocks_mhz,
                        "utilisation_pct": node.utilisation(d),
                        "processes": [p.pid for p in procs],
                        "_gpu_bytes": {p.pid: p.used_memory_bytes for p in procs},
                    }
                )
            return out

        try:
            live = await asyncio.get_running_loop().run_in_executor(None, query)
        except Exception as e:  # a vendor library error must not fail status
            st["devices_error"] = repr(e)
            return st
        for entry, extra in zip(st["devices"], live):
            gpu_bytes = extra.pop("_gpu_bytes")
            entry.update(extra)
            for w in st["pools"].get(entry["key"], {}).get("workers", []):
                w["gpu_bytes"] = gpu_bytes.get(w["pid"])  # NVML per process; None: not reported
        return st

    async def _host(self, st: dict[str, Any]) -> None:
        """Each running command's resident memory (its process tree), and on `cpu` devices the
        host's memory and CPU use, read with psutil on a thread (a walk of the process table)."""
        roots = {c["command"]: c["pid"] for c in st["commands"] if c["pid"] and c["state"] == "running"}

        def query() -> tuple[dict[str, dict[str, int]], Any, float]:
            import psutil

            return tree_memory(roots), psutil.virtual_memory(), psutil.cpu_percent(None)

        try:
            mem, vm, cpu = await asyncio.get_running_loop().run_in_executor(None, query)
        except Exception as e:  # status must answer even when /proc cannot be read
            st["host_error"] = repr(e)
            return
        for c in st["commands"]:
            if c["command"] in mem:
                c["rss_bytes"] = mem[c["command"]]["rss_bytes"]
        primed, self._cpu_primed = self._cpu_primed, True  # the first cpu_percent has no interval
        for d in st["devices"]:
            if d["vendor"] == "cpu":
                d["memory_total_bytes"] = int(vm.total)
                d["memory_free_bytes"] = int(vm.available)
                d["utilisation_pct"] = cpu if primed else None

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        devices = []
        for d in self.core.devices:
            q = self.core.scheduler.devices[d.key]
            holder = self.regions.holder_on(d.key)
            devices.append(
                {
                    "index": d.index,
                    "key": d.key,
                    "vendor": d.vendor,
                    "name": d.name,
                    "uuid": d.uuid,
                    "memory_total_bytes": d.memory_total_bytes,
                    "memory_free_bytes": d.memory_free_bytes,
                    "numa_node": d.numa_node,
                    "clocks_mhz": d.clocks_mhz,
                    "cpus": sorted(d.cpus),
                    "commands": sorted(q.commands),
                    "holder": q.holder,
                    "region": None
                    if holder is None
                    else {
                        "region": holder.id,
                        "name": holder.report.name,
                        "command": holder.command.id,
                        "pid": holder.pid,
                        "state": "share-wait" if holder.sharing else holder.report.outcome,
                        "share_for": list(holder.report.share_for) if holder.sharing else [],
                        "frozen": list(holder.frozen_ids),
                        "cores": sorted(holder.cores),
                        "locked": list(holder.locked_ids),
                    },
                    "queued": q.waiting and list(q.waiting) or [],
                    # memory-aware admission (admission.py): None where it does not track the device
                    "memory": memory_status(self.admission, d.key) if self.admission is not None else None,
                }
            )
        commands = [
            {
                "command": c.id,
                "argv": list(c.spec.argv),
                "state": c.state.value,
                "device": c.device_key or "none",
                "pid": c.pid,
                "uid": c.uid,
                "age_s": round(now - c.submitted, 3) if c.age_known else None,
                "frozen": bool(c.group and c.group.frozen),
                # "frozen" or "locked" while a region holds it (a cancel then kills it), else None
                "held": held[0] if (held := self.regions.holding(c)) is not None else None,
                "regions": len(c.regions),
                # held by others' regions: seconds in all, fraction of the window, owed now (share.py)
                **self.regions.share.status(c.id, now),
                "label": c.spec.label,
                "result": c.report.state if c.report else None,
                "via": c.launched.via if c.launched else None,
                "start_latency_s": c.launched.start_latency_s if c.launched else None,
                "pool_adopted": self.adoptions[c.id].adopted if c.id in self.adoptions else 0,
                "pool_declined": dict(self.adoptions[c.id].declined) if c.id in self.adoptions else {},
                "mem_need": c.mem_need,
                "mem_source": c.mem_source,
                "mem_bytes": c.mem_now,
                "mem_peak": c.mem_peak,
                "waiting_for": c.mem_wait if c.state.value == "queued" or c.gate == "asked" else "",
                "reruns": c.reruns,
                "gate": c.gate,  # --mem-gate: open (importing), asked (waits for memory), passed...
            }
            for c in self.core.commands.values()
        ]
        return {
            "policy": self.core.scheduler.policy.value,
            "pid": os.getpid(),
            "boot": self.boot,
            "version": __version__,
            "isolation": {"backend": self.core.backend.name, "reason": self.core.backend.reason},
            "probes": self.probes(),
            "pools": {k: p.status() for k, p in self.core.pools.items()},
            "freeze": self.core.config.freeze,
            "region_cores": self.core.config.region_cores,
            "share": {
                "hold_share": self.core.config.hold_share,
                "window_s": self.core.config.share_window,
                "on": self.regions.share.on,
            },
            "hold": self.regions.hold_status(),
            "state_disk_full": self.state_disk_full(),
            # why the state disk has no reserve for the records at all ("": it has one, or is full)
            "state_disk_reserve_unavailable": self.reserve_unavailable(),
            "devices": devices,
            "commands": commands,
        }

    def _reserve(self) -> reserve.Reserve | None:
        """The state dir's reserve for the records (linux/reserve), if the daemon has a state dir."""
        return reserve.of(self.core.config.state_dir) if self.core.config.state_dir else None

    def state_disk_full(self) -> bool:
        """Whether a record write met a full state disk and its reserve is not back (linux/reserve)."""
        r = self._reserve()
        return r is not None and r.refresh()

    def reserve_unavailable(self) -> str:
        r = self._reserve()
        return r.unavailable if r is not None else ""

    def probes(self) -> dict[str, Any]:
        """`core.probes` (state, backend, reason), plus what the running backend says of itself
        (the launch probe: its scope and how many processes it probes)."""
        out = dict(self.core.probes)
        if self.core.attributor is not None and out.get("state") == "running":
            try:
                out.update(self.core.attributor.describe())
            except Exception as e:  # status must answer even when a backend cannot
                out["describe_error"] = repr(e)
        return out


def memory_status(admission: Admission, key: str) -> dict[str, Any] | None:
    """A device's memory as admission sees it (None where it does not track the device)."""
    dm = admission.devices.get(key)
    if dm is None:
        return None
    commands = admission.core.commands
    return {
        "total_bytes": dm.total,
        "used_bytes": dm.used,
        "reserved_bytes": sum(commitment.holds(commands[c]) for c in dm.running if c in commands),
        "pool_bytes": dm.pool,
        "headroom_bytes": admission.headroom(dm),
        "free_for_commands_bytes": admission.free(dm),
        "waiting": [{"command": c, "reason": commands[c].mem_wait} for c in dm.waiting if c in commands],
        # --mem-gate: started, to be admitted at their first CUDA use; waiting to start (as many
        # are ahead of their CUDA start as the device has CPUs)
        "gated": sorted(dm.gated),
        "starting": [{"command": c, "reason": commands[c].mem_wait} for c in dm.starts if c in commands],
    }
