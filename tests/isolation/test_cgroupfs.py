"""CgroupFS and the intent record against a temporary tree (no root needed)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from krex_async.isolation.cgroupfs import CgroupFileError, CgroupFS, CgroupVanished, EventsWatcher
from krex_async.isolation.cpuset import fmt, parse
from krex_async.isolation.intent import Intent, read_record, sweep


def test_errors_carry_path_and_data(tmp_path):
    fs = CgroupFS(str(tmp_path))
    fs.mkdir("a")
    with pytest.raises(CgroupVanished) as ei:
        fs.write("gone", "cgroup.freeze", "1")
    assert ei.value.path == str(tmp_path / "gone" / "cgroup.freeze") and ei.value.data == "1"
    assert "'1'" in str(ei.value) and "gone/cgroup.freeze" in str(ei.value)
    with pytest.raises(CgroupFileError) as ei2:
        fs.write("", "a", "x")  # a directory: EISDIR, not a vanish
    assert not isinstance(ei2.value, CgroupVanished) and ei2.value.path == str(tmp_path / "a")


def test_tree_operations(tmp_path):
    fs = CgroupFS(str(tmp_path))
    assert fs.mkdir("k") and not fs.mkdir("k")
    fs.mkdir("k/c")
    (tmp_path / "k" / "c" / "cgroup.procs").write_text("12\n13\n")
    (tmp_path / "k" / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    assert fs.walk("k") == ["k", "k/c"] and fs.procs("k/c") == [12, 13] and fs.procs("nope") == []
    assert fs.events("k") == {"populated": 1, "frozen": 0}
    os.unlink(tmp_path / "k" / "c" / "cgroup.procs")
    assert fs.rmdir("k/c") and not fs.rmdir("k/c")


async def test_watch_sees_a_change_made_after_arming(tmp_path):
    f = tmp_path / "cgroup.events"
    f.write_text("frozen 0\n")
    fs = CgroupFS(str(tmp_path))
    watcher = EventsWatcher()
    try:
        with watcher.watch(str(f)) as w:
            asyncio.get_running_loop().call_later(0.05, f.write_text, "frozen 1\n")
            assert await w.until(lambda: fs.events("")["frozen"] == 1, 2.0)
        with watcher.watch(str(f)) as w:
            assert not await w.until(lambda: fs.events("")["frozen"] == 0, 0.1)
    finally:
        watcher.close()


def test_cpu_list_format_roundtrip():
    for cpus in ({0}, {0, 1, 2, 5}, {3, 4, 7, 8, 9}, set()):
        assert parse(fmt(cpus)) == cpus
    assert fmt({0, 1, 2, 5}) == "0-2,5"


async def test_intent_is_atomic_and_coalesced(tmp_path):
    it = Intent(str(tmp_path))
    writes = 0
    real = it._write

    def counted(seq: int, data: bytes) -> None:
        nonlocal writes
        writes += 1
        real(seq, data)

    it._write = counted  # type: ignore[method-assign]
    await asyncio.gather(*(it.ensure(frozen=[f"/cg/{i}"]) for i in range(16)))
    assert writes == 1
    rec = json.loads((tmp_path / "intent.json").read_text())
    assert sorted(rec["frozen"]) == sorted(f"/cg/{i}" for i in range(16))
    await it.ensure(frozen=["/cg/3"])  # already recorded: no write
    assert writes == 1 and not (tmp_path / "intent.json.tmp").exists()
    # noted ahead (as create() does): written in the background, and ensure() then costs nothing
    it.note(frozen=["/cg/a"], fenced={"/cg/a/cpuset.cpus": ""})
    await it.ensure(frozen=["/cg/a"])
    assert writes == 2 and "/cg/a" in json.loads((tmp_path / "intent.json").read_text())["frozen"]
    await it.ensure(frozen=["/cg/a"], fenced={"/cg/a/cpuset.cpus": ""})
    assert writes == 2
    (tmp_path / "intent.json").write_text("{bad")
    assert read_record(str(tmp_path))[0] is None and "damaged" in read_record(str(tmp_path))[1]


@pytest.mark.parametrize(
    "text",
    [
        '{"frozen": 3}',
        '{"frozen": null, "fenced": 2}',
        '{"frozen": ["a"], "fenced": ["b"]}',
        '{"version": 1, "pid": {}}',
    ],
)
def test_a_record_of_the_wrong_shape_is_damaged_not_fatal(tmp_path, text):
    """Valid JSON of another shape (hand-edited, another version) must not stop the sweep that
    start-up and the watchdog run: it is reported damaged, like a torn one."""
    (tmp_path / "intent.json").write_text(text)
    lines, alive = sweep(CgroupFS(str(tmp_path / "tree")), None, "none", str(tmp_path))
    assert alive == [] and any("damaged" in line for line in lines), lines
