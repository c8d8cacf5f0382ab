"""What krex's in-command runtime adds to a Python command's start-up (issue 5's runtime).

    python -m bench.runtime_start [--runs 30]

Runs `python -c pass` with and without the runtime (krex_async/runtime first on PYTHONPATH and a
command's KREX_SOCKET/KREX_COMMAND/KREX_TOKEN, the socket a listening stand-in that accepts and
holds connections), interleaved, and prints the time `site` took (-X importtime: the main thread's
wall time, the listener's GIL time included when they collide), the main thread's CPU time at the
first statement, and the whole run's wall time, as p50 and min over the runs.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench.harness.output import module_prog

RUNTIME = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "krex_async", "runtime")
PROG = "import time; print(time.thread_time_ns())"


def one(env: dict[str, str]) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", PROG],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    wall = (time.perf_counter() - t0) * 1e3
    site = re.search(r"import time:\s+\d+ \|\s+(\d+) \|\s*site$", out.stderr, re.M)
    assert site, out.stderr
    return int(site.group(1)) / 1e3, int(out.stdout) / 1e6, wall


def main() -> None:
    ap = argparse.ArgumentParser(
        prog=module_prog(__spec__), description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="krexrt-")
    path = os.path.join(d, "s")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(64)
    held: list[socket.socket] = []

    def accept_forever() -> None:
        while True:
            held.append(srv.accept()[0])

    threading.Thread(target=accept_forever, daemon=True).start()
    base = {k: v for k, v in os.environ.items() if not k.startswith("KREX_") and k != "PYTHONPATH"}
    with_rt = dict(
        base, PYTHONPATH=RUNTIME, KREX_SOCKET=path, KREX_COMMAND="c1", KREX_TOKEN="t0k", KREX_DEVICE="cpu"
    )
    res: dict[str, list[tuple[float, float, float]]] = {"without": [], "with runtime": []}
    for _ in range(args.runs):
        res["without"].append(one(base))
        res["with runtime"].append(one(with_rt))
    print(f"python -c pass, {args.runs} runs each, interleaved (ms)")
    print(
        f"{'':<14}{'site p50':>10}{'site min':>10}{'main cpu p50':>14}{'main cpu min':>14}"
        f"{'wall p50':>10}{'wall min':>10}"
    )
    for name, rows in res.items():
        site, cpu, wall = zip(*rows)
        print(
            f"{name:<14}{statistics.median(site):>10.2f}{min(site):>10.2f}"
            f"{statistics.median(cpu):>14.2f}{min(cpu):>14.2f}"
            f"{statistics.median(wall):>10.2f}{min(wall):>10.2f}"
        )


if __name__ == "__main__":
    main()
