"""Region and quiesce requests are honoured only with the command's token and from a process inside
that command: another command, even of the same user and holding the right id and token, cannot
freeze its siblings, release someone else's region, or register as their runtime."""

from __future__ import annotations

from ..conftest import PY, py_env, run_daemon

VICTIM = """
import os, sys, time
from krex_async import region
print(os.environ["KREX_COMMAND"], os.environ["KREX_TOKEN"], flush=True)
with region("victim") as r:
    print(r.report.region, flush=True)
    time.sleep(float(sys.argv[1]))
"""

THIEF = """
import os, sys
os.environ["KREX_COMMAND"], os.environ["KREX_TOKEN"] = sys.argv[1], sys.argv[2]
from krex_async import region, RegionError
from krex_async import protocol as P
from krex_async.client.region import _get_channel
try:
    with region("stolen"):
        print("granted")
except RegionError as e:
    print(e.code)
ch = _get_channel()
for msg in (P.RegionExit(id=50, region=sys.argv[3], token=sys.argv[2]),
            P.QuiesceReady(id=51, command=sys.argv[1], token=sys.argv[2])):
    reply = ch.call(msg)
    print(reply.code if isinstance(reply, P.Error) else type(reply).__name__)
"""


async def test_another_command_with_the_right_id_and_token_is_refused(script):
    victim, thief = script("victim.py", VICTIM), script("thief.py", THIEF)
    # Two devices: the thief runs on the other one, so it is not frozen by the victim's region.
    async with run_daemon("--isolation", "signal", "--devices", "cpu:2") as d:
        async with await d.client() as c:
            v = await c.submit([PY, victim, "5"], env=py_env(), device="0")
            lines: list[str] = []
            async for _, data in v.output():
                lines += data.decode().split()
                if len(lines) >= 3:
                    break
            cid, token, region_id = lines[:3]
            res = await c.run([PY, thief, cid, token, region_id], env=py_env(), timeout=30, device="1")
            assert res.stdout.decode().split() == ["forbidden", "forbidden", "forbidden"], (
                res.stdout,
                res.stderr,
            )
            st = await c.status()
            held = st["devices"][0]["region"]
            assert held is not None and held["region"] == region_id  # still the victim's
            assert st["devices"][1]["region"] is None
            done = await v.wait()
            assert [r.outcome for r in done.report.regions] == ["released"]
            assert res.report.regions == [] or all(r.outcome != "held" for r in res.report.regions)
