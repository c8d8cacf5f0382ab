"""Whose Ray cluster an address reaches, decided before the fleet's token goes to it.

Ray presents the token to whatever GCS it is pointed at, and its `auto` looks where any user of a
shared host can write: $RAY_ADDRESS, else the address in its default temp dir's
`ray_current_cluster` (/tmp/ray, which the first user to make it owns), else the `--gcs-address=`
of any process on this host whose name says raylet. A token sent there is the fleet: whoever holds
it runs commands on every node as any ordinary user. So krex resolves `auto` itself:

    $RAY_ADDRESS (the caller's own environment)
      └─ else ray_current_cluster, only where the file and its directory are a trusted user's own
           └─ else a raylet on this host, only one running as a trusted user

and any address on this host (loopback, or one of its interfaces), named or found, is used only
where every socket listening on its port is a trusted user's (/proc/net/tcp): a port the cluster
has left is anyone's to take. Trusted: root, this user, the local fleet's Ray user (krexray) where
it exists, and the uid in $KREX_RAY_UID (a cluster that another user runs, named on purpose).

What stays open: a listener that dies between the check and Ray's connect, and a cluster on another
host, whose listener no local check can see (Ray's token travels in clear over the network: keep
the GCS port on a network only the fleet's hosts reach).
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import socket
from collections.abc import Iterator

import psutil

from krex_async.client.submit import KrexError
from krex_async.linux.tcp import listener_uids
from krex_async.linux.trust import dir_problem, trusted_uids, who

UID_VAR = "KREX_RAY_UID"  # the uid of a Ray cluster's user trusted besides root, us and krexray
DEFAULT_RAY_USER = "krexray"  # the local fleet's Ray user as root (rayuser), trusted where it exists


def trusted() -> frozenset[int]:
    """The uids whose Ray cluster may hear the token: root, this user, krexray where it exists,
    and $KREX_RAY_UID. KrexError('bad_input') when that variable is not a uid."""
    text = os.environ.get(UID_VAR, "").strip()
    if text and not text.isdigit():
        raise KrexError("bad_input", f"{UID_VAR}={text!r} is not a uid (a number: the Ray cluster's user id)")
    uids = set(trusted_uids(int(text) if text else None))
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
    for uid, address in _raylets():
        (mine if uid in uids else others).append(address)
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
    if not os.path.isfile(path) or os.path.islink(path):
        return "not a regular file"
    if st.st_uid not in uids:
        return f"written by {who(st.st_uid)}"
    if st.st_mode & 0o022:
        return f"writable by others (mode {st.st_mode & 0o777:o})"
    return ""


def _raylets() -> Iterator[tuple[int, str]]:
    """(effective uid, GCS address) of each raylet on this host, as Ray's own `auto` finds them."""
    for proc in psutil.process_iter(["cmdline", "uids"]):
        cmdline, uids = proc.info["cmdline"], proc.info["uids"]
        if not cmdline or uids is None or "raylet" not in os.path.basename(cmdline[0]):
            continue
        for arg in " ".join(cmdline).split(" "):
            if arg.startswith("--gcs-address=") and (address := arg.split("=", 1)[1]) not in ("", "None"):
                yield uids.effective, address


def check_listener(address: str, uids: frozenset[int]) -> None:
    """KrexError('untrusted') when `address` (HOST:PORT or ray://HOST:PORT) is on this host and a
    process of a uid not in `uids` listens on its port ('unreachable' when none does); nothing for
    another host's address."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    host = host.strip("[]")
    for ip in _local_ips(host):
        try:
            owners = listener_uids(ip, int(port))
        except (OSError, ValueError) as e:
            why = f"its listener cannot be read: {e}"
            raise KrexError("untrusted", f"refusing the Ray cluster at {address}: {why}") from None
        if not owners:
            raise KrexError("unreachable", f"no Ray cluster at {address}: nothing listens on port {port}")
        if owners <= uids:
            continue
        why = f"the process listening there runs as {', '.join(who(u) for u in sorted(owners - uids))}"
        names = " or ".join(who(u) for u in sorted(uids))
        raise KrexError(
            "untrusted",
            f"refusing the Ray cluster at {address}: {why}, not {names}, and the fleet's token would go "
            f"to it; if that is the cluster you mean, name its user's uid in {UID_VAR}",
        )


def _local_ips(host: str) -> list[str]:
    """The addresses of this host that `host` (an IP or a name) resolves to; none for another's."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []  # a name that does not resolve: Ray's connect fails on it
    mine = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    ips = {str(info[4][0]) for info in infos}
    return sorted(ip for ip in ips if ipaddress.ip_address(ip).is_loopback or ip in mine)
