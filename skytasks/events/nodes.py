"""What happens to a pool's nodes: lost, out of reach and back, preempted, replaced."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from skytasks.events.event import Event
from skytasks.preemption import going_at


@dataclass(frozen=True)
class NodeLost(Event, level=logging.WARNING, prefect="skytasks.node.lost"):
    """A node's agent stream closed or fell silent, or its agent failed or is going away."""

    TEXT = "node {node} ({address}) was lost: {reason}"
    node: int
    address: str
    reason: str


@dataclass(frozen=True)
class NodeReconnecting(Event, level=logging.WARNING):
    """A node's stream broke (or fell silent) while the node may still run: the controller opens
    a new stream to the same agent, for up to `seconds`, before the node counts as lost."""

    TEXT = "node {node} ({address}): its stream broke ({reason}); re-attaching for up to {seconds:g}s"
    node: int
    address: str
    reason: str
    seconds: float  # reattach_seconds


@dataclass(frozen=True)
class NodeReconnected(Event, prefect="skytasks.node.reconnected"):
    """A node whose stream broke was reached again: its ranks ran on, nothing was lost, and the
    call goes on with no retry or node recovery spent."""

    TEXT = "node {node} ({address}) was out of reach for {down_seconds:.1f}s; re-attached, the call goes on"
    node: int
    address: str
    down_seconds: float  # from the break being noticed to the new stream carrying the old one's bytes


@dataclass(frozen=True)
class NodePreempted(Event, level=logging.WARNING, prefect="skytasks.node.preempted"):
    """A preemption notice: the node runs, but will be taken away (at `deadline`, when known)."""

    TEXT = "node {node} ({address}) will be taken away: {source}{going}; every rank is told (rank_info().preempted)"
    node: int
    address: str
    source: str  # the notice in the scheduler's or the cloud's words
    deadline: float | None = None

    @property
    def going(self) -> str:
        return going_at(self.deadline)


@dataclass(frozen=True)
class NodeReplaced(Event, prefect="skytasks.node.replaced", payload=("node", "old_address", "new_address")):
    TEXT = "node {node} ({old_address}) {why}; replaced by a new node ({new_address}) in {seconds:.2f}s"
    node: int
    old_address: str
    new_address: str
    why: str  # "was lost", "was preempted (...)"
    seconds: float
