"""The rendezvous port of a rank group: free when chosen, and outside the range the kernel hands
out to outgoing connections.

A port asked of the kernel (bind to port 0) comes from that ephemeral range, and so does the
local port of every connection this machine opens: between choosing it and the head's TCPStore
binding it, a flow's HTTP client could take it (EADDRINUSE at init_process_group).
A random port below the range, checked free, is never given to a connection. Standard library
only and self-contained: remote nodes run this file's text as it is (`port_snippet`).
"""

import random
import socket

_TORCHRUN_DEFAULTS = range(29400, 29501)  # torchrun's --master_port and c10d rendezvous: left to it


def ephemeral_range() -> tuple[int, int]:
    """The ports this machine gives outgoing connections (Linux's ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def candidates(low: int, high: int) -> range:
    """Where to choose, given the ephemeral range [low, high]: below it from 10000 (clear of the
    well-known and registered ports most daemons use), or above it when there is no room below."""
    return range(10000, low) if low - 10000 >= 4096 else range(high + 1, 65536)


def free_port(address: str = "", tries: int = 64) -> int:
    """A port nothing listens on now, chosen outside the ephemeral range (`candidates`); the
    kernel's own choice if none of `tries` was free. The check binds `address` ("": every
    interface, so the port is free on each of them) and never listens: nothing can connect to it,
    and the head's store binds only the peers' interface later (`socket_interface.peer_listener`)."""
    pool = candidates(*ephemeral_range())
    for _ in range(tries if len(pool) else 0):
        port = random.choice(pool)
        if port in _TORCHRUN_DEFAULTS:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((address, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def port_snippet() -> str:
    """Python code that prints a free port of the machine it runs on (for `python -c` on a node)."""
    import inspect
    import sys

    return inspect.getsource(sys.modules[__name__]) + "\nprint(free_port())\n"
