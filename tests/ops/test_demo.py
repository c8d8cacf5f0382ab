"""`krex demo`: a fair alone baseline and a verdict that says what the numbers support."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

from krex_async.ops.demo import verdict

from ..conftest import PY, ROOT, cmdline, py_env


def test_verdict_judges_against_the_alone_runs_spread() -> None:
    alone = [2.0, 2.02, 1.98, 2.01, 1.99, 2.0]
    clean = verdict(alone, {"region": [2.02, 2.05, 1.99], "shared": [2.0, 4.1, 6.3]})
    assert "regions kept every timing within 5% of alone (worst +2.5%)" in clean[-1], clean
    assert "worst +215.0%" in clean[-1]
    # a region timing far outside the alone spread is not called clean, and says why it may be
    busy = verdict(alone, {"region": [2.0, 6.0], "shared": [2.0, 7.0]}, (7.5, 2))
    assert "moved +200.0%" in busy[-1] and "load average 7.5 on 2 cores" in busy[-1], busy
    # noisy alone runs (wider than NOISY_PCT): no verdict either way, and it says why; a region at
    # +101.8% is not passed because the alone runs spread even wider
    noisy = verdict([1.0, 2.6, 1.5], {"region": [3.05], "shared": [2.9]}, (8.0, 2))
    assert noisy[-1].startswith("verdict: none: this machine is too noisy to judge"), noisy
    assert "load average 8.0 on 2 cores" in noisy[-1] and "region's worst +103.3%" in noisy[-1], noisy
    # noisy, but sharing beyond even that noise: said, and regions left unjudged
    beyond = verdict([2.0, 2.4, 2.1], {"region": [2.1], "shared": [6.2]}, (0.6, 2))
    assert beyond[-1].startswith("verdict: sharing moved a timing +195.2%, beyond even"), beyond
    assert "cannot be judged here (region's worst +0.0%)" in beyond[-1], beyond
    # spread just within NOISY_PCT: judged, with the spread as the floor
    fair = verdict([2.0, 2.2, 2.1], {"region": [2.15], "shared": [3.0]})
    assert "regions kept every timing within 10% of alone" in fair[-1], fair
    same = verdict(alone, {"region": [2.0], "shared": [2.03]})
    assert "no difference above the noise" in same[-1]


def test_demo_runs_and_ends_with_what_to_try_next() -> None:
    p = subprocess.run(
        [PY, "-m", "krex_async", "demo", "-n", "3"],
        capture_output=True,
        text=True,
        env=py_env(),
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "alone:" in out and "runs before, between and after" in out
    assert "verdict:" in out and out.rstrip().splitlines()[0].startswith("krex demo")
    assert "the same command alone (through krex, one at a time)" in out, out
    tail = out[out.index("\nnext") :]
    assert "krex serve" in tail and "krex run" in tail and "region(" in tail
    logs = re.search(r"logs and scripts in (/tmp/krex-demo-\S+)", out)
    assert logs, out
    shutil.rmtree(logs.group(1))  # the demo keeps them for its user; a test does not


def test_ctrl_c_ends_the_demo_with_130_a_line_and_no_daemon_left() -> None:
    """Ctrl-C while the demo's daemon runs its commands: no traceback, exit 130, the daemon and
    its commands gone (the terminal's SIGINT reaches the demo first; here only the demo gets it)."""
    p = subprocess.Popen(
        [PY, "-m", "krex_async", "demo", "-n", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=py_env(),
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 120
        tmp = None
        while tmp is None and time.monotonic() < deadline and p.poll() is None:
            for pid in os.listdir("/proc"):  # the demo's daemon: `serve --socket /tmp/krex-demo-*/`
                argv = cmdline(pid).split(b"\0")
                if b"serve" in argv and b"--socket" in argv and int(pid) != p.pid:
                    sock = argv[argv.index(b"--socket") + 1].decode()
                    if sock.startswith("/tmp/krex-demo-"):
                        tmp = os.path.dirname(sock)
            time.sleep(0.05)
        assert tmp is not None, "the demo started no daemon"
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, (out, err)
    assert "Traceback" not in err and f"interrupted; its daemon was stopped (logs in {tmp})" in err, err
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and tmp.encode() in cmdline(pid)]
    assert not left, [cmdline(pid) for pid in left]
    shutil.rmtree(tmp)
