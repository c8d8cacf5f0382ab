"""CgroupBackend on real cgroups and real processes (root only; skips say why)."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import tempfile
import time
import uuid

import pytest

from krex_async.isolation.base import FreezeError
from krex_async.isolation.cgroup import CgroupBackend, probe_cgroup
from krex_async.isolation.cgroupfs import CgroupFS

from ..testcgroups import new_name
from .cgroup_util import SPIN, CgRoot, allowed, cpu_ticks, reap, state, v1_freezer, wait_for


@pytest.fixture
def cgroot():
    r = CgRoot()
    yield r
    r.cleanup()


@pytest.fixture
async def backend(cgroot, tmp_path):
    b = CgroupBackend(root=cgroot.v2, state_dir=str(tmp_path / "state"), cpuset_root=cgroot.v1)
    yield b
    for g in list(b.groups.values()):
        await b.kill(g)
    await b.close()


async def start(b: CgroupBackend, argv: list[str], frozen: bool = False):  # type: ignore[no-untyped-def]
    g = await b.create(uuid.uuid4().hex[:8])
    p = subprocess.Popen(b.launch_argv(g, argv, frozen=frozen))
    await b.started(g, p.pid)
    assert wait_for(lambda: p.pid in b.pids(g)), "wrapper did not join its cgroup"
    return g, p


def frozen_reads(b: CgroupBackend, rel: str) -> int:
    return b.v2.events(rel)["frozen"]


async def test_probe_and_reason(backend):
    ok, why = probe_cgroup(backend.layout.v2)
    assert ok, why
    assert backend.reason and backend.layout.v2 in backend.reason


async def test_configured_root_gets_a_private_v1_twin(cgroot, tmp_path):
    if cgroot.v1 is None:
        pytest.skip("no v1 cpuset hierarchy: nothing to pair with")
    b = CgroupBackend(root=cgroot.v2, state_dir=str(tmp_path))
    assert b.layout.v1_cpuset == cgroot.v1 and b.cores.mode == "v1"


async def test_command_starts_inside_its_cgroup(backend):
    g, p = await start(backend, ["/bin/sh", "-c", "cat /proc/self/cgroup; sleep 5"])
    try:
        assert wait_for(lambda: p.pid in backend.pids(g))
        cg = open(f"/proc/{p.pid}/cgroup").read()
        assert f"{g.top}/run" in cg
    finally:
        await backend.kill(g)
        reap(p)
        await backend.remove(g)
    assert not backend.v2.exists(g.top)


async def test_command_runs_as_user_inside_its_cgroup(backend):
    where = tempfile.mkdtemp(prefix="krex-user-")  # pytest's tmp_path is private to root
    os.chmod(where, 0o777)
    out = pathlib.Path(where) / "id"
    g = await backend.create("user")
    argv = backend.launch_argv(
        g,
        ["/bin/sh", "-c", f"id -u > {out}; id -G >> {out}; cat /proc/self/cgroup >> {out}"],
        frozen=False,
        as_user=(65534, 65534, []),
    )
    p = subprocess.Popen(argv)
    assert p.wait(timeout=5) == 0
    uid, groups, *cg = out.read_text().splitlines()
    assert uid == "65534" and groups == "65534"
    assert any(line.endswith(f"{g.top}/run") for line in cg)
    await backend.remove(g)
    out.unlink()
    os.rmdir(where)


async def test_spinning_sibling_frozen_makes_no_progress(backend):
    g, p = await start(backend, SPIN)
    try:
        await asyncio.sleep(0.2)
        f = await backend.freeze(g)
        assert f.pids == 1 and not f.vanished and 0 < f.seconds < 1
        assert frozen_reads(backend, g.top) == 1
        t0 = cpu_ticks(p.pid)
        await asyncio.sleep(0.3)
        assert cpu_ticks(p.pid) == t0, "frozen process consumed cpu"
        await backend.thaw(g)
        await asyncio.sleep(0.3)
        assert cpu_ticks(p.pid) > t0, "thawed process made no progress"
        assert frozen_reads(backend, g.top) == 0
    finally:
        reap(p)


async def test_keep_pids_run_while_rest_is_frozen(backend):
    g, p = await start(backend, ["/bin/sh", "-c", "(while :; do :; done) & exec sleep 30"])
    try:
        assert wait_for(lambda: len(backend.pids(g)) == 2)
        spinner = [q for q in backend.pids(g) if q != p.pid][0]
        f = await backend.freeze(g, keep=frozenset({spinner}))
        assert f.pids == 1  # sleep frozen, spinner kept
        t0 = cpu_ticks(spinner)
        await asyncio.sleep(0.3)
        assert cpu_ticks(spinner) > t0, "kept pid was frozen"
        assert frozen_reads(backend, g.run) == 1 and backend.v2.read(g.top, "cgroup.freeze").strip() == "0"
        await backend.thaw(g)
        assert backend.v2.read(g.run, "cgroup.freeze").strip() == "0"
    finally:
        await backend.kill(g)
        reap(p)


@pytest.mark.parametrize("mode", ["auto", "none"])
async def test_set_cores_fences_all_threads_and_restores(cgroot, tmp_path, mode):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("fencing needs at least 2 cpus")
    b = CgroupBackend(root=cgroot.v2, state_dir=str(tmp_path), cpuset_root=cgroot.v1, cpuset=mode)
    code = "import threading,time\n[threading.Thread(target=time.sleep,args=(30,)).start() for _ in range(3)]"
    g, p = await start(b, ["python3", "-c", code])
    try:
        assert wait_for(lambda: len(os.listdir(f"/proc/{p.pid}/task")) == 4)
        before = allowed(p.pid)
        one = sorted(b.cpus)[-1]
        await b.set_cores(g, frozenset({one}))
        assert allowed(p.pid) == {str(one)}
        if b.cores.mode != "none":
            eff = "cpuset.effective_cpus" if b.cores.mode == "v1" else "cpuset.cpus.effective"
            assert b.cores.fs.read(g.run, eff).strip() == str(one)
            assert os.path.exists(b.intent.path)
        await b.set_cores(g, None)
        assert allowed(p.pid) == before
    finally:
        await b.kill(g)
        reap(p)
        await b.close()


async def test_set_cores_pids_fences_only_those(backend):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("fencing needs at least 2 cpus")
    g, p = await start(backend, ["/bin/sh", "-c", "sleep 30 & exec sleep 30"])
    try:
        assert wait_for(lambda: len(backend.pids(g)) == 2)
        other = [q for q in backend.pids(g) if q != p.pid][0]
        before = allowed(other)
        one = sorted(backend.cpus)[0]
        await backend.set_cores(g, frozenset({one}), pids=[p.pid])
        assert allowed(p.pid) == {str(one)} and allowed(other) == before
        await backend.set_cores(g, None)
        assert allowed(p.pid) == before
    finally:
        await backend.kill(g)
        reap(p)


@pytest.mark.parametrize("mode", ["auto", "none"])
async def test_region_fencing_pattern_of_the_daemon(cgroot, tmp_path, mode):
    """What regions.py does: owner pid onto the region core, the owner's other processes and a
    sibling off it (pids= all of theirs, or none at all), then everything back."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("fencing needs at least 2 cpus")
    backend = CgroupBackend(root=cgroot.v2, state_dir=str(tmp_path), cpuset_root=cgroot.v1, cpuset=mode)
    owner, p = await start(backend, ["/bin/sh", "-c", "sleep 30 & exec sleep 30"])
    sib, q = await start(backend, ["sleep", "30"])
    try:
        assert wait_for(lambda: len(backend.pids(owner)) == 2)
        helper = [x for x in backend.pids(owner) if x != p.pid][0]
        before = allowed(p.pid)
        core, rest = sorted(backend.cpus)[-1], frozenset(sorted(backend.cpus)[:-1])
        await backend.set_cores(owner, frozenset({core}), pids=[p.pid], exclusive=True)
        await backend.set_cores(owner, rest, pids=[helper])
        await backend.set_cores(sib, rest, pids=backend.pids(sib))
        await backend.set_cores(owner, rest, pids=[])  # nothing named: nothing changes
        rest_s = {x for x in allowed(helper)}
        assert allowed(p.pid) == {str(core)}
        assert rest_s == allowed(q.pid) and str(core) not in ",".join(rest_s)
        await backend.set_cores(owner, None, pids=[p.pid])
        assert allowed(p.pid) == before and allowed(helper) == rest_s
        await backend.set_cores(owner, None, pids=[helper])
        await backend.set_cores(sib, None, pids=backend.pids(sib))
        assert allowed(helper) == before and allowed(q.pid) == before
    finally:
        for g in (owner, sib):
            await backend.kill(g)
        reap(p)
        reap(q)


