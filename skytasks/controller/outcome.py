"""How a call attempt ended, as values: each rank's `RankState`, the attempt's `CallOutcome`, and
the `FailurePolicy` that decides from it whether the runner tries again.

After torch.distributed.elastic's `WorkerState`/`RunResult` and Ray Train's `FailurePolicy` →
`FailureDecision`: the state machine (`call_run`) reports what happened, a small pure policy
decides, and the runner applies the decision. The policy is Prefect's own for tasks:
`timeout_seconds` bounds each attempt, and every failure of the code is retried while retries are
left. A node lost or preempted is not the code's failure: like torch elastic's membership changes
and SkyPilot's preemption recovery (kept apart from `max_restarts_on_errors`), it restarts the
attempt from a budget of its own, `node_recoveries`, and never uses up a retry.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from skytasks.errors import DistributedTaskError


class RankState(StrEnum):
    PENDING = "pending"  # running, or not yet started
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"  # ended by us because of another rank, a node, a clock or the caller


class EndReason(StrEnum):
    """Why an attempt ended: the root cause's kind."""

    COMPLETED = "completed"
    RANK_FAILED = "rank failed"  # a rank raised, or its process died
    NODE_LOST = "node lost"  # an agent's stream closed or fell silent, its agent failed, or it is going away
    PREEMPTED = "preempted"  # a node had a preemption notice: the head saved and ended the attempt (Preempted)
    HANG = "hang"  # hang_timeout_seconds without a sign of progress
    INIT_TIMEOUT = "init timeout"  # the process group did not form
    DEADLINE = "deadline"  # timeout_seconds
    POOL_START = "pool did not start"  # PoolStartError before any rank ran


@dataclass(frozen=True)
class CallOutcome:
    reason: EndReason
    values: list[Any] | None = None  # every rank's value in rank order, when COMPLETED
    error: BaseException | None = None  # what the caller gets when nothing more is tried (its failures too)

    @property
    def ok(self) -> bool:
        return self.reason is EndReason.COMPLETED

    def unwrap(self) -> list[Any]:
        if self.ok:
            return list(self.values or [])
        assert self.error is not None
        raise self.error

    @property
    def cause(self) -> BaseException | None:
        """The root cause: the first member of the group, or the error itself."""
        if isinstance(self.error, DistributedTaskError):
            return self.error.exceptions[0]
        return self.error


# Ends that are the pool's doing (the cloud's, the scheduler's, the network's), not the code's.
MEMBERSHIP_ENDS = frozenset({EndReason.NODE_LOST, EndReason.PREEMPTED})


@dataclass(frozen=True)
class Spent:
    """What a call's attempts so far have used of each budget."""

    retries: int = 0
    node_recoveries: int = 0


@dataclass(frozen=True)
class Decision:
    retry: bool
    why: str
    charged: str | None = None  # the budget the next attempt uses: "retries" or "node_recoveries"

    def spent(self, before: Spent) -> Spent:
        if self.charged == "retries":
            return Spent(before.retries + 1, before.node_recoveries)
        if self.charged == "node_recoveries":
            return Spent(before.retries, before.node_recoveries + 1)
        return before


@dataclass(frozen=True)
class FailurePolicy:
    """Retry an attempt the code failed while retries are left (as Prefect retries a task,
    timeouts included); recover from a node lost or preempted while node recoveries are left.
    Interrupts never reach the policy: they are raised, not outcomes."""

    retries: int
    node_recoveries: int = 3

    def decide(self, outcome: CallOutcome, spent: Spent = Spent()) -> Decision:
        if outcome.ok:
            return Decision(False, "completed")
        if outcome.reason in MEMBERSHIP_ENDS:
            left = self.node_recoveries - spent.node_recoveries
            if left <= 0:
                return Decision(False, f"{outcome.reason}; no node recoveries left ({self.node_recoveries} allowed)")
            return Decision(True, f"{outcome.reason}; {left} node recover{'y' if left == 1 else 'ies'} left",
                            "node_recoveries")
        left = self.retries - spent.retries
        if left <= 0:
            return Decision(False, f"{outcome.reason}; no retries left ({self.retries} allowed)")
        return Decision(True, f"{outcome.reason}; {left} retr{'y' if left == 1 else 'ies'} left", "retries")
