"""Self-check of the cgroup backend on a pure cgroup v2 host with cpuset (the GPU machine).

    sudo python3 -m bench.gpu.check_cgroup_v2

Prints one PASS / FAIL / SKIP / INFO line per check and exits 1 when any check failed. Works in a
private root (krex-bench-<id>/ below the cgroup2 mount), removed at the end. Needs only the standard
library and the krex_async package (PYTHONPATH is set from this file's location).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time

from bench.cgroup_freeze import _private_root, measure
from krex_async.isolation.base import FreezeError  # noqa: F401
from krex_async.isolation.cgroup import CgroupBackend, probe_cgroup
from krex_async.isolation.cgroupfs import CgroupFS
from krex_async.isolation.intent import sweep

HERE = os.path.dirname(os.path.abspath(__file__))

FAILED: list[str] = []
SPIN = ["/bin/sh", "-c", "while :; do :; done"]


def report(ok: bool | None, name: str, detail: str = "") -> None:
    word = "PASS" if ok else "SKIP" if ok is None else "FAIL"
    if ok is False:
        FAILED.append(name)
    print(f"{word} {name}{': ' + detail if detail else ''}", flush=True)


def ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        x = f.read().rsplit(")", 1)[1].split()
    return int(x[11]) + int(x[12])


def allowed(pid: int) -> set[str]:
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            out.add(f.read().split("Cpus_allowed_list:")[1].split()[0])
    return out


async def start(b: CgroupBackend, argv: list[str], frozen: bool = False):  # type: ignore[no-untyped-def]
    g = await b.create(f"c{time.monotonic_ns() % 10**9}")
    p = subprocess.Popen(b.launch_argv(g, argv, frozen=frozen))
    await b.started(g, p.pid)
    deadline = time.monotonic() + 5
    while p.pid not in b.pids(g) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return g, p


async def checks(v2: str, v1: str | None, state: str) -> None:
    ok, why = probe_cgroup(v2)
    report(ok, "probe_cgroup", why)
    b = CgroupBackend(root=v2, state_dir=state, cpuset_root=v1)
    report(b.layout.kind == "v2" and b.cores.mode == "v2", "pure v2 layout with v2 cpuset", b.reason)
    cpus = sorted(b.cpus)

    g, p = await start(b, SPIN)
    await asyncio.sleep(0.2)
    f = await b.freeze(g)
    t0 = ticks(p.pid)
    await asyncio.sleep(0.3)
    report(
        b.v2.events(g.top)["frozen"] == 1 and ticks(p.pid) == t0,
        "freeze stops a spinner",
        f"{f.seconds * 1e3:.3f} ms",
    )
    await b.thaw(g)
    await asyncio.sleep(0.2)
    report(ticks(p.pid) > t0 and b.v2.events(g.top)["frozen"] == 0, "thaw resumes it")

    if len(cpus) >= 2:
        before = allowed(p.pid)
        fence = frozenset(cpus[-2:])
        await b.set_cores(g, fence)
        eff = b.v2.read(g.run, "cpuset.cpus.effective").strip()
        report(
            allowed(p.pid) == {f"{cpus[-2]}-{cpus[-1]}"} and eff == f"{cpus[-2]}-{cpus[-1]}",
            "set_cores v2 cpuset fences every thread",
            f"effective {eff}",
        )
        await b.set_cores(g, None)
        restored = b.v2.read(g.run, "cpuset.cpus").strip()
        parent = b.v2.read(g.top, "cpuset.cpus.effective").strip()
        report(
            allowed(p.pid) == before and restored in ("", parent),  # populated: no "" (ENOSPC)
            "set_cores None restores",
            f"{allowed(p.pid)} cpuset.cpus={restored!r}",
        )
        owner, q = await start(b, ["sleep", "30"])
        await b.set_cores(owner, frozenset({cpus[0]}), pids=[q.pid], exclusive=True)
        part = (
            b.v2.read(owner.keep, "cpuset.cpus.partition").strip()
            if b.v2.exists(owner.keep, "cpuset.cpus.partition")
            else "absent"
        )
        report(
            allowed(q.pid) == {str(cpus[0])},
            "owner pid fenced onto a region core",
            f"partition {part!r} {b.cores.partition_why}",
        )
        report(
            True if b.cores.partition else None,
            "cpuset partition for region cores",
            b.cores.partition_why or part,
        )
        others_eff = b.v2.read(g.run, "cpuset.cpus.effective").strip()
        print(f"INFO sibling effective cpus while owner partitioned: {others_eff}")
        await b.set_cores(owner, None, pids=[q.pid])
        report(
            allowed(q.pid) == before,
            "owner restored (partition back to member)",
            b.v2.read(owner.keep, "cpuset.cpus.partition").strip()
            if b.v2.exists(owner.keep, "cpuset.cpus.partition")
            else "",
        )
        await b.kill(owner)
        q.wait()
        await b.remove(owner)
    else:
        report(None, "set_cores", "fewer than 2 cpus")

    marker = os.path.join(state, "ran")
    g2, p2 = await start(b, ["/bin/sh", "-c", f"touch {marker}"], frozen=True)
    await asyncio.sleep(0.3)
    landed = not os.path.exists(marker) and b.v2.events(g2.run)["frozen"] == 1
    await b.thaw(g2)
    report(landed and p2.wait(timeout=5) == 0 and os.path.exists(marker), "launch frozen=True lands frozen")
    await b.remove(g2)

    await b.freeze(g)
    await b.kill(g)
    report(p.wait(timeout=2) == -signal.SIGKILL, "frozen group killed by cgroup.kill")
    await b.remove(g)

    g3, p3 = await start(b, SPIN)
    if len(cpus) >= 2:
        await b.set_cores(g3, frozenset(cpus[1:]))
    await b.freeze(g3)
    await b.close()
    b2 = CgroupBackend(root=v2, state_dir=state, cpuset_root=v1)
    lines = await b2.reconcile()
    tk = ticks(p3.pid)
    await asyncio.sleep(0.2)
    # Restored means: back to "" (inherit), or, where the kernel refuses "" on a populated v2
    # cgroup (ENOSPC on the H200), to its parent's effective cpus.
    restored = b2.v2.read(g3.run, "cpuset.cpus").strip()
    parent = b2.v2.read(g3.top, "cpuset.cpus.effective").strip()
    report(
        b2.v2.events(g3.top)["frozen"] == 0 and ticks(p3.pid) > tk and restored in ("", parent),
        "reconcile thaws and restores",
        f"cpuset.cpus {restored!r} (parent {parent!r}); " + "; ".join(lines),
    )

    standin = subprocess.Popen(["sleep", "60"])
    b2.start_watchdog(standin.pid)
    b2.groups[g3.command_id] = g3
    await b2.freeze(g3)
    killed_at = time.monotonic()
    standin.kill()
    standin.wait()
    while b2.v2.events(g3.top)["frozen"] == 1 and time.monotonic() - killed_at < 2:
        await asyncio.sleep(0.005)
    took = time.monotonic() - killed_at
    report(took < 1.0, "watchdog thaws after SIGKILL of the daemon", f"{took * 1e3:.1f} ms")
    await b2.kill(g3)
    p3.wait()
    await b2.remove(g3)
    await b2.close()


async def bench() -> None:
    for n in (1, 16):
        r = await measure(n, 50)
        ok = r["enter_p99_ms"] < 2.0 if n == 16 else True
        report(
            ok,
            f"enter latency with {n} siblings",
            " ".join(f"{k}={v:.3f}" for k, v in r.items() if k.endswith("_ms")),
        )


def main() -> int:
    if os.geteuid() != 0:
        print("SKIP everything: needs root")
        return 1
    v2, v1 = _private_root()
    state = tempfile.mkdtemp(prefix="krex-check-")
    try:
        if v1 is not None:
            report(False, "pure v2 host", f"this host is hybrid (v1 cpuset at {v1})")
        asyncio.run(checks(v2, v1, state))
        asyncio.run(bench())
    except Exception as e:  # a crash is a failed check, reported with its cause
        report(False, "check run", f"{type(e).__name__}: {e}")
    finally:
        fs = CgroupFS(v2)
        for rel in reversed(fs.walk("")):
            for pid in fs.procs(rel):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        sweep(fs, None, "v2", None)
        time.sleep(0.2)
        for rel in reversed(fs.walk("")):
            try:
                os.rmdir(fs.path(rel))
            except OSError as e:
                print(f"INFO could not remove {fs.path(rel)}: {e}")
        if v1:
            for rel in reversed(CgroupFS(v1).walk("")):
                os.rmdir(os.path.join(v1, rel))
    print("RESULT", "FAIL " + ", ".join(FAILED) if FAILED else "PASS")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
