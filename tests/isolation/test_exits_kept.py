"""daemon/exits.py: an exit a region froze is still an exit at the next region, however many
regions it has been frozen through (under --exit-wait 0 an exit runs only between regions)."""

from __future__ import annotations

import subprocess
import time
from types import SimpleNamespace
from typing import Any

from krex_async.daemon import exits as E
from krex_async.isolation.cudalock import start_time


def test_an_exit_frozen_through_regions_is_kept_past_its_first_notes_age() -> None:
    proc = subprocess.Popen(["sleep", "30"])  # a live process stands in for one exiting
    try:
        ex = E.Exits(SimpleNamespace())  # type: ignore[arg-type]
        old = time.monotonic() - E.EXITING_KEPT_S + 0.5  # first noted just under the limit ago
        r: Any = SimpleNamespace(exits_left={proc.pid: ("nvidia0", old, start_time(proc.pid))})
        ex.give_back(r)  # a region froze it and ends: the exit is renewed, not left to age out
        assert r.exits_left == {}
        time.sleep(1.0)
        assert ex.still_exiting(proc.pid, ex.exiting[proc.pid], time.monotonic())
        reused: Any = SimpleNamespace(exits_left={proc.pid: ("nvidia0", old, 12345)})
        ex2 = E.Exits(SimpleNamespace())  # type: ignore[arg-type]
        ex2.give_back(reused)  # another process under that pid: not an exit
        assert proc.pid not in ex2.exiting
    finally:
        proc.kill()
        proc.wait()
