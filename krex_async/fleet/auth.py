"""Who may use the fleet: Ray's token authentication on every cluster krex starts or joins, and a
signature on every request that makes a node agent act.

    token file (0600, the operator's) ──RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH──► Ray (GCS, raylets,
                                                                                  workers, drivers)
    FleetClient ──seal(token, method, node, body)──► NodeAgent.open(): HMAC-SHA256 checked, the
                                                     identity mapped to an unprivileged uid (run_as)

Why the Ray token is also the agents' key: every Ray caller must present it, and whoever holds it can
run any Ray task on any node, whose workers run as the node's Ray user (root where the agent owns a
root daemon). A second secret held by the same processes would add no barrier against a token
holder. The signature still makes the agent refuse (and log) a request that did not come from a
holder of this cluster's token: a node whose Ray runs without authentication, or a request that
reaches the agent's worker port other than through an authenticated Ray call. The identity it
carries maps to a user on the node who is never root: the agent passes it to the daemon as run_as,
as the gateway does for its jobs.

Nothing here imports Ray at module level: the agent (agent.py) uses open() without it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import pwd
import secrets
import stat
import sys
from typing import Any

import msgspec

from krex_async.client.submit import KrexError

TOKEN_FILE_ENV = "KREX_RAY_TOKEN_FILE"  # the operator's token file, where --ray-token-file is not given
RUN_AS_ENV = "KREX_FLEET_RUN_AS"  # the user a root fleet client's commands run as on the nodes
RAY_DEFAULT_TOKEN = os.path.join("~", ".ray", "auth_token")  # where `ray get-auth-token` keeps it


def default_token_file() -> str:
    """--ray-token-file's default: $KREX_RAY_TOKEN_FILE, Ray's own $RAY_AUTH_TOKEN_PATH, or
    ~/.ray/auth_token (`ray get-auth-token --generate` writes it)."""
    return (
        os.environ.get(TOKEN_FILE_ENV)
        or os.environ.get("RAY_AUTH_TOKEN_PATH")
        or os.path.expanduser(RAY_DEFAULT_TOKEN)
    )


def read_token(path: str) -> bytes:
    """The token in `path`: a regular file of ours or root's, readable by nobody else, not empty
    (checked on the file opened: a link is followed, as a Kubernetes Secret's file is one).
    KrexError('bad_token', ...) saying what is wrong."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise KrexError("bad_token", f"the Ray token file {path!r} cannot be read: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KrexError("bad_token", f"the Ray token file {path!r} is not a regular file")
        if st.st_uid not in (0, os.geteuid()):
            raise KrexError("bad_token", f"the Ray token file {path!r} belongs to uid {st.st_uid}, not to us")
        if st.st_mode & 0o077:
            raise KrexError(
                "bad_token",
                f"the Ray token file {path!r} is readable by others (mode {st.st_mode & 0o777:o}): "
                f"chmod 600 {path}",
            )
        token = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if not token:
        raise KrexError("bad_token", f"the Ray token file {path!r} is empty")
    return token


def create_token(path: str) -> str:
    """A new random token in `path` (0600, created: never an existing file), its directory made
    0700 if missing. Returns the path."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode())
    finally:
        os.close(fd)
    return path


def use_token(path: str) -> bytes:
    """Turn on Ray's token authentication for this process and the Ray processes it starts, with
    the token in `path` (checked as read_token checks it); returns the token. The token travels
    only as the file's path: never in argv, nor in the environment."""
    token = read_token(path)
    if os.environ.get("RAY_AUTH_TOKEN"):
        raise KrexError(
            "bad_token",
            "RAY_AUTH_TOKEN is set: krex takes the Ray token from a file (--ray-token-file, "
            f"${TOKEN_FILE_ENV}); unset RAY_AUTH_TOKEN",
        )
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = os.path.abspath(path)
    if "ray" in sys.modules:  # Ray caches its config and token at import: read them again
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    return token


def loopback(address: str) -> bool:
    """Whether a Ray address (HOST:PORT, ray://HOST:PORT) names this machine's loopback."""
    host = address.removeprefix("ray://").rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_only() -> None:
    """Keep this process's Ray on 127.0.0.1: Ray otherwise replaces a loopback address by the
    host's network address, where a cluster bound to loopback does not listen. Ray's own switch
    for a single-machine cluster, read when Ray is imported and by the Ray processes started here."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if "ray" in sys.modules:
        import ray._private.ray_constants as rc

        rc.ENABLE_RAY_CLUSTER = False


# -- signed agent requests ------------------------------------------------------------------------


def seal(key: bytes, method: str, node: str, body: dict[str, Any]) -> tuple[bytes, str]:
    """A request for `node`'s agent: its bytes and their HMAC-SHA256 under the fleet's key."""
    raw = msgspec.msgpack.encode({"method": method, "node": node, "body": body})
    return raw, hmac.new(key, raw, hashlib.sha256).hexdigest()


def open_sealed(key: bytes | None, method: str, node: str, raw: Any, mac: Any) -> dict[str, Any]:
    """The body of a request seal() made for this `method` on this `node`. KrexError('forbidden',
    ...) when there is no key here, the signature is wrong or missing, or it was made for another
    method or node (a request is not replayed elsewhere)."""
    if key is None:
        raise KrexError(
            "forbidden",
            "this node's Ray runs without token authentication (RAY_AUTH_MODE=token and a token "
            "file, RAY_AUTH_TOKEN_PATH): its krex agent acts for nobody",
        )
    if not isinstance(raw, bytes) or not isinstance(mac, str):
        raise KrexError("forbidden", "an unsigned request")
    if not hmac.compare_digest(hmac.new(key, raw, hashlib.sha256).hexdigest(), mac):
        raise KrexError("forbidden", "a request not signed with this fleet's token")
    try:
        req = msgspec.msgpack.decode(raw, type=dict[str, Any])
    except msgspec.DecodeError:
        raise KrexError("forbidden", "a malformed request") from None
    if req.get("method") != method or req.get("node") != node or not isinstance(req.get("body"), dict):
        raise KrexError("forbidden", f"a request signed for {req.get('method')!r} on {req.get('node')!r}")
    return dict(req["body"])


def node_key() -> bytes | None:
    """The agent's key: the token of the Ray it runs in (its worker inherits the raylet's
    RAY_AUTH_MODE and RAY_AUTH_TOKEN_PATH); None when that Ray runs without authentication."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token" or not path:
        return None
    try:
        return read_token(path)
    except KrexError:
        return None


