"""Prefect bookkeeping for a distributed call: one parent task run, one child task run per rank.

The ranks run in their own processes; a child task run is the rank's face in Prefect. It is
created in a thread of its own (with a copy of the parent's context, so Prefect links it to the
parent task run), relays that rank's output to its run logger while the rank runs, and ends in
the rank's state: Completed with its value, Failed with its exception, or Cancelled with the
reason it was stopped. Rank processes are started before any child run exists, so Prefect's API
latency is never on the critical path of rank start.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import sys
import threading
from typing import Any, Callable

from prefect import Task, tags as prefect_tags
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger
from prefect.states import Cancelled

from skytasks.lifecycle import RankOutcome

_DONE = object()
_VIEWS: contextvars.ContextVar[dict[int, "RankView"]] = contextvars.ContextVar("skytasks_rank_views")
RANK_RUN_JOIN_SECONDS = 60.0


class RankView:
    """What one rank's task run shows: its log lines as they come, then its outcome."""

    def __init__(self) -> None:
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self.outcome: RankOutcome | None = None
        self.closed = False

    def finish(self, outcome: RankOutcome) -> None:
        self.outcome = outcome  # a later, more precise outcome (a raced failure) replaces it
        if not self.closed:
            self.closed = True
            self.lines.put(_DONE)


def _rank_run(label: str, rank: int, world: int) -> Any:
    view = _VIEWS.get()[rank]
    logger = get_run_logger()
    while (item := view.lines.get()) is not _DONE:
        level, line = item
        logger.log(level, line)
    outcome = view.outcome
    assert outcome is not None
    if outcome.status == "completed":
        return outcome.value
    if outcome.status == "failed" and outcome.failure is not None:
        raise outcome.failure.exception
    return Cancelled(message=f"rank {rank}: {outcome.stop_reason or 'stopped'}")


# One task for every rank run; the name and tags are set per run. Ranks must never be served
# from Prefect's result cache (identical inputs on every rank would come back Cached).
RANK_TASK = Task(
    _rank_run,
    name="skytasks-rank",
    task_run_name="{label}[rank {rank}/{world}]",
    cache_policy=NO_CACHE,
    persist_result=False,
    retries=0,
)


class PrefectObserver:
    """Routes one attempt's rank output to the rank task runs, and starts those runs."""

    def __init__(self, label: str, world: int, run_tags: tuple[str, ...]):
        self.views = {r: RankView() for r in range(world)}
        self.threads: list[threading.Thread] = []
        token = _VIEWS.set(self.views)
        try:
            for r in range(world):
                ctx = contextvars.copy_context()
                t = threading.Thread(
                    target=ctx.run, args=(self._run_rank, label, r, world, run_tags),
                    daemon=True, name=f"skytasks-rank-run-{r}",
                )
                t.start()
                self.threads.append(t)
        finally:
            _VIEWS.reset(token)

    @staticmethod
    def _run_rank(label: str, rank: int, world: int, run_tags: tuple[str, ...]) -> None:
        with prefect_tags("skytasks", f"rank:{rank}", *run_tags):
            RANK_TASK(label=label, rank=rank, world=world, return_state=True)

    def on_output(self, rank: int, stream: str, line: str) -> None:
        self.on_log(rank, logging.WARNING if stream == "stderr" else logging.INFO, line)

    def on_log(self, rank: int, level: int, line: str) -> None:
        view = self.views[rank]
        if view.closed:  # a straggler after the rank's run ended: keep it visible on the console
            print(f"[rank {rank}] {line}", file=sys.stderr)
        else:
            view.lines.put((level, line))

    def on_rank_done(self, rank: int, outcome: RankOutcome) -> None:
        self.views[rank].finish(outcome)

    def close(self, reason: str) -> None:
        """Whatever happened, every rank run ends and is joined before the parent ends."""
        for r, view in self.views.items():
            if not view.closed:
                view.finish(RankOutcome(rank=r, node_rank=-1, node_addr="", status="stopped", stop_reason=reason))
        for t in self.threads:
            t.join(timeout=RANK_RUN_JOIN_SECONDS)


def run_as_parent_task(label: str, run_tags: tuple[str, ...], body: Callable[[Callable[[int, int], PrefectObserver]], list[Any]]) -> list[Any]:
    """Run `body` inside a parent task run named after the task; its result is persisted."""
    observers: list[PrefectObserver] = []

    def observer_for_attempt(attempt: int, world: int) -> PrefectObserver:
        if observers:
            observers[-1].close(f"attempt {attempt - 1} ended")
        observers.append(PrefectObserver(label, world, run_tags))
        return observers[-1]

    def parent(label: str) -> list[Any]:
        try:
            return body(observer_for_attempt)
        except BaseException as exc:
            reason = f"the call ended: {type(exc).__name__}"
            for o in observers:
                o.close(reason)
            raise
        finally:
            for o in observers:
                o.close("the call ended")

    parent_task = Task(
        parent,
        name=label,
        task_run_name=label,
        tags=["skytasks", *run_tags],
        cache_policy=NO_CACHE,
        persist_result=True,
        result_serializer="pickle",  # Prefect's pickle serializer is cloudpickle,
        retries=0,
    )
    return parent_task(label=label)
