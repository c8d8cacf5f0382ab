"""Whether a client may talk to what listens on a socket, decided before it sends anything; and why
nothing answers where it looked.

A socket found at a default path (no --socket, no KREX_SOCKET) must sit in a directory owned by the
user or root that nobody else can write: otherwise another user may have made the directory
(/tmp/krex-UID) and listen there. Every socket, named or found, must be served by root, the user
itself, or the uid named in KREX_SOCKET_UID (`peer_uid=`): a gateway's or a colleague's own daemon.
"""

from __future__ import annotations

import os
import socket
import stat

from krex_async.linux.trust import dir_problem, peer_problem, trusted_uids
from krex_async.protocol import SUN_PATH_MAX

PEER_UID_VAR = "KREX_SOCKET_UID"


class UntrustedSocket(Exception):
    """The socket cannot be trusted: the message is one line with the socket, why and the fix."""


def expected_peer(peer_uid: int | None = None) -> int | None:
    """`peer_uid`, else $KREX_SOCKET_UID: the uid of a daemon trusted besides root and the user.
    Raises ValueError naming the variable when it is not a uid."""
    if peer_uid is not None:
        return peer_uid
    text = os.environ.get(PEER_UID_VAR, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"{PEER_UID_VAR}={text!r} is not a uid (a number: the daemon's user id)")
    return int(text)


def check_dir(path: str) -> None:
    """Raise UntrustedSocket when the directory of default socket `path` is not the user's own."""
    where = os.path.dirname(os.path.abspath(path))
    why = dir_problem(where, trusted_uids())
    if why:
        raise UntrustedSocket(
            f"refusing the socket {path}: {why}, so another user could be listening there; remove "
            f"that directory (or have root do it) and start your own daemon, or name a trusted socket "
            "with --socket or KREX_SOCKET"
        )


def check_peer(path: str, sock: socket.socket, peer_uid: int | None = None) -> None:
    """Raise UntrustedSocket when connected `sock`'s listener is not root, the user or `peer_uid`."""
    why = peer_problem(sock, trusted_uids(peer_uid))
    if why:
        raise UntrustedSocket(
            f"refusing the socket {path}: {why}; if that is the daemon you mean to use, name its uid "
            f"in {PEER_UID_VAR}"
        )


def check_listener(path: str, sock: socket.socket, explicit: bool, peer_uid: int | None = None) -> None:
    """Raise UntrustedSocket, `sock` closed, unless connected `sock` may hear this client: its peer,
    and for a socket found at a default path (not `explicit`ly named) its directory too."""
    try:
        if not explicit:
            check_dir(path)
        check_peer(path, sock, peer_uid)
    except BaseException:
        sock.close()
        raise


def unreachable_reason(path: str, e: BaseException) -> str:
    """Why nothing answers at PATH, and what to do: a directory or a file named instead of the
    socket is said so (starting a daemon there would not help)."""
    if isinstance(e, PermissionError):
        return (
            f"the socket at {path} is not open to this user (Permission denied): a daemon admits its "
            "own user and the group it was started with (`krex serve --socket-group`)"
        )
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = 0
    if stat.S_ISDIR(mode):
        return (
            f"{path} is a directory, not a daemon's socket: --socket or KREX_SOCKET names the socket "
            f"file itself (e.g. {os.path.join(path, 'krex.sock')})"
        )
    if mode and not stat.S_ISSOCK(mode):
        return f"{path} is not a socket: --socket or KREX_SOCKET names the daemon's socket file"
    if len(os.fsencode(path)) >= SUN_PATH_MAX:
        return (
            f"{path}: {len(os.fsencode(path))} bytes; a Unix socket path must be under {SUN_PATH_MAX} "
            "(no daemon can serve there): name a shorter one with --socket or KREX_SOCKET"
        )
    strerror = getattr(e, "strerror", None)
    return (
        f"no krex daemon at {path}: {strerror or e} (start one with `krex serve --socket {path}`, or "
        "`systemctl start krex` where the unit is installed; --socket or KREX_SOCKET names another)"
    )
