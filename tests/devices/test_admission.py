"""Memory-aware admission on a real daemon with the fake test vendor (devices/fake.py): each device
has 1000 MiB, and each command's allocation is a file the vendor reads per process, as NVML's
per-process memory. Commands allocate with `python -m krex_async.devices.fake`, which fails as
CUDA does ("torch.OutOfMemoryError: CUDA out of memory") where the device is full."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from krex_async.client.submit import Client, CommandHandle, KrexError

from ..conftest import PY, krex_status, run_daemon, until
from ..ops.test_metrics import L, scrape
from .conftest import TOTAL, MiB

U = 7  # the user the footprints' unit tests learn and estimate as


def alloc(*sizes: str, gate: str = "", release: str = "", hold: float = 0.0, oom: str = "torch") -> list[str]:
    argv = [PY, "-m", "krex_async.devices.fake", *sizes, "--hold", str(hold), "--oom", oom]
    if gate:
        argv += ["--gate", gate]
    if release:
        argv += ["--release", release]
    return argv


def daemon(*extra: str, env: dict[str, str]) -> Any:
    """Admission at a command's start (--mem-gate off): test_memgate.py has the gate's tests."""
    return run_daemon(
        "--devices",
        "fake:1",
        "--mem-headroom",
        "0",
        "--policy",
        "shared",
        "--mem-gate",
        "off",
        *extra,
        env=env,
    )


async def row(c: Client, command: str) -> dict[str, Any]:
    st = await c.status()
    return next(x for x in st["commands"] if x["command"] == command)


async def eventually(read: Any, check: Any, what: str, timeout: float = 60.0) -> Any:
    """conftest.until for a value read asynchronously: poll `read()` until `check(value)` holds;
    AssertionError naming `what` and the last value after `timeout`."""
    t0 = asyncio.get_running_loop().time()
    while not check(value := await read()):
        assert asyncio.get_running_loop().time() - t0 < timeout, f"not within {timeout:g} s: {what}: {value}"
        await asyncio.sleep(0.05)
    return value


async def until_status(c: Client, command: str, check: Any, what: str) -> dict[str, Any]:
    """The command's `krex status` row once `check(row)` holds."""
    return await eventually(lambda: row(c, command), check, what)  # type: ignore[no-any-return]


def released(path: str) -> None:
    Path(path).touch()


async def ended_at(c: Client, h: CommandHandle, release: str, peak: int, what: str) -> Any:
    """The report of `h` (held until `release` exists), ended once a sample saw it reach `peak`."""
    await until_status(c, h.command, lambda s: s["mem_peak"] >= peak, what)
    released(release)
    return (await h.wait()).report


async def test_a_declared_need_holds_the_next_until_memory_frees_and_fifo_keeps_order(fake, tmp_path):
    """A holds 600 MiB (declared); B (600) waits for memory, with its reason in status; C (100,
    which would fit now) waits behind B under --mem-backfill 0, never passing it; A's end starts B,
    then C beside it (--mem-commit peak: A holds its 600 until it ends)."""
    env = fake
    ra, rb, rc = (str(tmp_path / n) for n in ("ra", "rb", "rc"))
    async with daemon("--mem-backfill", "0", "--mem-commit", "peak", env=env) as d:
        c = await d.client()
        a = await c.submit(alloc("600M", release=ra), env=env, mem=600 * MiB)
        b = await c.submit(alloc("600M", release=rb), env=env, mem=600 * MiB)
        cc = await c.submit(alloc("100M", release=rc), env=env, mem=100 * MiB)
        assert not a.queued and b.queued and cc.queued
        st = await row(c, b.command)
        assert st["state"] == "queued"
        assert "waiting for memory on fake0: needs ~0.6 GiB (declared), 0.4 GiB free" in st["waiting_for"]
        assert (await row(c, cc.command))["waiting_for"].startswith("queued behind 1 on fake0")
        await until_status(c, a.command, lambda s: s["mem_peak"] >= 600 * MiB, "A's usage sampled")
        text = " ".join((await krex_status(d.socket, env)).stdout.split())  # unwrapped
        want = (
            "reserved 600M, used 600M, pool 0B, headroom 0B, free for commands 400M; "
            f"2 queued for memory: {b.command}, {cc.command}"
        )
        assert want in text, text
        assert "waiting for memory on fake0: needs ~0.6 GiB" in text, text
        assert (await row(c, b.command))["state"] == "queued"  # still: 600 + 600 > 1000
        released(ra)
        assert (await a.wait()).report.exit_code == 0
        await until_status(c, b.command, lambda s: s["state"] == "running", "B started after A")
        await until_status(c, cc.command, lambda s: s["state"] == "running", "C started beside B")
        released(rb)
        released(rc)
        rep_b, rep_c = (await b.wait()).report, (await cc.wait()).report
        assert rep_b.exit_code == 0 and rep_c.exit_code == 0, (rep_b, rep_c)
        assert rep_b.mem_source == "declared" and rep_b.mem_need == 600 * MiB
        await c.close()