def identity(run_as: str | int | None) -> str:
    """The user a client's commands run as on the nodes, as sent to agents (a name, looked up on
    each node; a uid where this host has no name for it). Not root: a non-root client is itself
    by default; a root client names one (run_as, $KREX_FLEET_RUN_AS). KrexError('forbidden', ...)."""
    if run_as is None:
        run_as = os.environ.get(RUN_AS_ENV) or (None if os.geteuid() == 0 else os.geteuid())
    if run_as is None or run_as == "":
        raise KrexError(
            "forbidden",
            "the fleet runs no command as root: name the unprivileged user its commands run as "
            f"(run_as=, --run-as, ${RUN_AS_ENV})",
        )
    if isinstance(run_as, int) or str(run_as).isdigit():
        if int(run_as) == 0:
            raise KrexError("forbidden", "the fleet runs no command as root")
        try:
            return pwd.getpwuid(int(run_as)).pw_name
        except KeyError:
            return str(int(run_as))
    if run_as == "root":
        raise KrexError("forbidden", "the fleet runs no command as root")
    return str(run_as)


def node_uid(who: Any) -> int:
    """On the node: the uid an identity maps to. KrexError('forbidden', ...) for root, a user
    unknown here, or no identity at all."""
    if not isinstance(who, str) or not who:
        raise KrexError("forbidden", "a request without an identity (the user its command runs as)")
    try:
        uid = int(who) if who.isdigit() else pwd.getpwnam(who).pw_uid
    except KeyError:
        raise KrexError("forbidden", f"no user {who!r} on this node") from None
    if uid == 0:
        raise KrexError("forbidden", "the fleet runs no command as root")
    return uid
