"""How a call attempt ended, as values: each rank's `RankState`, the attempt's `CallOutcome`, and
the `FailurePolicy` that decides from it whether the runner tries again.

After torch.distributed.elastic's `WorkerState`/`RunResult` and Ray Train's `FailurePolicy` →
`FailureDecision`: the state machine (`call_run`) reports what happened, a small pure policy
decides, and the runner applies the decision. The policy is Prefect's own for tasks:
`timeout_seconds` bounds each attempt, and every failure is retried while retries are left.
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


@dataclass(frozen=True)
class Decision:
    retry: bool
    why: str


@dataclass(frozen=True)
class FailurePolicy:
    """Retry any failed attempt while retries are left (as Prefect retries a task, timeouts
    included). Interrupts never reach the policy: they are raised, not outcomes."""

    retries: int

    def decide(self, outcome: CallOutcome, attempt: int) -> Decision:
        if outcome.ok:
            return Decision(False, "completed")
        left = self.retries - (attempt - 1)
        if left <= 0:
            return Decision(False, f"{outcome.reason}; no retries left ({self.retries} allowed)")
        return Decision(True, f"{outcome.reason}; {left} retr{'y' if left == 1 else 'ies'} left")