async def test_mem_commit_now_counts_what_the_device_uses_and_peak_what_commands_could(fake, tmp_path):
    """A declares 600 MiB but uses 50. Under --mem-commit now, once a sample has seen its use, B
    (600) starts beside it; under peak, B waits for A's end (A is taken at its declared 600)."""
    env = fake
    for commit, beside in (("now", True), ("peak", False)):
        ra, rb = str(tmp_path / f"a-{commit}"), str(tmp_path / f"b-{commit}")
        async with daemon("--mem-commit", commit, env=env) as d:
            c = await d.client()
            a = await c.submit(alloc("50M", release=ra), env=env, mem=600 * MiB)
            await until_status(c, a.command, lambda s: s["mem_peak"] >= 50 * MiB, "A's use sampled")
            b = await c.submit(alloc("600M", release=rb), env=env, mem=600 * MiB)
            if beside:
                await until_status(c, b.command, lambda s: s["state"] == "running", "B beside A")
            else:
                assert b.queued and "needs ~0.6 GiB (declared)" in (await row(c, b.command))["waiting_for"]
            released(ra)
            await until_status(c, b.command, lambda s: s["state"] == "running", "B running")
            released(rb)
            assert (await a.wait()).report.exit_code == 0 and (await b.wait()).report.exit_code == 0
            await c.close()


async def test_commands_that_fit_start_past_a_waiting_head_until_its_backfill_window_closes(fake, tmp_path):
    """A holds 600 MiB; B (600) waits. Within --mem-backfill, C (100, fits) starts past B; once B has
    waited longer than the window, D (100, fits too) waits behind B, and starts only after B did."""
    env = fake
    ra, rb, rc, rd = (str(tmp_path / n) for n in ("ra", "rb", "rc", "rd"))
    async with daemon("--mem-backfill", "1.5", "--mem-commit", "peak", env=env) as d:
        c = await d.client()
        a = await c.submit(alloc("600M", release=ra), env=env, mem=600 * MiB)
        b = await c.submit(alloc("600M", release=rb), env=env, mem=600 * MiB)
        b_waits = time.monotonic()
        cc = await c.submit(alloc("100M", release=rc), env=env, mem=100 * MiB)
        assert not a.queued and b.queued
        await until_status(c, cc.command, lambda s: s["state"] == "running", "C started past B")
        assert (await row(c, b.command))["state"] == "queued"
        await until(lambda: time.monotonic() - b_waits > 2.0, "B waited past the window")
        dd = await c.submit(alloc("100M", release=rd), env=env, mem=100 * MiB)
        assert dd.queued
        await until_status(
            c, dd.command, lambda s: s["waiting_for"].startswith("queued behind"), "D behind B"
        )
        released(rc)
        assert (await cc.wait()).report.exit_code == 0
        assert (await row(c, dd.command))["state"] == "queued"  # 100 would fit beside A; B comes first
        released(ra)
        await until_status(c, b.command, lambda s: s["state"] == "running", "B started after A")
        await until_status(c, dd.command, lambda s: s["state"] == "running", "D started beside B")
        released(rb)
        released(rd)
        assert (await b.wait()).report.exit_code == 0 and (await dd.wait()).report.exit_code == 0
        await c.close()


async def test_a_footprint_learned_by_label_reserves_and_unknowns_run_one_at_a_time(fake, tmp_path):
    """A first `big` command (unknown) runs; a second unknown waits while its footprint is learned;
    once `big` ended at 700 MiB, two more `big` commands do not run together (learned 700 each),
    and the learned figure is kept in the state dir for the daemon's next life."""
    env = fake
    r1, r2, ru = (str(tmp_path / n) for n in ("r1", "r2", "ru"))
    async with daemon(env=env) as d:
        c = await d.client()
        first = await c.submit(alloc("700M", release=r1), env=env, label="big")
        other = await c.submit(alloc("10M", release=ru), env=env, label="small")
        assert not first.queued and other.queued
        assert "footprint unknown" in (await row(c, other.command))["waiting_for"]
        await until_status(c, first.command, lambda s: s["mem_peak"] >= 700 * MiB, "first's peak seen")
        released(r1)
        assert (await first.wait()).report.mem_peak == 700 * MiB
        await until_status(c, other.command, lambda s: s["state"] == "running", "the unknown started")
        released(ru)
        await other.wait()
        b1 = await c.submit(alloc("700M", release=r2), env=env, label="big")
        b2 = await c.submit(alloc("700M", hold=0), env=env, label="big")
        assert not b1.queued and b2.queued
        st = await row(c, b2.command)
        assert st["mem_source"] == "learned" and "needs ~0.7 GiB (learned)" in st["waiting_for"], st
        released(r2)
        assert (await b1.wait()).report.exit_code == 0
        rep = (await b2.wait()).report
        assert rep.exit_code == 0 and rep.mem_source == "learned", rep
        await c.close()
        state = Path(d.socket).parent / "state" / "memory.json"  # written within WRITE_S

        def kept() -> bool:
            return state.exists() and f'"u{os.geteuid()} label big"' in state.read_text()

        await until(kept, "the learned figure kept in the state dir")


