"""Who the pool's members are, as values: a `PoolStatus`, and a policy that maps it to decisions.

After Ray Train v2's scaling policies (`ResizeDecision` / `NoopDecision`) and torch elastic's
agent, where a change of members is not a failure: the session reads its nodes into a frozen
`PoolStatus`, asks the pool's `MembershipPolicy` what to do, and carries the decisions out through
the provider. The policies are pure functions of the status (the clock is in it too), tested
table-driven in tests/test_membership.py without a process.

    FixedPolicy     every lost or going node is replaced; the pool never shrinks or grows
    ElasticPolicy   lost or going nodes are dropped while at least `min` are left (the rest
                    replaced); before a call, never between the attempts of one, a pool short of
                    its most grows back, at most once per `grow_retry_seconds` after a shortfall
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Union


@dataclass(frozen=True)
class GoneNode:
    node_id: int  # the provider's key for it
    node_rank: int
    address: str
    reason: str  # "was lost: ...", "was preempted (...)"
    preempted: bool = False


@dataclass(frozen=True)
class PoolStatus:
    live: tuple[int, ...]  # node ids a new group may be placed on, in rank order
    gone: tuple[GoneNode, ...]  # lost, or with a preemption notice: they must leave before a group
    counts: tuple[int, int]  # (min, max) nodes
    now: float  # monotonic
    grow_failed_at: float | None = None  # when growing last came up short
    grow_retry_seconds: float = 60.0
    before_call: bool = False  # a call's first attempt: the one moment a pool may grow


@dataclass(frozen=True)
class Keep:
    """Nothing to change."""


@dataclass(frozen=True)
class Replace:
    node_ids: tuple[int, ...]


@dataclass(frozen=True)
class Drop:
    node_ids: tuple[int, ...]


@dataclass(frozen=True)
class Grow:
    count: int


Decision = Union[Keep, Replace, Drop, Grow]


class MembershipPolicy(Protocol):
    def decide(self, status: PoolStatus) -> tuple[Decision, ...]: ...


@dataclass(frozen=True)
class FixedPolicy:
    """Exactly the pool's nodes: a lost or going node is replaced."""

    def decide(self, status: PoolStatus) -> tuple[Decision, ...]:
        if not status.gone:
            return (Keep(),)
        return (Replace(tuple(g.node_id for g in status.gone)),)


@dataclass(frozen=True)
class ElasticPolicy:
    """Between `counts` (min, max): go on with the nodes left while at least min are, replacing
    only what keeps it at min; grow back toward max before a call, not more than once a
    `grow_retry_seconds` after coming up short."""

    def decide(self, status: PoolStatus) -> tuple[Decision, ...]:
        fewest, most = status.counts
        decisions: list[Decision] = []
        left = len(status.live)
        if status.gone:
            replace = max(0, fewest - left)
            kept, dropped = status.gone[:replace], status.gone[replace:]
            if dropped:
                decisions.append(Drop(tuple(g.node_id for g in dropped)))
            if kept:
                decisions.append(Replace(tuple(g.node_id for g in kept)))
            left += len(kept)
        throttled = status.grow_failed_at is not None and status.now < status.grow_failed_at + status.grow_retry_seconds
        if status.before_call and left < most and not throttled:
            decisions.append(Grow(most - left))
        return tuple(decisions) or (Keep(),)


def policy_for(counts: tuple[int, int]) -> MembershipPolicy:
    return ElasticPolicy() if counts[0] < counts[1] else FixedPolicy()
