"""Which network interface reaches the group's head: gloo (and nccl's bootstrap) are pointed at it.
A node's template finds it once for a group's ranks before it forks them; a cold rank finds its
own. Standard library only."""

from __future__ import annotations

import fcntl
import os
import socket
import struct


def pick_socket_interface(head_addr: str) -> None:
    """Point gloo (and nccl's bootstrap) at the interface that reaches the head, unless the user
    chose one. Left alone, gloo binds to whatever this machine's hostname resolves to, which on
    multi-NIC hosts, in containers or in network namespaces is often an address the peers cannot
    reach, or none at all ("Unable to find address for hostname")."""
    if os.environ.get("GLOO_SOCKET_IFNAME") and os.environ.get("NCCL_SOCKET_IFNAME"):
        return
    if head_addr not in _ROUTES:
        find_routes({head_addr})
    name = _ROUTES[head_addr]
    if name:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


# Head address -> the interface that reaches it. A node's template finds them for each group's
# ranks before it forks them (one probe a node, not one a rank); a cold rank finds its own.
_ROUTES: dict[str, str | None] = {}


def find_routes(addresses: set[str]) -> None:
    """Find afresh the interface towards each address (a route can change between groups)."""
    _ROUTES.clear()
    for address in addresses:
        _ROUTES[address] = _interface_towards(address) if address else None


def _interface_towards(address: str) -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # a UDP connect sends nothing; it only picks the route
            local = probe.getsockname()[0]
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                except OSError:
                    continue  # no IPv4 address on this interface
                if socket.inet_ntoa(packed[20:24]) == local:
                    return name
    except OSError:
        pass
    return None
