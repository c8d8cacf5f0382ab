"""One fleet command's handle: its agent's stream of items turned into output and one Result.

How the stream ends decides the report, and no end runs the command again:
    ("exited", ...)                   the daemon's report, renamed `<node>/<id>`
    ("lost", why)                     its daemon died: `lost`, the node down until its agent reports
    ActorDiedError, NodeDiedError...  its agent (that incarnation) died: `lost`, naming it; the node's
                                      next agent is made by FleetClient.discover
    ActorUnavailableError             its agent may live on (a blip): the command is killed through it
                                      and ends `lost`; the node stays up
    another RayError                  the stream broke: the command is killed, `lost`
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from typing import Any, NoReturn, Protocol

import msgspec
from ray.exceptions import (
    ActorUnavailableError,
    NodeDiedError,
    ObjectLostError,
    RayActorError,
    RayError,
    RayTaskError,
)

from krex_async import protocol as P
from krex_async.client.submit import KrexError, Result


class Fleet(Protocol):
    """What a handle needs of its FleetClient (client.py imports this module, not the reverse)."""

    async def _ask(self, name: str, method: str, *args: Any, timeout: float, agent: Any = None) -> Any: ...
    def _sealed(self, method: str, name: str, **body: Any) -> tuple[bytes, str]: ...
    async def cancel(self, command: str, sig: int = signal.SIGTERM, queued_only: bool = False) -> None: ...
    def _node_lost(self, name: str, reason: str, agent: Any = None) -> None: ...
    def _agent_gone(self, name: str, agent: Any, e: BaseException) -> None: ...
    def _forget(self, h: FleetHandle) -> None: ...


def why(e: BaseException) -> str:
    """A Ray error in a line: its type and its message's first line (ActorDiedError's run on)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


class FleetHandle:
    """One fleet command: `command` and `device` name its node; output() and wait() as
    CommandHandle's. A lost node or agent ends it with a `lost` report instead of an exception."""

    def __init__(
        self,
        fleet: Fleet,
        node: str,
        agent: Any,
        spec: dict[str, Any],
        gen: Any,
        accepted: tuple[Any, ...],
    ) -> None:
        self.client = fleet
        self.node = node
        self.agent = agent  # the incarnation that runs it: cancels go to it, not to a successor
        self.daemon_command = str(accepted[1])
        self.command = f"{node}/{accepted[1]}"
        self.device = f"{node}/{accepted[2]}"
        self.queued = bool(accepted[3])
        self.pid: int | None = None  # on its node, once its agent says it started (older agents: never)
        self._spec = spec
        self._error: KrexError | None = None
        self._gen = gen
        self._out = bytearray()
        self._err = bytearray()
        self._result: Result | None = None

    async def output(self, keep: bool = True) -> AsyncIterator[tuple[str, bytes]]:
        """Yield (stream, data) as the command writes, until it ends or its node is lost. `keep`: as
        CommandHandle.output's (False: the Result has only the tails sent with the end)."""
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
            except ActorUnavailableError as e:  # the agent may be fine: end the command, not the node
                self._end(self._lost(await self._after_blip(e)))
                break
            except (RayActorError, NodeDiedError, ObjectLostError) as e:  # that agent or node is gone
                self.client._agent_gone(self.node, self.agent, e)
                self._end(
                    self._lost(
                        f"its agent died while the command ran ({why(e)}); the command is not run again"
                    )
                )
                break
            except RayError as e:  # the stream broke, the node may be fine: end the command
                await self._after_blip(e)
                self._end(self._lost(f"its output stream failed ({why(e)}); the command was killed"))
                break
            match item:
                case ("started", pid):
                    self.pid = pid
                case ("output", stream, data):
                    if keep:
                        (self._out if stream == "stdout" else self._err).extend(data)
                    yield stream, data
                case ("exited", raw, out, err):
                    report = msgspec.msgpack.decode(raw, type=P.CommandReport)
                    self._out += out
                    self._err += err
                    self._end(msgspec.structs.replace(report, command=self.command, device=self.device))
                case ("lost", reason):
                    self.client._node_lost(self.node, reason, self.agent)
                    self._end(self._lost(reason))
                case ("error", code, message):
                    self._fail(KrexError(code, message))

    def _fail(self, error: KrexError) -> NoReturn:
        """No result will come (as Client's Error reply): every later output()/wait() raises."""
        self._error = error
        self.client._forget(self)
        raise error

    async def _after_blip(self, e: RayError) -> str:
        """The stream broke but the agent may live: SIGKILL the command through that agent (asked
        again while it is unavailable), so nothing runs on unread. Returns what happened, for the
        `lost` report: killed; its agent died after all (Ray says unavailable until it knows; the
        daemon kills what a dead agent ran); or the agent could not be reached."""
        try:
            kill = self.client._sealed("cancel", self.node, command=self.daemon_command, sig=signal.SIGKILL)
            await self.client._ask(self.node, "cancel", *kill, timeout=10.0, agent=self.agent)
        except RayTaskError:
            pass  # it had ended meanwhile: killed or not, nothing of it runs on
        except (ActorUnavailableError, TimeoutError, KrexError) as again:
            return (
                f"its agent became unavailable while the command ran ({why(e)}) and stayed so "
                f"({why(again)}); the command could not be killed through it and is not run again"
            )
        except (RayActorError, NodeDiedError, ObjectLostError) as died:
            self.client._agent_gone(self.node, self.agent, died)
            return f"its agent died while the command ran ({why(died)}); the command is not run again"
        return (
            f"its agent became unavailable while the command ran ({why(e)}); "
            "the command was killed, not run again"
        )

    def _lost(self, reason: str) -> P.CommandReport:
        return P.CommandReport(
            command=self.command,
            argv=list(self._spec["argv"]),
            device=self.device,
            policy="",
            state="lost",
            error=reason if reason.startswith("node ") else f"node {self.node}: {reason}",
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
