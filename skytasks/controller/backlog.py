"""Between the node streams and the call: the controller's queue of what the nodes said.

A rank may print faster than the record (the console, Prefect's log API) can take it: 1,024
ranks at 10 lines a second is 10,000 lines a second. Output and log lines wait in the queue only
while it holds fewer than `limit` messages; past that a line is dropped and counted for its rank,
and the call says how many (`LinesDropped`), never silently. The ranks never wait on the record
(the reader threads never block), and the controller's memory stays bounded. Every other message
(results, failures, exits, stacks) always gets through.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from typing import Any

from skytasks.protocol import Op

LINE_OPS = frozenset({Op.OUTPUT, Op.LOG})


class NodeEvents:
    """The session's event queue with a bound on waiting lines: `put` is what the node readers call."""

    def __init__(self, limit: int):
        # SimpleQueue: C-implemented, with no Condition for 128 reader threads to queue up on.
        self.queue: queue.SimpleQueue[tuple[int, dict[str, Any]]] = queue.SimpleQueue()
        self.limit = limit
        self._lock = threading.Lock()
        self._dropped: Counter[int] = Counter()

    def put(self, item: tuple[int, dict[str, Any]]) -> None:
        _, msg = item
        if msg["op"] in LINE_OPS and self.queue.qsize() >= self.limit:
            with self._lock:
                self._dropped[msg.get("rank", -1)] += 1
            return
        self.queue.put(item)

    def get(self, timeout: float | None = None) -> tuple[int, dict[str, Any]]:
        return self.queue.get(timeout=timeout)

    def get_nowait(self) -> tuple[int, dict[str, Any]]:
        return self.queue.get_nowait()

    def empty(self) -> bool:
        return self.queue.empty()

    def take_dropped(self) -> tuple[tuple[int, int], ...]:
        """The lines dropped since the last take, per rank, most first; and the count starts again."""
        with self._lock:
            dropped, self._dropped = self._dropped, Counter()
        return tuple(sorted(dropped.items(), key=lambda kv: (-kv[1], kv[0])))
