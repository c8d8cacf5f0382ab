"""The daemon's listening socket: its path checked before anything starts, bound with its final
mode from the first instant and only then given its name, a stale socket replaced and a live one
never stolen; and the file limit raised for thousands of idle agents.
"""

from __future__ import annotations

import contextlib
import grp
import os
import resource
import socket
import stat
import sys
from typing import NoReturn

from krex_async.linux.trust import dir_problem
from krex_async.protocol import NODE_SOCKET

LISTEN_BACKLOG = 4096


def usage_exit(message: str) -> NoReturn:
    """End `krex serve` with a usage error (exit 2, as the CLI's own), before anything is made."""
    print(f"krex serve: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def own_socket_dirs() -> frozenset[str]:
    """The default socket directories krex makes itself (root's /run/krex, a user's /tmp/krex-UID
    when there is no $XDG_RUNTIME_DIR); any other must exist: a typo must not leave directories."""
    return frozenset({os.path.dirname(NODE_SOCKET), f"/tmp/krex-{os.getuid()}"})


def find_group(group: str) -> int | None:
    """A group name's gid, or a number's; None where there is no such group."""
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        return int(group) if group.isdigit() else None


def group_id(group: str, option: str = "--socket-group") -> int:
    """A group name or number (--socket-group, --admin-group); SystemExit naming `option` if none."""
    gid = find_group(group)
    if gid is None:
        raise SystemExit(f"krex: {option} {group!r}: no such group")
    return gid


def make_own_dir(path: str, shared: bool) -> None:
    """Make default socket directory `path` (0755 when others reach the socket through its group,
    else 0700); one already there is judged by check_socket_dir, never chmodded or followed."""
    try:
        os.mkdir(path, 0o755 if shared or path == os.path.dirname(NODE_SOCKET) else 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise SystemExit(f"krex: cannot make the socket directory {path}: {e.strerror}") from None


def check_socket_dir(path: str) -> None:
    """Exit 2 unless the socket's directory is this daemon's (or root's) and nobody else can write
    it or move it: another user could otherwise replace the socket, or listen in its place first."""
    parent = os.path.dirname(os.path.abspath(path))
    why = dir_problem(parent, frozenset({os.geteuid(), 0}))
    if why:
        usage_exit(
            f"--socket {path}: refusing to serve there: {why}, so another user could replace the "
            "socket or listen in its place; serve in a directory only this user (or root) can write"
        )


def check_socket_path(path: str, group: str = "") -> None:
    """Whether `path` can be served on, before anything is started (SystemExit saying why not):
    short enough for a client to connect to, its directory there (made only when it is one of
    own_socket_dirs: exit 2 otherwise) and safe (check_socket_dir), nothing there but a socket
    nobody answers on (left by a daemon that died: bind_socket replaces it). `group`: the
    --socket-group, whose members must be able to enter a directory made here."""
    if len(os.fsencode(path)) >= 108:
        raise SystemExit(
            f"krex: --socket {path}: {len(os.fsencode(path))} bytes; a Unix socket path must be "
            "under 108 (no client could connect to it)"
        )
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) and parent not in own_socket_dirs():
        if os.path.lexists(parent):
            usage_exit(f"--socket {path}: {parent} is not a directory")
        usage_exit(
            f"--socket {path}: no directory {parent} (krex makes only its default "
            f"{' and '.join(sorted(own_socket_dirs()))}: create it, or give another --socket)"
        )
    if parent in own_socket_dirs():
        make_own_dir(parent, bool(group))
    check_socket_dir(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise SystemExit(f"krex: --socket {path}: {e.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise SystemExit(f"krex: {path} exists and is not a socket; not replacing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # stale: left by a daemon that died; bind_socket's rename replaces it
    except OSError as e:
        raise SystemExit(f"krex: {path} exists and is not a usable socket: {e}") from None
    else:
        raise SystemExit(f"krex: another daemon is serving on {path}")
    finally:
        probe.close()


def bind_socket(path: str, group: str = "") -> socket.socket:
    """Bind and listen with the final mode from the first instant; only then give it its name.

    The socket is bound under a temporary name with umask 0177 (mode 0600), given its group and mode
    0660 when `group` is set, put into listening state, and renamed onto `path`: at no moment is there
    a file at `path` with a looser mode, or one that refuses connections because it is not listening
    yet. A leftover socket at `path` that nobody answers on is replaced; a live one is never stolen;
    anything that is not a socket is left alone (SystemExit), so a wrong path deletes nothing.
    """
    gid = group_id(group) if group else None
    check_socket_path(path, group)
    # A short temporary name in the same directory (AF_UNIX paths end near 108 bytes; a path too
    # long for a suffix is bound directly: its mode is still right, only the listen window remains).
    tmp = os.path.join(os.path.dirname(path), f".{os.getpid()}~")
    if len(os.fsencode(tmp)) >= 108:
        tmp = path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(tmp)
    finally:
        os.umask(old)
    try:
        if gid is not None:
            os.chown(tmp, -1, gid)
            os.chmod(tmp, 0o660)
        sock.listen(LISTEN_BACKLOG)
        if tmp != path:
            os.rename(tmp, path)
    except BaseException:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    sock.setblocking(False)
    return sock


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (thousands of idle agents are normal).
    Returns the soft limit now in force; never raises."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
        except (ValueError, OSError):
            pass
    return soft