async def test_freeze_many_freezes_all_or_none(backend):
    gs = [await start(backend, SPIN) for _ in range(4)]
    try:
        res = await backend.freeze_many([g for g, _ in gs])
        assert len(res) == 4 and all(frozen_reads(backend, g.top) == 1 for g, _ in gs)
        for g, _ in gs:
            await backend.thaw(g)
        held = v1_frozen_task(backend, gs[0][0], gs[0][1])
        try:
            with pytest.raises(FreezeError):
                await backend.freeze_many([g for g, _ in gs], timeout=0.2)
            assert all(backend.v2.read(g.top, "cgroup.freeze").strip() == "0" for g, _ in gs)
        finally:
            v1_release(held)
    finally:
        for _, p in gs:
            reap(p)


async def test_sigstopped_sibling_stays_stopped_after_thaw(backend):
    g, p = await start(backend, ["sleep", "30"])
    try:
        assert wait_for(lambda: state(p.pid) == "S")
        os.kill(p.pid, signal.SIGSTOP)
        assert wait_for(lambda: state(p.pid) == "T")
        await backend.freeze(g)
        await backend.thaw(g)
        await asyncio.sleep(0.1)
        assert state(p.pid) == "T"
    finally:
        reap(p)


async def test_launch_frozen_never_runs_first_instruction(backend, tmp_path):
    marker = tmp_path / "ran"
    g, p = await start(backend, ["/bin/sh", "-c", f"touch {marker}"], frozen=True)
    try:
        await asyncio.sleep(0.3)
        assert not marker.exists(), "command ran although launched frozen"
        assert p.poll() is None and frozen_reads(backend, g.run) == 1
        assert backend.pids(g) == [p.pid]
        await backend.thaw(g)
        assert p.wait(timeout=5) == 0 and marker.exists()
    finally:
        reap(p)


