"""What the kernel's cgroup v2 freezer costs without krex: the floor under a region's freeze step.

    python3 -m bench.freeze_floor --root /sys/fs/cgroup/krexbench [--groups 16] [--rounds 200]

Creates N cgroups under --root, each with one sleeping process, then per round: writes 1 to every
cgroup.freeze (timing the writes), spins reading every cgroup.events until all show `frozen 1`
(no inotify: the file is current before its notification is sent), writes 0 to all and spins
until all show `frozen 0`. Also times a null syscall and one cgroup.events read, so a slow machine
shows as slow syscalls. Prints p50/p99 in microseconds; removes everything it made.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

from bench.harness.output import module_prog, write_json
from bench.harness.stats import quantile


def write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(prog=module_prog(__spec__), description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True, help="a cgroup v2 directory this process may write")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.root, "cgroup.procs")):
        ap.error(f"--root {args.root}: not a cgroup v2 directory")
    if args.groups < 1 or args.rounds < 1:
        ap.error("--groups and --rounds must be positive")
    base = os.path.join(args.root, f"floor-{os.getpid()}")
    os.mkdir(base)
    procs: list[subprocess.Popen[bytes]] = []
    dirs = []
    try:
        for i in range(args.groups):
            d = os.path.join(base, f"g{i}")
            os.mkdir(d)
            dirs.append(d)
            p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
            procs.append(p)
            write(os.path.join(d, "cgroup.procs"), str(p.pid).encode())
        time.sleep(0.5)  # let them reach their sleep
        freeze = [os.open(os.path.join(d, "cgroup.freeze"), os.O_WRONLY) for d in dirs]
        events = [os.open(os.path.join(d, "cgroup.events"), os.O_RDONLY) for d in dirs]

        def state(fd: int) -> bytes:
            return os.pread(fd, 256, 0).split(b"frozen ")[1][:1]

        def wait_all(want: bytes) -> None:
            pending = set(range(len(events)))
            while pending:
                pending = {i for i in pending if state(events[i]) != want}

        t_write, t_frozen, t_thaw = [], [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for fd in freeze:
                os.write(fd, b"1")
            t1 = time.perf_counter()
            wait_all(b"1")
            t2 = time.perf_counter()
            for fd in freeze:
                os.write(fd, b"0")
            wait_all(b"0")
            t3 = time.perf_counter()
            t_write.append(t1 - t0)
            t_frozen.append(t2 - t0)
            t_thaw.append(t3 - t2)
            time.sleep(0.005)
        n = 20000
        t0 = time.perf_counter()
        for _ in range(n):
            os.getppid()
        null = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        for _ in range(n // 10):
            os.pread(events[0], 256, 0)
        ev = (time.perf_counter() - t0) / (n // 10)
        for fd in freeze + events:
            os.close(fd)
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for d in dirs:
            try:
                write(os.path.join(d, "cgroup.freeze"), b"0")
            except OSError:
                pass
        for p in procs:
            p.wait()
        for d in dirs:
            os.rmdir(d)
        os.rmdir(base)
    us = 1e6
    row: dict[str, float] = {"groups": args.groups, "rounds": args.rounds}
    for name, xs in (("writes", t_write), ("frozen", t_frozen), ("thawed", t_thaw)):
        row[f"{name}_p50_us"] = statistics.median(xs) * us
        row[f"{name}_p99_us"] = quantile(xs, 0.99, "rank") * us
    row.update(null_syscall_us=null * us, events_read_us=ev * us)
    print(
        f"{'groups':>6} {'writes p50':>10} {'p99':>7} {'all frozen p50':>14} {'p99':>7} "
        f"{'thawed p50':>10} {'p99':>7} {'getppid':>8} {'events read':>11}   (us)"
    )
    print(
        f"{args.groups:>6} {row['writes_p50_us']:>10.1f} {row['writes_p99_us']:>7.1f} "
        f"{row['frozen_p50_us']:>14.1f} {row['frozen_p99_us']:>7.1f} {row['thawed_p50_us']:>10.1f} "
        f"{row['thawed_p99_us']:>7.1f} {row['null_syscall_us']:>8.2f} {row['events_read_us']:>11.2f}"
    )
    if args.json:
        write_json(
            args.json,
            {
                "host": os.uname().nodename,
                "release": os.uname().release,
                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                **row,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
