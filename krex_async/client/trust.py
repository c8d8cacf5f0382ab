"""Whether a client may talk to what listens on a socket, decided before it sends anything.

A socket found at a default path (no --socket, no KREX_SOCKET) must sit in a directory owned by the
user or root that nobody else can write: otherwise another user may have made the directory
(/tmp/krex-UID) and listen there. Every socket, named or found, must be served by root, the user
itself, or the uid named in KREX_SOCKET_UID (`peer_uid=`): a gateway's or a colleague's own daemon.
"""

from __future__ import annotations

import os
import socket

from krex_async.linux.trust import dir_problem, peer_problem, trusted_uids

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
    """Raise UntrustedSocket unless connected `sock` may hear this client: its peer, and for a
    socket found at a default path (not `explicit`ly named) its directory too."""
    if not explicit:
        check_dir(path)
    check_peer(path, sock, peer_uid)
