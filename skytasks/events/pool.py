"""What happens to a pool as a whole: up and down, shrunk, grown back or short, and a warm pool
(keep_warm_minutes; skytasks.controller.warm) attached, released or found ended."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from skytasks.events.event import Event, counted


@dataclass(frozen=True)
class PoolUp(Event, level=logging.DEBUG, prefect="skytasks.pool.up"):
    """The pool's nodes are up (at DEBUG: the console and the log already say what the provider did)."""

    provider: str
    nodes: int
    asked: str  # "2", or "2-4" for an elastic pool
    procs_per_node: int
    addresses: tuple[str, ...]

    def text(self) -> str:
        return f"the pool is up: {self.nodes} of {self.asked} nodes ({', '.join(self.addresses)})"

    def payload(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "addresses": list(self.addresses)}


@dataclass(frozen=True)
class PoolDown(Event, level=logging.DEBUG, prefect="skytasks.pool.down"):
    TEXT = "the pool is down"
    provider: str


# -- an elastic pool's size ------------------------------------------------------------------

@dataclass(frozen=True)
class PoolShrank(Event, level=logging.WARNING, prefect="skytasks.pool.shrank", payload=("from_nodes", "to_nodes", "reason")):
    """An elastic pool dropped a node it lost and goes on with the ones left."""

    from_nodes: int
    to_nodes: int
    reason: str  # "node 1 (10.0.0.2) was preempted (...)"
    most: int
    procs_per_node: int

    def text(self) -> str:
        return (f"{self.reason}; the elastic pool goes on with the {counted(self.to_nodes, 'node')} left, "
                f"{counted(self.to_nodes * self.procs_per_node, 'rank')}, and grows back toward {self.most} nodes "
                f"before a later call")


@dataclass(frozen=True)
class PoolGrew(Event, prefect="skytasks.pool.grew", payload=("from_nodes", "to_nodes", "reason")):
    from_nodes: int
    to_nodes: int
    most: int
    addresses: tuple[str, ...]
    seconds: float
    ranks: int
    reason: str = "grew back toward its most nodes before a call"

    def text(self) -> str:
        return (f"the pool grew back to {self.to_nodes} of {self.most} nodes ({', '.join(self.addresses)}) in "
                f"{self.seconds:.2f}s; this call runs on {self.ranks} ranks")


@dataclass(frozen=True)
class GrowFailed(Event, level=logging.WARNING, prefect="skytasks.pool.grow-failed", payload=("wanted", "have", "reason")):
    """An elastic pool short of its most nodes could not get (all of) them now: said, never raised."""

    TEXT = ("the pool has {have} of {wanted} nodes: {reason}; it tries again before a call {retry_seconds:g}s from "
            "now or later")
    wanted: int
    have: int
    reason: str
    retry_seconds: float


# -- a warm pool -----------------------------------------------------------------------------

@dataclass(frozen=True)
class PoolAttached(Event, prefect="skytasks.pool.attached"):
    """This process took a warm pool's running nodes over instead of starting new ones."""

    pool: str
    nodes: int
    up_seconds: float  # since the pool's nodes were started
    calls: int  # calls run on them before this process

    def text(self) -> str:
        return (f"attached to warm pool {self.pool} ({counted(self.nodes, 'node')}, up {self.up_seconds / 60:.0f} "
                f"min, {counted(self.calls, 'call')})")


@dataclass(frozen=True)
class PoolReleased(Event, prefect="skytasks.pool.released"):
    """This process let a warm pool go: its nodes stay up for the next one, until unheld this long."""

    pool: str
    nodes: int
    keep_warm_minutes: float
    expires_at: float  # epoch seconds: when the nodes end unless another process holds them first

    def text(self) -> str:
        return (f"released warm pool {self.pool}: its {counted(self.nodes, 'node')} stay up for the next process "
                f"for {self.keep_warm_minutes:g} min")


@dataclass(frozen=True)
class PoolExpired(Event, prefect="skytasks.pool.expired"):
    """A warm pool's nodes were found gone (unheld past keep_warm_minutes, or ended otherwise): its
    record is removed, and a process that wanted it starts the pool afresh."""

    TEXT = "warm pool {pool} has ended ({reason})"
    pool: str
    reason: str
