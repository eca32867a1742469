"""How long a node's stream has been silent: the controller gives up a node, and an agent its
controller, when nothing arrives for longer than the heartbeat timeout."""

from __future__ import annotations

import select
import time
from typing import Any


def _bytes_waiting(stream: Any) -> bool:
    """Whether the stream's descriptor has bytes (or its end) ready to read, without reading them."""
    try:
        poller = select.poll()  # not select(): a controller of 128 nodes has descriptors past 1,024
        poller.register(stream.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no descriptor (an SSH channel object), or closed
        return False


class HeardStream:
    """A reading stream that remembers when bytes last arrived. Any byte proves the far end is
    alive, so a frame of 500 MB that takes a minute to cross is never mistaken for silence."""

    def __init__(self, stream: Any):  # a binary stream with readinto (a pipe, a socket file)
        self._stream = stream
        self.last_heard = time.monotonic()

    def readinto(self, buffer: Any) -> int | None:
        n = self._stream.readinto(buffer)
        if n:
            self.last_heard = time.monotonic()
        return n

    def silent_for(self) -> float:
        """Seconds since a byte last arrived. Bytes that wait unread in the stream count as heard:
        a reader that is behind (its thread starved of CPU on a loaded machine) is not a far end
        that fell silent, and must not have its node given up."""
        silent = time.monotonic() - self.last_heard
        if silent > 1.0 and _bytes_waiting(self._stream):
            self.last_heard = time.monotonic()
            return 0.0
        return silent

    def close(self) -> None:
        self._stream.close()
