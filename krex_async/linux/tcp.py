"""Whose process holds this host's end of a TCP connection, from /proc/net/tcp and /proc/net/tcp6
(this network namespace's sockets, every user's, readable by any user): a client about to send a
secret over a connection it just made can ask who accepted it, as a Unix socket's client asks
SO_PEERCRED. A connection made to another host has no such end here. Standard library only.
"""

from __future__ import annotations

import ipaddress
import struct

from krex_async.linux import procfs

IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def ip(text: str) -> IP:
    """An address, an IPv4-mapped IPv6 one as the IPv4 address it maps."""
    return _unmapped(ipaddress.ip_address(text.split("%")[0]))


def _unmapped(a: IP) -> IP:
    return a.ipv4_mapped if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None else a


def _endpoint(text: str) -> tuple[IP, int]:
    """A /proc/net/tcp address: 32-bit words in hex, in host byte order, then the port in hex."""
    addr, _, port = text.partition(":")
    words = [int(addr[i : i + 8], 16) for i in range(0, len(addr), 8)]
    return _unmapped(ipaddress.ip_address(b"".join(struct.pack("=I", w) for w in words))), int(port, 16)


def owner(end: tuple[str, int], other: tuple[str, int], proc: str = procfs.PROC) -> tuple[bool, int | None]:
    """Whether this host holds the socket at `end` (address, port) connected to `other`, and the
    uid owning it once a process has accepted it: the user of the process that called accept()
    (its socket's inode is that process's). (False, None): no such socket here (`end` is another
    host's). (True, None): one that no process holds: still in its listener's queue, whose uid is
    whoever made the listener (0 on kernels before 6.17), closed, or in TIME_WAIT. OSError when a
    table cannot be read."""
    want = ((ip(end[0]), end[1]), (ip(other[0]), other[1]))
    here = False
    for row in procfs.tcp_sockets(proc):
        # sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
        cols = row.split()
        if (_endpoint(cols[1]), _endpoint(cols[2])) == want:
            if cols[9] != "0":
                return True, int(cols[7])
            here = True
    return here, None
