"""A held command's share of its device (--hold-share, --share-window; daemon/regions/share.py): back-to-back
regions of one command leave a busy sibling its share of the time, a region still never starts
while a sibling runs, an idle sibling is not waited for, and the option reads from every layer."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from krex_async import Client
from krex_async.daemon.config import ConfigError, load_config
from krex_async.daemon.observe.metrics import Metrics
from krex_async.daemon.regions.share import IDLE_PROBE_S, IdleProbes, Share, busy_by_thread, runnable
from krex_async.ops.statusview import render

from .conftest import PY, py_env, run_daemon, until
from .ops.test_metrics import L, scrape
from .ops.test_metrics_daemon import _free_port
from .test_regions import start_ticker, ticks

WINDOW = 1.5  # --share-window for the daemons here: three windows make a run of a few seconds

# An owner that enters regions back to back for argv[1] seconds, each spinning argv[2] seconds
# inside; one JSON list of its regions (inside times and what the report says of the share).
LOOP = """
import json, sys, time
from krex_async import region
end = time.monotonic() + float(sys.argv[1])
out = []
while time.monotonic() < end:
    with region("timing") as r:
        t0 = time.monotonic()
        stop = t0 + float(sys.argv[2])
        while time.monotonic() < stop:
            pass
        t1 = time.monotonic()
    g = r.report
    out.append({"t0": t0, "t1": t1, "outcome": g.outcome, "share_wait_s": getattr(g, "share_wait_s", 0.0),
                "share_for": getattr(g, "share_for", []), "share_idle": getattr(g, "share_idle", [])})
print(json.dumps(out))
"""

SLEEPER = """
import time
while True:
    time.sleep(0.05)
"""


async def alone_rate(out: str) -> float:
    """The ticker's ticks per second on its own (measured from its own ticks, under today's load)."""
    await until(lambda: len(ticks(out)) >= 300, "the ticker ticked 300 times", timeout=60)
    ts = ticks(out)[-300:]
    return (len(ts) - 1) / (ts[-1] - ts[0])


async def run_loop(c: Client, script, seconds: float, watch: str = "") -> tuple[list[dict[str, Any]], dict]:
    """The owner's regions for `seconds`, and what `krex status` showed meanwhile of `watch` (a
    sibling): whether it was ever starved, and a region ever waited for its share."""
    h = await c.submit([PY, script("loop.py", LOOP), str(seconds), "0.1"], env=py_env())
    seen: dict[str, Any] = {"starved": False, "share_wait": False, "max_owed_s": 0.0, "text": ""}
    done = asyncio.ensure_future(h.wait())
    while not done.done():
        st = await c.status()
        for x in st["commands"]:
            if x["command"] == watch and x.get("starved"):
                seen["starved"] = True
                seen["max_owed_s"] = max(seen["max_owed_s"], x["owed_s"])
        r = st["devices"][0]["region"]
        if r is not None and r["state"] == "share-wait" and watch in r.get("share_for", []):
            seen["share_wait"] = True
            seen["text"] = render(st)  # `krex status` as people read it
        await asyncio.sleep(0.02)
    res = await done
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout), seen


async def running(c: Client, command: str) -> None:
    for _ in range(3000):
        if any(x["command"] == command and x["state"] == "running" for x in (await c.status())["commands"]):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{command} did not start")


def progress(out: str, regions: list[dict[str, Any]], rate: float) -> float:
    """The sibling's ticks over the owner's loop, as a fraction of what it ticks alone in that time."""
    start, end = regions[0]["t0"], regions[-1]["t1"]
    n = sum(1 for t in ticks(out) if start <= t <= end)
    return n / (rate * (end - start))


async def test_back_to_back_regions_leave_a_busy_sibling_its_share(script, tmp_path):
    """Issue 36 (7): one command's regions back to back left another 2% of its progress. With the
    default --hold-share 0.5 the sibling keeps about half its progress over the windows (at least a
    quarter asserted, against a few percent before), the region reports say whom they waited for,
    and `krex status` shows the sibling starved while a region waited for it; the metrics count
    the waits and the sibling's held seconds, whose series goes once the sibling has ended."""
    addr = ("127.0.0.1", _free_port())
    metrics = ("--metrics", f"{addr[0]}:{addr[1]}") if Metrics().available else ()
    async with run_daemon("--share-window", str(WINDOW), *metrics) as d:
        async with await d.client() as c:
            ticker, out = await start_ticker(c, script, tmp_path)
            rate = await alone_rate(out)
            regions, seen = await run_loop(c, script, 3 * WINDOW, watch=ticker.command)
            sib = next(x for x in (await c.status())["commands"] if x["command"] == ticker.command)
            scraped = scrape(addr) if metrics else {}
            await ticker.cancel(9)
            await ticker.wait()
            await run_loop(c, script, 0.01)  # one region released after the sibling's end
            after = scrape(addr) if metrics else {}
    got = progress(out, regions, rate)
    waited = sum(r["share_wait_s"] for r in regions)
    print(f"progress {got:.1%}, {len(regions)} regions, waited {waited:.2f} s, status {sib}")
    assert got >= 0.25, f"the sibling kept {got:.1%} of its progress ({len(regions)} regions)"
    assert all(r["outcome"] == "released" for r in regions)
    assert waited > 0.5 and any(ticker.command in r["share_for"] for r in regions), regions
    assert not any(r["share_idle"] for r in regions), "a busy sibling was taken for idle"
    assert seen["starved"] and seen["share_wait"], seen
    assert f"waits for the share of {ticker.command}" in seen["text"], seen["text"]
    assert 0 < seen["max_owed_s"] <= WINDOW, seen
    # the daemon's own accounting agrees: held about half the loop, never much over the share
    loop_s = regions[-1]["t1"] - regions[0]["t0"]
    assert 0.3 * loop_s < sib["held_s"] < 0.75 * loop_s, (sib, loop_s)
    assert sib["held_fraction"] <= 0.75, sib
    if metrics:
        held = scraped[("krex_command_held_seconds_total", L(device="cpu", command=ticker.command))]
        assert held == pytest.approx(sib["held_s"], abs=0.01)
        assert scraped[("krex_region_share_wait_seconds_total", L(device="cpu"))] == pytest.approx(
            waited, abs=0.01
        )
        assert not any(k[0] == "krex_command_held_seconds_total" for k in after), (
            "the ended sibling's series stayed"
        )


