"""Device helpers in a CPU-only process: nothing to synchronise, and no GPU library gets loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from krex_async.runtime import quiesce
from krex_async import protocol as P

REPO = Path(__file__).resolve().parents[2]


def test_cpu_only_process_syncs_nothing_and_loads_nothing() -> None:
    code = ("from krex_async.runtime import devicework as d\n"
            "print(d.synchronize(), d.idle_verify(1.0), d.warm(5), d.cuda_context_current())\n"
            "maps = open('/proc/self/maps').read()\n"
            "print('libcuda' in maps, 'amdhip' in maps, 'torch' in __import__('sys').modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["none ('unverified', 0.0) ('none', 0.0) False",
                                       "False False False"]


def test_codec_speaks_the_protocol_both_ways() -> None:
    for msg in (P.Quiesce(id=7, region="r-1"), P.Resume(id=2**40, region="x" * 300),
                P.Welcome(id=1, version=1, server="krex", policy="region", uid=0),
                P.Error(id=2, code="forbidden", message="ü" * 40)):
        body = P.encode(msg)[4:]
        decoded = quiesce.unpack(body)
        assert decoded == {k: v for k, v in P.to_builtins(msg).items()}, msg
    ours = quiesce.frame({"type": "quiesce_ack", "id": 7, "region": "r", "synced": "none",
                          "seconds": 0.25})
    assert int.from_bytes(ours[:4], "big") == len(ours) - 4
    assert P.decode_request(ours[4:]) == P.QuiesceAck(id=7, region="r", synced="none", seconds=0.25)
    ready = quiesce.frame({"type": "quiesce_ready", "id": 2, "command": "c", "token": "t", "pid": -1})
    assert P.decode_request(ready[4:]) == P.QuiesceReady(id=2, command="c", token="t", pid=-1)
    assert quiesce.unpack(quiesce.pack([None, True, False, -33, 1.5, b"ab", {"k": [1]}])) == \
        [None, True, False, -33, 1.5, b"ab", {"k": [1]}]
