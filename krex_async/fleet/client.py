"""The fleet client: `Client`'s shape over every node of a Ray cluster.

    async with await FleetClient.connect("auto") as fc:      # a Ray address, or "auto"
        h = await fc.submit(["python", "bench.py"], mem=8 << 30)
        async for stream, data in h.output():
            ...
        res = await h.wait()          # Result; res.report.state == "lost" if its node died

    connect: ray.init ─► one NodeAgent actor per alive node (named, detached, NodeAffinity-pinned)
    submit:  pick(node, device) from the capacity reports ─► agent.run(spec) (a streaming call)
    refresh: every refresh_s, each agent's capacity() ─► NodeView (up, devices, their commands)

Commands are named `<node>/<daemon's id>`, devices `<node>/<key>`. Each command has one result: the
daemon's report, or a report with state `lost` naming the node when its daemon or its actor died
while it ran; the other nodes go on. An agent call is never retried once the daemon accepted the
command (Ray actor tasks run at most once here), so no command runs twice.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import threading
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import msgspec
import ray
from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from krex_async import protocol as P
from krex_async.client.submit import KrexError, Result
from krex_async.devices import NoDevice
from krex_async.fleet.agent import DaemonSpec, NodeAgent
from krex_async.fleet.placement import NodeView, pick

NAMESPACE = "krex"
NODE_RESOURCE = "krex_node_"  # a custom resource "krex_node_<name>": <name> names the node
RemoteAgent = ray.remote(NodeAgent)


def node_name(node: dict[str, Any]) -> str:
    """A node's fleet name: from a `krex_node_<name>` resource, else its Ray node id's first 8."""
    for res in node.get("Resources", {}):
        if res.startswith(NODE_RESOURCE):
            return str(res[len(NODE_RESOURCE) :])
    return str(node["NodeID"][:8])


def join(address: str | None, options: dict[str, Any] | None = None) -> None:
    """ray.init, keeping this process's SIGTERM/SIGINT handlers: Ray's own would end the process
    (sys.exit) where a daemon or the gateway shuts down cleanly. KrexError when nobody answers.
    Already joined: nothing to do (two connects of one process, e.g. the gateway's job runner and
    its env view, both find Ray uninitialised before their address check, and join one after the
    other; ray.init a second time raises)."""
    if ray.is_initialized():
        return
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        ray.init(
            address=address,
            namespace=NAMESPACE,
            log_to_driver=False,
            configure_logging=False,
            **(options or {}),
        )
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise KrexError("unreachable", f"no Ray cluster at {address!r}: {e}") from None
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


async def reachable(address: str, timeout: float = 3.0) -> str:
    """The cluster's GCS host:port ("auto": the one this host last started, or $RAY_ADDRESS), once a
    TCP connect to it succeeds: ray.init would block minutes for a GCS that is not there."""
    from ray._private.services import canonicalize_bootstrap_address_or_die

    try:
        gcs = canonicalize_bootstrap_address_or_die(address)
        host, _, port = gcs.rpartition(":")
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), timeout)
        writer.close()
    except (TimeoutError, ConnectionError, OSError, ValueError) as e:
        raise KrexError("unreachable", f"no Ray cluster at {address!r}: {e or type(e).__name__}") from None
    return gcs


class FleetHandle:
    """One fleet command: `command` and `device` name its node; output() and wait() as
    CommandHandle's. A lost node ends it with a `lost` report instead of an exception."""

    def __init__(
        self, fleet: FleetClient, node: str, spec: dict[str, Any], gen: Any, accepted: tuple[Any, ...]
    ) -> None:
        self.client = fleet
        self.node = node
        self.daemon_command = str(accepted[1])
        self.command = f"{node}/{accepted[1]}"
        self.device = f"{node}/{accepted[2]}"
        self.queued = bool(accepted[3])
        self.pid: int | None = None  # on another node: not reported
        self._spec = spec
        self._error: KrexError | None = None
        self._gen = gen
        self._out = bytearray()
        self._err = bytearray()
        self._result: Result | None = None

    async def output(self) -> AsyncIterator[tuple[str, bytes]]:
        """Yield (stream, data) as the command writes, until it ends or its node is lost."""
        if self._error is not None:
            raise self._error
        while self._result is None:
            try:
                item = await (await self._gen.__anext__())
            except StopAsyncIteration:
                self._end(self._lost("its agent ended the stream without a result"))
                break
            except RayTaskError as e:  # a bug in the agent, not a lost node: say so
                self._fail(KrexError("fleet_error", f"node {self.node}: {e}"))
            except (RayActorError, NodeDiedError, ObjectLostError) as e:  # agent or node gone
                self.client._node_lost(self.node, f"its agent is gone ({type(e).__name__})")
                self._end(self._lost(f"its agent is gone ({type(e).__name__})"))
                break
            except RayError as e:  # the stream broke, the node may be fine: end the command
                await self._kill_quietly()
                self._end(
                    self._lost(f"its output stream failed ({type(e).__name__}: {e}); the command was killed")
                )
                break
            match item:
                case ("output", stream, data):
                    (self._out if stream == "stdout" else self._err).extend(data)
                    yield stream, data
                case ("exited", raw, out, err):
                    report = msgspec.msgpack.decode(raw, type=P.CommandReport)
                    self._out += out
                    self._err += err
                    self._end(msgspec.structs.replace(report, command=self.command, device=self.device))
                case ("lost", why):
                    self.client._node_lost(self.node, why)
                    self._end(self._lost(why))
                case ("error", code, message):
                    self._fail(KrexError(code, message))

    def _fail(self, error: KrexError) -> NoReturn:
        """No result will come (as Client's Error reply): every later output()/wait() raises."""
        self._error = error
        self.client._forget(self)
        raise error

    async def _kill_quietly(self) -> None:
        try:
            await asyncio.wait_for(self.client.cancel(self.command, signal.SIGKILL), 5.0)
        except (TimeoutError, KrexError, RayError):
            pass  # it ended, or its node went: either way nothing of it runs on

    def _lost(self, why: str) -> P.CommandReport:
        return P.CommandReport(
            command=self.command,
            argv=list(self._spec["argv"]),
            device=self.device,
            policy="",
            state="lost",
            error=why if why.startswith("node ") else f"node {self.node}: {why}",
            label=self._spec.get("label", ""),
        )

    def _end(self, report: P.CommandReport) -> None:
        self._result = Result(report, bytes(self._out), bytes(self._err))
        self.client._forget(self)

    async def wait(self) -> Result:
        async for _ in self.output():
            pass
        assert self._result is not None
        return self._result

    async def cancel(self, sig: int = signal.SIGTERM) -> None:
        await self.client.cancel(self.command, sig)


