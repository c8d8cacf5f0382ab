"""--mem-commit none and auto (the default) on a real daemon with the fake vendor (test_admission.py
has its helpers): memory holds no first run back, a co-located out-of-memory is re-run so that no
job is lost, and a declared need is still reserved; auto is optimistic only where that re-run is
allowed."""

from __future__ import annotations

from .conftest import MiB
from .test_admission import alloc, daemon, ended_at, released, row, until_status


async def test_first_runs_start_whatever_memory_and_a_co_located_oom_is_re_run(fake, tmp_path):
    """A (unknown footprint) holds 600 MiB of 1000. B, unknown too, starts beside it at once (under
    `now` it would wait: one unknown at a time), grows to 600 and meets CUDA out of memory; it is
    re-run, guarded at the floor its out-of-memory showed (600: 50 held, 550 more), which waits
    for A (its need unknown) to end, and succeeds. C declares 600 MiB: a declared need still waits
    for room."""
    env = fake
    ra, gb, rc = (str(tmp_path / n) for n in ("ra", "gb", "rc"))
    async with daemon("--mem-commit", "none", "--mem-backfill", "0", env=env) as d:
        c = await d.client()
        a = await c.submit(alloc("600M", release=ra), env=env, label="a-kind")
        await until_status(c, a.command, lambda s: s["mem_peak"] >= 600 * MiB, "A allocated")
        b = await c.submit(alloc("50M", "600M", gate=gb), env=env, label="b-kind", rerun_on_oom=True)
        assert not b.queued
        st = await until_status(c, b.command, lambda s: s["mem_peak"] >= 50 * MiB, "B beside A")
        assert st["mem_source"] == "unknown", st
        cc = await c.submit(alloc("600M", release=rc), env=env, mem=600 * MiB)
        assert cc.queued
        assert "needs ~0.6 GiB (declared)" in (await row(c, cc.command))["waiting_for"]
        released(gb)
        st = await until_status(c, b.command, lambda s: s["reruns"] == 1, "B re-queued after its OOM")
        assert st["state"] == "queued" and st["mem_need"] == 600 * MiB, st
        assert f"waits for {a.command} (need unknown) on fake0" in st["waiting_for"], st
        released(ra)
        assert (await a.wait()).report.exit_code == 0
        res = await b.wait()
        rep = res.report
        assert rep.exit_code == 0 and rep.reruns == 1 and rep.rerun_reason == "co-located OOM", rep
        assert res.stdout == b"allocated 52428800\nallocated 629145600\n", res
        released(rc)
        assert (await cc.wait()).report.exit_code == 0
        await c.close()


async def test_auto_is_optimistic_only_for_commands_whose_out_of_memory_is_re_run(fake, tmp_path):
    """The default, --mem-commit auto: A (unknown footprint) holds 600 MiB. B, unknown too and not
    allowing a re-run (a plain client's default), waits while A's footprint is learned, as under
    `now`; C, unknown and allowing one (as the gateway's jobs do), starts beside A at once."""
    env = fake
    ra, rb, rc = (str(tmp_path / n) for n in ("ra", "rb", "rc"))
    async with daemon("--mem-backfill", "600", env=env) as d:
        c = await d.client()
        a = await c.submit(alloc("600M", release=ra), env=env, label="a-kind")
        await until_status(c, a.command, lambda s: s["mem_peak"] >= 600 * MiB, "A allocated")
        b = await c.submit(alloc("10M", release=rb), env=env, label="b-kind")
        assert b.queued
        assert "footprint unknown" in (await row(c, b.command))["waiting_for"]
        cc = await c.submit(alloc("10M", release=rc), env=env, label="c-kind", rerun_on_oom=True)
        assert not cc.queued
        await until_status(c, cc.command, lambda s: s["mem_peak"] >= 10 * MiB, "C beside A")
        assert (await row(c, b.command))["state"] == "queued"
        for path in (ra, rb, rc):
            released(path)
        for h in (a, b, cc):
            assert (await h.wait()).report.exit_code == 0
        await c.close()


async def test_an_optimistic_start_waits_while_the_device_is_full_already(fake, tmp_path):
    """Optimism is about peaks to come, not memory in use: A holds all 1000 MiB; B (unknown,
    allowing a re-run) waits with a reason naming the full device instead of starting into an
    out-of-memory, and starts once A ends. This bounds a pile-up (`--max-running auto`: 64)."""
    env = fake
    ra, rb = str(tmp_path / "ra"), str(tmp_path / "rb")
    async with daemon("--mem-commit", "none", env=env) as d:
        c = await d.client()
        a = await c.submit(alloc("1000M", release=ra), env=env, label="a-kind")
        await until_status(c, a.command, lambda s: s["mem_peak"] >= 1000 * MiB, "A allocated")
        b = await c.submit(alloc("10M", release=rb), env=env, label="b-kind", rerun_on_oom=True)
        assert b.queued
        why = (await row(c, b.command))["waiting_for"]
        assert "full already (1.0 GiB of 1.0 GiB in use or starting)" in why, why
        released(ra)
        assert (await a.wait()).report.exit_code == 0
        await until_status(c, b.command, lambda s: s["state"] == "running", "B once A ended")
        released(rb)
        rep = (await b.wait()).report
        assert rep.exit_code == 0 and rep.reruns == 0, rep
        await c.close()


async def test_auto_counts_a_need_learned_from_the_commands_own_kind_as_now_does(fake, tmp_path):
    """Under auto a guess starts optimistically, but a need learned from the command's own key does
    not: `big` peaked at 600 MiB before, A holds 500 of 1000, so the next `big` (allowing a re-run)
    waits for memory instead of starting into an out-of-memory, a wasted run and a re-run that
    would hold every later command back; it starts once A ends, and is never re-run."""
    env = fake
    r0, ra, rb = (str(tmp_path / n) for n in ("r0", "ra", "rb"))
    async with daemon(env=env) as d:
        c = await d.client()
        first = await c.submit(alloc("600M", release=r0), env=env, label="big", rerun_on_oom=True)
        await until_status(c, first.command, lambda s: s["mem_peak"] >= 600 * MiB, "big's peak seen")
        released(r0)
        assert (await first.wait()).report.exit_code == 0
        a = await c.submit(alloc("500M", release=ra), env=env, label="a-kind", rerun_on_oom=True)
        await until_status(c, a.command, lambda s: s["mem_peak"] >= 500 * MiB, "A allocated")
        b = await c.submit(alloc("600M", release=rb), env=env, label="big", rerun_on_oom=True)
        assert b.queued
        st = await row(c, b.command)
        assert st["mem_source"] == "learned" and "needs ~0.6 GiB (learned)" in st["waiting_for"], st
        released(ra)
        assert (await a.wait()).report.exit_code == 0
        rep = await ended_at(c, b, rb, 600 * MiB, "B ran once A ended")
        assert rep.exit_code == 0 and rep.reruns == 0, rep
        await c.close()
