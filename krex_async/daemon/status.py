"""What `krex status` and the metrics endpoint see of the daemon: a snapshot of its devices,
commands, regions, pools and probes, and (live) what the vendor libraries and /proc say now."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from krex_async import __version__, logs
from krex_async.ctxpool import adoption
from krex_async.daemon.core import Core
from krex_async.daemon.regions import Regions
from krex_async.linux import reserve
from krex_async.linux.procfs import tree_memory

log = logs.get("krex.daemon")


class Status:
    def __init__(self, core: Core, regions: Regions, adoptions: dict[str, adoption.Tally], boot: str) -> None:
        self.core = core
        self.regions = regions  # who holds each device, and how a region there would hold
        self.adoptions = adoptions  # command id -> interpreters adopted or declined
        self.boot = boot
        self._cpu_primed = False  # psutil's first cpu_percent has no interval to measure

    async def sample_metrics(self, every_s: float = 5.0) -> None:
        """While --metrics serves: every few seconds, the pools' sizes and each GPU's utilisation
        (vendor queries block: they run on a thread). Errors are logged, never fatal."""
        loop = asyncio.get_running_loop()
        node = self.core.node
        while True:
            self.core.metrics.state_disk_full(self.state_disk_full())
            for key, pool in self.core.pools.items():
                st = pool.status()
                self.core.metrics.pool(key, st.get("warm", 0), st.get("busy", 0), st.get("retired", 0))
            if node is not None and any(d.vendor != "cpu" for d in self.core.devices):
                try:
                    utils = await loop.run_in_executor(
                        None, lambda: [(d.key, node.utilisation(d)) for d in self.core.devices]
                    )
                except Exception as e:  # a vendor library error costs one sample
                    log.warning("metrics_sample_failed", error=repr(e))
                    utils = []
                for key, pct in utils:
                    if pct is not None:
                        self.core.metrics.device_util(key, pct)
            await asyncio.sleep(every_s)

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
                        "state": holder.report.outcome,
                        "frozen": list(holder.frozen_ids),
                        "cores": sorted(holder.cores),
                        "locked": list(holder.locked_ids),
                    },
                    "queued": q.waiting and list(q.waiting) or [],
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
                "label": c.spec.label,
                "result": c.report.state if c.report else None,
                "via": c.launched.via if c.launched else None,
                "start_latency_s": c.launched.start_latency_s if c.launched else None,
                "pool_adopted": self.adoptions[c.id].adopted if c.id in self.adoptions else 0,
                "pool_declined": dict(self.adoptions[c.id].declined) if c.id in self.adoptions else {},
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
            "hold": self.regions.hold_status(),
            "state_disk_full": self.state_disk_full(),
            "devices": devices,
            "commands": commands,
        }

    def state_disk_full(self) -> bool:
        """Whether a record write met a full state disk and its reserve is not back (linux/reserve)."""
        r = reserve.of(self.core.config.state_dir) if self.core.config.state_dir else None
        return r is not None and r.refresh()

    def probes(self) -> dict[str, Any]:
        """`daemon.probes` (state, backend, reason), plus what the running backend says of itself
        (the launch probe: its scope and how many processes it probes)."""
        out = dict(self.core.probes)
        if self.core.attributor is not None and out.get("state") == "running":
            try:
                out.update(self.core.attributor.describe())
            except Exception as e:  # status must answer even when a backend cannot
                out["describe_error"] = repr(e)
        return out
