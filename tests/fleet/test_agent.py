"""The node agent's body without Ray, over a real daemon it owns: a submission withdrawn after its
client's call broke (ActorUnavailableError: it may or may not have reached the agent) never runs,
or is killed if it did; a stream its caller abandons kills its command."""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from krex_async.fleet.agent import DaemonSpec, NodeAgent

from .conftest import env

PY = sys.executable


@pytest.fixture
async def agent() -> AsyncIterator[NodeAgent]:
    with tempfile.TemporaryDirectory(prefix="krex-agent-", dir="/tmp") as base:
        a = NodeAgent("solo", own=DaemonSpec(base, args=("--devices", "cpu:1")))
        try:
            yield a
        finally:
            await a.stop()


def spec(tmp: Path, *code: str) -> dict[str, object]:
    return {"argv": [PY, "-c", *code], "cwd": str(tmp), "env": env(), "device": "auto"}


async def states(agent: NodeAgent) -> dict[str, str]:
    return {c["command"]: c["state"] for c in (await agent.status())["commands"]}


async def test_a_withdrawn_token_is_refused_when_its_run_comes_late(agent: NodeAgent, tmp_path: Path) -> None:
    await agent.hello()
    assert await agent.withdraw("t-1") is False  # never reached here: the client may place it anew
    items = [i async for i in agent.run(spec(tmp_path, "print('ran')"), "t-1")]
    assert [i[:2] for i in items] == [("error", "withdrawn")], items
    assert await states(agent) == {}  # nothing was submitted to the daemon


async def test_withdrawing_an_accepted_run_kills_its_command(agent: NodeAgent, tmp_path: Path) -> None:
    gen = agent.run(spec(tmp_path, "import time; time.sleep(30)"), "t-2")
    accepted = await anext(gen)
    assert accepted[0] == "accepted"
    assert await agent.withdraw("t-2") is True  # it reached here: the client must not run it again
    rest = [i async for i in gen]
    assert rest[-1][0] == "exited", rest
    assert (await states(agent))[accepted[1]] == "ended"


async def test_an_abandoned_stream_kills_its_command(agent: NodeAgent, tmp_path: Path) -> None:
    gen = agent.run(spec(tmp_path, "import time; print('up', flush=True); time.sleep(30)"), "t-3")
    accepted = await anext(gen)
    assert (await anext(gen))[0] == "started"  # its client's job timeout runs from here
    assert (await anext(gen))[:2] == ("output", "stdout")
    await gen.aclose()  # as Ray closes it when its caller is gone
    deadline = asyncio.get_running_loop().time() + 10
    while (await states(agent))[accepted[1]] != "ended":
        assert asyncio.get_running_loop().time() < deadline, await states(agent)
        await asyncio.sleep(0.1)
