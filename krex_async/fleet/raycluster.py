"""Joining a Ray cluster, and what names a node in it: the plumbing FleetClient.connect and the local
fleet share.

A node is named by a custom Ray resource `krex_node_<name>` (`ray start --resources
'{"krex_node_gpu-a1": 1}'`), else by its Ray node id's first 8 characters; its agent is the actor
`krex-node-<name>` in namespace `krex`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from typing import Any

import ray

from krex_async.client.submit import KrexError
from krex_async.fleet import auth, clustertrust
from krex_async.linux import tcp

NAMESPACE = "krex"
NODE_RESOURCE = "krex_node_"  # a custom resource "krex_node_<name>": <name> names the node
# Ray refuses a driver whose Python's patch version differs from the cluster's; a root driver (this
# venv's Python) joins a local fleet whose Ray user runs the system's python3 of the same minor.
PYTHON_MATCH_ENV = "RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL"


def node_name(node: dict[str, Any]) -> str:
    """A node's fleet name: from a `krex_node_<name>` resource, else its Ray node id's first 8."""
    for res in node.get("Resources", {}):
        if res.startswith(NODE_RESOURCE):
            return str(res[len(NODE_RESOURCE) :])
    return str(node["NodeID"][:8])


class _PatchMismatch(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Python patch version mismatch")


def minor_python_match() -> None:
    """Let this driver join a cluster of the same Python minor version (unless
    $RAY_DEFAULT_PYTHON_VERSION_MATCH_LEVEL says otherwise), without Ray's warning each time: the
    local fleet's Ray user runs the system's python3, a root driver this venv's."""
    if os.environ.setdefault(PYTHON_MATCH_ENV, "minor") == "minor":
        logging.getLogger("ray._private.utils").addFilter(_PATCH_MISMATCH)


_PATCH_MISMATCH = _PatchMismatch()


def join(address: str | None, options: dict[str, Any] | None = None) -> None:
    """ray.init, keeping this process's SIGTERM/SIGINT handlers: Ray's own would end the process
    (sys.exit) where a daemon or the gateway shuts down cleanly. KrexError when nobody answers.
    Already joined: nothing to do (two connects of one process, e.g. the gateway's job runner and
    its env view, both find Ray uninitialised before their address check, and join one after the
    other; ray.init a second time raises)."""
    if ray.is_initialized():
        return
    minor_python_match()
    if address and auth.loopback(address):
        auth.local_only()  # a cluster bound to 127.0.0.1 is reached there, not at the host's address
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        ray.init(
            address=address,
            namespace=NAMESPACE,
            log_to_driver=False,
            configure_logging=False,
            **(options or {}),
        )
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise KrexError("unreachable", f"no Ray cluster at {address!r}: {e}") from None
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


async def reachable(address: str, timeout: float = 3.0, uids: frozenset[int] | None = None) -> str:
    """The cluster's GCS IP:port (a Ray client's ray://IP:PORT), the address a TCP connect to it
    reached (ray.init would block minutes for a GCS that is not there), once the process that
    accepted that connection, where on this host, runs as one of `uids` (default: clustertrust's
    trusted users). "auto" is found as clustertrust.auto_address says. KrexError 'unreachable' or
    'untrusted', nothing sent."""
    from ray._private.services import canonicalize_bootstrap_address_or_die

    uids = uids if uids is not None else clustertrust.trusted()
    raw = clustertrust.auto_address(uids) if address == "auto" else address
    try:
        if auth.loopback(raw):
            auth.local_only()
        target = raw if "://" in raw else canonicalize_bootstrap_address_or_die(raw)
        host, _, port = target.split("://", 1)[-1].rpartition(":")
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), timeout)
    except (TimeoutError, ConnectionError, OSError, ValueError) as e:
        raise KrexError("unreachable", f"no Ray cluster at {address!r}: {e or type(e).__name__}") from None
    try:
        sock = writer.get_extra_info("socket")
        peer = sock.getpeername()[:2]
        await clustertrust.check_peer(target, sock.getsockname()[:2], peer, uids)
    finally:
        writer.close()
    # the address checked, not a name that Ray would resolve again (perhaps to another address)
    checked = tcp.ip(peer[0])
    hostport = f"[{checked}]:{port}" if checked.version == 6 else f"{checked}:{port}"
    return f"ray://{hostport}" if target.startswith("ray://") else hostport
