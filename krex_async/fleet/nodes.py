"""The fleet's nodes as its client sees them: one NodeAgent actor per alive Ray node, each node's
capacity view kept fresh, and every call to an agent asked again through Ray's blips.

    _add_agents: per alive node, an agent (named, detached, NodeAffinity-pinned), found or made
    refresh:     every refresh_s, each agent's capacity() ─► NodeView (up, devices, their commands)
    discover:    new nodes, and nodes back under their name (a dead agent's successor is made); paced
                 by discovery.DiscoverPace
    _ask:        an idempotent call (capacity, status, cancel, withdraw), asked again after BACKOFF's
                 pauses while its agent is only unavailable; a dead agent is dropped (_agent_gone)

FleetClient (client.py) stands on this to place and run commands; these are its node half.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from krex_async.client.submit import KrexError
from krex_async.fleet import auth
from krex_async.fleet.agent import DaemonSpec, NodeAgent
from krex_async.fleet.discovery import DiscoverPace
from krex_async.fleet.handle import why
from krex_async.fleet.placement import NodeView
from krex_async.fleet.raycluster import NAMESPACE, node_name

RemoteAgent = ray.remote(NodeAgent)
# Pauses between tries of a call to an agent that is unavailable (ActorUnavailableError: a network
# blip, a restart; Ray says the call may or may not have run), about 3 s in all; only ActorDiedError
# says the agent is gone.
BACKOFF = (0.1, 0.2, 0.4, 0.8, 1.6)
STATUS_S = 5.0  # an agent's status or capacity answer, at most (a stopped daemon never answers)


class FleetNodes:
    """The nodes' agents and views; the refresher task (`_task`) is started and ended by FleetClient."""

    def __init__(self, agents: dict[str, Any], refresh_s: float) -> None:
        self.agents = agents  # node name -> actor handle (none while a node's agent is dead)
        self.nodes: dict[str, NodeView] = {n: NodeView(n) for n in agents}
        self.refresh_s = refresh_s
        self._pinned: dict[str, str] = {}  # node name -> the Ray node id its agent was made on
        self._socket: str | None = None  # how agents made by this client reach their daemon
        self._daemon: DaemonSpec | None = None
        # How each node's agent reached its daemon, from its capacity reports: that node's next
        # agent is made the same way (not with this client's defaults, e.g. the default socket).
        self._how: dict[str, tuple[str | None, DaemonSpec | None]] = {}
        self._key = b""  # the fleet's key (the Ray token): seals every request that makes an agent act
        self._task: asyncio.Task[None] | None = None  # the refresher: done once closed

    @property
    def connected(self) -> bool:
        """As Client's: False once closed (the refresher ended)."""
        return self._task is not None and not self._task.done()

    def _sealed(self, method: str, name: str, **body: Any) -> tuple[bytes, str]:
        """A request for `name`'s agent, signed (auth.seal)."""
        return auth.seal(self._key, method, name, body)

    def _learn_how(self, name: str, how: Any) -> None:
        if not isinstance(how, dict):
            return  # an agent of an older krex
        own = how.get("own")
        spec = DaemonSpec(**{**own, "args": tuple(own["args"])}) if own else None
        self._how[name] = (None if spec else how.get("socket"), spec)

    def _add_agents(self, nodes: list[dict[str, Any]]) -> dict[str, Any]:
        """An agent on each alive node that has none here, or whose agent was made on a Ray node
        that is gone (the node came back under its name: a new Ray node id). An existing named agent
        is reused, with the socket or daemon it was made with. Returns the new ones by node name."""
        alive: dict[str, list[str]] = {}
        for node in sorted(nodes, key=node_name):
            if node.get("Alive"):
                alive.setdefault(node_name(node), []).append(node["NodeID"])
        new: dict[str, Any] = {}
        for name, ids in alive.items():
            if name in self.agents and self._pinned.get(name) in ids:
                continue
            socket, daemon = self._how.get(name, (self._socket, self._daemon))
            new[name] = RemoteAgent.options(
                name=f"krex-node-{name}",
                namespace=NAMESPACE,
                get_if_exists=True,
                lifetime="detached",
                num_cpus=0,
                max_restarts=0,
                max_task_retries=0,
                max_concurrency=10000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(ids[0], soft=False),
            ).remote(name, socket, daemon)
            self._pinned[name] = ids[0]
        for name, agent in new.items():
            self.agents[name] = agent
            view = self.nodes.setdefault(name, NodeView(name))
            view.up, view.reason = False, "its agent is new: waiting for its first capacity report"
        return new

    async def discover(self) -> list[str]:
        """Reach nodes that joined the Ray cluster since, or came back (same name, new agent);
        returns their names. The refresher calls it every `discover_every` refreshes, and sooner,
        backing off, while a node has no agent (discovery.py)."""
        nodes = await asyncio.to_thread(ray.nodes)
        return sorted(self._add_agents(nodes))

    async def _ask(self, name: str, method: str, *args: Any, timeout: float, agent: Any = None) -> Any:
        """Call an idempotent agent method (capacity, status, cancel, withdraw) on `name`'s agent
        (or the given incarnation), trying again after BACKOFF's pauses while the agent is only
        unavailable, all within `timeout`. An agent that died is dropped (discover() makes the
        node's next one). Raises what the last try raised, or KrexError when the node has no agent."""
        agent = agent if agent is not None else self.agents.get(name)
        if agent is None:
            reason = self.nodes[name].reason if name in self.nodes else "no such node"
            raise KrexError("unreachable", f"node {name} has no agent now ({reason})")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for pause in (*BACKOFF, None):
            try:
                return await asyncio.wait_for(getattr(agent, method).remote(*args), deadline - loop.time())
            except ActorUnavailableError:
                if pause is None or loop.time() + pause >= deadline:
                    raise
                await asyncio.sleep(pause)
            except RayActorError as e:  # ActorDiedError: that incarnation is gone for good
                self._agent_gone(name, agent, e)
                raise

    async def refresh(self) -> None:
        """Ask every agent for its capacity (STATUS_S each at most, an unavailable agent asked again
        within it); an agent that does not answer leaves its node down, saying why."""
        names = list(self.agents)
        reports = await asyncio.gather(
            *(self._ask(n, "capacity", timeout=STATUS_S) for n in names), return_exceptions=True
        )
        for name, rep in zip(names, reports):
            view = self.nodes[name]
            if isinstance(rep, BaseException):
                if not isinstance(rep, RayActorError) or name in self.agents:
                    view.up, view.reason = False, f"no capacity report: {why(rep)}"
                continue
            view.up, view.reason, view.devices = rep["up"], rep["reason"], rep["devices"]
            self._learn_how(name, rep.get("how"))

    async def _refresher(self, discover_every: int = 10) -> None:
        pace = DiscoverPace(discover_every)
        for tick in itertools.count(1):
            await asyncio.sleep(self.refresh_s)
            try:
                if pace.due(tick, self.nodes.keys() - self.agents.keys()):
                    await self.discover()
                await self.refresh()
            except Exception:  # a refresh that fails leaves the last views; the next one retries
                pass

    def unavailable(self) -> str:
        """Why no command can be placed now ("" when a node is up): for the gateway, which keeps its
        queue waiting rather than failing jobs a node would take once it is back."""
        if any(v.up for v in self.nodes.values()):
            return ""
        down = "; ".join(f"{n}: {v.reason or 'down'}" for n, v in sorted(self.nodes.items()))
        return f"no node of the fleet is up ({down or 'no nodes'})"

    async def capacity(self) -> dict[str, dict[str, Any]]:
        """Each node's capacity report as its agent gives it now (KrexError-free: down says why)."""
        names = list(self.nodes)
        reps = await asyncio.gather(
            *(self._ask(n, "capacity", timeout=60.0) for n in names), return_exceptions=True
        )
        return {
            n: r
            if not isinstance(r, BaseException)
            else {"node": n, "up": False, "reason": why(r), "devices": []}
            for n, r in zip(names, reps)
        }

    async def status(self) -> dict[str, Any]:
        """Every node's daemon status merged: devices and commands named by node, and `nodes` with
        each node's state. Nodes that do not answer (in STATUS_S) are listed down, with why."""
        names = list(self.nodes)
        sts = await asyncio.gather(
            *(self._ask(n, "status", timeout=STATUS_S) for n in names), return_exceptions=True
        )
        out: dict[str, Any] = {"policy": None, "devices": [], "commands": [], "nodes": []}
        for name, st in zip(names, sts):
            if isinstance(st, BaseException):
                out["nodes"].append({"node": name, "up": False, "reason": why(st)})
                continue
            out["policy"] = out["policy"] or st.get("policy")
            out["nodes"].append(
                {"node": name, "up": True, "pid": st.get("pid"), "isolation": st.get("isolation")}
            )
            for d in st.get("devices", []):
                out["devices"].append({**d, "node": name, "key": f"{name}/{d['key']}"})
            for c in st.get("commands", []):
                out["commands"].append(
                    {
                        **c,
                        "node": name,
                        "command": f"{name}/{c['command']}",
                        "device": f"{name}/{c['device']}",
                    }
                )
        return out

    def _node_lost(self, name: str, reason: str, agent: Any = None) -> None:
        """Place nothing more there until a capacity report says it is up again (news from an
        agent that is no longer the node's says nothing of its successor)."""
        if agent is not None and self.agents.get(name) is not agent:
            return
        view = self.nodes[name]
        view.up, view.reason = False, reason

    def _agent_gone(self, name: str, agent: Any, e: BaseException) -> None:
        """That incarnation of the node's agent died (or its node did): forget it, so discover()
        makes the next one when the node is back, under the same name."""
        if self.agents.get(name) is not agent:
            return
        del self.agents[name]
        self._pinned.pop(name, None)
        self._node_lost(name, f"its agent died ({why(e)}); waiting for the node to come back")

    async def stop_nodes(self) -> None:
        """Stop every agent (an owned daemon ends its commands) and remove the actors."""
        await asyncio.gather(
            *(a.stop.remote(*self._sealed("stop", n)) for n, a in self.agents.items()), return_exceptions=True
        )
        for a in self.agents.values():
            try:
                ray.kill(a)
            except RayError:
                pass
