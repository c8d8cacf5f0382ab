"""Bounded soak: N concurrent agents (one Client connection each) run commands with regions for a
fixed time against one daemon on a loopback Unix socket, then check that nothing was lost or leaked.

    python -m bench.soak                        # 64 agents, 30 s, its own daemon
    python -m bench.soak --agents 64 --seconds 300 --json soak.json
    python -m bench.soak --socket /run/krex/krex.sock   # against a running daemon (no leak checks
                                                        # of its own start-up state)

Each command runs `--regions` regions (`with region("soak")`, holding it `--hold-ms`). Checks:
- no deadlock: the whole run must end within seconds + --grace (exit 2 otherwise);
- every submitted command's result reaches its agent exactly once (results counted per command id at
  the agent, late duplicates caught on the connection) and the daemon traced one end per command;
- every region was released (no expiry, no refusal), and no region report is missing;
- nothing leaked: the daemon's open fds, krex cgroups and its commands (after --retention) are back
  where they were before the load; its RSS after is within --rss-slack-mib of before (measured after a
  warm-up round, so imports and first-use caches are not counted).
Prints one table; exit 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import sys
import time
from typing import Any

from bench.harness import output
from bench.harness.output import module_prog, write_json
from bench.harness.stack import Daemon, bench_env
from bench.harness.stats import pct_or_nan
from krex_async import Client
from krex_async import protocol as P

COMMAND = """
import time
from krex_async import region
for _ in range({regions}):
    with region("soak"):
        time.sleep({hold})