async def test_several_siblings_each_get_their_share(script, tmp_path):
    """Two busy siblings: a region waits until neither is owed time, so each keeps its share."""
    async with run_daemon("--share-window", str(WINDOW)) as d:
        async with await d.client() as c:
            a, out_a = await start_ticker(c, script, tmp_path, "a")
            b, out_b = await start_ticker(c, script, tmp_path, "b")
            rates = [await alone_rate(out_a), await alone_rate(out_b)]
            regions, _ = await run_loop(c, script, 3 * WINDOW)
            for h in (a, b):
                await h.cancel(9)
                await h.wait()
    got = [progress(out, regions, rate) for out, rate in zip((out_a, out_b), rates)]
    assert min(got) >= 0.2, f"progress {got}"
    owed = {x for r in regions for x in r["share_for"]}
    assert owed == {a.command, b.command}, owed


async def test_hold_share_0_is_off_and_the_sibling_starves(script, tmp_path):
    """The same loop with --hold-share 0 (off, as before the share): the sibling gets next to
    nothing, which is what the test above would see without the share."""
    async with run_daemon("--share-window", str(WINDOW), "--hold-share", "0") as d:
        async with await d.client() as c:
            ticker, out = await start_ticker(c, script, tmp_path)
            rate = await alone_rate(out)
            regions, seen = await run_loop(c, script, 2 * WINDOW, watch=ticker.command)
            st = await c.status()
            await ticker.cancel(9)
            await ticker.wait()
    got = progress(out, regions, rate)
    print(f"progress with the share off {got:.1%}, {len(regions)} regions")
    assert got < 0.15, f"the sibling kept {got:.1%} with the share off"
    assert sum(r["share_wait_s"] for r in regions) == 0 and not seen["starved"], seen
    assert st["share"] == {"hold_share": 0.0, "window_s": WINDOW, "on": False}


