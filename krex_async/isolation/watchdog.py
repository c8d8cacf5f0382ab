"""A tiny separate process that thaws krex's cgroups when the daemon dies, SIGKILL included.

    daemon ──start_watchdog()── exec python -m krex_async.isolation.watchdog --pid DAEMON ...
       │                                    │ pidfd_open(DAEMON); print "ready"
       ╳ (dies)                              │ poll(pidfd) wakes
                                             └─ intent.sweep(): thaw all, restore cpusets;
                                                cudalock.release_left(): unlock its locks; exit

It is started with exec (subprocess, its own session), never as a fork of the event loop, imports
only the cgroupfs, instance and intent modules (and cudalock, with libcuda where a lock was recorded, once the
daemon has died), and removes nothing but empty command cgroups, all under its daemon's instance
directory (`--base krex/<instance>`): other daemons' cgroups are never thawed. It sweeps holding
the instance's owner lock shared (instance.py), so a daemon restarted on the same state dir waits
for it; and not at all once such a daemon owns the instance: that one's start-up sweep did the
work, and a late one would thaw its regions and remove its new cgroups.

A "ready" that finds no reader (the daemon died while it started the watchdog) is no error: the
pidfd says the same a moment later, and the sweep runs.

The daemon's clean shutdown releases it by writing "Q" to its stdin pipe (it exits without a
sweep: nothing is frozen any more). End of that pipe without a "Q" means the daemon died. SIGTERM
and SIGINT are ignored: `systemctl stop` signals every process of the unit at once, and a
watchdog that left then could not thaw what a daemon that hangs in its shutdown still holds.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time

from krex_async.isolation.cgroupfs import CgroupFS
from krex_async.isolation.instance import owner_of, pin_instance
from krex_async.isolation.intent import KREX, sweep


def start_watchdog(
    pid: int,
    v2_root: str,
    v1_root: str | None,
    cpuset: str,
    state_dir: str,
    base: str = KREX,
    timeout: float = 5.0,
) -> subprocess.Popen[bytes]:
    """Start the watchdog for `pid` and return once it holds the pidfd. Raises RuntimeError when it
    does not report ready within `timeout` (the child is killed then)."""
    argv = [
        sys.executable,
        "-m",
        "krex_async.isolation.watchdog",
        "--pid",
        str(pid),
        "--v2",
        v2_root,
        "--cpuset",
        cpuset,
        "--state-dir",
        state_dir,
        "--base",
        base,
    ]
    if v1_root:
        argv += ["--v1", v1_root]
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True, close_fds=True
    )
    assert proc.stdout is not None
    ready = select.select([proc.stdout], [], [], timeout)[0]
    line = proc.stdout.readline() if ready else b""
    if line.strip() != b"ready":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"watchdog for pid {pid} did not start: {line!r}")
    return proc


def release(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """The daemon's clean shutdown: tell the watchdog to exit without a sweep, and reap it."""
    try:
        if proc.stdin is not None:
            proc.stdin.write(b"Q\n")
            proc.stdin.close()
    except OSError:
        pass  # it is gone already
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _released(rfd: int) -> bool | None:
    """Read the daemon's pipe: True on "Q", False on its end without one, None for nothing yet."""
    data = os.read(rfd, 64)
    if not data:
        return False
    return True if b"Q" in data else None


def guard(
    pid: int, v2: CgroupFS, v1: CgroupFS | None, cpuset: str, state_dir: str, rfd: int = 0, base: str = KREX
) -> list[str]:
    """Block until `pid` exits (sweep; returns the sweep's lines) or releases us (returns [])."""
    pidfd = os.pidfd_open(pid)
    guarded = owner_of(state_dir)  # the instance's owner now: the daemon (a test's stand-in: itself)
    try:
        try:
            print("ready", flush=True)
        except BrokenPipeError:  # the daemon died while it started us: its pidfd says so next
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        p = select.poll()
        p.register(pidfd, select.POLLIN)
        p.register(rfd, select.POLLIN)
        while True:
            events = dict(p.poll())
            if rfd in events and (said := _released(rfd)) is not None:
                if said:
                    return []
                break  # the pipe ended without a "Q": the daemon died
            if pidfd in events:
                break
    finally:
        os.close(pidfd)
    t0 = time.monotonic()
    pin, owner = _pin(state_dir, pid)
    if owner is not None and owner != guarded:
        return [f"watchdog: daemon {pid} died; daemon {owner} has started on its state dir since: no sweep"]
    try:
        lines, _alive = sweep(v2, v1, cpuset, state_dir, base=base)
        from krex_async.isolation.cudalock import release_left  # only now: ctypes, libcuda if needed

        lines += release_left(state_dir)  # the CUDA driver locks it took: they outlive it
    finally:
        if pin >= 0:
            os.close(pin)
    lines.append(f"watchdog: daemon {pid} died; sweep took {time.monotonic() - t0:.4f}s")
    return lines


def _pin(state_dir: str, dead: int) -> tuple[int, str | None]:
    """Pin the instance for the sweep (instance.pin_instance), so that a daemon restarted on the
    state dir meanwhile waits for it; else the live owner's pid. The dead daemon's own lock can
    outlive the end of its pipe by a moment: waited for, then swept regardless."""
    deadline = time.monotonic() + 2.0
    while True:
        fd, owner = pin_instance(state_dir)
        if owner != str(dead):
            return fd, owner
        if time.monotonic() > deadline:
            return -1, None
        time.sleep(0.005)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="krex-watchdog")
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--v2", required=True)
    ap.add_argument("--v1")
    ap.add_argument("--cpuset", default="v2")
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--base", default=KREX, help="the daemon's instance directory (krex/<instance>)")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        lines = guard(
            a.pid, CgroupFS(a.v2), CgroupFS(a.v1) if a.v1 else None, a.cpuset, a.state_dir, base=a.base
        )
    except ProcessLookupError:
        print(f"watchdog: pid {a.pid} is not running", file=sys.stderr)
        return 1
    for line in lines:
        print(line, file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
