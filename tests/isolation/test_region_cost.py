"""What a region entry may not cost the cgroup backend: no intent write and no cgroup migration on a
command's first region (the replay's 20 ms 'cpuset'), and no file opened per freeze (kept fds).
Real cgroups and processes (root only; skips say why)."""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import pytest

from krex_async.isolation.cgroup import CgroupBackend
from krex_async.isolation.cgroupfs import CgroupFS, CgroupVanished

from .cgroup_util import CgRoot, allowed, reap, wait_for
from .test_cgroup import start


@pytest.fixture
def cgroot():
    r = CgRoot()
    yield r
    r.cleanup()


async def test_first_region_writes_no_intent_and_moves_no_process(cgroot, tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("fencing needs at least 2 cpus")
    b = CgroupBackend(root=cgroot.v2, state_dir=str(tmp_path), cpuset_root=cgroot.v1)
    owner, p = await start(b, ["sleep", "30"])
    sibs = [await start(b, ["sleep", "30"]) for _ in range(3)]
    try:
        await asyncio.sleep(0.2)  # create() records in the background
        rec = json.loads(open(b.intent.path).read())
        for g, _ in sibs:  # durable before anything is frozen or fenced
            assert b.v2.path(g.top) in rec["frozen"]
        if b.cores.mode != "none":
            assert b.cores.fs.path(owner.run, "cpuset.cpus") in rec["fenced"]
        writes = []
        real = b.intent._write
        b.intent._write = lambda seq, data: (writes.append(seq), real(seq, data))  # type: ignore
        core = sorted(b.cpus)[-1]
        await b.freeze_many([g for g, _ in sibs])
        await b.set_cores(owner, frozenset({core}), pids=[p.pid], exclusive=True)
        assert writes == [], "a region entry waited for an intent write"
        assert allowed(p.pid) == {str(core)}
        for fs in {b.v2, b.cores.fs}:  # the v2 tree and (hybrid) the v1 cpuset tree
            assert p.pid in fs.procs(owner.run), f"the owner was moved in {fs} (cgroup.procs write)"
        await b.set_cores(owner, None, pids=[p.pid])
        assert str(core) in ",".join(allowed(p.pid)) and len(allowed(p.pid)) == 1
        assert ",".join(allowed(p.pid)) != str(core)
    finally:
        for g, q in [(owner, p), *sibs]:
            await b.kill(g)
            reap(q)
            await b.remove(g)
        await b.close()


async def test_freezes_open_no_files_and_removal_closes_them(cgroot, tmp_path):
    b = CgroupBackend(root=cgroot.v2, state_dir=str(tmp_path), cpuset_root=cgroot.v1)
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    gs = [await start(b, ["sleep", "30"]) for _ in range(4)]
    before_any = None
    try:
        for i in range(5):
            await b.freeze_many([g for g, _ in gs])
            for g, _ in gs:
                await b.thaw(g)
            if i == 0:
                before_any = fds()
        assert fds() == before_any, "fds grew across freezes"
    finally:
        for g, q in gs:
            await b.kill(g)
            reap(q)
            await b.remove(g)
    assert not [p for p in b.v2._kept if "/cmd-" in p], "removed groups kept files open"
    await b.close()
    assert b.v2._kept == {}


async def test_kept_file_of_a_recreated_cgroup_reads_the_new_one(cgroot):
    fs = CgroupFS(cgroot.v2, keep_procs=True)
    name = f"t-{uuid.uuid4().hex[:6]}"
    fs.mkdir(name)
    fs.write(name, "cgroup.freeze", "1")
    assert fs.read(name, "cgroup.freeze").strip() == "1"
    fs.write(name, "cgroup.freeze", "0")
    os.rmdir(fs.path(name))  # behind the cache's back
    with pytest.raises(CgroupVanished):
        fs.read(name, "cgroup.freeze")
    os.mkdir(fs.path(name))
    assert fs.read(name, "cgroup.freeze").strip() == "0"
    assert fs.procs(name) == []
    assert fs.rmdir(name)
    assert not [p for p in fs._kept if f"/{name}/" in p]
    assert wait_for(lambda: not os.path.exists(fs.path(name)))
