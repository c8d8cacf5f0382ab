"""What a device's memory is taken to hold for admission (admission.py), by --mem-commit:

    peak   every running command's need or observed peak (whichever is larger), for its whole
           life, plus the pool's idle workers; or the vendor's reported use, if that is more
    now    the vendor's use at the last sample, plus the need of each running command that sample
           could not see (started since, or not seen holding memory yet, for UNSEEN_S)
    auto   as now, plus what each command whose need was learned from its own key or problem has
           still to take (need less what it holds now) until it has reached that need, for at
           most GROW_S after its admission, where the vendor's pids are ours (`grows`). What a
           problem peaked at before it reaches again; counted only by what it held at the last
           sample, its growth went to the next command admitted, and both ran out of memory (on an
           H100, three of the reusing pool's twelve re-runs were of commands whose 39.7-42.7 GiB
           need was learned)
    none   as now (the commitment a first run's optimism is bounded by)

A guarded re-run running on the device keeps its room (--mem-guard): under peak, every mode is
peak until it ends; under want, the mode's count plus what it has still to take (`guard`).
docs/admission.md has why the modes are what they are."""

from __future__ import annotations

import time

from krex_async.daemon.commands.devmemory import DeviceMemory
from krex_async.daemon.model.command import Command

# how long a started command not yet seen holding memory counts its need (a start races the sample)
UNSEEN_S = 5.0
# how long after its admission a command of learned need counts what it has still to take: longer
# than any job of KernelBench's large set lived on an H100 (0.7-21.7 s in the reusing pool, session
# 26), and a bound on what a command that never allocates (a sleep under a learned label) holds
# back from the others
GROW_S = 30.0


def holds(cmd: Command) -> int:
    """What a running command is taken to hold for its whole life: its need, or more where seen (a
    guarded re-run: what it is guarded at, its failed run's peak and floor included)."""
    return max(cmd.mem_need, cmd.mem_peak, cmd.mem_guard if cmd.guarded else 0)


def peaks(dm: DeviceMemory, running: list[Command]) -> int:
    """The device taken at every running command's need or peak, for its whole life, plus the
    pool's workers; or what the vendor reports used, if that is more."""
    return max(sum(holds(c) for c in running) + dm.pool, dm.used)


def grows(dm: DeviceMemory, cmd: Command, now: float) -> int:
    """What a running command seen by the last sample is taken to have still to take (auto): its
    need, learned from its own key or problem (footprints.py), less what it holds now; nothing once
    it has reached that need (what it holds is in the reported use), GROW_S after its admission,
    or where the vendor's pids are not ours (a command not alone then holds 0 by the figures,
    though its use is in the device's: counting its need on top would count it twice)."""
    if cmd.mem_source != "learned" or not dm.mapped or now - cmd.mem_admitted > GROW_S:
        return 0
    return 0 if cmd.mem_peak >= cmd.mem_need else max(0, cmd.mem_need - cmd.mem_now)


def guard(cmd: Command) -> int:
    """What a guarded re-run has still to take (--mem-guard want): what it was guarded at less
    what it holds now, until it has reached it (what it holds is in the reported use)."""
    return 0 if cmd.mem_peak >= cmd.mem_guard else max(0, cmd.mem_guard - cmd.mem_now)


def committed(dm: DeviceMemory, running: list[Command], mode: str, guarding: str = "peak") -> int:
    """What the device is taken to hold with `running` on it under --mem-commit `mode` and
    --mem-guard `guarding`."""
    guarded = [c for c in running if c.guarded]
    # want counts a re-run's use by its processes: where the vendor's pids are not ours, by peaks
    if mode == "peak" or (guarded and (guarding == "peak" or not dm.mapped)):
        return peaks(dm, running)
    now = time.monotonic()  # not seen yet: started since, or starting (no memory seen, bounded)
    unseen = [
        c
        for c in running
        if not c.guarded
        and (c.mem_admitted > dm.sampled_at or (not c.mem_peak and now - c.mem_admitted < UNSEEN_S))
    ]
    more = sum(c.mem_need for c in unseen) + sum(guard(c) for c in guarded)
    if mode == "auto":
        counted = {id(c) for c in unseen}
        more += sum(grows(dm, c, now) for c in running if id(c) not in counted and not c.guarded)
    return dm.used + more
