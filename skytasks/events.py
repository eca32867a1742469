"""What happens to a pool and a call, as typed values.

The controller, the session and the providers say what happened with one of these, never with
prose: `observer.on_event(event)` during a call, `PoolReporter.event(event)` from a provider. Each
event renders itself (`text()`, at `LEVEL`) for the console and the run's log, and those with a
`PREFECT_EVENT` name become a Prefect event with `payload()` (`skytasks.prefect_records` does
that), so a Prefect Automation can act on them: "notify me when a node of pool X is preempted".
Tests assert on these values, not on their wording. Standard library only.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from skytasks.preemption import going_at


@dataclass(frozen=True)
class Event:
    LEVEL: ClassVar[int] = logging.INFO
    PREFECT_EVENT: ClassVar[str | None] = None  # e.g. "skytasks.node.lost"; None: a log line only
    PAYLOAD: ClassVar[tuple[str, ...] | None] = None  # the fields the Prefect event carries; None: all

    def text(self) -> str:
        raise NotImplementedError

    def payload(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        return fields if self.PAYLOAD is None else {k: fields[k] for k in self.PAYLOAD}


def _nodes(count: int) -> str:
    return f"{count} node{'s' * (count != 1)}"


# -- membership ------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodeLost(Event):
    """A node's agent stream closed or fell silent, or its agent failed or is going away."""

    LEVEL = logging.WARNING
    PREFECT_EVENT = "skytasks.node.lost"
    node: int
    address: str
    reason: str

    def text(self) -> str:
        return f"node {self.node} ({self.address}) was lost: {self.reason}"


@dataclass(frozen=True)
class NodeReconnecting(Event):
    """A node's stream broke (or fell silent) while the node may still run: the controller opens
    a new stream to the same agent, for up to `seconds`, before the node counts as lost."""

    LEVEL = logging.WARNING
    node: int
    address: str
    reason: str
    seconds: float  # reattach_seconds

    def text(self) -> str:
        return (f"node {self.node} ({self.address}): its stream broke ({self.reason}); re-attaching for up to "
                f"{self.seconds:g}s")


@dataclass(frozen=True)
class NodeReconnected(Event):
    """A node whose stream broke was reached again: its ranks ran on, nothing was lost, and the
    call goes on with no retry or node recovery spent."""

    PREFECT_EVENT = "skytasks.node.reconnected"
    node: int
    address: str
    down_seconds: float  # from the break being noticed to the new stream carrying the old one's bytes

    def text(self) -> str:
        return (f"node {self.node} ({self.address}) was out of reach for {self.down_seconds:.1f}s; re-attached, "
                f"the call goes on")


@dataclass(frozen=True)
class NodePreempted(Event):
    """A preemption notice: the node runs, but will be taken away (at `deadline`, when known)."""

    LEVEL = logging.WARNING
    PREFECT_EVENT = "skytasks.node.preempted"
    node: int
    address: str
    source: str  # the notice in the scheduler's or the cloud's words
    deadline: float | None = None

    def text(self) -> str:
        return (f"node {self.node} ({self.address}) will be taken away: {self.source}{going_at(self.deadline)}; "
                f"every rank is told (rank_info().preempted)")


@dataclass(frozen=True)
class NodeReplaced(Event):
    PREFECT_EVENT = "skytasks.node.replaced"
    PAYLOAD = ("node", "old_address", "new_address")
    node: int
    old_address: str
    new_address: str
    why: str  # "was lost", "was preempted (...)"
    seconds: float

    def text(self) -> str:
        return (f"node {self.node} ({self.old_address}) {self.why}; replaced by a new node ({self.new_address}) "
                f"in {self.seconds:.2f}s")


@dataclass(frozen=True)
class PoolShrank(Event):
    """An elastic pool dropped a node it lost and goes on with the ones left."""

    LEVEL = logging.WARNING
    PREFECT_EVENT = "skytasks.pool.shrank"
    PAYLOAD = ("from_nodes", "to_nodes", "reason")
    from_nodes: int
    to_nodes: int
    reason: str  # "node 1 (10.0.0.2) was preempted (...)"
    most: int
    procs_per_node: int

    def text(self) -> str:
        ranks = self.to_nodes * self.procs_per_node
        return (f"{self.reason}; the elastic pool goes on with the {_nodes(self.to_nodes)} left, "
                f"{ranks} rank{'s' * (ranks != 1)}, and grows back toward {self.most} nodes before a later call")


