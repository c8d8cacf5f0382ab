"""`krex cleanup` as an SRE on a shared node uses it: --dry-run previews a sweep and touches
nothing (no cgroup file written, no directory removed), a mistyped --config is refused with 2 as
`krex serve` refuses it (it warned and swept the defaults), and the change count counts changes,
not the "left alone" lines of a live daemon's instance."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess

import pytest

from krex_async.ops import cleanup as cg

from ..conftest import PY, ROOT, is_root, private_cgroup_root, py_env, remove_cgroup_tree, run_daemon
from .test_cleanup import progresses, read, spinner, tree, wait_for, write

pytestmark = pytest.mark.skipif(not is_root(), reason="cgroup writes need root")


def krex_cleanup(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "krex_async", "cleanup", "--socket", "/nonexistent/krex.sock", *args],
        capture_output=True,
        text=True,
        env=py_env(),
        cwd=ROOT,
        timeout=60,
    )


def snapshot(base: str) -> dict[str, tuple[str | None, ...]]:
    """Every directory below `base` with what a sweep would write: freeze state and cpus."""
    out = {}
    for d in cg._walk(base):
        vals = []
        for name in ("cgroup.freeze", "cpuset.cpus", "cpuset.cpus.partition", "cgroup.procs"):
            try:
                vals.append(read(os.path.join(d, name)))
            except OSError:
                vals.append(None)
        out[d] = tuple(vals)
    return out


def test_dry_run_previews_the_sweep_and_changes_nothing(tmp_path) -> None:
    with tree(cg.v2_mount(), "cgroup v2") as base:
        krex = os.path.join(base, "krex")
        cmd1, cmd2 = os.path.join(krex, "cmd-1"), os.path.join(krex, "cmd-2")
        for d in (krex, cmd1, cmd2, os.path.join(cmd2, "leaf")):
            os.mkdir(d)
        if not os.path.exists(os.path.join(cmd1, "cgroup.freeze")):
            pytest.skip("no cgroup v2 freezer (kernel < 5.2)")
        proc, out = spinner(tmp_path, cmd1)
        try:
            for d in (cmd1, cmd2, krex):
                write(os.path.join(d, "cgroup.freeze"), "1")
            wait_for(lambda: "frozen 1" in read(os.path.join(cmd1, "cgroup.events")), "not frozen")
            before = snapshot(base)
            dry = krex_cleanup("--dry-run", "--json", "--root", base)
            assert dry.returncode == 0, dry.stderr
            preview = json.loads(dry.stdout)
            assert snapshot(base) == before, "a dry run changed the cgroups"
            assert not progresses(out), "a dry run thawed the spinner"
            human = krex_cleanup("--dry-run", "--root", base)
            assert snapshot(base) == before and human.returncode == 0, human.stderr
            real = krex_cleanup("--json", "--root", base)
            done = json.loads(real.stdout)
            assert real.returncode == 0 and progresses(out), real.stderr
        finally:
            proc.kill()
            proc.wait()
    assert preview["dry_run"] and preview["ok"], preview
    assert f"would thaw: {cmd1}/cgroup.freeze <- '0'" in preview["actions"], preview
    # a parent whose children would all go counts as empty: the preview is the sweep's whole plan
    assert f"would remove empty {cmd2}" in preview["actions"], preview
    planned = [a.removeprefix("would ").replace("remove empty", "removed empty") for a in preview["actions"]]
    assert planned == done["actions"], (preview, done)
    n = len(preview["actions"])
    assert f"{n} change(s) that would be made (dry run)" in human.stdout, human.stdout
    assert "would thaw" in human.stdout


def test_a_mistyped_config_is_refused_like_serve_and_nothing_is_swept(tmp_path) -> None:
    with tree(cg.v2_mount(), "cgroup v2") as base:
        krex = os.path.join(base, "krex")
        os.mkdir(krex)
        if not os.path.exists(os.path.join(krex, "cgroup.freeze")):
            pytest.skip("no cgroup v2 freezer (kernel < 5.2)")
        write(os.path.join(krex, "cgroup.freeze"), "1")
        bad = krex_cleanup("--config", str(tmp_path / "krex.tmol"), "--root", base)
        still = read(os.path.join(krex, "cgroup.freeze"))
        serve = subprocess.run(
            [PY, "-m", "krex_async", "serve", "--config", str(tmp_path / "krex.tmol")],
            capture_output=True,
            text=True,
            env=py_env(),
            cwd=ROOT,
            timeout=60,
        )
    assert (bad.returncode, serve.returncode) == (2, 2), (bad.stderr, serve.stderr)
    assert "config file not found" in bad.stderr and "nothing was swept" in bad.stderr, bad.stderr
    assert still == "1", "a refused cleanup thawed"


async def test_the_change_count_leaves_out_what_was_left_alone() -> None:
    """A live daemon's instance directories are left alone: said, but not counted as changes
    (they were: "4 change(s)" for a sweep that changed nothing)."""
    root = private_cgroup_root()
    if root is None:
        pytest.skip("needs root and cgroup v2")
    try:
        async with run_daemon("--cgroup-root", root):
            p = await asyncio.to_thread(krex_cleanup, "--root", root)
    finally:
        remove_cgroup_tree(root)
    assert p.returncode == 0, p.stderr
    alone = [x for x in p.stdout.splitlines() if "alone: its daemon" in x]
    assert alone, p.stdout
    assert f"0 change(s), {len(alone)} left alone, 0 error(s)" in p.stdout, p.stdout
