"""On a rank, before torch's rendezvous: can this rank reach the head at all?

torch's TCPStore client retries an unreachable head until its whole timeout (minutes), so a node
behind a firewall or without a route would only be found by a clock, and every rank would be
waiting, none named. With a preflight on, a rank first opens (and closes) one plain TCP
connection to the head's store port: refused means the head is not listening yet (tried again),
no route or silence past the budget means this node cannot reach it, and the rank fails at once
naming both ends. Standard library only.
"""

from __future__ import annotations

import errno
import os
import socket
import time

NO_ROUTE = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL}
NO_ROUTE_GRACE = 3.0  # a route may still be coming up (an interface just set up): seconds before it counts


class HeadUnreachable(ConnectionError):
    """This rank cannot open a connection to the head's rendezvous port."""


def reach_head(addr: str, port: int, budget: float) -> None:
    """Return once a TCP connection to the head's port opens; HeadUnreachable naming the rank, its
    node and the head when it cannot within `budget` seconds (or NO_ROUTE_GRACE without a route)."""
    started = time.monotonic()
    no_route_since: float | None = None
    last: OSError | None = None
    while True:
        left = budget - (time.monotonic() - started)
        if left <= 0:
            break
        try:
            with socket.create_connection((addr, port), timeout=min(2.0, left)):
                return
        except OSError as exc:
            last = exc
            if exc.errno in NO_ROUTE:
                no_route_since = no_route_since or time.monotonic()
                if time.monotonic() - no_route_since >= NO_ROUTE_GRACE:
                    break
            else:
                no_route_since = None
        time.sleep(0.1)
    rank, node = os.environ.get("RANK", "?"), os.environ.get("GROUP_RANK", "?")
    why = os.strerror(last.errno) if last is not None and last.errno else (str(last) if last else "no answer")
    raise HeadUnreachable(f"rank {rank} on node {node} cannot reach the head's rendezvous at {addr}:{port}: {why} "
                          f"(after {time.monotonic() - started:.1f}s)")
