"""What a caller without a token can hold: connections, per address and in time.

    accept --> over --max-connections-per-address from that address? close its oldest connection
               that has not authenticated (none: the new one)
           --> no authenticated request within --unauthenticated-timeout? closed

A connection becomes trusted with its first request that carries a valid token (the middleware
calls `trust`); from then on aiohttp's keep-alive timeout governs it. Behind a reverse proxy every
caller has the proxy's address: raise the cap there. `raise_nofile` lifts the soft open-files limit
to the hard one at start, so a burst of connections meets the cap before EMFILE.
"""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Callable
from typing import Any

DEFAULT_PER_ADDRESS = 128
DEFAULT_IDLE = 10.0  # seconds a connection may stay without an authenticated request


def raise_nofile() -> str:
    """Raise the soft RLIMIT_NOFILE to the hard limit; a line saying so ("" when nothing changed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft >= hard:
        return ""
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError) as e:
        return f"cannot raise the open-files limit from {soft} to {hard}: {e}"
    return f"open-files limit raised from {soft} to {hard}"


class _Conn:
    __slots__ = ("addr", "timer", "transport", "trusted")

    def __init__(self, addr: str, transport: asyncio.BaseTransport, timer: asyncio.TimerHandle) -> None:
        self.addr, self.transport, self.timer, self.trusted = addr, transport, timer, False


class ConnectionGuard:
    """Tracks the server's connections by peer address (`install` hooks aiohttp's Server)."""

    def __init__(self, per_address: int = DEFAULT_PER_ADDRESS, idle: float = DEFAULT_IDLE) -> None:
        self.per_address, self.idle = per_address, idle
        self.conns: dict[object, _Conn] = {}  # handler -> its connection
        self.by_addr: dict[str, dict[object, None]] = {}  # address -> its handlers, oldest first
        self.evicted = self.refused = self.expired = 0

    def install(self, server: Any) -> None:
        """Wrap `server.connection_made/lost` (aiohttp's web_server.Server, which every
        RequestHandler reports to) on this instance."""
        made: Callable[[object, asyncio.Transport], None] = server.connection_made
        lost: Callable[[object, BaseException | None], None] = server.connection_lost

        def connection_made(handler: object, transport: asyncio.Transport) -> None:
            made(handler, transport)
            self.made(handler, transport)

        def connection_lost(handler: object, exc: BaseException | None = None) -> None:
            self.lost(handler)
            lost(handler, exc)

        server.connection_made = connection_made
        server.connection_lost = connection_lost

    def made(self, handler: object, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        addr = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        mine = self.by_addr.setdefault(addr, {})
        if len(mine) >= self.per_address:
            victim = next((h for h in mine if not self.conns[h].trusted), None)
            if victim is None:  # all of them authenticated: the newcomer waits for one to end
                self.refused += 1
                transport.close()
                return
            self.evicted += 1
            self._drop(victim).transport.close()
        timer = asyncio.get_running_loop().call_later(self.idle, self._expire, handler)
        self.conns[handler] = _Conn(addr, transport, timer)
        mine[handler] = None

    def lost(self, handler: object) -> None:
        if handler in self.conns:
            self._drop(handler)

    def trust(self, handler: object) -> None:
        """The connection made a request with a valid token: no idle deadline of ours any more."""
        conn = self.conns.get(handler)
        if conn is not None and not conn.trusted:
            conn.trusted = True
            conn.timer.cancel()

    def _expire(self, handler: object) -> None:
        conn = self.conns.get(handler)
        if conn is not None and not conn.trusted:
            self.expired += 1
            self._drop(handler).transport.close()

    def _drop(self, handler: object) -> _Conn:
        conn = self.conns.pop(handler)
        conn.timer.cancel()
        mine = self.by_addr[conn.addr]
        del mine[handler]
        if not mine:
            del self.by_addr[conn.addr]
        return conn