@dataclass(frozen=True)
class PoolGrew(Event):
    PREFECT_EVENT = "skytasks.pool.grew"
    PAYLOAD = ("from_nodes", "to_nodes", "reason")
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
class GrowFailed(Event):
    """An elastic pool short of its most nodes could not get (all of) them now: said, never raised."""

    LEVEL = logging.WARNING
    PREFECT_EVENT = "skytasks.pool.grow-failed"
    PAYLOAD = ("wanted", "have", "reason")
    wanted: int
    have: int
    reason: str
    retry_seconds: float

    def text(self) -> str:
        return (f"the pool has {self.have} of {self.wanted} nodes: {self.reason}; it tries again before a call "
                f"{self.retry_seconds:g}s from now or later")


# -- attempts --------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttemptRestarted(Event):
    """An attempt failed and the whole group restarts: a retry (the code's failure) or a node
    recovery (a node lost or preempted), each from its own budget."""

    LEVEL = logging.WARNING
    PREFECT_EVENT = "skytasks.attempt.restarted"
    PAYLOAD = ("task", "attempt", "reason", "retries_left", "node_recoveries_left")
    task: str
    attempt: int  # the attempt that failed
    reason: str  # the EndReason: "rank failed", "node lost", "preempted", ...
    cause: str  # the root cause, as repr
    charged: str  # "retries" or "node_recoveries"
    retries_left: int
    node_recoveries_left: int
    delay: float

    def text(self) -> str:
        if self.charged == "node_recoveries":
            budget = (f"a node recovery, not a retry ({self.node_recoveries_left} node "
                      f"recover{'y' if self.node_recoveries_left == 1 else 'ies'} left)")
        else:
            budget = f"{self.retries_left} retr{'y' if self.retries_left == 1 else 'ies'} left"
        return (f"{self.task}: attempt {self.attempt} failed ({self.cause}); {self.reason}; {budget}; "
                f"restarting the ranks in {self.delay:g}s")


@dataclass(frozen=True)
class _Said(Event):
    """An event that is its sentence, already written where it happened."""

    message: str

    def text(self) -> str:
        return self.message


@dataclass(frozen=True)
class RanksStillRunning(_Said):
    """Some ranks returned and others still run: a warning, never a failure."""

    LEVEL = logging.WARNING


# -- what a call or a provider says along the way ---------------------------------------------

@dataclass(frozen=True)
class LinesDropped(Event):
    """The record fell behind the ranks' output: lines past the controller's backlog were dropped,
    counted per rank, so the ranks never wait and the controller's memory stays bounded."""

    LEVEL = logging.WARNING
    PREFECT_EVENT = "skytasks.call.lines-dropped"
    PAYLOAD = ("total", "ranks")
    counts: tuple[tuple[int, int], ...]  # (rank, lines dropped), most first
    backlog: int  # the most lines the controller holds waiting

    @property
    def total(self) -> int:
        return sum(n for _, n in self.counts)

    def payload(self) -> dict[str, Any]:
        return {"total": self.total, "ranks": len(self.counts)}

    def text(self) -> str:
        shown = "; ".join(f"rank {r}: {n:,}" for r, n in self.counts[:5])
        more = f"; and {len(self.counts) - 5} more ranks" if len(self.counts) > 5 else ""
        return (f"{self.total:,} output lines dropped: the record fell behind the ranks ({shown}{more}); the "
                f"controller holds at most {self.backlog:,} waiting lines (SKYTASKS_LINE_BACKLOG)")


@dataclass(frozen=True)
class BackendChosen(_Said):
    """A backend fallback the user should know of (skytasks.devices)."""


@dataclass(frozen=True)
class WorkdirSynced(_Said):
    """What `workdir=` sent to the nodes."""