async def test_a_mem_key_of_parts_uses_its_own_footprint_once_known_and_its_kinds_until_then(fake, tmp_path):
    """`kind / p1` peaks at 700 MiB; `kind / p3`, never seen, is taken to need its kind's 700 MiB;
    once it ran (300 MiB), it is taken at its own 300; an unseen `kind / p9` needs the kind's
    typical peak (the median of 700, 300, 300: 300), not its largest."""
    env = fake
    runs = iter(range(100))

    async def need(size: str, key: str) -> tuple[int, str]:
        release = str(tmp_path / f"r{next(runs)}")
        h = await c.submit(alloc(size, release=release), env=env, mem_key=key)
        peak = int(size[:-1]) * MiB
        await until_status(c, h.command, lambda s: s["mem_peak"] >= peak, f"{key}'s peak seen")
        released(release)
        rep = (await h.wait()).report
        assert rep.exit_code == 0 and rep.mem_peak == peak, rep
        return rep.mem_need, rep.mem_source

    async with daemon(env=env) as d:
        c = await d.client()
        assert await need("700M", "kind / p1") == (0, "unknown")
        assert await need("300M", "kind / p3") == (700 * MiB, "typical")  # the kind's, until it ran
        assert await need("300M", "kind / p3") == (300 * MiB, "learned")  # its own
        assert await need("300M", "kind / p9") == (300 * MiB, "typical")
        assert await need("700M", "kind / p1") == (700 * MiB, "learned")  # its own largest
        await c.close()


async def _scenario(
    c: Client, env: dict[str, str], tmp_path: Path, rerun: bool, oom: str = "torch"
) -> tuple[CommandHandle, Any]:
    """A (need unknown, allocates 50 MiB) runs; B (400) starts beside it; A then grows to 700 MiB,
    which does not fit beside B: CUDA out of memory, though A alone fits. torch's message shows what
    A needs at least (its floor: 50 held, 650 tried), so its re-run is guarded at 700 beside B's
    peak; cuBLAS's says nothing of sizes, and a failed run teaches no peak, so A's need is still
    unknown: its re-run runs alone."""
    gate, rb = str(tmp_path / "gate"), str(tmp_path / "rb")
    a = await c.submit(alloc("50M", "700M", gate=gate, oom=oom), env=env, rerun_on_oom=rerun)
    await until_status(c, a.command, lambda s: s["mem_peak"] >= 50 * MiB, "A allocated")
    b = await c.submit(alloc("400M", release=rb), env=env, mem=400 * MiB)
    assert not b.queued
    await until_status(c, b.command, lambda s: s["mem_peak"] >= 400 * MiB, "B allocated")
    released(gate)
    return a, b


@pytest.mark.parametrize("oom", ["torch", "cublas"])
async def test_a_co_located_oom_is_re_run_once_alone_and_reported(fake, tmp_path, oom):
    """Whether torch's allocator or a CUDA library (cuBLAS creating its handle, as a job lost on
    the H100 in session 22) ran out of device memory beside others."""
    env = fake
    addr = ("127.0.0.1", _free_port())
    async with daemon("--metrics", f"{addr[0]}:{addr[1]}", env=env) as d:
        c = await d.client()
        a, b = await _scenario(c, env, tmp_path, rerun=True, oom=oom)
        events: list[str] = []

        async def watch() -> None:
            async for stream, _data in a.output(reruns=True):
                events.append(stream)

        watcher = asyncio.get_running_loop().create_task(watch())
        st = await until_status(c, a.command, lambda s: s["reruns"] == 1, "A re-queued after its OOM")
        waits = {
            "torch": "needs ~0.7 GiB (learned) beside the others' peaks on fake0",
            "cublas": "waits to run alone on fake0",
        }[oom]
        assert st["state"] == "queued" and waits in st["waiting_for"], st
        assert (await row(c, b.command))["state"] == "running"
        await until(lambda: "rerun" in events, "the agent heard of the re-run")
        m = await asyncio.to_thread(scrape, addr)
        assert m[("krex_command_reruns_total", L(device="fake0", reason="co-located OOM"))] == 1.0, m
        assert m[("krex_commands_waiting_memory", L(device="fake0"))] == 1.0, m
        released(str(tmp_path / "rb"))
        await watcher
        res = a._result
        assert res is not None
        rep = res.report
        assert rep.state == "exited" and rep.exit_code == 0, rep
        assert rep.reruns == 1 and rep.rerun_reason == "co-located OOM" and rep.oom == ""
        assert (
            b"out of memory" not in res.stderr and res.stdout == b"allocated 52428800\nallocated 734003200\n"
        ), res
        assert (await b.wait()).report.exit_code == 0
        await c.close()