@pytest.mark.parametrize("isolation", ["cgroup", "signal"])
async def test_a_region_is_granted_only_after_the_sibling_is_held_again(isolation, script, tmp_path):
    """Timings stay clean: the sibling runs while a region waits for its share (it ticks in that
    wait), and never inside a region: each grant comes after it is held again."""
    async with run_daemon("--isolation", isolation, "--share-window", "1") as d:
        async with await d.client() as c:
            ticker, out = await start_ticker(c, script, tmp_path)
            regions, _ = await run_loop(c, script, 2.5)
            await ticker.cancel(9)
            await ticker.wait()
    ts = ticks(out)
    inside = [(i, t) for i, r in enumerate(regions) for t in ts if r["t0"] < t < r["t1"]]
    assert inside == [], f"the sibling ran inside regions: {inside[:5]}"
    shared = [i for i, r in enumerate(regions) if i and r["share_wait_s"] > 0.05]  # not a mere ms
    assert shared, f"no region waited for the sibling's share: {regions}"
    for i in shared:  # it ran in the wait, between the previous region's end and this grant
        assert any(regions[i - 1]["t1"] < t < regions[i]["t0"] for t in ts), (i, regions[i])


async def beside_the_loop(script, source: str, seconds: float) -> tuple[str, list[dict[str, Any]]]:
    """A sibling running `source` while the owner's regions go back to back for `seconds`: its
    command id, and the owner's regions."""
    async with run_daemon("--share-window", str(WINDOW)) as d:
        async with await d.client() as c:
            sibling = await c.submit([PY, script("sibling.py", source)], env=py_env())
            await running(c, sibling.command)
            regions, _ = await run_loop(c, script, seconds)
            await sibling.cancel(9)
            await sibling.wait()
    return sibling.command, regions


async def test_an_idle_sibling_is_not_waited_for(script, tmp_path):
    """A sibling that sleeps uses none of the time it is given: the region stops waiting for it
    after a short probe (IDLE_PROBE_S), and the report names it idle."""
    sleeper, regions = await beside_the_loop(script, SLEEPER, 2 * WINDOW)
    idle = [r for r in regions if sleeper in r["share_idle"]]
    assert idle, f"the sleeper was never found idle: {regions}"
    waited = sum(r["share_wait_s"] for r in regions)
    assert waited < 0.25 * (regions[-1]["t1"] - regions[0]["t0"]), (
        f"waited {waited:.2f} s for an idle sibling"
    )


# ------------------------------------------------------------------------------ without a daemon


def test_owed_time_is_what_slides_the_held_part_under_the_share() -> None:
    s = Share(0.5, 10.0)
    s.end("r1", ["b"], 0.0, 4.0)
    s.end("r2", ["b"], 4.5, 6.0)  # held 5.5 s of the window [-4, 6]: over 5 by 0.5
    assert s.held_s("b", 6.0) == pytest.approx(5.5)
    # the window's left edge must pass 0.5 s of its held spans: from -4 to 0.5, 4.5 s of running
    assert s.owed_s("b", 6.0) == pytest.approx(4.5 + 0.001)
    assert s.owed_s("b", 8.0) == pytest.approx(2.5 + 0.001)  # it ran 2 s of them meanwhile
    under = Share(0.5, 10.0)
    under.end("r1", ["b"], 0.0, 4.0)
    assert under.owed_s("b", 4.0) == 0.0  # 4 s of the window [-6, 4]: under the share
    assert s.owed_s("a", 6.0) == 0.0  # never held
    st = s.status("b", 6.0)
    assert st["starved"] and st["held_s"] == 5.5 and st["held_fraction"] == 0.55
    s.forget("b")  # idle: owed nothing from its past, its total kept
    assert s.owed_s("b", 6.0) == 0.0 and s.status("b", 6.0)["held_s"] == 5.5
    s.begin("r3", ["c"], 1.0)  # held now: counted up to now
    assert s.held_s("c", 3.0) == pytest.approx(2.0)


