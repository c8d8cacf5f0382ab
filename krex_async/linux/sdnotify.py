"""systemd's notify protocol, without libsystemd: READY=1 once serving, WATCHDOG=1 while alive.

    notify("READY=1\\nSTATUS=serving on /run/krex/krex.sock")   # after the socket listens
    task = loop.create_task(watchdog_loop())                    # pings at half of WatchdogSec
    notify("STOPPING=1")                                        # when shutdown begins

A datagram goes to $NOTIFY_SOCKET: a filesystem path, or an abstract socket when it starts with '@'.
Outside systemd (no NOTIFY_SOCKET) every call is a no-op that returns False. A send that fails (the
manager went away, a full socket buffer) returns False and never raises: the daemon does not depend
on its supervisor being there. The watchdog ping runs on the event loop on purpose: a loop that stalls
stops pinging, and systemd restarts a daemon that no longer answers anyone.
"""

from __future__ import annotations

import asyncio
import os
import socket

__all__ = ["notify", "watchdog_interval", "watchdog_loop"]


def _address(value: str) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None  # vsock: and other forms are not used on a node


def notify(msg: str, env: dict[str, str] | None = None) -> bool:
    """Send one notify message (e.g. "READY=1", "WATCHDOG=1", "STATUS=..."). True if it was sent.

    Opens and closes its own socket each call; never raises for a missing or broken NOTIFY_SOCKET."""
    addr = _address((env if env is not None else os.environ).get("NOTIFY_SOCKET", ""))
    if addr is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.setblocking(False)
            s.sendto(msg.encode(), addr)
    except OSError:
        return False
    return True


def watchdog_interval(env: dict[str, str] | None = None) -> float | None:
    """Seconds between pings (half of WATCHDOG_USEC), or None when no watchdog is asked for this
    process (WATCHDOG_USEC unset or invalid, or WATCHDOG_PID naming another process)."""
    e = env if env is not None else os.environ
    try:
        usec = int(e.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = e.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 2e6


async def watchdog_loop(env: dict[str, str] | None = None) -> None:
    """Ping WATCHDOG=1 every half watchdog period until cancelled; returns at once without a watchdog."""
    interval = watchdog_interval(env)
    if interval is None:
        return
    while True:
        notify("WATCHDOG=1", env)
        await asyncio.sleep(interval)