async def test_a_re_run_of_known_need_is_guarded_beside_the_others_peaks_not_alone(fake, tmp_path):
    """A declares 300 MiB and uses 50 at first; B (400) and D (350) start beside it under
    --mem-commit now. A's growth to 300 meets CUDA out of memory. A's re-run is guarded: it waits
    while 300 does not fit beside B's and D's peaks, and starts once D ends, with B still running
    (not alone); while it runs, an unknown C waits for it (C's peak could take A's room), and A
    ends well with one re-run."""
    env = fake
    gate, ra, rb, rc, rd = (str(tmp_path / n) for n in ("gate", "ra", "rb", "rc", "rd"))
    async with daemon(env=env) as d:
        c = await d.client()
        a = await c.submit(
            alloc("50M", "300M", gate=gate, release=ra), env=env, mem=300 * MiB, rerun_on_oom=True
        )
        await until_status(c, a.command, lambda s: s["mem_peak"] >= 50 * MiB, "A allocated")
        b = await c.submit(alloc("400M", release=rb), env=env, mem=400 * MiB)
        dd = await c.submit(alloc("350M", release=rd), env=env, mem=350 * MiB)
        assert not b.queued and not dd.queued
        for h, n in ((b, 400), (dd, 350)):
            await until_status(c, h.command, lambda s, n=n: s["mem_peak"] >= n * MiB, "B and D allocated")
        released(gate)
        st = await until_status(c, a.command, lambda s: s["reruns"] == 1, "A re-queued after its OOM")
        assert st["state"] == "queued", st
        assert (
            "needs ~0.3 GiB (declared) beside the others' peaks on fake0, 0.2 GiB free" in st["waiting_for"]
        ), st
        released(rd)
        assert (await dd.wait()).report.exit_code == 0
        await until_status(
            c,
            a.command,
            lambda s: s["state"] == "running" and s["mem_bytes"] >= 300 * MiB,
            "A's re-run grew to 300 beside B",
        )
        assert (await row(c, b.command))["state"] == "running"
        cc = await c.submit(alloc("10M", release=rc), env=env, label="never seen")
        assert cc.queued
        st = await row(c, cc.command)
        assert (
            st["mem_source"] == "unknown"
            and f"waiting for {a.command}, a guarded re-run" in st["waiting_for"]
        ), st
        released(ra)
        rep = (await a.wait()).report
        assert rep.exit_code == 0 and rep.reruns == 1 and rep.rerun_reason == "co-located OOM", rep
        assert (await row(c, b.command))["state"] == "running"  # A's re-run never needed B gone
        await until_status(c, cc.command, lambda s: s["state"] == "running", "C after A's re-run")
        released(rb)
        released(rc)
        assert (await b.wait()).report.exit_code == 0 and (await cc.wait()).report.exit_code == 0
        await c.close()


async def test_a_guarded_re_run_that_meets_out_of_memory_again_runs_once_more_alone(fake, tmp_path):
    """A declares 100 MiB but grows to 700: its guarded re-run (100 fits beside B's 400) meets out of
    memory again beside B, so it is re-run a second time, alone: it waits for B, then succeeds.
    A's out-of-memory is cuBLAS's, whose message shows no floor (torch's would have guarded the
    re-run at 700)."""
    env = fake
    gate, rb = str(tmp_path / "gate"), str(tmp_path / "rb")
    async with daemon(env=env) as d:
        c = await d.client()
        argv = alloc("50M", "700M", gate=gate, oom="cublas")
        a = await c.submit(argv, env=env, mem=100 * MiB, rerun_on_oom=True)
        await until_status(c, a.command, lambda s: s["mem_peak"] >= 50 * MiB, "A allocated")
        b = await c.submit(alloc("400M", release=rb), env=env, mem=400 * MiB)
        await until_status(c, b.command, lambda s: s["mem_peak"] >= 400 * MiB, "B allocated")
        released(gate)
        st = await until_status(c, a.command, lambda s: s["reruns"] == 2, "A re-run a second time")
        assert st["state"] == "queued" and "waits to run alone on fake0" in st["waiting_for"], st
        assert (await row(c, b.command))["state"] == "running"
        released(rb)
        assert (await b.wait()).report.exit_code == 0
        res = await a.wait()
        assert res.report.exit_code == 0 and res.report.reruns == 2, res.report
        assert res.stdout == b"allocated 52428800\nallocated 734003200\n", res
        await c.close()


