"""Child programs of bench/region_overhead.py, run as `python -m bench.workload.region_loop MODE`.

- owner N: enter and leave N empty regions; one JSON line with each entry's and exit's latency (call
  to return) and the report fields the table splits the entry into.
- sleep: a sibling that sleeps in 50 ms steps (an idle command the region freezes).
- spin: a sibling that keeps a core busy (--busy).
"""

from __future__ import annotations

import json
import sys
import time


def owner(n: int) -> None:
    from krex_async import region

    enter: list[float] = []
    exit_: list[float] = []
    rep: list[tuple[object, ...]] = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = region("bench")
        r.__enter__()
        t1 = time.perf_counter()
        r.__exit__(None, None, None)
        t2 = time.perf_counter()
        enter.append(t1 - t0)
        exit_.append(t2 - t1)
        g = r.report
        assert g is not None  # inside krex every region has a report
        rep.append(
            (
                g.freeze_s,
                g.cores_s,
                g.wait_s,
                g.enter_s,
                len(g.frozen),
                g.quiesce_s,
                g.select_s,
                g.settle_s,
                g.drain,
            )
        )
    print(json.dumps({"enter": enter, "exit": exit_, "rep": rep}))


def main(argv: list[str]) -> int:
    match argv:
        case ["owner", n]:
            owner(int(n))
        case ["sleep"]:
            while True:
                time.sleep(0.05)
        case ["spin"]:
            while True:
                pass
        case _:
            print("usage: python -m bench.workload.region_loop owner N | sleep | spin", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