async def test_thaw_undoes_a_launch_freeze_and_a_region_freeze_together(backend, tmp_path):
    """A command launched frozen (run/ at 1) and then frozen again for a sibling's region (top/
    at 1) must run after one thaw: the fast thaw writes 0 to every cgroup it wrote 1 to."""
    marker = tmp_path / "ran"
    g, p = await start(backend, ["/bin/sh", "-c", f"touch {marker}"], frozen=True)
    try:
        (f,) = await backend.freeze_many([g])
        assert f.stopped == [p.pid] and not f.vanished
        assert frozen_reads(backend, g.top) == 1 and frozen_reads(backend, g.run) == 1
        await backend.thaw(g)
        assert backend.v2.read(g.top, "cgroup.freeze").strip() == "0"
        assert backend.v2.read(g.run, "cgroup.freeze").strip() == "0"
        assert p.wait(timeout=5) == 0 and marker.exists()
        assert not g.frozen and not g.written
    finally:
        reap(p)


async def test_watches_are_armed_at_create_and_closed_at_remove(backend):
    g, p = await start(backend, ["sleep", "30"])
    try:
        watches = dict(g.watches)
        assert set(watches) == {g.top, g.run}, "a freeze would arm a watch on its own path"
        for _ in range(3):
            await backend.freeze_many([g])
            await backend.thaw(g)
        assert g.watches == watches, "the kept watches were replaced"
    finally:
        await backend.kill(g)
        reap(p)
        await backend.remove(g)
    assert not g.watches
    assert backend._watcher is not None and not backend._watcher._watches, "a watch leaked"


@pytest.mark.parametrize("use_cgroup_kill", [True, False])
async def test_frozen_group_can_be_killed(backend, use_cgroup_kill):
    backend.has_kill = backend.has_kill and use_cgroup_kill
    g, p = await start(backend, ["/bin/sh", "-c", "sleep 30 & while :; do :; done"])
    assert wait_for(lambda: len(backend.pids(g)) == 2)
    await backend.freeze(g)
    await backend.kill(g)
    assert p.wait(timeout=2) == -signal.SIGKILL
    await backend.remove(g, timeout=2)
    assert not backend.v2.exists(g.top)