async def test_the_floor_an_out_of_memory_shows_guards_its_re_run_and_is_learned_for_its_kind(fake, tmp_path):
    """A (label `wide`, need unknown) grows to 700 MiB beside B's 400: torch's message shows A needs
    700 at least. A's re-run waits guarded at that floor (on the old code: alone, its need
    unknown), and the next `wide` command is taken at 700 learned (on the old code: unknown, as a
    failed run taught nothing). Once B ends, A's re-run succeeds."""
    env = fake
    gate, ra, rb = str(tmp_path / "gate"), str(tmp_path / "ra"), str(tmp_path / "rb")
    async with daemon(env=env) as d:
        c = await d.client()
        argv = alloc("50M", "700M", gate=gate, release=ra)
        a = await c.submit(argv, env=env, label="wide", rerun_on_oom=True)
        await until_status(c, a.command, lambda s: s["mem_peak"] >= 50 * MiB, "A allocated")
        b = await c.submit(alloc("400M", release=rb), env=env, mem=400 * MiB)
        assert not b.queued
        await until_status(c, b.command, lambda s: s["mem_peak"] >= 400 * MiB, "B allocated")
        released(gate)
        st = await until_status(c, a.command, lambda s: s["reruns"] == 1, "A re-queued after its OOM")
        assert st["state"] == "queued", st
        assert "needs ~0.7 GiB (learned) beside the others' peaks on fake0" in st["waiting_for"], st
        e = await c.submit(alloc("10M"), env=env, label="wide")
        assert e.queued
        st = await row(c, e.command)
        assert st["mem_source"] == "learned" and st["mem_need"] == 700 * MiB, st
        released(rb)
        assert (await b.wait()).report.exit_code == 0
        rep = await ended_at(c, a, ra, 700 * MiB, "A's re-run at 700")
        assert rep.exit_code == 0 and rep.reruns == 1, rep
        assert (await e.wait()).report.exit_code == 0
        await c.close()


async def test_under_auto_a_learned_need_keeps_what_its_command_has_still_to_take(fake, tmp_path):
    """A `grow` command peaked at 600 MiB; the next (learned 600) holds 50 at first. Under the
    default --mem-commit auto, B (declared 500) waits: 50 used and 550 still to come leave 400.
    A then grows to 600 and ends well, and B starts. Under `now` (on the old code, auto too) B
    started beside A's 50, and A's growth met an out-of-memory."""
    env = fake
    gate, r1, ra = (str(tmp_path / n) for n in ("gate", "r1", "ra"))
    async with daemon(env=env) as d:
        c = await d.client()
        first = await c.submit(alloc("600M", release=r1), env=env, label="grow")
        assert (await ended_at(c, first, r1, 600 * MiB, "the first's peak seen")).mem_peak == 600 * MiB
        argv = alloc("50M", "600M", gate=gate, release=ra)
        a = await c.submit(argv, env=env, label="grow", rerun_on_oom=True)
        st = await until_status(c, a.command, lambda s: s["mem_bytes"] >= 50 * MiB, "A at 50 MiB")
        assert st["mem_source"] == "learned" and st["mem_need"] == 600 * MiB, st
        b = await c.submit(alloc("500M"), env=env, mem=500 * MiB)
        assert b.queued
        st = await row(c, b.command)
        assert "needs ~0.5 GiB (declared), 0.4 GiB free" in st["waiting_for"], st
        released(gate)
        await until_status(c, a.command, lambda s: s["mem_peak"] >= 600 * MiB, "A grown to 600")
        assert (await row(c, b.command))["state"] == "queued"
        rep = await ended_at(c, a, ra, 600 * MiB, "A at 600")
        assert rep.exit_code == 0 and rep.reruns == 0, rep
        assert (await b.wait()).report.exit_code == 0
        await c.close()


async def test_a_guarded_re_run_whose_floor_grew_is_guarded_again_not_run_alone(fake, tmp_path):
    """A (label `steps`) holds 50 MiB beside B (400), D (350) and C (100, declared), then asks for
    300: out of memory, floor 300. Its guarded re-run starts once D ends (300 fits beside B and C)
    and grows to 700: out of memory again, floor 700. It is guarded again at 700, not alone: it
    starts once B ends, with C still running, and succeeds with two re-runs. On the old code the
    second re-run ran alone, after C too."""
    env = fake
    gate, ra, rb, rc, rd = (str(tmp_path / n) for n in ("gate", "ra", "rb", "rc", "rd"))
    async with daemon(env=env) as d:
        c = await d.client()
        argv = alloc("50M", "300M", "700M", gate=gate, release=ra)
        a = await c.submit(argv, env=env, label="steps", rerun_on_oom=True)
        await until_status(c, a.command, lambda s: s["mem_peak"] >= 50 * MiB, "A allocated")
        others = {}
        for name, size, release in (("B", 400, rb), ("D", 350, rd), ("C", 100, rc)):
            h = await c.submit(alloc(f"{size}M", release=release), env=env, mem=size * MiB)
            await until_status(c, h.command, lambda s, n=size: s["mem_peak"] >= n * MiB, f"{name} allocated")
            others[name] = h
        released(gate)
        st = await until_status(c, a.command, lambda s: s["reruns"] == 1, "A re-queued at its floor")
        assert "needs ~0.3 GiB (learned) beside the others' peaks" in st["waiting_for"], st
        released(rd)
        st = await until_status(c, a.command, lambda s: s["reruns"] == 2, "A re-queued at its new floor")
        assert (
            st["state"] == "queued"
            and "needs ~0.7 GiB (learned) beside the others' peaks" in st["waiting_for"]
        ), st
        released(rb)
        await until_status(c, a.command, lambda s: s["mem_bytes"] >= 700 * MiB, "A's third run at 700")
        assert (await row(c, others["C"].command))["state"] == "running", "A was guarded, not alone"
        released(ra)
        rep = (await a.wait()).report
        assert rep.exit_code == 0 and rep.reruns == 2 and rep.oom == "", rep
        released(rc)
        for h in others.values():
            assert (await h.wait()).report.exit_code == 0
        await c.close()


