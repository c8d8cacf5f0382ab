"""The node agent: one Ray actor per node that owns or reaches that node's daemon.

    FleetClient ──ray actor call──► NodeAgent (pinned to its node) ──Client (Unix socket)──► krex daemon
                 ◄─streamed items──   run(): accepted, output..., exited | lost | error

The agent is an async actor (`num_cpus=0`, so it takes no slot from Ray's own work): every call runs
on its event loop, and many commands run at once over its one daemon connection. It owns its daemon
when given a DaemonSpec (the local fleet of `krex fleet demo` and the tests, unless its root process
keeps the daemons: DaemonSpec.start), else it connects to the node's socket (a DaemonSet on
Kubernetes, a systemd unit). An owned daemon is started again on the same state dir when it dies:
that daemon's start-up sweep ends what the dead one left running.

Every call that makes the agent act (run, cancel, withdraw, stop) is sealed with the fleet's key
(auth.py): one without a valid seal is refused and logged, and a run's identity maps to the
unprivileged user its command runs as (the daemon's run_as; never root).

Nothing here imports Ray: fleet/client.py wraps NodeAgent with `ray.remote`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket as socketlib
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, NoReturn

import msgspec

from krex_async.client.submit import Client, KrexError
from krex_async.fleet import auth
from krex_async.protocol import default_socket

# Started between fork and exec of the daemon: the daemon gets SIGTERM (and so ends its commands and
# thaws what it froze) when the agent's process dies, even by SIGKILL. A plain exec wrapper rather
# than preexec_fn, which is unsafe in a threaded process such as a Ray worker.
_PDEATHSIG = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "os.getppid() == int(sys.argv[1]) or sys.exit(1)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


@dataclass(frozen=True)
class DaemonSpec:
    """How an agent starts its node's daemon: socket, state dir and log under `<base_dir>/<node>/`."""

    base_dir: str
    args: tuple[str, ...] = ("--devices", "cpu:2")
    cgroup: bool = True  # as root on cgroup v2: a private cgroup root of its own, removed at stop
    restart: bool = True  # start it again (same state dir) when it dies
    # False: the agent only reaches the daemon at <base_dir>/<node>/s; someone else (the local
    # fleet as root, whose Ray runs as an unprivileged user: fleet/rayuser.py) starts and keeps it
    start: bool = True