def test_held_part_of_the_window_kept_in_o1_agrees_with_the_spans() -> None:
    """held_s keeps a running sum (a region's turn must not walk hundreds of spans per sibling):
    it agrees with the sum over the spans clipped to the window (each charged in part or in
    full), and only a command held to the share or over is a candidate for owed time."""
    rng = random.Random(36)
    s, spans, now = Share(0.5, 2.0), [], 0.0
    for i in range(400):  # a region's turn (now), then its span: time only goes on
        start = now + rng.uniform(0.0, 0.05)
        t = start + rng.uniform(0.001, 0.1)
        ran = rng.choice([0.0, 0.0, rng.uniform(0.0, 1.2)]) * (t - start)  # frozen, or locked and ran
        s.begin(f"r{i}", ["b"], start, {"b": {1: 0}})
        s.end(f"r{i}", ["b"], start, t, {"b": {1: int(ran * 1e9)}})
        spans.append((start, t, max(0.0, 1 - ran / (t - start))))  # the charge spread evenly
        now = t + rng.uniform(0.0, 0.5) * (i % 7 == 0)
        brute = sum(max(0.0, e - max(a, now - 2.0)) * d for a, e, d in spans)
        assert s.held_s("b", now) == pytest.approx(brute, abs=1e-6)  # ns read as ints
        assert ("b" in s.over) == (s.owed_s("b", now) > 0) or s.held_s("b", now) < 1.0
    assert len(s.spans["b"]) < 100  # pruned to the window


