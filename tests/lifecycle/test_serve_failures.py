"""`krex serve` failing once its parts have started (after the start checks: a socket it cannot
bind, a stdout it cannot write its serving line to): it releases what it made, as a stop would (its
cgroup instance, watchdog, warm workers, probes), and exits with a message saying why, not with a
traceback and its parts left to the watchdog."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from ..conftest import ROOT, is_root, private_cgroup_root, py_env, remove_cgroup_tree, v2_mount
from ..ops.test_cli_input import KREX

pytestmark = pytest.mark.skipif(
    not is_root() or v2_mount() is None, reason="the cgroup backend, whose start makes the most, needs root"
)


def _marked(mark: str) -> list[int]:
    """The processes whose environment carries `mark` (the daemon's, inherited by its watchdog and
    its warm workers)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark.encode() in f.read().split(b"\0"):
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def _serve(d: Path, root: str, mark: str, *extra: str, stdout: int | None = None) -> subprocess.Popen[bytes]:
    env = py_env()
    env["KREX_TEST_MARK"] = mark.split("=", 1)[1]
    with open(d / "log", "wb") as out:
        return subprocess.Popen(
            [*KREX, "serve", "--socket", str(d / "sock" / "s"), "--state-dir", str(d / "state")]
            + ["--cgroup-root", root, "--isolation", "cgroup", "--log-format", "json", "--pool-size", "1"]
            + list(extra),
            stdout=out if stdout is None else stdout,
            stderr=out,
            env=env,
            cwd=ROOT,
        )


def _wait(p: subprocess.Popen[bytes]) -> None:
    try:
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _nothing_left(d: Path, root: str, mark: str) -> str:
    """Assert that the daemon, gone, left no process, cgroup or socket file; its log."""
    text = (d / "log").read_text()
    # released before the exit, not by whoever notices the daemon is gone: at once
    assert _marked(mark) == [], (_marked(mark), text)
    left = [t for t in (root, root.replace("/unified/", "/cpuset/", 1)) if glob.glob(f"{t}/krex/d-*")]
    assert not left, (left, text)
    assert "Traceback" not in text, text
    assert not glob.glob(str(d / "sock" / "*")) and not glob.glob(str(d / "sock" / ".*")), text
    return text


def test_a_socket_name_that_cannot_be_bound_releases_what_the_start_made(tmp_path: Path) -> None:
    """The socket's temporary name (bound there, then renamed onto --socket) is taken by a directory
    the start checks do not look at: the bind fails after the pools and the watchdog started."""
    root = private_cgroup_root()
    assert root is not None
    mark = f"KREX_TEST_MARK={uuid.uuid4().hex}"
    (tmp_path / "sock").mkdir()
    try:
        p = _serve(tmp_path, root, mark, "--probes", "off")
        blocker = tmp_path / "sock" / f".{p.pid}~"  # listener.bind_socket's temporary name
        (blocker / "in").mkdir(parents=True)  # long before the daemon's modules are imported
        _wait(p)
        shutil.rmtree(blocker)  # not the daemon's to remove
        text = _nothing_left(tmp_path, root, mark)
        assert p.returncode == 1, (p.returncode, text)
        assert f"krex: --socket {tmp_path}/sock/s: cannot listen" in text and "Is a directory" in text, text
    finally:
        remove_cgroup_tree(root)


def test_a_socket_directory_replaced_by_a_file_while_starting_is_exit_2(tmp_path: Path) -> None:
    """The socket's directory is there at the start checks and replaced by a file while the probes
    compile (seconds with bcc): exit 2 naming --socket, as the checks would have said, and nothing
    of the start is left."""
    from krex_async.probes import bcc_works

    ok, why = bcc_works()
    if not ok:
        pytest.skip(f"bcc unavailable: {why} (its compile is the window between the checks and the bind)")
    root = private_cgroup_root()
    assert root is not None
    mark = f"KREX_TEST_MARK={uuid.uuid4().hex}"
    sock = tmp_path / "sock"
    sock.mkdir()
    try:
        p = _serve(tmp_path, root, mark, "--probes", "ioctl")
        deadline = time.monotonic() + 30
        while '"devices"' not in (tmp_path / "log").read_text():  # then the probes compile
            assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()
            time.sleep(0.002)
        sock.rmdir()
        sock.write_text("")
        _wait(p)
        sock.unlink()
        sock.mkdir()
        text = _nothing_left(tmp_path, root, mark)
        assert p.returncode == 2, (p.returncode, text)
        assert f"--socket {sock}/s: {sock} is not a directory" in text, text
    finally:
        remove_cgroup_tree(root)


def test_a_stdout_that_cannot_take_the_serving_line_releases_what_the_start_made(tmp_path: Path) -> None:
    """Its stdout a pipe nobody reads any more (whoever waited for "serving" is gone): the line
    fails once the daemon listens, which then stops as a stop signal would stop it."""
    root = private_cgroup_root()
    assert root is not None
    mark = f"KREX_TEST_MARK={uuid.uuid4().hex}"
    (tmp_path / "sock").mkdir()
    r, w = os.pipe()
    os.close(r)
    try:
        p = _serve(tmp_path, root, mark, "--probes", "off", stdout=w)
        os.close(w)
        _wait(p)
        text = _nothing_left(tmp_path, root, mark)
        assert p.returncode == 1, (p.returncode, text)
        assert "krex: cannot say on stdout that it serves: [Errno 32] Broken pipe" in text, text
        assert '"stopped"' in text, text
    finally:
        remove_cgroup_tree(root)
