"""`krex cleanup` on real cgroups: frozen v2 and v1 groups thawed, cpusets restored, empty command
cgroups removed. Every test works in its own krex-test-* tree and sweeps only that (--root), so it never
touches what other tests or daemons on this machine froze."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from krex_async.ops import cleanup as cg

from ..conftest import PY, ROOT, is_root, py_env
from ..testcgroups import new_name

pytestmark = pytest.mark.skipif(not is_root(), reason="cgroup writes need root")

SPIN = (
    "import sys, time\nf = open(sys.argv[1], 'a', buffering=1)\nwhile True:\n"
    "    f.write('x\\n'); time.sleep(0.001)\n"
)


def read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def write(path: str, data: str) -> None:
    with open(path, "w") as f:
        f.write(data)


def wait_for(cond, what: str, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


@contextlib.contextmanager
def tree(mount: str | None, what: str) -> Iterator[str]:
    """A fresh <mount>/krex-test-<creator>-... directory, torn down (thawed, emptied) afterwards."""
    if mount is None:
        pytest.skip(f"no {what} hierarchy on this machine")
    base = os.path.join(mount, new_name("cleanup"))
    os.mkdir(base)
    try:
        yield base
    finally:
        for d in reversed(list(cg._walk(base))):
            for name, val in (("cgroup.freeze", "0"), ("freezer.state", "THAWED")):
                with contextlib.suppress(OSError):
                    write(os.path.join(d, name), val)
            with contextlib.suppress(OSError):
                for pid in read(os.path.join(d, "cgroup.procs")).split():
                    os.kill(int(pid), signal.SIGKILL)
            deadline = time.monotonic() + 3
            while os.path.isdir(d):
                try:
                    os.rmdir(d)
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)


def spinner(tmp_path, cgroup_dir: str, name: str = "spin") -> tuple[subprocess.Popen[bytes], str]:
    out = str(tmp_path / name)
    p = subprocess.Popen([PY, "-c", SPIN, out])
    write(os.path.join(cgroup_dir, "cgroup.procs"), str(p.pid))
    wait_for(lambda: os.path.exists(out) and os.path.getsize(out) > 0, "spinner did not start", 10)
    return p, out


def progresses(path: str, wait: float = 0.3) -> bool:
    a = os.path.getsize(path)
    time.sleep(wait)
    return os.path.getsize(path) > a


def run_cleanup(*roots: str) -> dict:
    # --socket: a path nobody serves on, so a daemon elsewhere on this machine cannot refuse us.
    args = [a for r in roots for a in ("--root", r)] + ["--socket", "/nonexistent/krex.sock"]
    p = subprocess.run(
        [PY, "-m", "krex_async.ops.cleanup", "--json", *args],
        capture_output=True,
        text=True,
        env=py_env(),
        cwd=ROOT,
        timeout=30,
    )
    out = json.loads(p.stdout)
    assert p.returncode == (0 if out["ok"] else 1), p.stderr
    return out


def test_v2_thaws_frozen_groups_and_removes_empty_ones(tmp_path):
    with tree(cg.v2_mount(), "cgroup v2") as base:
        krex = os.path.join(base, "krex")
        cmd1, cmd2 = os.path.join(krex, "cmd-1"), os.path.join(krex, "cmd-2")
        for d in (krex, cmd1, cmd2):
            os.mkdir(d)
        if not os.path.exists(os.path.join(cmd1, "cgroup.freeze")):
            pytest.skip("no cgroup v2 freezer (kernel < 5.2)")
        proc, out = spinner(tmp_path, cmd1)
        try:
            for d in (cmd1, cmd2, krex):  # as a daemon killed mid-region could leave them
                write(os.path.join(d, "cgroup.freeze"), "1")
            wait_for(lambda: "frozen 1" in read(os.path.join(cmd1, "cgroup.events")), "not frozen")
            assert not progresses(out), "the spinner ran while frozen: the test proves nothing"
            res = run_cleanup(base)
            assert res["ok"] and res["trees"] == [krex], res
            for d in (krex, cmd1):
                assert read(os.path.join(d, "cgroup.freeze")) == "0"
                assert "frozen 0" in read(os.path.join(d, "cgroup.events")).splitlines()
            assert progresses(out), "the spinner did not resume"
            assert not os.path.exists(cmd2), "the empty command cgroup was not removed"
            assert os.path.isdir(cmd1), "a cgroup with processes must stay"
        finally:
            proc.kill()
            proc.wait()
        wait_for(lambda: read(os.path.join(cmd1, "cgroup.procs")) == "", "spinner not gone")
        res = run_cleanup(base)
        assert not os.path.exists(cmd1) and os.path.isdir(krex), res
        assert run_cleanup(base)["actions"] == []  # idempotent


def test_only_krex_trees_are_touched(tmp_path):
    with tree(cg.v2_mount(), "cgroup v2") as base:
        other = os.path.join(base, "not-krex")
        os.mkdir(other)
        if not os.path.exists(os.path.join(other, "cgroup.freeze")):
            pytest.skip("no cgroup v2 freezer")
        write(os.path.join(other, "cgroup.freeze"), "1")
        res = run_cleanup(base)
        assert res["trees"] == [] and res["actions"] == []
        assert read(os.path.join(other, "cgroup.freeze")) == "1" and os.path.isdir(other)


def test_v1_freezer_thawed(tmp_path):
    with tree(cg.v1_mount("freezer"), "v1 freezer") as base:
        cmd = os.path.join(base, "krex", "cmd-1")
        os.makedirs(cmd)
        proc, out = spinner(tmp_path, cmd)
        try:
            write(os.path.join(cmd, "freezer.state"), "FROZEN")
            wait_for(lambda: read(os.path.join(cmd, "freezer.state")) == "FROZEN", "not frozen")
            assert not progresses(out)
            res = run_cleanup(base)
            assert res["ok"], res
            assert read(os.path.join(cmd, "freezer.state")) == "THAWED"
            assert progresses(out)
        finally:
            proc.kill()
            proc.wait()


def test_v1_cpuset_restored_from_parent(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 cpus to fence one off")
    m = cg.v1_mount("cpuset")
    with tree(m, "v1 cpuset") as base:
        assert m is not None
        krex = os.path.join(base, "krex")
        cmd = os.path.join(krex, "cmd-1")
        for d in (krex, cmd):
            os.mkdir(d)
        for d in (base, krex):  # a v1 cpuset starts empty: give the tree the root's cpus
            write(os.path.join(d, "cpuset.cpus"), read(os.path.join(m, "cpuset.cpus")))
            write(os.path.join(d, "cpuset.mems"), read(os.path.join(m, "cpuset.mems")))
        write(os.path.join(cmd, "cpuset.mems"), read(os.path.join(m, "cpuset.mems")))
        write(os.path.join(cmd, "cpuset.cpus"), str(cpus[0]))  # fenced, as during a region
        proc, _ = spinner(tmp_path, cmd)
        try:
            assert os.sched_getaffinity(proc.pid) == {cpus[0]}
            res = run_cleanup(base)
            assert res["ok"], res
            assert read(os.path.join(cmd, "cpuset.cpus")) == read(os.path.join(krex, "cpuset.cpus"))
            assert os.sched_getaffinity(proc.pid) == set(cpus)
        finally:
            proc.kill()
            proc.wait()


def test_v2_cpuset_restored(tmp_path):
    m = cg.v2_mount()
    if m is None or "cpuset" not in read(os.path.join(m, "cgroup.subtree_control")).split():
        pytest.skip("no cgroup v2 cpuset controller enabled at the v2 root (hybrid host)")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 cpus to fence one off")
    with tree(m, "cgroup v2") as base:
        krex = os.path.join(base, "krex")
        cmd = os.path.join(krex, "cmd-1")
        os.mkdir(krex)
        write(os.path.join(base, "cgroup.subtree_control"), "+cpuset")
        write(os.path.join(krex, "cgroup.subtree_control"), "+cpuset")
        os.mkdir(cmd)
        write(os.path.join(cmd, "cpuset.cpus"), str(cpus[-1]))
        proc, _ = spinner(tmp_path, cmd)
        try:
            assert os.sched_getaffinity(proc.pid) == {cpus[-1]}
            res = run_cleanup(base)
            assert res["ok"], res
            assert read(os.path.join(cmd, "cpuset.cpus")) == ""
            assert os.sched_getaffinity(proc.pid) == set(cpus)
        finally:
            proc.kill()
            proc.wait()


async def test_refuses_while_a_daemon_serves(tmp_path):
    from ..conftest import run_daemon

    with tree(cg.v2_mount(), "cgroup v2") as base:
        cmd = os.path.join(base, "krex", "cmd-1")
        os.makedirs(cmd)
        if not os.path.exists(os.path.join(cmd, "cgroup.freeze")):
            pytest.skip("no cgroup v2 freezer")
        write(os.path.join(cmd, "cgroup.freeze"), "1")
        async with run_daemon() as d:
            p = subprocess.run(
                [PY, "-m", "krex_async.ops.cleanup", "--root", base, "--socket", d.socket],
                capture_output=True,
                text=True,
                env=py_env(),
                cwd=ROOT,
                timeout=30,
            )
            assert p.returncode == 1 and "a daemon is serving" in p.stderr, p.stderr
            assert read(os.path.join(cmd, "cgroup.freeze")) == "1"  # untouched
            p = subprocess.run(
                [
                    PY,
                    "-m",
                    "krex_async.ops.cleanup",
                    "--root",
                    base,
                    "--socket",
                    d.socket,
                    "--force",
                    "--keep-empty",
                ],
                capture_output=True,
                text=True,
                env=py_env(),
                cwd=ROOT,
                timeout=30,
            )
            assert p.returncode == 0 and read(os.path.join(cmd, "cgroup.freeze")) == "0"
        # After the daemon stopped its socket is gone (or stale): no refusal.
        assert run_cleanup(base)["ok"]


def test_default_roots_cover_own_cgroup_and_mounts():
    roots = cg.default_roots("/x/configured")
    assert roots[0] == "/x/configured"
    m2 = cg.v2_mount()
    if m2:
        assert m2 in roots
        own = cg.own_cgroup("")
        assert own is not None and os.path.join(m2, own.lstrip("/")) in roots
    for ctrl in ("freezer", "cpuset"):
        if cg.v1_mount(ctrl):
            assert cg.v1_mount(ctrl) in roots


def test_krex_cleanup_verb(tmp_path):
    top = subprocess.run(
        [PY, "-m", "krex_async", "--help"], capture_output=True, text=True, env=py_env(), cwd=ROOT, timeout=30
    )
    if "cleanup" not in top.stdout:
        pytest.skip("wired by lead: `krex cleanup` is not a verb yet")
    p = subprocess.run(
        [
            PY,
            "-m",
            "krex_async",
            "cleanup",
            "--json",
            "--root",
            str(tmp_path),
            "--socket",
            "/nonexistent/krex.sock",
        ],
        capture_output=True,
        text=True,
        env=py_env(),
        cwd=ROOT,
        timeout=30,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {
        "ok": True,
        "dry_run": False,
        "trees": [],
        "actions": [],
        "notes": [],
        "errors": [],
    }


def test_a_user_without_rights_is_told_to_run_it_as_root(tmp_path):
    """`krex cleanup` as a plain user meets root's cgroups: beside each failed path, one line says
    why they all failed and what to run instead."""
    from tests.security.helpers import USER_PY, USER_PYTHONPATH, make_users

    users = make_users()
    alice = next(users)["alice"]
    with tree(cg.v2_mount(), "cgroup v2") as base:
        os.makedirs(os.path.join(base, "krex", "d-gone", "cmd-1"))
        p = subprocess.run(
            [USER_PY, "-m", "krex_async", "cleanup", "--root", base, "--socket", "/nonexistent/krex.sock"],
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": USER_PYTHONPATH, "HOME": "/tmp"},
            cwd="/tmp",
            user=alice.uid,
            group=alice.gid,
            timeout=60,
        )
        assert p.returncode == 1, (p.stdout, p.stderr)
        assert "rmdir failed: Permission denied" in p.stderr, p.stderr
        assert "permission denied: the cgroups are root's" in p.stderr and "sudo krex cleanup" in p.stderr
        assert os.path.isdir(os.path.join(base, "krex", "d-gone", "cmd-1"))


# A live daemon's stand-in: its owner lock on the state dir (as CgroupBackend takes it), until stdin ends.
OWNER = """
import sys
from krex_async.isolation.instance import claim_instance
claim_instance(sys.argv[1], "krex/test")
print("ready", flush=True)
sys.stdin.readline()
"""


def test_cleanup_leaves_a_live_daemons_cuda_locks_alone(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`krex cleanup --state-dir S` unlocked every process the record in S names, even while S's
    daemon was alive (serving on another socket than the one cleanup asked, or started since it
    asked): a region's held siblings ran on inside it. Now it unlocks only with S's owner lock
    pinned, as the sweep does: a live daemon's locks stay; a dead one's are undone."""
    from ..isolation.fakecuda import build

    (tmp_path / "fake").mkdir()
    fake = build(tmp_path / "fake")
    state, root = tmp_path / "state", tmp_path / "root"
    root.mkdir()
    env = {**py_env(), **fake.env()}
    monkeypatch.setenv("FAKE_CUDA_DIR", str(fake.state))  # the driver's state, for this process's lock
    sib = subprocess.Popen(fake.argv("s1", "cuda", gpu_file=False), env=env)
    owner = subprocess.Popen(
        [PY, "-c", OWNER, str(state)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline() == "ready\n"
        wait_for(lambda: fake.stats("s1")[1] > 0, "the sibling made no CUDA call", timeout=10)
        pid = fake.stats("s1")[0]
        from krex_async.isolation.cudalock import open_driver

        drv, why = open_driver(fake.lib)
        assert drv is not None, why
        assert drv.lock(pid, 500) == 0
        st = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])
        record = json.dumps({"version": 1, "pid": owner.pid, "library": fake.lib, "locked": [[pid, st]]})
        (state / "locks.json").write_text(record)
        argv = [PY, "-m", "krex_async", "cleanup", "--root", str(root), "--state-dir", str(state)]
        argv += ["--socket", str(tmp_path / "not-served")]
        r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert fake.lock_state(pid) == 1, f"cleanup unlocked a live daemon's sibling: {r.stdout}"
        assert (state / "locks.json").read_text() == record
        assert f"daemon (pid {owner.pid}) is alive" in r.stdout
        owner.communicate("\n", timeout=30)  # the daemon dies: its locks are cleanup's to undo
        r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
        assert r.returncode == 0 and f"unlocked pid {pid}" in r.stdout, r.stdout + r.stderr
        assert fake.lock_state(pid) == 0
    finally:
        for p in (owner, sib):
            if p.poll() is None:
                p.kill()
                p.wait()