class OwnedDaemon:
    """A `krex serve` child of the agent's process. stop() blocks (call it on a thread)."""

    def __init__(self, spec: DaemonSpec, node: str) -> None:
        self.spec = spec
        self.dir = os.path.join(spec.base_dir, node)
        self.socket = os.path.join(self.dir, "s")  # short: AF_UNIX paths stop near 108 bytes
        self.proc: subprocess.Popen[bytes] | None = None
        self.cgroup: str | None = None
        self.starts = 0

    def alive(self) -> bool:
        """Running; True when it is not ours to start (a connection to it says whether it is up)."""
        return not self.spec.start or (self.proc is not None and self.proc.poll() is None)

    async def start(self, timeout: float = 30.0) -> None:
        """Start the daemon and wait for its socket. Raises RuntimeError with its log's tail.

        Spawned from the event loop's thread, which lives as long as the agent: the death signal
        is tied to the thread that forked, not the process."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        if "--socket-group" in self.spec.args:  # its commands' users reach the socket: let them pass
            os.chmod(self.dir, 0o711)
        args = list(self.spec.args)
        if self.spec.cgroup and "--cgroup-root" not in args and self.cgroup is None:
            self.cgroup = _private_cgroup()
            if self.cgroup is not None:  # for whoever cleans up after a dead agent (LocalFleet);
                # a line each: a node back under its name has a new agent, and its own root
                with open(os.path.join(self.dir, "cgroup"), "a") as f:
                    f.write(self.cgroup + "\n")
        if self.cgroup is not None and "--cgroup-root" not in args:
            args += ["--cgroup-root", self.cgroup]
        if "--probes" not in args:
            args += ["--probes", "off"]  # one probe set per host is plenty; a node may ask for them
        log = os.path.join(self.dir, "daemon.log")
        env = {k: v for k, v in os.environ.items() if k != "KREX_SOCKET"}
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _PDEATHSIG,
                    str(os.getpid()),
                    "-m",
                    "krex_async",
                    "serve",
                    "--socket",
                    self.socket,
                    "--state-dir",
                    os.path.join(self.dir, "state"),
                    "--log-format",
                    "json",
                    *args,
                ],
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.starts += 1
        deadline = time.monotonic() + timeout
        while not _listening(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                await asyncio.to_thread(self.stop)
                raise RuntimeError(f"the node's daemon did not start (see {log}): {_tail(log)}")
            await asyncio.sleep(0.02)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (the daemon ends its commands and thaws), SIGKILL after `timeout`; then the
        private cgroup root is removed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.cgroup is not None:
            remove_cgroup(self.cgroup)
            self.cgroup = None


def _listening(path: str) -> bool:
    s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - n))
            return f.read().decode(errors="replace")
    except OSError as e:
        return f"(no log: {e})"


def _private_cgroup() -> str | None:
    """A fresh v2 cgroup for one daemon, so the daemons of one host never sweep each other's
    commands; None where the cgroup backend cannot run (not root, no v2)."""
    from krex_async.ops.cleanup import v2_mount

    mount = v2_mount()
    if os.geteuid() != 0 or mount is None:
        return None
    return tempfile.mkdtemp(prefix="krex-fleet-", dir=mount)


def remove_cgroup(path: str) -> None:
    """rmdir the tree leaf first, and its v1 cpuset twin on a hybrid host (cgroup directories
    hold only kernel files)."""
    tops = [path]
    if "/unified/" in path:
        tops.append(path.replace("/unified/", "/cpuset/", 1))
    for top in tops:
        for dirpath, _, _ in sorted(os.walk(top), key=lambda t: -t[0].count("/")):
            try:
                os.rmdir(dirpath)
            except OSError:
                pass


def summarize(name: str, status: dict[str, Any]) -> dict[str, Any]:
    """A capacity report from a daemon's status: devices with their commands, free memory and
    regions; running and queued commands; regions held or waiting."""
    live = [c for c in status.get("commands", []) if c.get("state") != "ended"]
    region_policy = status.get("policy") == "region"
    devices = []
    for d in status.get("devices", []):
        devices.append(
            {
                "key": d["key"],
                "index": d.get("index"),
                "vendor": d.get("vendor"),
                "name": d.get("name"),
                "memory_total_bytes": d.get("memory_total_bytes") or 0,
                "memory_free_bytes": d.get("memory_free_bytes") or 0,
                "commands": [c["command"] for c in live if c.get("device") == d["key"]],
                "region": (d.get("region") or {}).get("name"),
                "regions_queued": len(d.get("queued") or []) if region_policy else 0,
            }
        )
    return {
        "node": name,
        "up": True,
        "reason": "",
        "policy": status.get("policy"),
        "daemon_pid": status.get("pid"),
        "devices": devices,
        "running": sum(c.get("state") in ("starting", "running") for c in live),
        "queued": sum(c.get("state") == "queued" for c in live),
        "regions": sum((d["region"] is not None) + d["regions_queued"] for d in devices),
    }


class NodeAgent:
    """The actor's body. Every method is a coroutine on the actor's loop; none raises for a daemon
    that is away: capacity() says `up: False` and why, run() ends with ("lost", why)."""

    def __init__(self, name: str, socket: str | None = None, own: DaemonSpec | None = None) -> None:
        self.name = name
        self.owned = OwnedDaemon(own, name) if own is not None else None
        self.socket = self.owned.socket if self.owned else (socket or default_socket())
        self.client: Client | None = None
        self._lock = asyncio.Lock()
        self._stopped = False
        # run() tokens: the command each started ("" until accepted), and those a client withdrew
        # after its call broke before an answer (a late run() with one is refused: never run twice).
        self._runs: dict[str, str] = {}
        self._withdrawn: set[str] = set()
        self._kills: set[asyncio.Task[None]] = set()
        self._key = auth.node_key()  # None: this node's Ray runs without a token; nothing is done
        self.refused = 0  # requests refused (unsigned, forged, or for root)

    def _open(self, method: str, raw: Any, mac: Any) -> dict[str, Any]:
        """A sealed request's body; KrexError('forbidden', ...) refused, and logged to the agent's
        stderr (the Ray worker's log on its node)."""
        try:
            return auth.open_sealed(self._key, method, self.name, raw, mac)
        except KrexError as e:
            self._refuse(method, e)

    def _refuse(self, method: str, e: KrexError) -> NoReturn:
        self.refused += 1
        print(f"krex node agent {self.name}: refused {method}: {e.message}", file=sys.stderr, flush=True)
        raise e

    async def _client(self) -> Client:
        """The daemon connection, made again if it was lost (an owned daemon that died is started
        again first). Raises KrexError('unreachable', ...)."""
        async with self._lock:
            c = self.client
            if c is not None and c.connected:
                return c
            self.client = None
            if c is not None:
                await c.close()
            if self._stopped:
                raise KrexError("unreachable", f"node {self.name} is stopping")
            owned = self.owned
            if owned is not None and not owned.alive():
                if owned.starts and not owned.spec.restart:
                    raise KrexError("unreachable", f"the daemon of node {self.name} died")
                try:
                    await owned.start()
                except RuntimeError as e:
                    raise KrexError("unreachable", str(e)) from None
            self.client = await Client.connect(self.socket, timeout=5)
            return self.client

    async def hello(self) -> dict[str, Any]:
        """Who and where this agent is; starts or reaches the daemon (KrexError if it cannot)."""
        c = await self._client()
        return {
            "node": self.name,
            "host": socketlib.gethostname(),
            "pid": os.getpid(),
            "socket": self.socket,
            "policy": c.welcome.policy if c.welcome else "",
            "daemon_pid": self.owned.proc.pid if self.owned and self.owned.proc else None,
        }

    def how(self) -> dict[str, Any]:
        """How this agent reaches its daemon: a client makes the node's next agent (one that comes
        back after this one died) the same way, rather than with its own defaults."""
        own = self.owned.spec if self.owned else None
        return {"socket": self.socket, "own": dataclasses.asdict(own) if own else None}

    async def capacity(self) -> dict[str, Any]:
        try:
            c = await self._client()
            rep = summarize(self.name, await c.status())
        except KrexError as e:
            rep = {"node": self.name, "up": False, "reason": e.message, "devices": []}
        return {**rep, "how": self.how(), "refused": self.refused, "signed": self._key is not None}

    async def status(self) -> dict[str, Any]:
        """The daemon's own status (KrexError if it is away)."""
        return await (await self._client()).status()

    async def run(self, request: Any, mac: Any = None) -> AsyncIterator[tuple[Any, ...]]:
        """A sealed run (auth.seal: {"spec": Client.submit's arguments, "token": .., "user": ..}):
        refused, as ("error", "forbidden", why), unless signed with the fleet's key and for a user
        of this node who is not root; else _run() as that user."""
        try:
            body = self._open("run", request, mac)
            try:
                spec, token = dict(body["spec"]), str(body.get("token", ""))
                spec["run_as"] = auth.node_uid(body.get("user"))
            except (KeyError, TypeError, ValueError) as e:
                self._refuse("run", KrexError("forbidden", f"a malformed run request ({e!r})"))
            except KrexError as e:  # no identity, root, or a user unknown here
                self._refuse("run", e)
        except KrexError as e:
            yield ("error", "forbidden", f"node {self.name}: {e.message}")
            return
        gen = self._run(spec, token)
        try:
            async for item in gen:
                yield item
        finally:  # closed early by Ray (its caller gone): the inner run's own finally kills it now
            await gen.aclose()

    async def _run(self, spec: dict[str, Any], token: str) -> AsyncGenerator[tuple[Any, ...], None]:
        """Submit one command and stream what happens to it, as tuples:
        ("accepted", command, device, queued), ("started", pid) and ("output", stream, data)...,
        then exactly one of ("exited", report msgpack, stdout tail, stderr tail), ("lost", why),
        ("error", code, msg).

        `token` names this call for withdraw(). A stream its caller abandons before the end (Ray
        closes the generator) kills a command submitted with on_disconnect="kill", as the daemon
        does when a client's connection drops: nobody would get its result."""
        if token in self._withdrawn:
            yield ("error", "withdrawn", f"node {self.name}: this submission was withdrawn; not run")
            return
        if token:
            self._runs[token] = ""
        command = ""
        try:
            try:
                h = await (await self._client()).submit(**spec)
            except KrexError as e:
                yield ("error", e.code, e.message)
                return
            command = h.command
            if token in self._withdrawn:  # withdrawn while the daemon accepted it
                self._kill_later(command)
                command = ""
                yield ("error", "withdrawn", f"node {self.name}: this submission was withdrawn; killed")
                return
            if token:
                self._runs[token] = command
            yield ("accepted", h.command, h.device, h.queued)
            # keep=False: forwarded as it comes; the handle would keep a second copy
            async for stream, data in h.output(started=True, keep=False):
                if stream == "started":  # a queued command's start: its job's timeout runs from it
                    yield ("started", h.pid)
                    continue
                yield ("output", stream, data)
            res = await h.wait()
            command = ""  # ended: nothing left to kill
        except KrexError as e:
            command = ""  # the daemon ended it, or its connection did (which kills it)
            if e.code != "disconnected":
                yield ("error", e.code, e.message)
                return
            yield ("lost", f"node {self.name}: its daemon went away while {h.command} ran")
            return
        finally:
            self._runs.pop(token, None)
            if command and spec.get("on_disconnect", "kill") == "kill":
                self._kill_later(command)  # closed early, its caller gone: a result nobody reads
        yield ("exited", msgspec.msgpack.encode(res.report), res.stdout, res.stderr)

    async def withdraw(self, request: Any, mac: Any = None) -> bool:
        """A sealed {"token": ..}. For a client whose run(token) broke before its first answer
        (ActorUnavailableError: it may or may not have reached this agent). Fences the token, so a
        run() still on its way is refused, and kills the command it started, if any. True when a
        run(token) reached here."""
        token = str(self._open("withdraw", request, mac).get("token", ""))
        self._withdrawn.add(token)
        command = self._runs.get(token)
        if command:
            self._kill_later(command)
        return command is not None

    def _kill_later(self, command: str) -> None:
        """SIGKILL a command off the caller's path (from a generator's finally, which cannot wait)."""

        async def kill() -> None:
            try:
                await (await self._client()).cancel(command, signal.SIGKILL)
            except KrexError:
                pass  # it ended meanwhile, or its daemon did (and so did it)

        task = asyncio.get_running_loop().create_task(kill())
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    async def cancel(self, request: Any, mac: Any = None) -> None:
        """A sealed {"command": .., "sig": .., "queued_only": ..}: Client.cancel on this node."""
        body = self._open("cancel", request, mac)
        sig, queued_only = int(body.get("sig", signal.SIGTERM)), bool(body.get("queued_only", False))
        await (await self._client()).cancel(str(body["command"]), sig, queued_only)

    async def stop(self, request: Any = None, mac: Any = None) -> None:
        """A sealed {}: close the connection and stop an owned daemon (its commands end as
        `shutdown`)."""
        self._open("stop", request, mac)
        self._stopped = True
        async with self._lock:
            if self.client is not None:
                await self.client.close()
                self.client = None
            if self.owned is not None:
                await asyncio.to_thread(self.owned.stop)