"""


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_targets(pid: int) -> dict[str, str]:
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return out


def krex_cgroups(ids: set[str] | None = None) -> int:
    """cgroup directories (any hierarchy: v2, or v1 cpuset/freezer) named for krex commands: those
    of the commands in `ids` when given (other daemons on the host do not count), else any."""
    n = 0
    for _, dirs, _ in os.walk("/sys/fs/cgroup"):
        for d in dirs:
            if ids is None:
                n += "krex" in d or d.startswith("cmd-")
            elif d.startswith("cmd-") and d[4:].split(".")[0] in ids:
                n += 1
    return n


def pct(xs: list[float], q: float) -> float:
    return pct_or_nan(xs, q, "rank")


class Tally:
    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.results: collections.Counter[str] = collections.Counter()
        self.late: collections.Counter[str] = collections.Counter()
        self.traced_ends: collections.Counter[str] = collections.Counter()
        self.enter_s: list[float] = []
        self.isolate_s: list[float] = []  # enter minus the wait in line: what isolating cost
        self.regions = 0
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.states: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []
        self.last_progress = time.monotonic()  # last command start/end or region grant/release


async def agent(
    path: str, argv: list[str], env: dict[str, str], until: float, tally: Tally, regions: int
) -> None:
    async with await Client.connect(path) as c:
        late: asyncio.Queue[Any] = asyncio.Queue()
        while time.monotonic() < until:
            try:
                h = await c.submit(argv, env=env, timeout=120)
            except Exception as e:
                tally.errors.append(f"submit: {e}")
                await asyncio.sleep(0.1)
                continue
            tally.submitted.append(h.command)
            res = await h.wait()
            tally.results[h.command] += 1
            # The client forgets a request once it ended; anything more for it is a duplicate.
            c._queues[h.req_id] = late  # noqa: SLF001 - the instrument looks at the connection
            tally.states[res.report.state] += 1
            if len(res.report.regions) != regions:
                tally.errors.append(
                    f"{h.command}: {len(res.report.regions)} region reports "
                    f"of {regions} (stderr {res.stderr[-300:]!r})"
                )
            for r in res.report.regions:
                tally.regions += 1
                tally.outcomes[r.outcome] += 1
                tally.enter_s.append(r.enter_s)
                tally.isolate_s.append(max(0.0, r.enter_s - r.wait_s))
        await asyncio.sleep(0.2)  # let any duplicate arrive before looking
        while not late.empty():
            msg = late.get_nowait()
            if isinstance(msg, P.Exited):
                tally.late[msg.report.command] += 1


PROGRESS = {"command_start", "command_end", "region_grant", "region_release"}


async def tracer(path: str, tally: Tally) -> None:
    async with await Client.connect(path) as c:
        async for ev in c.trace(probes=False):
            if ev.kind in PROGRESS:
                tally.last_progress = time.monotonic()
            if ev.kind == "command_end":
                tally.traced_ends[ev.command] += 1


async def wait_until(pred: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await pred():
            return True
        await asyncio.sleep(0.1)
    return bool(await pred())


async def soak(args: argparse.Namespace, path: str) -> dict[str, Any]:
    env = bench_env()
    argv = [sys.executable, "-c", COMMAND.format(regions=args.regions, hold=args.hold_ms / 1000)]
    tally = Tally()
    async with await Client.connect(path) as c:
        dpid = int((await c.status())["pid"])
    # Warm-up: one round of every agent, so first-use allocations are not counted as growth.
    warm = Tally()
    await asyncio.gather(
        *(
            asyncio.wait_for(agent(path, argv, env, time.monotonic() + 0.01, warm, args.regions), 120)
            for _ in range(args.agents)
        )
    )
    await asyncio.sleep(args.retention + 1)
    fds_then = fd_targets(dpid)
    before = {"rss_kib": rss_kib(dpid), "fds": fds(dpid), "cgroups": krex_cgroups(set(warm.submitted))}
    trace_task = asyncio.create_task(tracer(path, tally))
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    until = t0 + args.seconds
    agents = [
        asyncio.create_task(agent(path, argv, env, until, tally, args.regions)) for _ in range(args.agents)
    ]
    # A deadlock is a daemon that stops making progress while work is pending, not a slow one: at
    # 64 agents on one device every region freezes 63 commands, so the commands in flight when the
    # time is up can take many seconds to finish. --grace bounds the whole run all the same.
    deadlock = False
    pending: set[asyncio.Task[None]] = set(agents)
    while pending:
        done, pending = await asyncio.wait(pending, timeout=0.25)
        now = time.monotonic()
        if pending and now - tally.last_progress > args.stall:
            deadlock = True
            tally.errors.append(f"no progress for {args.stall} s with {len(pending)} agents waiting")
            break
        if pending and now > until + args.grace:
            tally.errors.append(f"{len(pending)} agents still waiting {args.grace} s after the end")
            break
    wall = time.monotonic() - t0
    drain = max(0.0, wall - args.seconds)
    unfinished = bool(pending)
    stuck = [i for i in tally.submitted if tally.results[i] == 0]
    if stuck:
        async with await Client.connect(path) as c:
            live = {x["command"]: x for x in (await c.status())["commands"]}
        states = {
            i: (live[i]["state"], live[i]["frozen"], live[i]["regions"]) if i in live else "gone"
            for i in stuck[:10]
        }
        tally.errors.append(f"{len(stuck)} commands without a result (daemon says {states})")
    for t in pending:
        t.cancel()
    done = {t for t in agents if t.done() and not t.cancelled()}
    for t in done:
        if t.exception() is not None:
            tally.errors.append(f"agent: {t.exception()!r}")
    await asyncio.sleep(0.5)
    trace_task.cancel()

    async def settled() -> bool:
        async with await Client.connect(path) as c:
            st = await c.status()
        return not st["commands"] and fds(dpid) <= before["fds"]

    await wait_until(settled, args.retention + 10)
    async with await Client.connect(path) as c:
        left = len((await c.status())["commands"])
    ids = set(tally.submitted)
    # Our own status connection just closed: give the daemon a moment to see its end of stream.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(
        v.startswith("socket:") and fds_then.get(k) != v for k, v in fd_targets(dpid).items()
    ):
        await asyncio.sleep(0.05)
    fds_now = fd_targets(dpid)
    new_fds = {k: v for k, v in fds_now.items() if fds_then.get(k) != v}
    # The cgroup backend opens one inotify instance per loop, lazily (on the first freeze that has
    # to wait): not a leak when the warm-up did not happen to create it.
    lazy = int(
        "anon_inode:inotify" not in fds_then.values()
        and list(new_fds.values()).count("anon_inode:inotify") == 1
    )
    if len(fds_now) - lazy > len(fds_then):
        tally.errors.append(f"fds opened during the load and still open: {new_fds}")
    after = {"rss_kib": rss_kib(dpid), "fds": fds(dpid), "cgroups": krex_cgroups(ids)}
    checks = {
        "no deadlock": not deadlock,
        "finished within grace": not unfinished,
        "one result per command": all(tally.results[i] == 1 for i in ids)
        and len(ids) == len(tally.submitted),
        "no late duplicates": not tally.late,
        "one traced end per command": all(tally.traced_ends[i] == 1 for i in ids),
        "every region released": set(tally.outcomes) <= {"released"},
        "no agent errors": not tally.errors,
        "no fd leaked": after["fds"] - lazy <= before["fds"],
        "no cgroup leaked": after["cgroups"] <= before["cgroups"],
        "no command left after retention": left == 0,
        "memory flat": after["rss_kib"] - before["rss_kib"] <= args.rss_slack_mib * 1024,
    }
    return {
        "agents": args.agents,
        "seconds": round(wall, 2),
        "commands": len(ids),
        "regions": tally.regions,
        "commands_per_s": round(len(ids) / wall, 2),
        "drain_after_end_s": round(drain, 2),
        "region_enter_p50_ms": round(pct(tally.enter_s, 0.50) * 1000, 3),
        "region_enter_p99_ms": round(pct(tally.enter_s, 0.99) * 1000, 3),
        "region_enter_max_ms": round(max(tally.enter_s, default=float("nan")) * 1000, 3),
        "region_isolate_p50_ms": round(pct(tally.isolate_s, 0.50) * 1000, 3),
        "region_isolate_p99_ms": round(pct(tally.isolate_s, 0.99) * 1000, 3),
        "states": dict(tally.states),
        "region_outcomes": dict(tally.outcomes),
        "rss_before_mib": round(before["rss_kib"] / 1024, 1),
        "rss_after_mib": round(after["rss_kib"] / 1024, 1),
        "fds_before": before["fds"],
        "fds_after": after["fds"],
        "cgroups_before": before["cgroups"],
        "cgroups_after": after["cgroups"],
        "errors": tally.errors[:10],
        "checks": checks,
        "ok": all(checks.values()),
    }


def start_daemon(args: argparse.Namespace) -> Daemon:
    """The soak's own daemon; its directory (and log) kept with --keep-log."""
    return Daemon(
        [
            "--isolation",
            args.isolation,
            "--devices",
            args.devices,
            "--retention",
            str(args.retention),
            "--region-timeout",
            "60",
            "--log-format",
            "json",
            "--log-level",
            args.log_level,
        ],
        prefix="krex-soak-",
        keep=args.keep_log,
    ).start()


