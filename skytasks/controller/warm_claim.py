"""A warm pool's record as generations, and the rules a process follows while it waits on one.

**Generations.** Every write of a pool's record is generation N+1 of a record the writer read at
generation N, and it happens only if N is still the newest (`WarmStore.write`: compare-and-set).
A process that lost the pool (another took its nodes while its streams were broken) holds an old
generation, so its release writes nothing; it never overwrites the newer holder's record. A pool
that ends leaves a tombstone (state "gone", no secret) as its newest generation, so the numbers
never start over and a writer from before it cannot come back.

**Claims.** A process that finds no pool writes a "starting" placeholder (one generation, so of two
processes only one starts the pool) and rewrites it every CLAIM_REFRESH_SECONDS while it starts.
A waiter takes a placeholder for abandoned only when its generation did not change for
CLAIM_STALE_SECONDS on the waiter's own monotonic clock: no clock of another machine is read.

**Backoff.** A waiter asks again after a wait that doubles: up to HELD_BACKOFF's most while a
holder has the pool (each ask keeps its place in the agents' line, node/holding.py's
TICKET_SECONDS), up to UNREAD_BACKOFF's most while the provider could not be read.

Pure: every rule takes `now`, so tests/test_warm_decisions.py drives them with a fake clock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

RECORD_VERSION = 2
STARTING, UP, GONE = "starting", "up", "gone"
CLAIM_REFRESH_SECONDS = 10.0
CLAIM_STALE_SECONDS = 60.0
HELD_BACKOFF = (0.5, 3.0)  # below the agents' TICKET_SECONDS (5 s): a waiter keeps its place in line
UNREAD_BACKOFF = (1.0, 30.0)


class WarmStore(Protocol):
    """Where warm pools' records are kept, by pool name (a secret store: they hold the pool's key).
    The controller is handed one (skytasks.wiring: Prefect's secrets, prefect_records/warm_store.py)
    and never looks one up."""

    def newest(self, pool: str) -> tuple[int, dict[str, Any] | None]:
        """The newest generation (0: never written) and its record (None: none, or a tombstone)."""

    def write(self, pool: str, record: dict[str, Any], after: int) -> bool:
        """Write generation `after` + 1, only if `after` is the newest; False when another
        process wrote first (nothing is written then)."""

    def names(self) -> list[str]:
        """The pools that have a live record."""


def tombstone(pool: str) -> dict[str, Any]:
    """What is left of an ended pool's record: no key, no node, its generation only."""
    return {"version": RECORD_VERSION, "pool": pool, "state": GONE}


class Backoff:
    """Waits that double from `first` to `most`; `reset` when something changed."""

    def __init__(self, first: float, most: float):
        self.first, self.most = first, most
        self._next = first

    def wait(self) -> float:
        wait, self._next = self._next, min(self._next * 2, self.most)
        return wait

    def reset(self) -> None:
        self._next = self.first


class ClaimWatch:
    """A "starting" placeholder as one waiter sees it: abandoned once its generation stayed the
    same for `stale` seconds of this process's clock (its starter rewrites it while it lives)."""

    def __init__(self, stale: float = CLAIM_STALE_SECONDS):
        self.stale = stale
        self.generation: int | None = None
        self.since = 0.0

    def abandoned(self, generation: int, now: float) -> bool:
        if generation != self.generation:
            self.generation, self.since = generation, now
            return False
        return now - self.since >= self.stale


# What one node of a record turned out to be, as a process tried to hold it.
HELD, NODE_GONE, UNREAD = "held", "gone", "unread"
# What the process then does with the pool.
ATTACH, POOL_GONE, ASK_AGAIN = "attach", "pool gone", "ask again"


@dataclass(frozen=True)
class NodeTries:
    """How the nodes of one attempt went: held, definitely gone (the provider's NodeGone, another
    agent at the door, lost before the release), or unread (no answer: maybe only out of reach)."""

    held: int
    gone: int
    unread: int


def verdict(tries: NodeTries, unread_since: float | None, now: float, grace: float) -> str:
    """ATTACH, POOL_GONE (only when every node is definitely gone) or ASK_AGAIN. Nodes that could
    not be read hold the attach back (their agents may run on) until they stayed unread for
    `grace` seconds while others were held; then they are taken as lost, to be replaced."""
    if tries.unread:
        if tries.held and unread_since is not None and now - unread_since >= grace:
            return ATTACH
        return ASK_AGAIN
    return ATTACH if tries.held else POOL_GONE


class ClaimKeeper:
    """Rewrites a "starting" placeholder every CLAIM_REFRESH_SECONDS while the pool starts, so a
    waiter sees its generation move; stops when another process took the claim (`stop`: None)."""

    def __init__(self, store: WarmStore, pool: str, placeholder: dict[str, Any], generation: int):
        self.store, self.pool, self.placeholder, self.generation = store, pool, dict(placeholder), generation
        self.lost = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"skytasks-claim-{pool}")

    def start(self) -> ClaimKeeper:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(CLAIM_REFRESH_SECONDS):
            with self._lock:
                if self._stop.is_set():
                    return
                self.placeholder["beat"] = int(self.placeholder.get("beat", 0)) + 1
                try:
                    written = self.store.write(self.pool, self.placeholder, self.generation)
                except Exception:  # noqa: BLE001 - the API out of reach: the next beat tries again
                    continue
                if not written:
                    self.lost = True
                    return
                self.generation += 1

    def stop(self) -> int | None:
        """The generation the claim stands at now, or None when it was taken."""
        with self._lock:
            self._stop.set()
        self._thread.join(timeout=60)
        return None if self.lost else self.generation
