"""Whether a directory or a socket's peer may be trusted, as ssh decides for its own files.

A directory is trusted when it is no symbolic link, is owned by one of the given uids, and no other
user can write it; each directory above it must be owned by root or one of those uids and not be
writable by others unless it is sticky (others cannot rename or remove our entries in a sticky
/tmp). A socket's peer is trusted by its SO_PEERCRED uid. Every check returns "" or the reason,
one phrase, for the caller to put into its own refusal. Standard library only (`krex cleanup`).
"""

from __future__ import annotations

import os
import pwd
import socket
import stat
import struct

ROOT = 0


def who(uid: int) -> str:
    """`uid 1001 (alice)`, or `uid 1001` for a uid with no name."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _writable_by(mode: int) -> str:
    parts = [w for bit, w in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "other users")) if mode & bit]
    return " and ".join(parts)


def dir_problem(path: str, owners: frozenset[int]) -> str:
    """ "" when `path` is a real directory owned by one of `owners` that nobody else can write
    and whose ancestors are safe (see the module); else why not. A missing one says so."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{path} does not exist"
    except OSError as e:
        return f"{path}: {e.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid not in owners:
        return f"{path} is owned by {who(st.st_uid)}"
    if by := _writable_by(st.st_mode):
        return f"{path} is writable by {by} (mode {stat.S_IMODE(st.st_mode):04o})"
    return ancestors_problem(path, owners)


def ancestors_problem(path: str, owners: frozenset[int]) -> str:
    """ "" when every directory above `path` (links resolved) is owned by root or one of `owners`
    and not writable by others unless sticky: nobody else can move `path` away or replace it."""
    up = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    allowed = owners | {ROOT}
    while True:
        try:
            st = os.stat(up)
        except OSError as e:
            return f"{up}: {e.strerror}"
        if st.st_uid not in allowed:
            return f"{up}, above it, is owned by {who(st.st_uid)}"
        if (by := _writable_by(st.st_mode)) and not st.st_mode & stat.S_ISVTX:
            return f"{up}, above it, is writable by {by} (mode {stat.S_IMODE(st.st_mode):04o})"
        if up == "/":
            return ""
        up = os.path.dirname(up)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process that made the other end of connected Unix socket `sock`."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def trusted_uids(extra: int | None = None) -> frozenset[int]:
    """Whom a client trusts to be its daemon: root, itself, and `extra` (a named daemon's uid)."""
    uids = {ROOT, os.getuid(), os.geteuid()}
    if extra is not None:
        uids.add(extra)
    return frozenset(uids)


def peer_problem(sock: socket.socket, uids: frozenset[int]) -> str:
    """ "" when the process listening at the other end of `sock` runs as one of `uids`."""
    try:
        uid = peer_uid(sock)
    except OSError as e:
        return f"its listener's identity cannot be read: {e.strerror}"
    if uid in uids:
        return ""
    names = " or ".join(who(u) for u in sorted(uids))
    return f"the process listening there runs as {who(uid)}, not {names}"


def state_dir_problem(path: str) -> str:
    """ "" when `path` may be a daemon's state dir: everything a daemon or `krex cleanup` reads back
    there (command records, the driver-lock record) must come from this user alone, so the
    directory is this euid's own, writable by nobody else, no symbolic link, safe above."""
    return dir_problem(path, frozenset({os.geteuid()}))


def state_dir_refusal(path: str, why: str) -> str:
    """The refusal line for an unsafe state dir (after the command's name), with the fix."""
    return (
        f"--state-dir {path}: refusing it: {why}; a state dir must be this user's own ({who(os.geteuid())}), "
        "writable by nobody else and no symbolic link, since what is read back from it must not come "
        "from another user: give another --state-dir, or remove this one"
    )
