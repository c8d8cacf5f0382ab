"""What a device's memory is taken to hold for admission (admission.py), by --mem-commit:

    peak   every running command's need or observed peak (whichever is larger), for its whole
           life, plus the pool's idle workers; or the vendor's reported use, if that is more
    now    the vendor's use at the last sample, plus the need of each running command that sample
           could not see (started since, or not seen holding memory yet, for UNSEEN_S)
    auto   as now, plus what each command whose need was learned from its own key or problem has
           still to take: max(0, need - what it holds now). What a problem peaked at before it
           reaches again; counted only by what it held at the last sample, its growth went to the
           next command admitted, and both ran out of memory (on an H100, three of the reusing
           pool's twelve re-runs were of commands whose 39.7-42.7 GiB need was learned)
    none   as now (the commitment a first run's optimism is bounded by)

A guarded re-run running on the device switches every mode to peak until it ends (it keeps what
it needs). docs/admission.md has why the modes are what they are."""

from __future__ import annotations

import time

from krex_async.daemon.commands.devmemory import DeviceMemory
from krex_async.daemon.model.command import Command

# how long a started command not yet seen holding memory counts its need (a start races the sample)
UNSEEN_S = 5.0


def holds(cmd: Command) -> int:
    """What a running command is taken to hold for its whole life: its need, or more where seen."""
    return max(cmd.mem_need, cmd.mem_peak)


def peaks(dm: DeviceMemory, running: list[Command]) -> int:
    """The device taken at every running command's need or peak, for its whole life, plus the
    pool's workers; or what the vendor reports used, if that is more."""
    return max(sum(holds(c) for c in running) + dm.pool, dm.used)


def grows(cmd: Command) -> bool:
    """Whether a running command is counted by what it has still to take (auto): its need was
    learned from its own key or problem (footprints.py), so it will reach it again."""
    return cmd.mem_source == "learned"


def committed(dm: DeviceMemory, running: list[Command], mode: str) -> int:
    """What the device is taken to hold with `running` on it under --mem-commit `mode`."""
    if mode == "peak" or any(c.guarded for c in running):
        return peaks(dm, running)
    now = time.monotonic()  # not seen yet: started since, or starting (no memory seen, bounded)
    unseen = [
        c
        for c in running
        if c.mem_admitted > dm.sampled_at or (not c.mem_peak and now - c.mem_admitted < UNSEEN_S)
    ]
    more = sum(c.mem_need for c in unseen)
    if mode == "auto":
        more += sum(max(0, c.mem_need - c.mem_now) for c in running if grows(c) and c not in unseen)
    return dm.used + more