def test_a_locked_sibling_is_charged_the_span_less_its_cpu_time_a_frozen_one_all_of_it() -> None:
    """A region of S = 4 s: the locked sibling `l` used X = 1.5 s of CPU in it (two processes, read
    at begin and end) and is charged S - X; the frozen `f` (no CPU read) all S; `busy` used more
    CPU than the span (several threads) and is charged nothing, never less; `gone` ended (nothing
    read at the end) is charged the span, never more; `moved` lost a process and gained one (a warm
    worker with 100 s of CPU behind it): only the process read both times is credited."""
    s = Share(0.5, 10.0)
    G = 10**9
    s.begin(
        "r1",
        ["f", "l", "busy", "gone", "moved"],
        0.0,
        {"l": {1: G, 2: 0}, "busy": {3: 0}, "gone": {4: 5 * G}, "moved": {5: 0, 6: 0}},
    )
    at_end = {"l": {1: 2 * G, 2: G // 2}, "busy": {3: 9 * G}, "gone": {}, "moved": {5: G // 2, 7: 100 * G}}
    got = s.end("r1", ["f", "l", "busy", "gone", "moved"], 0.0, 4.0, at_end)
    assert got == pytest.approx({"f": 4.0, "l": 2.5, "busy": 0.0, "gone": 4.0, "moved": 3.5})
    assert s.held_s("l", 4.0) == pytest.approx(2.5) and s.held_s("busy", 4.0) == 0.0
    st = s.status("l", 4.0)
    assert st["held_s"] == 2.5 and st["held_wall_s"] == 4.0 and st["held_fraction"] == 0.25
    assert s.status("busy", 4.0)["held_wall_s"] == 4.0 and "busy" not in s.over
    # no CPU read at the begin (frozen when granted, locked at the end): charged as frozen
    s.begin("r2", ["x"], 5.0)
    assert s.end("r2", ["x"], 5.0, 6.0, {"x": {8: 10**12}}) == {"x": 1.0}


def test_a_locked_sibling_s_charge_is_spread_over_its_span_for_the_window() -> None:
    """The CPU read at each end says how much of a span was charged, not when: the charge is spread
    evenly over it, so it leaves the window at that rate. Frozen over [0, 6], the sibling is 1 s
    over the share of the window [-4, 6] and owed 5 s (the edge must pass 1 s of the span); locked
    over [-4, 6] using 4 s of CPU, it is charged 6 s (0.6 of each second), as far over, and owed the
    1/0.6 s in which the edge passes 1 s of charge."""
    frozen = Share(0.5, 10.0)
    frozen.end("r1", ["l"], 0.0, 6.0)
    assert frozen.held_s("l", 6.0) == pytest.approx(6.0)
    assert frozen.owed_s("l", 6.0) == pytest.approx(5.0 + 0.001)
    locked = Share(0.5, 10.0)
    locked.begin("r1", ["l"], -4.0, {"l": {1: 0}})
    locked.end("r1", ["l"], -4.0, 6.0, {"l": {1: 4 * 10**9}})
    assert locked.held_s("l", 6.0) == pytest.approx(6.0) and "l" in locked.over
    assert locked.owed_s("l", 6.0) == pytest.approx(1.0 / 0.6 + 0.001)
    assert locked.owed_s("l", 7.0) == pytest.approx(1.0 / 0.6 - 1.0 + 0.001)  # it ran 1 s
    assert locked.held_s("l", 8.0) == pytest.approx(6.0 - 2 * 0.6)  # 2 s of the span left it
    assert locked.owed_s("l", 6.0 + 1.0 / 0.6 + 0.002) == 0.0


@pytest.mark.parametrize("share", [0.0, 1.0])
def test_share_0_and_1_are_off(share: float) -> None:
    s = Share(share, 10.0)
    s.end("r", ["b"], 0.0, 10.0)
    assert not s.on and s.owed_s("b", 10.0) == 0.0


def test_hold_share_from_every_layer(tmp_path) -> None:
    f = tmp_path / "krex.toml"
    f.write_text("hold-share = 0.25\nshare_window = 30\n")
    cfg = load_config(str(f), {}, {})
    assert (cfg.hold_share, cfg.share_window) == (0.25, 30.0)
    cfg = load_config(str(f), {"KREX_HOLD_SHARE": "0.75"}, {"share_window": 5.0})
    assert (cfg.hold_share, cfg.share_window) == (0.75, 5.0)
    assert load_config(None, {}, {}).hold_share == 0.5
    with pytest.raises(ConfigError, match="KREX_HOLD_SHARE"):
        load_config(None, {"KREX_HOLD_SHARE": "1.5"}, {})
    with pytest.raises(ConfigError, match="--share-window"):
        load_config(None, {}, {"share_window": 0.0})


# A spinner on one CPU (argv[1]) under a policy (argv[2]: SCHED_IDLE, SCHED_FIFO or SCHED_OTHER),
# for argv[3] seconds (0: until killed); "go" once it spins
SPIN = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
policy = getattr(os, sys.argv[2])
os.sched_setscheduler(0, policy, os.sched_param(1 if policy == os.SCHED_FIFO else 0))
end = time.monotonic() + float(sys.argv[3]) if float(sys.argv[3]) else float("inf")
print("go", flush=True)
while time.monotonic() < end:
    pass
"""


def _spin(cpu: int, policy: str, seconds: float = 0) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", SPIN, str(cpu), policy, str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline() == "go\n"
    return p


def busy_ns(pids: list[int]) -> int:
    """What the processes `pids` have been busy in all (on a CPU or in a run queue), in ns."""
    return sum(busy_by_thread(pids).values())


async def _probe(pids: list[int]) -> bool:
    """One idle probe of the processes `pids`, as a region's share wait takes it."""
    probes = IdleProbes()
    probes.start("x", pids)
    await asyncio.sleep(IDLE_PROBE_S)
    return probes.idle("x", pids)


async def test_the_idle_probe_takes_a_sibling_kept_off_its_cpu_for_busy() -> None:
    """A spinner that a real-time spinner on its one CPU keeps from running for the whole probe
    gets no CPU time in it, and the kernel adds its wait in the run queue to its schedstat only
    once it runs: it is found busy by its runnable thread alone (CPU time alone, the rule before
    2026-12-07, took it for idle, and its share was forgotten). A sleeper is idle, a spinner busy."""
    if os.geteuid() != 0:
        pytest.skip("a real-time spinner needs root")
    cpu = max(os.sched_getaffinity(0))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time\nwhile True:\n    time.sleep(1)"])
    spinner = _spin(cpu, "SCHED_IDLE")
    try:
        assert not await _probe([spinner.pid])
        await until(
            lambda: open(f"/proc/{sleeper.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "S", "it sleeps"
        )
        assert await _probe([sleeper.pid])
        rt = _spin(cpu, "SCHED_FIFO", 0.5)  # the kernel keeps 5% of each second for the others
        try:
            probes = IdleProbes()
            probes.start("x", [spinner.pid])
            then = busy_ns([spinner.pid])
            await asyncio.sleep(IDLE_PROBE_S)
            assert busy_ns([spinner.pid]) == then, "the spinner ran beside the real-time one"
            assert runnable([spinner.pid])
            assert not probes.idle("x", [spinner.pid])
        finally:
            rt.kill()
            rt.wait()
    finally:
        for p in (sleeper, spinner):
            p.kill()
            p.wait()


# After "go" on stdin: spins argv[1] s, then every argv[3] s spins argv[2] s more (0: sleeps);
# argv[4] "exit": exits after its first spin instead.
BURSTS = """
import sys, time
first, each, period = map(float, sys.argv[1:4])
def spin(s):
    end = time.monotonic() + s
    while time.monotonic() < end:
        pass
print("ready", flush=True)
sys.stdin.readline()
spin(first)
if sys.argv[4] == "exit":
    sys.exit(0)
while True:
    time.sleep(period or 3600)
    spin(each)
"""


def _bursts(first: float, each: float = 0, period: float = 0, then: str = "stay") -> subprocess.Popen[str]:
    """A BURSTS process, ready (its "go" not given yet)."""
    p = subprocess.Popen(
        [sys.executable, "-c", BURSTS, str(first), str(each), str(period), then],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p


def _go(p: subprocess.Popen[str]) -> None:
    assert p.stdin is not None
    p.stdin.write("go\n")
    p.stdin.flush()


async def _probes_until_idle(
    pids: Callable[[float], list[int]], limit_s: float, begin: Callable[[], None] = lambda: None
) -> float | None:
    """Seconds of 20 ms probes until the sibling whose processes are pids(seconds so far) is found
    idle; None if not within `limit_s`. `begin` runs once the first probe has started."""
    probes = IdleProbes()
    t0 = time.monotonic()
    probes.start("x", pids(0.0))
    begin()
    while (now := time.monotonic() - t0) < limit_s:
        await asyncio.sleep(IDLE_PROBE_S)
        if probes.idle("x", pids(now)):
            return time.monotonic() - t0
    return None


async def test_a_sibling_s_catch_up_is_forgiven_a_sibling_busy_a_tenth_of_the_time_is_not() -> None:
    """A sibling that spins 3 ms (catching up, thawed) and then sleeps is found idle once its last
    probe was quiet and the 3 ms are under 5% of the wait: within 0.2 s here (by 1% of the whole
    wait, the rule until session 28, not before 0.3 s). One that spins 3 ms every 20 ms (13% of
    the time) is never found idle, however its probes fall between its spins."""
    for first, each, period, limit in ((0.003, 0, 0, 2.0), (0.003, 0.003, 0.02, 1.0)):
        p = _bursts(first, each, period)
        try:
            took = await _probes_until_idle(lambda _s, p=p: [p.pid], limit, lambda p=p: _go(p))
        finally:
            p.kill()
            p.wait()
        if each:
            assert took is None, took
        else:
            assert took is not None and 2 * IDLE_PROBE_S <= took < 0.2, took


async def test_a_worker_that_ends_takes_nothing_back_and_one_that_joins_brings_no_past() -> None:
    """What a sibling was busy is counted thread by thread. Its worker spins 0.3 s and exits while
    the rest sleeps: still busy over 5% of the wait at 0.8 s, so not idle (summed over its
    processes, the worker's end took its whole past back, and the sibling was idle at once). A
    child started during the wait counts all its time, its start included. A warm worker that
    spun 0.2 s before it joined and sleeps since adds none of that: idle soon after it joins
    (summed, it was 'busy' for the next 4 s)."""
    main, worker = _bursts(0), _bursts(0.3, then="exit")
    children: list[subprocess.Popen[str]] = []
    _go(main)
    try:
        took = await _probes_until_idle(
            lambda _s: [p.pid for p in (main, worker) if p.poll() is None], 0.8, lambda: _go(worker)
        )
        assert took is None, took
        assert worker.wait(5) == 0

        def spawn() -> None:  # its interpreter's start and a 40 ms spin, all after the first probe
            children.append(_bursts(0.04))
            _go(children[0])

        took = await _probes_until_idle(lambda _s: [main.pid] + [c.pid for c in children], 0.6, spawn)
        assert took is None, took
    finally:
        for p in (main, worker, *children):
            p.kill()
            p.wait()
    main, warm = _bursts(0), _bursts(0.2)
    for p in (main, warm):
        _go(p)
    try:
        await until(lambda: busy_ns([warm.pid]) >= 0.15e9 and not runnable([warm.pid]), "the warm one spun")
        took = await _probes_until_idle(lambda s: [main.pid] + ([warm.pid] if s > 0 else []), 2.0)
        assert took is not None and took < 0.35, took
    finally:
        for p in (main, warm):
            p.kill()
            p.wait()
