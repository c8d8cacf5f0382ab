"""Who may ask what of a command, and see what of the node; the error a refused request answers with.

An agent acts only on its own commands (root on any), a request from inside a command must carry its
token and come from one of its processes, and only root (or, within bounds, a --run-as-peers user:
run_as()) may run a command as another user (docs/security.md, docs/fleet.md). Every check raises
`RequestError`, which connection.py answers. A peer that is not an admin sees its own commands'
trace events and status, and only counts of the others'.
"""

from __future__ import annotations

import functools
import hmac
import pwd
from typing import Any

from krex_async import protocol as P
from krex_async.daemon.config import comma_list
from krex_async.daemon.model.command import Command, CommandState
from krex_async.daemon.model.core import Core
from krex_async.linux.procfs import stat_fields


class RequestError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# A --run-as-peers user may name only a uid from here up: below are root and the system's own
# users (daemons, services: Debian's and most distributions' UID_MIN), which no fleet job runs as.
FIRST_USER_UID = 1000


@functools.lru_cache(maxsize=8)
def peer_uids(peers: str) -> frozenset[int]:
    """The uids of --run-as-peers (comma-separated names or uids: a uid needs no passwd entry, as a
    pod's runAsUser has none in the daemon's container). ValueError naming a name that is no user
    here, or root (who may already)."""
    out = set()
    for who in comma_list(peers):
        try:
            uid = int(who) if who.isdigit() else pwd.getpwnam(who).pw_uid
        except KeyError:
            raise ValueError(f"{who!r}: no such user") from None
        if uid == 0:
            raise ValueError(f"{who!r} is root, who may run commands as other users already")
        out.add(uid)
    return frozenset(out)


def run_as(target: int, peer_uid: int, peers: str = "") -> tuple[int, int]:
    """(uid, primary gid) for Submit.run_as: root (by SO_PEERCRED) may name any other uid; a
    --run-as-peers user (`peers`) only an ordinary user's (uid >= 1000) that is not one of those
    peers: never root, a system user, or a uid that could grant itself again. Only a uid with a
    passwd entry (its groups come from there)."""
    if peer_uid != 0:
        try:
            granted = peer_uids(peers)
        except ValueError:  # a user removed since the start, which checked them
            granted = frozenset()
        if peer_uid not in granted:
            raise RequestError(
                "forbidden", "only root (or a --run-as-peers user) may run a command as another user (run_as)"
            )
        if target < FIRST_USER_UID or target in granted:
            raise RequestError(
                "forbidden",
                f"run_as {'root' if target == 0 else f'uid {target}'}: a --run-as-peers user may run "
                f"commands only as ordinary users (uid >= {FIRST_USER_UID}) who are not such peers",
            )
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


# Events about the node rather than a command: every subscriber may see them (a probes_failed
# means that each region from then on is reported tainted, theirs too).
NODE_EVENTS = frozenset({"probes_failed"})


def visible_event(ev: P.TraceEvent, commands: dict[str, Any], uid: int) -> bool:
    """Whether a subscriber that is not an admin may see `ev`: its own commands' events (a stray in
    its region included, whoever's process it was) and the node's own."""
    if not ev.command:
        return ev.kind in NODE_EVENTS
    cmd = commands.get(ev.command)
    return cmd is not None and cmd.uid == uid


def visible_status(status: dict[str, Any], uid: int) -> dict[str, Any]:
    """What `krex status` shows a peer that is not an admin: its own commands in full, other users'
    commands only counted (`other_commands`), and a device held by another user's region as held,
    without naming its command or region."""
    mine = [c for c in status["commands"] if c.get("uid") == uid]
    own = {c["command"] for c in mine}

    def own_id(x: object) -> bool:  # a command id, or a region id "<command>.<n>"
        return isinstance(x, str) and (x in own or x.rsplit(".", 1)[0] in own)

    devices = []
    for d in status["devices"]:
        d = dict(
            d,
            commands=[c for c in d["commands"] if c in own],
            other_commands=sum(c not in own for c in d["commands"]),
            queued=[q for q in d["queued"] if own_id(q)],
            holder=d["holder"] if d["holder"] is None or own_id(d["holder"]) else "other",
        )
        r = d.get("region")
        if r is not None and r.get("command") not in own:
            d["region"] = {
                "region": "other",
                "name": "",
                "command": "other user",
                "pid": None,
                "state": r.get("state"),
                "cores": r.get("cores", []),
                "frozen": [f for f in r.get("frozen", []) if f in own],
            }
        devices.append(d)
    return dict(status, devices=devices, commands=mine, other_commands=len(status["commands"]) - len(mine))
