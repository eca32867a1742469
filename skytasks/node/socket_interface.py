"""Which network interface reaches the group's head: gloo (and nccl's bootstrap) are pointed at it,
and the head's TCPStore listens on it alone (`peer_listener`).
A node's template finds it once for a group's ranks before it forks them; a cold rank finds its
own. Standard library only."""

from __future__ import annotations

import errno
import fcntl
import ipaddress
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


# torch's TCPStore listens with this backlog (libuv's daemon): 1,024 ranks connect at once.
STORE_BACKLOG = 16384


def peer_listener(head_addr: str, port: int, peers: list[str] | None = None) -> socket.socket:
    """A TCP socket listening on `port` at the address the pool's peers reach the head by, never
    at 0.0.0.0 or ::. torch's TCPStore, left to bind by itself, listens on every interface, and
    PyTorch's security policy is plain that whoever reaches its port can run code in the ranks:
    so the head binds it here and hands torch the descriptor (`master_listen_fd`).

    Where: `head_addr` (MASTER_ADDR) itself when it is an address of this machine, as it is on
    every provider but behind NAT; else the local address of the route towards it (the
    interface the peers' packets arrive on). A name that resolves here to loopback (Debian's
    127.0.1.1 for the host's own name) while other peers are elsewhere is not what they reach:
    then the route towards them decides. OSError (EADDRINUSE, or no such address) otherwise."""
    others = [p for p in (peers or []) if p != head_addr]
    last: OSError | None = None
    for family, address in _candidates(head_addr, others):
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own bind does
            sock.bind((address, port))
            sock.listen(STORE_BACKLOG)
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise OSError(exc.errno, f"the rendezvous port {address}:{port} is taken: {exc.strerror}") from exc
            last = exc
    raise OSError(errno.EADDRNOTAVAIL, f"no address of this machine reaches the pool's peers at {head_addr}"
                                       f"{f' ({last})' if last else ''}; nothing listens on every interface")


def _candidates(head_addr: str, others: list[str]) -> list[tuple[int, str]]:
    """Where the head's listener may bind, best first (`peer_listener`)."""
    found: list[tuple[int, str]] = []
    try:
        infos = socket.getaddrinfo(head_addr, None, type=socket.SOCK_STREAM)
    except OSError:
        infos = []
    peers_elsewhere = any(not _is_loopback(p) for p in others)
    for family, _, _, _, sockaddr in infos:
        address = str(sockaddr[0])
        if family in (socket.AF_INET, socket.AF_INET6) and not (peers_elsewhere and _is_loopback(address)):
            found.append((family, address))
    for target in [head_addr, *others]:
        route = _route_source(target)
        if route is not None and not (peers_elsewhere and _is_loopback(route[1])):
            found.append(route)
    return [c for i, c in enumerate(found) if c not in found[:i] and c[1] not in ("0.0.0.0", "::", "")]


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a name: loopback if that is all it resolves to here
        try:
            return all(ipaddress.ip_address(i[4][0]).is_loopback for i in socket.getaddrinfo(address, None))
        except (OSError, ValueError):
            return False


def _route_source(address: str) -> tuple[int, str] | None:
    """The local address this machine sends from towards `address` (a UDP connect sends nothing)."""
    try:
        for family, _, _, _, sockaddr in socket.getaddrinfo(address, 9, type=socket.SOCK_DGRAM):
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                try:
                    probe.connect(sockaddr)
                except OSError:
                    continue
                return family, str(probe.getsockname()[0])
    except OSError:
        pass
    return None