async def test_a_co_located_oom_without_rerun_on_oom_fails_naming_co_location(fake, tmp_path):
    env = fake
    async with daemon(env=env) as d:
        c = await d.client()
        a, b = await _scenario(c, env, tmp_path, rerun=False)
        res = await a.wait()
        rep = res.report
        assert rep.exit_code == 1 and rep.oom == "co-located" and rep.reruns == 0, rep
        assert "co-located on fake0" in rep.error and "rerun_on_oom" in rep.error, rep.error
        assert b"CUDA out of memory" in res.stderr
        released(str(tmp_path / "rb"))
        await b.wait()
        # alone, an OOM is the command's own
        lone = await c.run(alloc("2000M"), env=env)
        assert (
            lone.report.exit_code == 1
            and lone.report.oom == "alone"
            and "co-located" not in lone.report.error
        )
        await c.close()


async def test_larger_than_the_device_is_refused_and_fits_alone_always_runs(fake, tmp_path):
    env = fake
    async with daemon(env=env) as d:
        c = await d.client()
        with pytest.raises(KrexError) as e:
            await c.submit(alloc("1M"), env=env, mem=2000 * MiB, device="fake0")
        assert e.value.code == "too_large" and "more than fake0 has in all" in e.value.message
        with pytest.raises(KrexError) as e:
            await c.submit(alloc("1M"), env=env, mem=2000 * MiB)
        assert e.value.code == "bad_device" and "no device is large enough" in e.value.message
        # a need up to the whole device (the headroom aside) runs once the device is free
        rel = str(tmp_path / "r")
        small = await c.submit(alloc("10M", release=rel), env=env, mem=10 * MiB)
        whole = await c.submit(alloc("990M"), env=env, mem=TOTAL)
        assert whole.queued
        released(rel)
        await small.wait()
        assert (await whole.wait()).report.exit_code == 0
        await c.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_pids_that_are_not_ours_still_measure_a_command_running_alone(fake, tmp_path):
    """NVML's pids are the host's: a daemon in a container matches none of them. A command alone
    on its device is then measured by the device's use above its idle baseline, and learned."""
    env = dict(fake, KREX_FAKE_GPU_PID_OFFSET="4000000")
    rel = str(tmp_path / "r")
    async with daemon(env=env) as d:
        c = await d.client()
        h = await c.submit(alloc("300M", release=rel), env=env, label="far")
        await until_status(c, h.command, lambda s: s["mem_peak"] >= 300 * MiB, "its use above the baseline")
        released(rel)
        assert (await h.wait()).report.mem_peak == 300 * MiB
        nxt = await c.submit(alloc("1M"), env=env, label="far")
        res = await nxt.wait()
        assert res.report.mem_source == "learned" and res.report.mem_need == 300 * MiB, res.report
        await c.close()


REGION_OWNER = """
import os, sys, time
from krex_async import region
with region(sys.argv[1]):
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.02)
"""


async def test_region_backlog_holds_a_new_command_while_regions_queue(fake, tmp_path, script):
    """--region-backlog 1 under policy region: while one region waits behind another on the device,
    a new command waits too (its reason names the backlog); it starts once the line is gone."""
    env = fake
    owner = script("owner.py", REGION_OWNER)
    ra, rb = str(tmp_path / "ra"), str(tmp_path / "rb")
    args = (
        "--devices",
        "fake:1",
        "--mem-headroom",
        "0",
        "--policy",
        "region",
        "--freeze",
        "device-holders",
        "--mem-gate",
        "off",
    )
    async with run_daemon(*args, "--region-backlog", "1", "--mem-default", "1", env=env) as d:
        c = await d.client()
        a = await c.submit([PY, owner, "a", ra], env=env, label="a")

        async def device() -> dict[str, Any]:
            return (await c.status())["devices"][0]  # type: ignore[no-any-return]

        await eventually(lambda: device(), lambda dev: dev["holder"] is not None, "A's region held")
        b = await c.submit([PY, owner, "b", rb], env=env, label="b")
        await eventually(lambda: device(), lambda dev: len(dev["queued"]) == 1, "B's region queued")
        new = await c.submit(alloc("1M"), env=env, label="new")
        st = await row(c, new.command)
        assert (
            st["state"] == "queued"
            and "1 region(s) already queued on fake0 (--region-backlog 1)" in st["waiting_for"]
        ), st
        released(ra)
        released(rb)
        assert (await new.wait()).report.exit_code == 0
        assert (await a.wait()).report.exit_code == 0 and (await b.wait()).report.exit_code == 0
        await c.close()