class FleetClient:
    """Places commands on the nodes of a Ray cluster. One per process; close() ends the refresher
    and cancels commands submitted with on_disconnect="kill"."""

    def __init__(self, agents: dict[str, Any], refresh_s: float) -> None:
        self.agents = agents  # node name -> actor handle
        self.nodes: dict[str, NodeView] = {n: NodeView(n) for n in agents}
        self.lost: list[str] = []  # names of commands reported lost, in order
        self.refresh_s = refresh_s
        self._handles: dict[str, FleetHandle] = {}  # in flight, by fleet command name
        self._kill_on_close: set[str] = set()
        self._pending = itertools.count(1)
        self._socket: str | None = None  # how agents made by this client reach their daemon
        self._daemon: DaemonSpec | None = None
        self._task: asyncio.Task[None] | None = None  # the refresher: done once closed
        self.welcome: P.Welcome | None = None  # as Client's; policy: the nodes' policies

    @classmethod
    async def connect(
        cls,
        address: str | None = "auto",
        *,
        socket: str | None = None,
        daemon: DaemonSpec | None = None,
        refresh_s: float = 1.0,
        ray_options: dict[str, Any] | None = None,
    ) -> FleetClient:
        """Join the Ray cluster at `address` (already joined: reused) and reach an agent on every
        alive node, creating it where there is none: it connects to `socket` (default: the node's
        krex socket) or, with `daemon`, starts and owns the node's daemon. Raises KrexError
        ('unreachable', ...) when no Ray cluster answers or no node's daemon does."""
        if not ray.is_initialized():
            if address is not None and "://" not in address:  # not a Ray client address
                address = await reachable(address)
            join(address, ray_options)
        self = cls({}, refresh_s)
        self._socket, self._daemon = socket, daemon
        agents = self._add_agents(ray.nodes())
        hellos = await asyncio.gather(*(a.hello.remote() for a in agents.values()), return_exceptions=True)
        await self.refresh()
        if not any(v.up for v in self.nodes.values()):
            why = "; ".join(f"{n}: {h}" for n, h in zip(agents, hellos))
            raise KrexError("unreachable", f"no node's krex daemon answers ({why or 'no nodes'})")
        policies = sorted({h["policy"] for h in hellos if isinstance(h, dict)})
        self.welcome = P.Welcome(
            id=0, version=P.PROTOCOL_VERSION, server="krex fleet", policy=",".join(policies)
        )
        self._task = asyncio.get_running_loop().create_task(self._refresher())
        return self

    def _add_agents(self, nodes: list[dict[str, Any]]) -> dict[str, Any]:
        """An agent on each alive node that has none here yet (an existing named agent is reused,
        with the socket or daemon it was made with); returns the new ones by node name."""
        new: dict[str, Any] = {}
        for node in sorted(nodes, key=node_name):
            name = node_name(node)
            if not node.get("Alive") or name in self.agents:
                continue
            new[name] = RemoteAgent.options(
                name=f"krex-node-{name}",
                namespace=NAMESPACE,
                get_if_exists=True,
                lifetime="detached",
                num_cpus=0,
                max_restarts=0,
                max_task_retries=0,
                max_concurrency=10000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
            ).remote(name, self._socket, self._daemon)
        for name, agent in new.items():
            self.agents[name] = agent
            self.nodes[name] = NodeView(name)
        return new

    async def discover(self) -> list[str]:
        """Reach nodes that joined the Ray cluster since; returns their names. The refresher
        calls it every `discover_every` refreshes."""
        nodes = await asyncio.to_thread(ray.nodes)
        return sorted(self._add_agents(nodes))

    async def __aenter__(self) -> FleetClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def refresh(self) -> None:
        """Ask every agent for its capacity (2 s each at most); an agent that fails is down."""
        names = list(self.agents)
        reports = await asyncio.gather(
            *(asyncio.wait_for(self.agents[n].capacity.remote(), 2.0) for n in names), return_exceptions=True
        )
        for name, rep in zip(names, reports):
            view = self.nodes[name]
            if isinstance(rep, BaseException):
                view.up, view.reason = False, f"no capacity report: {type(rep).__name__} {rep}"
                continue
            view.up, view.reason, view.devices = rep["up"], rep["reason"], rep["devices"]

    async def _refresher(self, discover_every: int = 10) -> None:
        for tick in itertools.count(1):
            await asyncio.sleep(self.refresh_s)
            try:
                if tick % discover_every == 0:
                    await self.discover()
                await self.refresh()
            except Exception:  # a refresh that fails leaves the last views; the next one retries
                pass

    async def capacity(self) -> dict[str, dict[str, Any]]:
        """Each node's capacity report as its agent gives it now (KrexError-free: down says why)."""
        names = list(self.agents)
        reps = await asyncio.gather(
            *(self.agents[n].capacity.remote() for n in names), return_exceptions=True
        )
        return {
            n: (
                r
                if not isinstance(r, BaseException)
                else {"node": n, "up": False, "reason": repr(r), "devices": []}
            )
            for n, r in zip(names, reps)
        }

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
        run_as: int | None = None,
    ) -> FleetHandle:
        """Place and start a command (as Client.submit; `node` pins it to one node; `run_as`, for
        a root client such as the gateway, runs it as that uid on the node). env=None
        passes this process's environment; cwd must exist on the node that runs it. A node whose
        agent or daemon is gone before accepting is marked down and the next node is tried."""
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
            "run_as": run_as,
        }
        while True:
            try:
                name, key = pick(list(self.nodes.values()), mem, str(device), node)
            except NoDevice as e:
                down = not any(v.up for v in self.nodes.values())
                raise KrexError("unreachable" if down else "bad_device", str(e)) from None
            # Counted on its device from now, so concurrent submits spread before any is accepted.
            ours = self.nodes[name].ours.setdefault(key, set())
            pending = f"pending-{next(self._pending)}"
            ours.add(pending)
            try:
                gen = self.agents[name].run.remote({**spec, "device": key})
                first = await (await gen.__anext__())
            except RayTaskError as e:
                raise KrexError("fleet_error", f"node {name}: {e}") from None
            except (RayError, StopAsyncIteration) as e:
                self._node_lost(name, f"its agent is gone ({type(e).__name__})")
                continue
            finally:
                ours.discard(pending)
            if first[0] == "error" and first[1] in ("unreachable", "disconnected"):
                self._node_lost(name, first[2])  # not accepted there: the next node may take it
                continue
            if first[0] == "error":
                raise KrexError(first[1], f"node {name}: {first[2]}")
            h = FleetHandle(self, name, spec, gen, first)
            self.nodes[name].ours.setdefault(str(first[2]), set()).add(h.daemon_command)
            self._handles[h.command] = h
            if on_disconnect == "kill":
                self._kill_on_close.add(h.command)
            return h

    async def run(self, argv: list[str], **kw: Any) -> Result:
        return await (await self.submit(argv, **kw)).wait()

    async def cancel(self, command: str, sig: int = signal.SIGTERM) -> None:
        """Signal a fleet command (`<node>/<id>`). KrexError when it or its node is unknown."""
        name, sep, cid = command.partition("/")
        if not sep or name not in self.agents:
            raise KrexError(
                "unknown_command", f"no command {command!r} in the fleet (fleet commands are named NODE/ID)"
            )
        try:
            await self.agents[name].cancel.remote(cid, sig)
        except RayTaskError as e:
            cause = e.cause if isinstance(e.cause, KrexError) else None
            raise (cause or KrexError("fleet_error", str(e))) from None
        except RayActorError as e:
            raise KrexError("lost", f"node {name} is gone ({type(e).__name__})") from None

    async def status(self) -> dict[str, Any]:
        """Every node's daemon status merged: devices and commands named by node, and `nodes` with
        each node's state. Nodes that do not answer are listed down, with why."""
        names = list(self.agents)
        sts = await asyncio.gather(*(self.agents[n].status.remote() for n in names), return_exceptions=True)
        out: dict[str, Any] = {"policy": None, "devices": [], "commands": [], "nodes": []}
        for name, st in zip(names, sts):
            if isinstance(st, BaseException):
                out["nodes"].append({"node": name, "up": False, "reason": str(st)})
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

    def _node_lost(self, name: str, why: str) -> None:
        """Place nothing more there until a capacity report says it is up again."""
        view = self.nodes[name]
        view.up, view.reason = False, why

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
            except (TimeoutError, KrexError):
                pass  # it ended meanwhile, or its node is gone

    async def stop_nodes(self) -> None:
        """Stop every agent (an owned daemon ends its commands) and remove the actors."""
        await asyncio.gather(*(a.stop.remote() for a in self.agents.values()), return_exceptions=True)
        for a in self.agents.values():
            try:
                ray.kill(a)
            except RayError:
                pass
