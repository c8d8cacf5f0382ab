"""Beyond one node: the Ray fleet (`pip install 'krex[fleet]'`).

    agents ─► FleetClient ──Ray──► NodeAgent actor per node ──Unix socket──► that node's krex daemon
    krex gateway --fleet ADDR ─► the same FleetClient behind the agate jobs API

agent.py    the per-node actor's body (owns or reaches the daemon; capacity; streamed runs)
placement.py which node and device a command goes to (pure)
discovery.py when the client asks Ray for its nodes again (pure)
client.py   FleetClient: Client's shape over the fleet (imports Ray)
handle.py   FleetHandle: one command's stream and result; how a lost agent ends it
raycluster.py joining a Ray cluster; node names (imports Ray)
auth.py     Ray's token authentication on; agents' sealed requests; who commands run as
local.py    a Ray cluster of N nodes on this machine with a daemon each (demo, tests, bench)
cli.py      `krex fleet status | demo`

Ray is imported only by client.py, handle.py, raycluster.py and local.py, so the base install
stays light; `require_ray()` says how to get it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any


def require_ray() -> str | None:
    """None when Ray can be imported here, else what to install."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        return f"the fleet needs Ray (pip install 'krex[fleet]'): {e}"
    return None


def fleet_connector(address: str, token_file: str | None = None) -> Callable[[], Awaitable[Any]]:
    """For `krex gateway --fleet ADDRESS [--ray-token-file F]`: the gateway JobRunner's connect(),
    giving one FleetClient for the gateway's life (it keeps its nodes' views fresh itself); until it
    exists, each call tries again and raises KrexError('unreachable' | 'bad_token', ...) as the
    daemon's connect does."""
    made: list[Any] = []

    async def connect() -> Any:
        if not made:
            from krex_async.fleet.client import FleetClient

            made.append(await FleetClient.connect(address, token_file=token_file))
        return made[0]

    return connect