async def test_krex_run_mem_declares_the_need(fake):
    """`krex run --mem SIZE` is Submit.mem: larger than the device, refused before anything runs."""
    env = fake
    async with daemon(env=env) as d:
        run = [PY, "-m", "krex_async", "run", "--socket", d.socket, "--device", "fake0"]
        p = await asyncio.to_thread(
            subprocess.run,
            [*run, "--mem", "2G", "--", "true"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert p.returncode == 125 and "needs 2.0 GiB (Submit.mem), more than fake0 has in all" in p.stderr, p
        ok = await asyncio.to_thread(
            subprocess.run,
            [*run, "--mem", "100M", "--", "true"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert ok.returncode == 0, ok


def test_footprints_are_kept_bounded_and_survive_a_damaged_file(tmp_path, monkeypatch):
    from krex_async.daemon.commands import footprints

    monkeypatch.setattr(footprints, "KEEP_KEYS", 3)
    path = str(tmp_path / "memory.json")
    f = footprints.Footprints(path)
    for i in range(5):
        f.learn(U, [f"k{i}"], i)
    f.learn(U, ["k3"], 10)
    for _ in range(footprints.KEEP_PEAKS):
        f.learn(U, ["k4"], 1)
    again = footprints.Footprints(path)
    assert list(again.peaks) == ["u7 k2", "u7 k3", "u7 k4"] and again.get("u7 k3") == 10  # the oldest went
    assert again.peaks["u7 k4"] == [1] * footprints.KEEP_PEAKS and again.get("u7 k4") == 1  # the last 8
    Path(path).write_text("{not json")
    assert footprints.Footprints(path).peaks == {}  # learned anew, not a daemon that cannot start


def test_one_users_many_keys_never_push_out_anothers(monkeypatch):
    """Past KEEP_KEYS the user holding the most keys gives up its oldest: a user learning many keys
    (by chance, or to evict) pushes out its own, not another user's few."""
    from krex_async.daemon.commands import footprints

    monkeypatch.setattr(footprints, "KEEP_KEYS", 4)
    f = footprints.Footprints(None)
    f.learn(1, ["mine"], 5)
    for i in range(10):
        f.learn(2, [f"k{i}"], i)
    assert list(f.peaks) == ["u1 mine", "u2 k7", "u2 k8", "u2 k9"]
    f.learn(1, ["also"], 6)  # now user 2 holds the most still
    assert list(f.peaks) == ["u1 mine", "u2 k8", "u2 k9", "u1 also"]
    f.learn(1, ["third"], 7)  # user 1 holds the most now: its own oldest goes
    assert list(f.peaks) == ["u2 k8", "u2 k9", "u1 also", "u1 third"]
    tie = footprints.Footprints(None)
    for uid, keys in ((1, ["a1", "a2"]), (2, ["b1"]), (3, ["c1"]), (2, ["b2"])):
        tie.learn(uid, keys, 1)
    # users 1 and 2 both hold two at the end: the one learning gives up its own oldest
    assert list(tie.peaks) == ["u1 a1", "u1 a2", "u3 c1", "u2 b2"]


def test_what_one_user_taught_tells_nothing_of_anothers_need():
    """Every source a need comes from is the user's own: its key, a prefix (typical) and a
    mem_alike feature another user's commands share."""
    from krex_async import protocol as P
    from krex_async.daemon.commands import footprints

    f = footprints.Footprints(None)

    def job(problem: str) -> P.Submit:
        alike = ["runner", f"file {problem}"]
        return P.Submit(id=1, argv=["sh"], mem_key="dev / shape", mem_alike=alike)

    for problem, peak in (("a", 9), ("b", 1), ("c", 2)):
        f.learn(1, footprints.alike_keys(job(problem)) + footprints.mem_keys(job(problem)), peak * MiB)
    assert f.need(job("a"), 1, 0) == (9 * MiB, "learned")  # its own file's peak
    assert f.need(job("new"), 1, 0) == (2 * MiB, "typical")  # its kind's median
    for problem in ("a", "new"):
        assert f.need(job(problem), 2, 0) == (0, "unknown")  # another user: nothing known
    assert f.need(job("a"), 2, 5 * MiB) == (5 * MiB, "default")


def test_a_jobs_problem_files_bound_its_need_and_a_new_problem_takes_the_typical(tmp_path):
    """Jobs of one shape (the same runner and file names, as an agent's) for several problems:
    each problem's own file bounds its need, the runner every job carries does not, and a problem
    not seen yet is taken at the shape's typical peak, not its largest. On an H100 the shape's
    largest held a 1.1 GiB ResNet18 job 23 s as if it needed an element-wise problem's 42.7 GiB."""
    from krex_async import protocol as P
    from krex_async.daemon.commands import footprints

    path = str(tmp_path / "memory.json")
    f = footprints.Footprints(path)

    def job(problem: str) -> P.Submit:
        alike = ["command 11", "file job.py 22", f"file problem.py {problem}"]
        return P.Submit(id=1, argv=["sh"], mem_key="gateway dev / shape", mem_alike=alike)

    def ran(f: footprints.Footprints, problem: str, peak: int) -> None:
        spec = job(problem)
        f.learn(U, footprints.alike_keys(spec) + footprints.mem_keys(spec), peak)

    for problem, peak in (("big", 40), ("small", 1), ("mid", 3), ("small", 2)):
        ran(f, problem, peak * MiB)
    assert f.need(job("small"), U, 0) == (2 * MiB, "learned")  # its own file's largest, not the shape's
    assert f.need(job("big"), U, 0) == (40 * MiB, "learned")
    assert f.need(job("new"), U, 0) == (3 * MiB, "typical")  # the shape's median of 1, 2, 3, 40
    again = footprints.Footprints(path)  # which jobs taught what survives a restart
    assert again.need(job("small"), U, 0) == (2 * MiB, "learned") and again.seq == 4
    one = footprints.Footprints(None)  # one problem only: its file is every job's, so the median
    for peak in (5, 7, 6):
        ran(one, "only", peak * MiB)
    assert one.need(job("only"), U, 0) == (6 * MiB, "typical")
    no_alike = P.Submit(id=1, argv=["sh"], mem_key="gateway dev / shape")
    assert one.need(no_alike, U, 0) == (7 * MiB, "learned")  # without features: its key's largest
    for version in (1, 2):  # keys of no user: learned anew
        old = {"version": version, "peaks": {"key gateway dev / shape": [9 * MiB]}}
        Path(path).write_text(json.dumps(old))
        assert footprints.Footprints(path).need(job("new"), U, 0) == (0, "unknown")


def test_a_feature_shared_beyond_a_key_is_not_taken_for_its_problem():
    """Each problem under its own key (its own file name), one runner for all: a new problem's key
    is unknown, so its kind (the prefix) is what the runner is compared with, and the runner, taught
    by every one of the kind's commands, bounds nothing: the kind's typical peak, not the largest
    peak of every problem that ran the runner. A runner shared with another kind remembers fewer of
    this kind's commands: compared over what both remember, it still bounds nothing."""
    from krex_async import protocol as P
    from krex_async.daemon.commands import footprints

    def job(kind: str, problem: str) -> P.Submit:
        alike = ["command run", f"file {problem}.py {problem}"]
        return P.Submit(id=1, argv=["sh"], mem_key=f"{kind} / {problem}", mem_alike=alike)

    f = footprints.Footprints(None)
    for i, peak in enumerate((28, 1, 2, 1, 3, 2, 1, 2, 2, 1)):
        spec = job("dev" if i % 3 else "eval", f"p{i}")
        f.learn(U, footprints.alike_keys(spec) + footprints.mem_keys(spec), peak * MiB)
    assert f.need(job("dev", "new"), U, 0) == (2 * MiB, "typical")  # dev's median, not the runner's 28
    # its own key, of one problem here: every feature of it is its key's, so its key's median,
    # a guess as for a key of many problems (what features alone cannot tell apart)
    assert f.need(job("dev", "p4"), U, 0) == (3 * MiB, "typical")
    assert f.specific("u7 alike file p5.py p5", ["u7 key dev"])  # one problem's file among the kind's
    assert not f.specific("u7 alike command run", ["u7 key dev"])  # every one of them ran it


async def test_footprints_are_written_within_write_s_and_at_a_flush(tmp_path):
    """On the daemon's loop a command's end does not write memory.json at once (all of it, each
    time): within WRITE_S, or at flush() (the daemon's stop)."""
    from krex_async.daemon.commands import footprints

    path = tmp_path / "memory.json"
    f = footprints.Footprints(str(path))
    f.learn(U, ["k"], 1)
    assert not path.exists()  # due within WRITE_S
    f.flush()
    assert json.loads(path.read_text())["peaks"] == {"u7 k": [1]}
    f.learn(U, ["k"], 2)
    t0 = asyncio.get_running_loop().time()
    while json.loads(path.read_text())["peaks"]["u7 k"] != [1, 2]:
        assert asyncio.get_running_loop().time() - t0 < footprints.WRITE_S + 30, "never written"
        await asyncio.sleep(0.05)