async def test_freeze_racing_fork_loop_completes(backend):
    g, p = await start(backend, ["/bin/sh", "-c", "while :; do /bin/true & done"])
    try:
        await asyncio.sleep(0.2)
        f = await backend.freeze(g, timeout=2.0)
        assert f.pids >= 1 and frozen_reads(backend, g.top) == 1
        n = len(backend.pids(g))
        await asyncio.sleep(0.2)
        assert len(backend.pids(g)) == n, "processes forked while frozen"
    finally:
        await backend.kill(g)
        reap(p)
        await backend.remove(g)


def v1_frozen_task(b: CgroupBackend, g, p) -> str:  # type: ignore[no-untyped-def]
    """Hold `p` in a v1 freezer cgroup: the v2 freezer cannot stop a task sitting in the v1
    refrigerator (state D), which is what really blocks it on this kernel (SIGSTOP, ptrace stops
    and vfork parents all count as frozen)."""
    mnt = v1_freezer()
    if mnt is None:
        pytest.skip("no v1 freezer hierarchy: no way to hold a task unfreezable here")
    path = os.path.join(mnt, new_name(g.command_id))
    os.mkdir(path)
    fs = CgroupFS(path)
    fs.write("", "cgroup.procs", str(p.pid))
    fs.write("", "freezer.state", "FROZEN")
    assert wait_for(lambda: state(p.pid) == "D")
    return path


def v1_release(path: str) -> None:
    CgroupFS(path).write("", "freezer.state", "THAWED")
    for pid in CgroupFS(path).procs(""):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(lambda: not CgroupFS(path).procs(""))
    os.rmdir(path)


async def test_freeze_that_cannot_complete_raises_and_writes_zero(backend):
    g, p = await start(backend, SPIN)
    held = v1_frozen_task(backend, g, p)
    try:
        t0 = time.monotonic()
        with pytest.raises(FreezeError) as ei:
            await backend.freeze(g, timeout=0.2)
        assert time.monotonic() - t0 < 1.0
        assert str(p.pid) in str(ei.value) and g.top in str(ei.value)
        with open(f"/proc/{p.pid}/wchan") as f:  # where the culprit sleeps: the v1 refrigerator
            assert f"{p.pid}(D {f.read().strip()})" in str(ei.value), str(ei.value)
        assert backend.v2.read(g.top, "cgroup.freeze").strip() == "0"
        assert backend.v2.read(g.run, "cgroup.freeze").strip() == "0"
        assert not g.frozen
    finally:
        v1_release(held)
        reap(p)


async def test_cgroup_vanishing_mid_freeze_is_a_state(backend):
    g, p = await start(backend, SPIN)
    held = v1_frozen_task(backend, g, p)

    async def vanish() -> None:
        await asyncio.sleep(0.1)
        v1_release(held)  # the task dies
        assert wait_for(lambda: backend.v2.events(g.top)["populated"] == 0)
        for rel in (g.run, g.top):
            os.rmdir(backend.v2.path(rel))

    try:
        t0 = time.monotonic()
        f, _ = await asyncio.gather(backend.freeze(g, timeout=3.0), vanish())
        assert f.vanished and f.pids == 0
        assert time.monotonic() - t0 < 2.0
        assert (await backend.freeze(g)).vanished  # and again, now that the directory is gone
        await backend.thaw(g)
        await backend.set_cores(g, None)
    finally:
        reap(p)


async def test_reconcile_thaws_leftover_and_restores_cpusets(cgroot, tmp_path):
    state_dir = str(tmp_path / "state")
    old = CgroupBackend(root=cgroot.v2, state_dir=state_dir, cpuset_root=cgroot.v1)
    g, p = await start(old, SPIN)
    empty = await old.create("empty")
    try:
        before = allowed(p.pid)
        await old.freeze(g)
        await old.freeze(empty)
        if old.cores.mode != "none" and len(old.cpus) > 1:
            await old.set_cores(g, frozenset({sorted(old.cpus)[0]}))
        await old.close()  # the old daemon "dies" without thawing
        with open(os.path.join(state_dir, "intent.json"), "w") as f:
            f.write("{damaged")
        new = CgroupBackend(root=cgroot.v2, state_dir=state_dir, cpuset_root=cgroot.v1)
        lines = await new.reconcile()
        text = "\n".join(lines)
        assert f"thawed {g.top}" in text and "damaged" in text
        assert f"ended {empty.top}" in text and not new.v2.exists(empty.top)
        assert f"adopted {g.top}" in text and new.orphans[0][1] == [p.pid]
        assert new.v2.events(g.top)["frozen"] == 0
        t0 = cpu_ticks(p.pid)
        await asyncio.sleep(0.2)
        assert cpu_ticks(p.pid) > t0
        assert allowed(p.pid) == before
        if new.cores.mode == "v1":
            assert new.v1.read(g.run, "cpuset.cpus") == new.v1.read(g.top, "cpuset.cpus")  # type: ignore[union-attr]
        await new.close()
    finally:
        reap(p)


