"""A node that dies and comes back under its name (a new Ray node, a new agent): the command that ran
on the dead incarnation ends `lost` naming it, and is not run again; the node is used again without
a new client."""

from __future__ import annotations

import pytest

from tests.conftest import until

from .conftest import NEEDS_RAY, PY, env
from .test_node_death import survivors

pytestmark = pytest.mark.slow
pytest.importorskip("ray", reason=NEEDS_RAY)
from krex_async.fleet.local import LocalFleet  # noqa: E402


async def test_a_node_back_under_its_name_is_used_again(local_fleet: LocalFleet) -> None:
    async with await local_fleet.connect(refresh_s=0.2) as fc:
        local_fleet.add_node("phoenix")
        try:
            await until(
                lambda: "phoenix" in fc.nodes and fc.nodes["phoenix"].up, f"phoenix found: {fc.nodes}"
            )
            marked = [
                PY,
                "-c",
                "import time; print('up', flush=True); time.sleep(20); print('twice')",
                "phx-mark",
            ]
            h = await fc.submit(marked, env=env(), node="phoenix", label="doomed")
            seen = b""
            async for _stream, data in h.output():
                seen += data
                if seen == b"up\n":
                    break
            local_fleet.remove_node("phoenix")
            r = await h.wait()
            assert r.report.state == "lost" and r.report.command == h.command, r.report
            # Ray may call the agent unavailable before it knows it died; either way the report
            # names the node and says the command is not run again.
            assert "node phoenix: its agent " in r.report.error, r.report.error
            assert "not run again" in r.report.error, r.report.error
            assert r.report.label == "doomed" and r.stdout == b"up\n"
            await until(lambda: not fc.nodes["phoenix"].up, f"phoenix down: {fc.nodes['phoenix']}")

            local_fleet.add_node("phoenix")  # same name, new Ray node: this client finds it
            await until(lambda: fc.nodes["phoenix"].up, f"phoenix back: {fc.nodes['phoenix']}")
            again = await fc.run([PY, "-c", "print('again')"], env=env(), node="phoenix")
            assert again.report.state == "exited" and again.stdout == b"again\n", again.report
            # The lost command did not outlive its node, nor run on the new one.
            assert survivors("phx-mark") == []
            # The new daemon (same state dir) knows it once, ended by its start-up sweep.
            doomed = [c for c in (await fc.status())["commands"] if c.get("label") == "doomed"]
            assert [c["state"] for c in doomed] in ([], ["ended"]), doomed
            assert fc.lost == [h.command]
        finally:
            if "phoenix" in local_fleet.ray_nodes:
                local_fleet.remove_node("phoenix")
