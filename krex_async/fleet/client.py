"""The fleet client: `Client`'s shape over every node of a Ray cluster.

    async with await FleetClient.connect("auto") as fc:      # a Ray address, or "auto"
        h = await fc.submit(["python", "bench.py"], mem=8 << 30)
        async for stream, data in h.output():
            ...
        res = await h.wait()          # Result; res.report.state == "lost" if its node died

    connect:  ray.init ─► one NodeAgent actor per alive node (named, detached, NodeAffinity-pinned)
    submit:   pick(node, device) from the capacity reports ─► agent.run(spec, token) (streamed)
    refresh, discover, capacity, status: the nodes' half (nodes.FleetNodes, which this extends)

Commands are named `<node>/<daemon's id>`, devices `<node>/<key>`. Each command has one result: the
daemon's report, or a report with state `lost` naming the node when its daemon or its actor died
while it ran; the other nodes go on. Ray's ActorUnavailableError (a blip: the call may or may not
have run) is not a death: idempotent calls are asked again (BACKOFF); a run() is never sent again
unless its agent says (withdraw) that it never started, so no command runs twice.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import signal
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayError, RayTaskError

from krex_async import protocol as P
from krex_async.client.submit import KrexError, Result
from krex_async.devices import NoDevice
from krex_async.fleet import auth
from krex_async.fleet.agent import DaemonSpec
from krex_async.fleet.handle import FleetHandle, why
from krex_async.fleet.nodes import BACKOFF, FleetNodes
from krex_async.fleet.placement import pick
from krex_async.fleet.raycluster import NAMESPACE, NODE_RESOURCE, join, node_name, reachable

__all__ = ["NAMESPACE", "NODE_RESOURCE", "FleetClient", "FleetHandle", "join", "node_name", "reachable"]


class FleetClient(FleetNodes):
    """Places commands on the nodes of a Ray cluster. One per process; close() ends the refresher
    and cancels commands submitted with on_disconnect="kill"."""

    def __init__(self, agents: dict[str, Any], refresh_s: float) -> None:
        super().__init__(agents, refresh_s)
        self.lost: list[str] = []  # names of commands reported lost, in order
        self._handles: dict[str, FleetHandle] = {}  # in flight, by fleet command name
        self._kill_on_close: set[str] = set()
        self._pending = itertools.count(1)
        self._tokens = itertools.count(1)  # run() tokens, unique to this client: withdraw() names one
        self._token_base = secrets.token_hex(6)
        self.welcome: P.Welcome | None = None  # as Client's; policy: the nodes' policies
        self._user = ""  # who the commands run as on the nodes (auth.identity)

    @classmethod
    async def connect(
        cls,
        address: str | None = "auto",
        *,
        socket: str | None = None,
        daemon: DaemonSpec | None = None,
        refresh_s: float = 1.0,
        ray_options: dict[str, Any] | None = None,
        token_file: str | None = None,
        run_as: str | int | None = None,
    ) -> FleetClient:
        """Join the Ray cluster at `address` ("auto" or None: found as clustertrust says; already
        joined: reused) with Ray's token authentication, the token in `token_file` (default:
        auth.default_token_file()), and reach an agent on every alive node, creating it where
        there is none: it connects to `socket` (default: the node's krex socket) or, with
        `daemon`, starts and owns the node's daemon.
        Commands run on the nodes as `run_as` (a user name or uid, never root; default: this
        process's user, or $KREX_FLEET_RUN_AS for root). Raises KrexError ('unreachable', ...) when
        no Ray cluster answers or no node's daemon does; ('untrusted', ...), nothing sent, when the
        process that accepts the connection on this host is another user's; ('bad_token' |
        'forbidden', ...) for a token file that is missing or readable by others, or no user to
        run as."""
        try:
            user = auth.identity(run_as)
        except KrexError:
            if run_as is not None:
                raise
            user = ""  # a root client (the gateway) names one at each submit
        path = token_file or auth.default_token_file()
        if ray.is_initialized():
            key = auth.read_token(path)
        else:
            key = auth.use_token(path)
            # never Ray's None, which reads an address file anyone may write; a Ray client's
            # ray:// address too: its server hears the token
            address = await reachable(address or "auto")
            join(address, ray_options)
        self = cls({}, refresh_s)
        self._socket, self._daemon, self._key, self._user = socket, daemon, key, user
        agents = self._add_agents(ray.nodes())
        hellos = await asyncio.gather(*(a.hello.remote() for a in agents.values()), return_exceptions=True)
        await self.refresh()
        if not any(v.up for v in self.nodes.values()):
            reasons = "; ".join(f"{n}: {h}" for n, h in zip(agents, hellos))
            raise KrexError("unreachable", f"no node's krex daemon answers ({reasons or 'no nodes'})")
        policies = sorted({h["policy"] for h in hellos if isinstance(h, dict)})
        self.welcome = P.Welcome(
            id=0, version=P.PROTOCOL_VERSION, server="krex fleet", policy=",".join(policies)
        )
        self._task = asyncio.get_running_loop().create_task(self._refresher())
        return self

    async def __aenter__(self) -> FleetClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def submit(
        self,
        argv: list[str],
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        device: str | int = "auto",
        timeout: float | None = None,
        mem: int = 0,
        stdin: bytes | None = None,
        on_disconnect: str = "kill",
        label: str = "",
        stream: bool = True,
        node: str | None = None,
        run_as: str | int | None = None,
    ) -> FleetHandle:
        """Place and start a command (as Client.submit; `node` pins it to one node; `run_as` runs it
        as that uid (or user name) on the node instead of the client's user; never root). env=None
        passes this process's environment; cwd must exist on the node that runs it. A node whose
        agent or daemon is gone before accepting is marked down and the next node is tried; one
        whose agent is unavailable as it answers is asked (withdraw) whether the command started:
        if not, it is placed again; if so, it is killed there and KrexError says so."""
        spec = {
            "argv": list(argv),
            "cwd": cwd or os.getcwd(),
            "env": dict(os.environ) if env is None else env,
            "timeout": timeout,
            "mem": mem,
            "stdin": stdin,
            "on_disconnect": on_disconnect,
            "label": label,
            "stream": stream,
        }
        user = self._user if run_as is None else auth.identity(run_as)
        user = user or auth.identity(None)  # raises: a root client named nobody to run as
        pauses = iter(BACKOFF)
        while True:
            try:
                name, key = pick(list(self.nodes.values()), mem, str(device), node)
            except NoDevice as e:
                down = not any(v.up for v in self.nodes.values())
                raise KrexError("unreachable" if down else "bad_device", str(e)) from None
            agent = self.agents[name]
            # Counted on its device from now, so concurrent submits spread before any is accepted.
            ours = self.nodes[name].ours.setdefault(key, set())
            pending = f"pending-{next(self._pending)}"
            token = f"{self._token_base}-{next(self._tokens)}"
            ours.add(pending)
            try:
                gen = agent.run.remote(
                    *self._sealed("run", name, spec={**spec, "device": key}, token=token, user=user)
                )
                first = await (await gen.__anext__())
            except RayTaskError as e:
                raise KrexError("fleet_error", f"node {name}: {e}") from None
            except ActorUnavailableError as e:  # it may or may not have reached the agent
                await self._withdraw(name, agent, token, e)  # raises unless it never started
                pause = next(pauses, None)
                if pause is None:
                    self._node_lost(name, f"its agent stays unavailable ({why(e)})", agent)
                else:
                    await asyncio.sleep(pause)
                continue
            except (RayError, StopAsyncIteration) as e:
                # Gone before it answered: the daemon kills what a lost connection submitted with
                # on_disconnect="kill", so only those may go elsewhere without running twice.
                self._agent_gone(name, agent, e)
                if on_disconnect != "kill":
                    raise KrexError(
                        "lost", f"node {name}: its agent died as it was given the command ({why(e)})"
                    ) from None
                continue
            finally:
                ours.discard(pending)
            if first[0] == "error" and first[1] in ("unreachable", "disconnected"):
                self._node_lost(name, first[2], agent)  # not accepted there: the next node may take it
                continue
            if first[0] == "error":
                raise KrexError(first[1], f"node {name}: {first[2]}")
            h = FleetHandle(self, name, agent, spec, gen, first)
            self.nodes[name].ours.setdefault(str(first[2]), set()).add(h.daemon_command)
            self._handles[h.command] = h
            if on_disconnect == "kill":
                self._kill_on_close.add(h.command)
            return h

    async def _withdraw(self, name: str, agent: Any, token: str, cause: BaseException) -> None:
        """After run(token) broke before its first answer: fence the token on that agent. Returns
        when no command started there (it may be placed again); raises KrexError when one did (it
        is killed there) or when the agent cannot say: never a second run."""
        try:
            sealed = self._sealed("withdraw", name, token=token)
            reached = await self._ask(name, "withdraw", *sealed, timeout=10.0, agent=agent)
        except (RayError, KrexError, TimeoutError) as e:
            raise KrexError(
                "fleet_error",
                f"node {name}: its agent became unavailable ({why(cause)}) as the command was "
                f"submitted and cannot say whether it started ({why(e)}); it is not submitted again",
            ) from None
        if reached:
            raise KrexError(
                "fleet_error",
                f"node {name}: its agent became unavailable ({why(cause)}) as it took the command; "
                "the command was killed there and is not submitted again",
            )

    async def run(self, argv: list[str], **kw: Any) -> Result:
        return await (await self.submit(argv, **kw)).wait()

    CANCEL_S = 30.0  # a cancel's answer, at most: an agent or daemon that hangs (stopped) never answers

    async def cancel(self, command: str, sig: int = signal.SIGTERM, queued_only: bool = False) -> None:
        """Signal a fleet command (`<node>/<id>`), through the agent that runs it (`queued_only`: as
        Client.cancel's). KrexError when it or its node is unknown, its agent is gone, or it did not
        answer within CANCEL_S (as Client.cancel's callers expect: nothing else reaches them)."""
        name, sep, cid = command.partition("/")
        if not sep or name not in self.nodes:
            raise KrexError(
                "unknown_command", f"no command {command!r} in the fleet (fleet commands are named NODE/ID)"
            )
        h = self._handles.get(command)
        try:
            sealed = self._sealed("cancel", name, command=cid, sig=int(sig), queued_only=queued_only)
            await self._ask(name, "cancel", *sealed, timeout=self.CANCEL_S, agent=h.agent if h else None)
        except RayTaskError as e:
            cause = e.cause if isinstance(e.cause, KrexError) else None
            raise (cause or KrexError("fleet_error", str(e))) from None
        except RayActorError as e:
            raise KrexError("lost", f"node {name}: its agent is gone ({why(e)})") from None
        except (TimeoutError, ActorUnavailableError) as e:  # hung, or unreachable past the retries
            raise KrexError(
                "unreachable", f"node {name}: no answer to the cancel within {self.CANCEL_S:g} s ({why(e)})"
            ) from None

    def _forget(self, h: FleetHandle) -> None:
        if self._handles.pop(h.command, None) is None:
            return
        self._kill_on_close.discard(h.command)
        for ids in self.nodes[h.node].ours.values():
            ids.discard(h.daemon_command)
        if h._result is not None and h._result.report.state == "lost":
            self.lost.append(h.command)

    async def close(self) -> None:
        """Stop refreshing; cancel (SIGKILL) the commands submitted with on_disconnect='kill'."""
        if self._task is not None:
            self._task.cancel()
        for command in list(self._kill_on_close):
            try:
                await asyncio.wait_for(self.cancel(command, signal.SIGKILL), 5.0)
            except (TimeoutError, KrexError, RayError):
                pass  # it ended meanwhile, or its node is gone