def table(r: dict[str, Any]) -> str:
    rows = [
        ("agents", r["agents"]),
        ("seconds", r["seconds"]),
        ("commands", r["commands"]),
        ("regions", r["regions"]),
        ("commands/s", r["commands_per_s"]),
        ("s to finish after the end", r["drain_after_end_s"]),
        ("region enter p50 ms", r["region_enter_p50_ms"]),
        ("region enter p99 ms", r["region_enter_p99_ms"]),
        ("region enter max ms", r["region_enter_max_ms"]),
        ("  of which isolating p50 ms", r["region_isolate_p50_ms"]),
        ("  of which isolating p99 ms", r["region_isolate_p99_ms"]),
        ("daemon RSS before/after MiB", f"{r['rss_before_mib']} / {r['rss_after_mib']}"),
        ("daemon fds before/after", f"{r['fds_before']} / {r['fds_after']}"),
        ("krex cgroups before/after", f"{r['cgroups_before']} / {r['cgroups_after']}"),
        ("command states", r["states"]),
        ("region outcomes", r["region_outcomes"]),
    ]
    rows += [(f"check: {k}", "ok" if v else "FAILED") for k, v in r["checks"].items()]
    out = [output.table(None, [(k, str(v)) for k, v in rows], sep="  ", left=True)]
    out += [f"error: {e}" for e in r["errors"]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog=module_prog(__spec__), description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--regions", type=int, default=2, help="regions per command")
    ap.add_argument("--hold-ms", type=float, default=1.0, help="time inside each region")
    ap.add_argument("--socket", help="use this running daemon instead of starting one")
    ap.add_argument("--isolation", default="auto", choices=["auto", "cgroup", "signal"])
    ap.add_argument("--devices", default="auto")
    ap.add_argument(
        "--retention",
        type=float,
        default=2.0,
        help="the started daemon's --retention (results kept after the end)",
    )
    ap.add_argument(
        "--grace",
        type=float,
        default=120.0,
        help="seconds past --seconds for the commands in flight to finish",
    )
    ap.add_argument(
        "--stall",
        type=float,
        default=20.0,
        help="seconds without any command or region progress while agents wait: a deadlock",
    )
    ap.add_argument("--rss-slack-mib", type=float, default=24.0)
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--log-level", default="warning", help="the started daemon's log level")
    ap.add_argument("--keep-log", action="store_true", help="keep the started daemon's log")
    args = ap.parse_args(argv)
    daemon = start_daemon(args) if args.socket is None else None
    try:
        result = asyncio.run(soak(args, daemon.socket if daemon else args.socket))
    finally:
        if daemon is not None:
            daemon.stop()
            if args.keep_log:
                print(f"daemon log: {daemon.log}")
    print(table(result))
    if args.json:
        write_json(args.json, result, indent=2)
    if not (result["checks"]["no deadlock"] and result["checks"]["finished within grace"]):
        return 2
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
