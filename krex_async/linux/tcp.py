"""Who listens on a TCP port of this host, from /proc/net/tcp and /proc/net/tcp6 (this network
namespace's sockets, every user's, readable by any user): a client that is about to send a secret
to 127.0.0.1:PORT can first ask whose process will hear it, as a Unix socket's client asks
SO_PEERCRED. Standard library only.
"""

from __future__ import annotations

import ipaddress
import struct

IP = ipaddress.IPv4Address | ipaddress.IPv6Address

LISTEN = "0A"  # the kernel's TCP_LISTEN, as /proc/net/tcp prints a socket's state
TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def _address(text: str) -> IP:
    """A /proc/net/tcp local address's IP: 32-bit words printed in hex in host byte order."""
    words = [int(text[i : i + 8], 16) for i in range(0, len(text), 8)]
    raw = b"".join(struct.pack("=I", w) for w in words)
    return ipaddress.ip_address(raw)


def _reaches(bound: IP, ip: IP) -> bool:
    """Whether a listener bound to `bound` may accept a connection to `ip`: the same address, its
    IPv4-mapped form, or a wildcard (an IPv6 wildcard takes IPv4 too unless IPV6_V6ONLY, which
    /proc does not show: counted, so that no listener that might answer is missed)."""
    if bound.is_unspecified:
        return bound.version == 6 or ip.version == 4
    if isinstance(bound, ipaddress.IPv6Address) and bound.ipv4_mapped is not None:
        bound = bound.ipv4_mapped
    return bound == ip


def listener_uids(host: str, port: int, tables: tuple[str, ...] = TABLES) -> set[int]:
    """The uids owning the listening sockets a connection to `host`:`port` (an IP address) could
    reach; empty when none listens. OSError when a table cannot be read."""
    ip = ipaddress.ip_address(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    uids = set()
    for table in tables:
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
        for line in lines:
            # sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid ...
            fields = line.split()
            local, state, uid = fields[1], fields[3], fields[7]
            addr, _, hexport = local.partition(":")
            if state == LISTEN and int(hexport, 16) == port and _reaches(_address(addr), ip):
                uids.add(int(uid))
    return uids
