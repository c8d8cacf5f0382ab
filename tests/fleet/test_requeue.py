"""A gateway job claimed while a fleet node looked up, whose submit then finds no node that can
take it (every agent died between the claim and the start), goes back to `queued` in its place,
with its job dir removed, and runs once, from a fresh dir, when a node is back; it is not failed.

The window is hit deterministically: the runner's on_change (the gateway's long-poll notifier) is
called right after the claim, before the job's task starts, and ends every node's agent there."""

from __future__ import annotations

import asyncio
import os

import pytest

from krex_async.gateway import catalog
from krex_async.gateway.jobs import JobRunner
from krex_async.gateway.limits import Limits
from krex_async.gateway.store import Store
from tests.conftest import until
from tests.security.helpers import _ensure_user

from ..gateway.conftest import JOB_USER, gateway_home, job_python
from .conftest import NEEDS_RAY

pytestmark = pytest.mark.slow
pytest.importorskip("ray", reason=NEEDS_RAY)
from krex_async.fleet.local import LocalFleet  # noqa: E402


async def test_a_job_whose_nodes_all_go_between_claim_and_start_is_queued_again(
    local_fleet: LocalFleet,
) -> None:
    import ray

    from krex_async.fleet.raycluster import node_name

    run_as = _ensure_user(JOB_USER, []).uid if os.geteuid() == 0 else None

    def others() -> list[str]:
        """Nodes Ray still calls alive that are not the fleet's own (one an earlier test removed
        is called alive until its heartbeats are missed), whose agents the test would not end."""
        return [node_name(n) for n in ray.nodes() if n["Alive"] and node_name(n) not in local_fleet.ray_nodes]

    await until(lambda: not others(), lambda: f"nodes left by earlier tests: {others()}")
    # refreshed here only: the claim sees the nodes up, as a refresher's last view would
    async with await local_fleet.connect(refresh_s=3600) as fc:
        with gateway_home() as home:
            state = home / "gw"
            state.mkdir(mode=0o711)
            (state / "jobs").mkdir(mode=0o711)
            runs = home / "scratch" / "runs"
            store = Store(state / "jobs.db")
            kinds, _ = catalog.build(Limits(), frozenset(["local"]), None, job_python())
            claims: list[str] = []
            errors: list[BaseException] = []

            def on_change(job_id: str) -> None:
                if store.status(job_id) == "running" and job_id not in claims:
                    claims.append(job_id)
                    try:
                        local_fleet.stop_agents()  # every node's agent (and its daemon) ends here
                    except BaseException as e:  # said by the test, not lost with the claim loop
                        errors.append(e)

            def seen() -> str:
                return f"{store.get(job)}; claims {claims}, errors {errors}, {runner.waiting!r}, {fc.nodes}"

            runner = JobRunner(
                store,
                state / "jobs",
                Limits(),
                None,
                kinds,
                on_change,
                python=job_python(),
                run_as=run_as,
                connect=lambda: asyncio.sleep(0, fc),
            )
            request = kinds["dev"].validate(
                {"command": f"pwd; ls -A; echo ran >> {runs}", "spec": {"target_hardware": ["local"]}}
            )[0]
            job = store.create("dev", request, "t", None, None, run_uid=run_as)[0]["job_id"]
            runner.start()
            try:
                await until(lambda: claims and runner.waiting, seen)
                assert not errors, errors
                view = store.get(job)
                assert view is not None and view["status"] == "queued", view
                assert view.get("krex_command") is None and view.get("started_at") is None, view
                assert runner.waiting.startswith("waiting for a fleet node: no node of the fleet is up")
                assert "its agent died" in runner.waiting, runner.waiting
                assert not (state / "jobs" / job).exists() and not runs.exists()
                assert job not in runner.running

                assert sorted(await fc.discover()) == ["node0", "node1", "node2"]  # their next agents
                await fc.refresh()
                await until(lambda: store.status(job) not in ("queued", "running"), seen)
                view = store.get(job)
                assert view is not None and view["status"] == "succeeded", view
                out = view["result"]["stdout"].split("\n")
                assert out[0] == str(state / "jobs" / job) and out[1] == ".torch_extensions", out
                assert runs.read_text() == "ran\n"  # once
                assert claims == [job]
            finally:
                await runner.stop()
                store.close()