@dataclass(frozen=True)
class ProviderNote(Event):
    """A provider's word on its nodes (a launch short of capacity, a job's output line, ...)."""

    pool: str
    provider: str
    message: str
    level: int = logging.INFO

    def text(self) -> str:
        return self.message


@dataclass(frozen=True)
class ProviderProgress(Event):
    """Nodes coming up: `ready` of `total`, and what the rest are doing."""

    pool: str
    provider: str
    ready: int
    total: int
    detail: str

    def text(self) -> str:
        return f"{self.pool}: {self.ready}/{self.total} nodes ready - {self.detail}"


@dataclass(frozen=True)
class TeardownFailed(Event):
    LEVEL = logging.ERROR
    PREFECT_EVENT = "skytasks.pool.teardown-failed"
    PAYLOAD = ("provider", "pool_id", "resources", "detail")
    pool: str
    provider: str
    pool_id: str
    resources: tuple[str, ...]
    detail: str

    def text(self) -> str:
        return (f"{self.pool_id}: teardown could not confirm these gone: {', '.join(self.resources) or '(unknown)'} "
                f"({self.detail}); `skytasks gc` finds them by their tags or job name")

    def payload(self) -> dict[str, Any]:
        return {"provider": self.provider, "pool_id": self.pool_id, "resources": list(self.resources),
                "detail": self.detail}


def level_of(event: Event) -> int:
    """An event's log level (a provider's note carries its own)."""
    return event.level if isinstance(event, ProviderNote) else event.LEVEL


# -- a pool's life ---------------------------------------------------------------------------

@dataclass(frozen=True)
class PoolUp(Event):
    LEVEL = logging.DEBUG  # the console and the log already say what the provider did
    PREFECT_EVENT = "skytasks.pool.up"
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
class PoolDown(Event):
    LEVEL = logging.DEBUG
    PREFECT_EVENT = "skytasks.pool.down"
    provider: str

    def text(self) -> str:
        return "the pool is down"


# -- warm pools (keep_warm_minutes; skytasks.controller.warm) --------------------------------

@dataclass(frozen=True)
class PoolAttached(Event):
    """This process took a warm pool's running nodes over instead of starting new ones."""

    PREFECT_EVENT = "skytasks.pool.attached"
    pool: str
    nodes: int
    up_seconds: float  # since the pool's nodes were started
    calls: int  # calls run on them before this process

    def text(self) -> str:
        return (f"attached to warm pool {self.pool} ({_nodes(self.nodes)}, up {self.up_seconds / 60:.0f} min, "
                f"{self.calls} call{'s' * (self.calls != 1)})")


@dataclass(frozen=True)
class PoolReleased(Event):
    """This process let a warm pool go: its nodes stay up for the next one, until unheld this long."""

    PREFECT_EVENT = "skytasks.pool.released"
    pool: str
    nodes: int
    keep_warm_minutes: float
    expires_at: float  # epoch seconds: when the nodes end unless another process holds them first

    def text(self) -> str:
        return (f"released warm pool {self.pool}: its {_nodes(self.nodes)} stay up for the next process for "
                f"{self.keep_warm_minutes:g} min")


@dataclass(frozen=True)
class PoolExpired(Event):
    """A warm pool's nodes were found gone (unheld past keep_warm_minutes, or ended otherwise): its
    record is removed, and a process that wanted it starts the pool afresh."""

    PREFECT_EVENT = "skytasks.pool.expired"
    pool: str
    reason: str

    def text(self) -> str:
        return f"warm pool {self.pool} has ended ({self.reason})"


# -- listening -------------------------------------------------------------------------------

_listeners: list[list[Event]] = []


class listen:
    """Every event this process says while the block runs, in order: pools' and calls' alike.

        with skytasks.events.listen() as heard:
            train()
        assert any(isinstance(e, NodePreempted) for e in heard)
    """

    def __enter__(self) -> list[Event]:
        self._heard: list[Event] = []
        _listeners.append(self._heard)
        return self._heard

    def __exit__(self, *exc: object) -> None:
        _listeners.remove(self._heard)


def announce(event: Event) -> None:
    """Called once per event where it is said (the console, the Prefect observer, a reporter)."""
    for heard in list(_listeners):
        heard.append(event)
