"""Who may ask what of a command, and the error a refused request answers with.

An agent acts only on its own commands (root on any), a request from inside a command must carry its
token and come from one of its processes, and only root may run a command as another user (DESIGN.md,
Security and failure model). Every check raises `RequestError`, which server.py answers.
"""

from __future__ import annotations

import hmac
import pwd

from krex_async.daemon.commands import Command, CommandState
from krex_async.daemon.core import Core
from krex_async.linux.procfs import stat_fields


class RequestError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def run_as(target: int, peer_uid: int) -> tuple[int, int]:
    """(uid, primary gid) for Submit.run_as: only root (by SO_PEERCRED) may name another uid, and
    only one with a passwd entry (its groups come from there)."""
    if peer_uid != 0:
        raise RequestError("forbidden", "only root may run a command as another user (run_as)")
    try:
        return target, pwd.getpwuid(target).pw_gid
    except KeyError:
        raise RequestError("bad_request", f"run_as: uid {target} has no passwd entry") from None


def ancestors(pid: int, limit: int = 512) -> list[int]:
    """pid and its parents up to init, read from /proc."""
    out: list[int] = []
    while pid > 1 and len(out) < limit:
        out.append(pid)
        fields = stat_fields(pid)
        if fields is None:
            break
        pid = int(fields[1])
    return out


def own(core: Core, command: str, uid: int) -> Command:
    """The command `uid` asks about, if it is theirs (root: any)."""
    cmd = core.commands.get(command)
    if cmd is None:
        raise RequestError(
            "unknown_command",
            f"no command {command!r} (ended results are kept for {core.config.retention:.0f} s)",
        )
    if uid not in (0, cmd.uid):
        raise RequestError("forbidden", f"command {command} belongs to another user")
    return cmd


def inside(core: Core, cmd: Command, peer_pid: int, token: str, claimed_pid: int) -> int:
    """The requesting pid, after checking the token and that the peer runs inside the command."""
    if not hmac.compare_digest(token.encode(), cmd.token.encode()):
        raise RequestError("forbidden", f"wrong token for command {cmd.id}")
    if claimed_pid and claimed_pid != peer_pid:
        raise RequestError("forbidden", f"request claims pid {claimed_pid} but comes from pid {peer_pid}")
    if cmd.state != CommandState.RUNNING or cmd.group is None:
        raise RequestError("bad_request", f"command {cmd.id} is {cmd.state}, not running")
    if cmd.pid not in ancestors(peer_pid) and peer_pid not in core.backend.pids(cmd.group):
        raise RequestError("forbidden", f"pid {peer_pid} is not a process of command {cmd.id}")
    return peer_pid