@pytest.mark.parametrize("sigterm_first", [False, True], ids=["sigkill", "sigterm-then-sigkill"])
async def test_watchdog_thaws_within_a_second_of_sigkill(backend, sigterm_first):
    """sigterm-then-sigkill: `systemctl stop` signals the whole unit; the watchdog stays on guard."""
    standin = subprocess.Popen(["sleep", "60"])
    g, p = await start(backend, SPIN)
    try:
        backend.start_watchdog(standin.pid)
        if sigterm_first:
            backend.watchdog.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            assert backend.watchdog.poll() is None, "the watchdog left on SIGTERM"
        await backend.freeze(g)
        if len(backend.cpus) > 1 and backend.cores.mode != "none":
            await backend.set_cores(g, frozenset({sorted(backend.cpus)[0]}))
        assert frozen_reads(backend, g.top) == 1
        t0 = time.monotonic()
        standin.send_signal(signal.SIGKILL)
        assert wait_for(lambda: frozen_reads(backend, g.top) == 0, timeout=1.0), "still frozen after 1 s"
        took = time.monotonic() - t0
        assert took < 1.0
        if backend.cores.mode == "v1":
            assert wait_for(
                lambda: len(allowed(p.pid)) == 1 and allowed(p.pid) != {str(sorted(backend.cpus)[0])},
                1.0 - took,
            )
        assert backend.watchdog is not None and backend.watchdog.wait(timeout=2) == 0
    finally:
        reap(standin)
        reap(p)


async def test_a_released_watchdog_exits_without_a_sweep(backend):
    """The clean shutdown's release is told apart from the daemon's death: no thaw behind its back."""
    from krex_async.isolation.watchdog import release

    g, p = await start(backend, SPIN)
    try:
        backend.start_watchdog()
        await backend.freeze(g)
        wd, backend.watchdog = backend.watchdog, None
        assert wd is not None
        release(wd)
        assert wd.returncode == 0
        assert frozen_reads(backend, g.top) == 1, "the release swept"
        await backend.thaw(g)
    finally:
        reap(p)


@pytest.mark.parametrize("restore", ["pids", "group"])
async def test_affinity_fence_is_lifted_from_processes_forked_while_fenced(cgroot, tmp_path, restore):
    """cpuset "none" (the fallback when the daemon cannot use cpusets): a sibling fenced off the
    region cores that forks while fenced gets its children back on every cpu at the restore, the
    way regions.refence restores (pids= the group's pids now), and with pids=None too."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("fencing needs at least 2 cpus")
    b = CgroupBackend(root=cgroot.v2, state_dir=str(tmp_path), cpuset_root=cgroot.v1, cpuset="none")
    go = tmp_path / "go"
    g, p = await start(
        b, ["/bin/sh", "-c", f"while [ ! -e {go} ]; do sleep 0.01; done; sleep 30 & sleep 30 & wait"]
    )
    try:
        before = allowed(p.pid)
        one = sorted(b.cpus)[0]
        await b.set_cores(g, frozenset({one}), pids=b.pids(g))
        assert allowed(p.pid) == {str(one)}
        go.touch()
        assert wait_for(lambda: len(b.pids(g)) == 3)
        children = [x for x in b.pids(g) if x != p.pid]
        assert all(allowed(c) == {str(one)} for c in children)  # they inherited the fence
        await b.set_cores(g, None, pids=b.pids(g) if restore == "pids" else None)
        assert allowed(p.pid) == before
        assert [allowed(c) for c in children] == [before] * 2, "a child stayed fenced"
    finally:
        await b.kill(g)
        reap(p)
        await b.close()
