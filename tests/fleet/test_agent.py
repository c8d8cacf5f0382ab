"""The node agent's body without Ray, over a real daemon it owns: a submission withdrawn after its
client's call broke (ActorUnavailableError: it may or may not have reached the agent) never runs,
or is killed if it did; a stream its caller abandons kills its command. A request not sealed with
the fleet's key, or for root, is refused and logged; a sealed one runs as the user it names."""

from __future__ import annotations

import asyncio
import os
import pwd
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from krex_async.client.submit import KrexError
from krex_async.fleet import auth
from krex_async.fleet.agent import DaemonSpec, NodeAgent

from .conftest import PY, env

USER = "nobody" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name


@pytest.fixture
async def agent(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> AsyncIterator[NodeAgent]:
    with tempfile.TemporaryDirectory(prefix="krex-agent-", dir="/tmp") as base:
        # As in a Ray worker of a node started with token authentication.
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", auth.create_token(os.path.join(base, "token")))
        a = NodeAgent("solo", own=DaemonSpec(base, args=("--devices", "cpu:1")))
        try:
            yield a
        finally:
            await a.stop(*sealed("stop"))


def sealed(method: str, node: str = "solo", **body: Any) -> tuple[bytes, str]:
    return auth.seal(auth.read_token(os.environ["RAY_AUTH_TOKEN_PATH"]), method, node, body)


def run(agent: NodeAgent, spec: dict[str, Any], token: str, user: str = USER) -> AsyncIterator[Any]:
    return agent.run(*sealed("run", spec=spec, token=token, user=user))


def withdraw(agent: NodeAgent, token: str) -> Any:
    return agent.withdraw(*sealed("withdraw", token=token))


def spec(tmp: Path, *code: str) -> dict[str, object]:
    # /tmp, not pytest's 0700 tmp_path: the command runs as USER
    return {"argv": [PY, "-c", *code], "cwd": "/tmp", "env": env(), "device": "auto"}


async def states(agent: NodeAgent) -> dict[str, str]:
    return {c["command"]: c["state"] for c in (await agent.status())["commands"]}


async def test_a_withdrawn_token_is_refused_when_its_run_comes_late(agent: NodeAgent, tmp_path: Path) -> None:
    await agent.hello()
    assert await withdraw(agent, "t-1") is False  # never reached here: the client may place it anew
    items = [i async for i in run(agent, spec(tmp_path, "print('ran')"), "t-1")]
    assert [i[:2] for i in items] == [("error", "withdrawn")], items
    assert await states(agent) == {}  # nothing was submitted to the daemon


async def test_withdrawing_an_accepted_run_kills_its_command(agent: NodeAgent, tmp_path: Path) -> None:
    gen = run(agent, spec(tmp_path, "import time; time.sleep(30)"), "t-2")
    accepted = await anext(gen)
    assert accepted[0] == "accepted"
    assert await withdraw(agent, "t-2") is True  # it reached here: the client must not run it again
    rest = [i async for i in gen]
    assert rest[-1][0] == "exited", rest
    assert (await states(agent))[accepted[1]] == "ended"


async def test_an_abandoned_stream_kills_its_command(agent: NodeAgent, tmp_path: Path) -> None:
    gen = run(agent, spec(tmp_path, "import time; print('up', flush=True); time.sleep(30)"), "t-3")
    accepted = await anext(gen)
    assert (await anext(gen))[0] == "started"  # its client's job timeout runs from here
    item = await anext(gen)
    assert item[:2] == ("output", "stdout"), item
    await gen.aclose()  # as Ray closes it when its caller is gone
    deadline = asyncio.get_running_loop().time() + 10
    while (await states(agent))[accepted[1]] != "ended":
        assert asyncio.get_running_loop().time() < deadline, await states(agent)
        await asyncio.sleep(0.1)


async def test_a_sealed_run_runs_as_the_user_it_names(agent: NodeAgent, tmp_path: Path) -> None:
    items = [i async for i in run(agent, spec(tmp_path, "import os; print(os.getuid())"), "t-4")]
    assert items[-1][0] == "exited", items
    out = b"".join(i[2] for i in items if i[0] == "output")
    assert out == f"{pwd.getpwnam(USER).pw_uid}\n".encode(), items


async def test_requests_without_the_fleets_seal_or_for_root_are_refused_and_logged(
    agent: NodeAgent, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """What a caller who reached the agent without the fleet's token could send: nothing runs."""
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('x')"
    body = {"spec": {**spec(tmp_path, code), "cwd": str(tmp_path)}, "token": "t-5"}
    forged = auth.seal(b"not the fleet's token", "run", "solo", {**body, "user": USER})
    other_node = sealed("run", node="node9", **body, user=USER)
    attempts = {
        "unsigned": agent.run(body),  # the old agent's run(spec, token) shape
        "forged": agent.run(*forged),
        "replayed for another node": agent.run(*other_node),
        "as root": run(agent, body["spec"], "t-5", user="root"),
        "as uid 0": run(agent, body["spec"], "t-5", user="0"),
        "without an identity": agent.run(*sealed("run", **body)),
    }
    for what, gen in attempts.items():
        items = [i async for i in gen]
        assert [i[:2] for i in items] == [("error", "forbidden")], (what, items)
    with pytest.raises(KrexError, match="not signed"):
        await agent.cancel(*auth.seal(b"forged", "cancel", "solo", {"command": "1"}))
    with pytest.raises(KrexError, match="unsigned"):
        await agent.stop()
    assert agent.refused == len(attempts) + 2
    assert not marker.exists()
    assert await states(agent) == {}  # nothing reached the daemon
    err = capfd.readouterr().err
    assert err.count("krex node agent solo: refused") == agent.refused, err
    assert "refused run: the fleet runs no command as root" in err, err


async def test_an_agent_on_a_node_without_token_auth_acts_for_nobody(
    agent: NodeAgent, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAY_AUTH_MODE")
    bare = NodeAgent("solo", own=DaemonSpec(str(tmp_path), args=("--devices", "cpu:1")))
    items = [i async for i in bare.run(*sealed("run", spec=spec(tmp_path, "print(1)"), token="t", user=USER))]
    assert items[0][:2] == ("error", "forbidden") and "without token authentication" in items[0][2], items
