"""The isolation interface: what the daemon asks of a backend, and the errors a backend raises.

A backend owns one *group* per command: the set of processes that krex started for it (the command's
process tree, or its cgroup). The daemon drives the backend from the event loop; every method that can
block on the kernel is a coroutine and is bounded in time.

Life of a group::

    group = await backend.create(command_id)          # before the command's first instruction
    argv = backend.launch_argv(group, argv, frozen=)  # how to spawn so the process starts inside it
    await backend.started(group, pid)                 # after spawn (the pid of the command's leader)
    ... freeze / thaw / set_cores during regions ...
    await backend.kill(group, SIGKILL)                # timeout, shutdown
    await backend.remove(group)                       # after the command ended

Errors are typed (FreezeError, IsolationError) and name the group and the kernel object involved.
A group whose processes are all gone is a state (`Freeze.vanished`), not an error.
"""

from __future__ import annotations

import abc
import signal as _signal
from dataclasses import dataclass, field


class IsolationError(Exception):
    """A backend operation failed; the message names the group and the file or pid involved."""


class FreezeError(IsolationError):
    """A freeze did not complete within its bound. The backend has already thawed what it froze."""

    def __init__(self, group: str, reason: str) -> None:
        super().__init__(f"freeze of {group} failed: {reason}")
        self.group = group
        self.reason = reason


@dataclass
class Freeze:
    """What one freeze did: seconds it took, pids stopped (and which), whether the group had
    vanished. `stopped` is read once the freeze took hold, so it stays true while frozen."""

    group: str
    seconds: float = 0.0
    pids: int = 0
    vanished: bool = False
    stopped: list[int] = field(default_factory=list)


@dataclass
class Group:
    """One command's processes as the backend knows them. Backends subclass it for their state."""

    command_id: str
    pid: int | None = None  # the command's leader, once started
    frozen: bool = False
    cores: frozenset[int] | None = None  # the cpus it is fenced to, None when unrestricted
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"cmd-{self.command_id}"


class Backend(abc.ABC):
    """Freeze, thaw and fence the processes of commands. One instance per daemon."""

    #: "signal" or "cgroup"
    name: str = "?"
    #: the launch wrapper needs the daemon's privileges (it writes cgroup files): spawn as the
    #: daemon and let launch_argv(as_user=...) drop to the submitting user before exec
    wrapper_drops_privileges: bool = False

    def __init__(self) -> None:
        self.reason = ""  # why this backend was chosen, for `krex status` and the start-up line

    @abc.abstractmethod
    async def create(self, command_id: str) -> Group:
        """Make the group for a command that is about to start."""

    def launch_argv(
        self,
        group: Group,
        argv: list[str],
        *,
        frozen: bool,
        as_user: tuple[int, int, list[int]] | None = None,
    ) -> list[str]:
        """The argv to exec so that the command starts inside its group (and stopped when `frozen`).

        The default runs argv unchanged; backends that must act before the first instruction wrap it.
        """
        return argv

    def cgroup_dir(self, group: Group) -> str | None:
        """The cgroup v2 directory the group's processes start in, where there is one."""
        return None

    def join(self, group: Group, pid: int) -> None:
        """Move a process that was started elsewhere (a pool worker) into the group, before it runs
        the command's first instruction. Backends without a kernel group do nothing."""

    def leader_left(self, group: Group) -> None:
        """The leader (a pool worker) went back to its pool, out of the group's cgroups: the
        group no longer includes it, so killing or freezing the group spares it."""
        group.pid = None

    @abc.abstractmethod
    async def started(self, group: Group, pid: int) -> None:
        """Record the command's leader pid once it has been spawned."""

    @abc.abstractmethod
    def pids(self, group: Group) -> list[int]:
        """Every live pid of the group (leader first when alive). Never raises for a vanished group."""

    @abc.abstractmethod
    async def freeze(
        self, group: Group, *, keep: frozenset[int] = frozenset(), timeout: float = 1.0
    ) -> Freeze:
        """Stop every process of the group except the pids in `keep`.

        Raises FreezeError after thawing again when the freeze cannot be verified within `timeout`.
        """

    async def freeze_many(
        self, groups: list[Group], *, keep: frozenset[int] = frozenset(), timeout: float = 1.0
    ) -> list[Freeze]:
        """Freeze several groups (concurrently where the backend can). On a FreezeError the groups
        this call froze are thawed again before it propagates."""
        done: list[Group] = []
        out: list[Freeze] = []
        try:
            for g in groups:
                out.append(await self.freeze(g, keep=keep, timeout=timeout))
                done.append(g)
        except BaseException:
            for g in done:
                await self.thaw(g)
            raise
        return out

    @abc.abstractmethod
    async def thaw(self, group: Group) -> float:
        """Resume what `freeze` stopped; returns seconds taken. Safe to call on a thawed group."""

    @abc.abstractmethod
    async def set_cores(
        self,
        group: Group,
        cpus: frozenset[int] | None,
        *,
        pids: list[int] | None = None,
        exclusive: bool = False,
    ) -> None:
        """Fence the group (or only `pids` of it) onto `cpus`; None restores the original cpus.
        `exclusive`: these are a region owner's cores (a cpuset partition where the kernel allows)."""

    @abc.abstractmethod
    async def kill(self, group: Group, sig: int = _signal.SIGKILL) -> None:
        """Send `sig` to every process of the group, frozen ones included (they die when killed)."""

    @abc.abstractmethod
    async def remove(self, group: Group) -> None:
        """Release everything the group holds after its command ended."""

    async def reconcile(self) -> list[str]:
        """At start-up: undo what a previous daemon left frozen or fenced. Returns what it did."""
        return []

    async def close(self) -> None:
        """At shutdown, after every group was removed."""
