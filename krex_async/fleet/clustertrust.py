"""Whose Ray cluster an address reaches, decided before the fleet's token goes to it.

Ray presents the token to whatever GCS it is pointed at, and its `auto` looks where any user of a
shared host can write: $RAY_ADDRESS, else the address in its default temp dir's
`ray_current_cluster` (/tmp/ray, which the first user to make it owns), else the `--gcs-address=`
of any process on this host whose name says raylet. A token sent there is the fleet: whoever holds
it runs commands on every node as any ordinary user. So krex resolves `auto` itself:

    $RAY_ADDRESS (the caller's own environment)
      └─ else ray_current_cluster, only where the file and its directory are a trusted user's own
           └─ else a raylet on this host, only one whose real, effective and saved uids are trusted

and joins any address, named or found, only after a TCP connect to it whose accepting end, where
it is on this host (/proc/net/tcp), a trusted user's process has accepted: a port the cluster has
left is anyone's to take, and 0.0.0.0, ::ffff:127.0.0.1 or a local route reach the same listeners
as 127.0.0.1. Ray is then given the address that was checked, not a name to resolve again.
Trusted: root, this user, the uid in $KREX_RAY_UID (a cluster that another user runs, named on
purpose), and for root the local fleet's Ray user krexray where it exists.

What stays open: a listener that replaces the checked one between the check and Ray's own connect
(the cluster's process gone in that instant), and a cluster on another host, whose process no local
check can see (Ray's token travels in clear over the network: keep the GCS port on a network only
the fleet's hosts reach).
"""

from __future__ import annotations

import asyncio
import os
import pwd
import stat
import time
from collections.abc import Iterator

import psutil

from krex_async.client.submit import KrexError
from krex_async.linux import tcp
from krex_async.linux.trust import dir_problem, trusted_uids, who

UID_VAR = "KREX_RAY_UID"  # the uid of a Ray cluster's user trusted besides root, us and krexray
DEFAULT_RAY_USER = "krexray"  # the local fleet's Ray user as root (rayuser), trusted where it exists


def trusted() -> frozenset[int]:
    """The uids whose Ray cluster may hear the token: root, this user, $KREX_RAY_UID, and for root
    krexray where it exists (the local fleet's Ray user; a token holder runs code as it, so it is
    no one else's to trust). KrexError('bad_input') when that variable is not a uid."""
    text = os.environ.get(UID_VAR, "").strip()
    if text and not text.isdigit():
        raise KrexError("bad_input", f"{UID_VAR}={text!r} is not a uid (a number: the Ray cluster's user id)")
    uids = set(trusted_uids(int(text) if text else None))
    if os.geteuid() == 0:
        try:
            uids.add(pwd.getpwnam(DEFAULT_RAY_USER).pw_uid)
        except KeyError:
            pass
    return frozenset(uids)


def auto_address(uids: frozenset[int]) -> str:
    """What `auto` names (see the module), trusting `uids`; KrexError('unreachable') saying what
    was passed over when nothing trusted names a cluster."""
    if env := os.environ.get("RAY_ADDRESS", "").strip():
        return env
    from ray._private.utils import get_ray_address_file

    skipped = []
    path = get_ray_address_file(None)
    why = _file_problem(path, uids)
    if not why:
        with open(path) as f:
            if address := f.read().strip():
                return address
    elif not why.endswith("does not exist"):
        skipped.append(f"{path}: {why}")
    mine: list[str] = []
    others: list[str] = []
    for owners, address in _raylets():
        (mine if owners <= uids else others).append(address)
    if mine:
        return sorted(mine)[0]
    if others:
        skipped.append(f"the raylets of other users, naming {', '.join(sorted(set(others)))}")
    passed = f" (passed over: {'; '.join(skipped)})" if skipped else ""
    raise KrexError(
        "unreachable",
        f"no Ray cluster found for 'auto'{passed}: give its address (HOST:PORT), or set RAY_ADDRESS",
    )


def _file_problem(path: str, uids: frozenset[int]) -> str:
    """ "" when Ray's address file is a regular file of one of `uids` that nobody else can write,
    in a directory that is theirs alone; else why not."""
    if why := dir_problem(os.path.dirname(path), uids):
        return why
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{path} does not exist"
    if not stat.S_ISREG(st.st_mode):  # a link too: lstat does not follow it
        return "not a regular file"
    if st.st_uid not in uids:
        return f"written by {who(st.st_uid)}"
    if st.st_mode & 0o022:
        return f"writable by others (mode {st.st_mode & 0o777:o})"
    return ""


def _raylets() -> Iterator[tuple[frozenset[int], str]]:
    """(real, effective and saved uids, GCS address) of each raylet on this host, as Ray's own
    `auto` finds them: a process of root's is trusted only when it is root's through and through,
    not a setuid program that another user started under a raylet's name."""
    for proc in psutil.process_iter(["cmdline", "uids"]):
        cmdline, uids = proc.info["cmdline"], proc.info["uids"]
        if not cmdline or uids is None or "raylet" not in os.path.basename(cmdline[0]):
            continue
        for arg in " ".join(cmdline).split(" "):
            if arg.startswith("--gcs-address=") and (address := arg.split("=", 1)[1]) not in ("", "None"):
                yield frozenset(uids), address


async def check_peer(
    address: str, local: tuple[str, int], peer: tuple[str, int], uids: frozenset[int], accept_s: float = 1.0
) -> None:
    """KrexError('untrusted') unless the process that accepted this host's connection from `local`
    to `peer` (made to reach `address`) runs as one of `uids`, or the connection went to another
    host. Until a process accepts it the connection's owner is not known (its listener's maker,
    root before Linux 6.17, whoever accepts it later): waited for up to `accept_s` (a GCS accepts
    at once). One to an address of this host that no process here accepts in that time (closed at
    once, or another network namespace's, through a NAT) is refused too."""
    deadline, local_peer = time.monotonic() + accept_s, _local(peer[0])
    try:
        while True:
            here, uid = tcp.owner(peer, local)
            if uid is not None or not (here or local_peer) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.01)
    except (OSError, ValueError) as e:
        raise KrexError("untrusted", f"refusing the Ray cluster at {address}: {e}") from None
    if uid is None and not (here or local_peer):
        return  # another host's: no check here sees its process
    if uid in uids:
        return
    why = (
        f"the process listening there runs as {who(uid)}"
        if uid is not None
        else f"no process on this host accepted the connection within {accept_s:g} s"
    )
    names = " or ".join(who(u) for u in sorted(uids))
    raise KrexError(
        "untrusted",
        f"refusing the Ray cluster at {address}: {why}, not {names}, and the fleet's token would go "
        f"to it; if that is the cluster you mean, name its user's uid in {UID_VAR}",
    )


def _local(address: str) -> bool:
    """Whether `address` is one of this host's: loopback, unspecified, or an interface's."""
    a = tcp.ip(address)
    if a.is_loopback or a.is_unspecified:
        return True
    mine = (x.address for xs in psutil.net_if_addrs().values() for x in xs)
    return any(_is_ip(x) and tcp.ip(x) == a for x in mine)


def _is_ip(text: str) -> bool:
    try:
        tcp.ip(text)
        return True
    except ValueError:
        return False
