"""`krex serve` at its edges: paths it cannot serve on refused before anything is made (exit 2,
naming the flag), and signals that come while it starts ending it as cleanly as later ones."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ..conftest import ROOT, cmdline, is_root, private_cgroup_root, py_env, remove_cgroup_tree
from .test_cli_input import KREX, krex

QUIET = ("--isolation", "signal", "--probes", "off")  # a daemon that served by mistake holds nothing


def test_a_socket_in_a_missing_directory_is_refused_and_nothing_is_made(tmp_path: Path) -> None:
    """The daemon made every missing directory of --socket (a typo left a tree behind); only its
    own default directories are made now."""
    missing = tmp_path / "no" / "dir"
    rc, err = krex("serve", "--socket", str(missing / "s"), "--state-dir", str(tmp_path / "st"), *QUIET)
    assert rc == 2 and f"--socket {missing}/s: no directory {missing}" in err, (rc, err)
    assert not (tmp_path / "no").exists() and not (tmp_path / "st").exists()
    (tmp_path / "file").write_text("")
    rc, err = krex(
        "serve", "--socket", str(tmp_path / "file" / "s"), "--state-dir", str(tmp_path / "st"), *QUIET
    )
    assert rc == 2 and f"{tmp_path}/file is not a directory" in err, (rc, err)


def test_a_state_dir_that_is_a_file_is_refused_by_its_flag(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    for state in (tmp_path / "file", tmp_path / "file" / "sub"):
        rc, err = krex("serve", "--socket", str(tmp_path / "s"), "--state-dir", str(state), *QUIET)
        assert rc == 2 and f"--state-dir {state}: not a directory" in err, (rc, err)
        assert "File exists" not in err and not (tmp_path / "s").exists()


def watchdogs_of(pid: int) -> list[int]:
    """The watchdog processes guarding `pid` (isolation/watchdog.py, `--pid PID` on their argv)."""
    found = []
    for entry in os.listdir("/proc"):
        argv = cmdline(entry).split(b"\0")
        if b"krex_async.isolation.watchdog" in argv and str(pid).encode() in argv:
            found.append(int(entry))
    return found


# Each phase's first log line (or the line before it): a signal sent once it shows comes while the
# next phase runs (with probes on, "devices" is followed by the bcc compile of the probes). CAUGHT:
# as soon as the process catches SIGTERM, before any log line (the daemon's modules still import).
CAUGHT = "SIGTERM caught"
PHASES = [CAUGHT, '"starting"', '"reconciled"', '"devices"', '"probes"', '"serving"']


def catches_sigterm(pid: int) -> bool:
    """Whether `pid` has a handler for SIGTERM (SigCgt in /proc/PID/status): Python itself catches
    only SIGINT, so this is krex's stop handler in place."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask & (1 << (signal.SIGTERM - 1)))


@pytest.mark.skipif(not is_root(), reason="the cgroup backend, whose start makes the most, needs root")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_during_the_start_stops_it_cleanly(tmp_path: Path, sig: int) -> None:
    """SIGTERM killed a starting daemon (-15, its cgroups and watchdog left to others), SIGINT
    ended it in a KeyboardInterrupt traceback: each now stops it at its next phase, exit 0 as a
    later stop, with its instance directory, watchdog and socket gone."""
    for phase in PHASES:
        root = private_cgroup_root()
        assert root is not None
        d = tmp_path / phase.strip('"').replace(" ", "-")
        d.mkdir()
        log = d / "log"
        try:
            with open(log, "wb") as out:
                p = subprocess.Popen(
                    [*KREX, "serve", "--socket", str(d / "s"), "--state-dir", str(d / "state")]
                    + ["--cgroup-root", root, "--log-format", "json", "--probes", "auto"],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=py_env(),
                    cwd=ROOT,
                )
            try:
                deadline = time.monotonic() + 30
                while not (catches_sigterm(p.pid) if phase == CAUGHT else phase in log.read_text()):
                    assert p.poll() is None and time.monotonic() < deadline, (phase, log.read_text())
                    time.sleep(0.002)
                p.send_signal(sig)
                rc = p.wait(30)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            text = log.read_text()
            assert rc == 0 and "Traceback" not in text, (phase, rc, text)
            assert not (d / "s").exists(), (phase, text)
            left = [t for t in (root, root.replace("/unified/", "/cpuset/", 1)) if glob.glob(f"{t}/krex/d-*")]
            assert not left, (phase, left, text)
            assert not watchdogs_of(p.pid), (phase, text)  # released and reaped before the exit
        finally:
            remove_cgroup_tree(root)
