"""Prefect bookkeeping for a distributed call: one parent task run, one child task run per rank,
artifacts and events.

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
import re
import sys
import threading
import time
from typing import Any, Callable

from prefect import Task, tags as prefect_tags
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE, CachePolicy
from prefect.logging import get_run_logger
from prefect.states import Cancelled

from skytasks.events import emit, pool_resource, rank_resource
from skytasks.lifecycle import RankOutcome

_DONE = object()
_VIEWS: contextvars.ContextVar[dict[int, "RankView"]] = contextvars.ContextVar("skytasks_rank_views")
RANK_RUN_JOIN_SECONDS = 60.0
METRICS_ARTIFACT_EVERY_SECONDS = 1.0


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
        logger.log(level, "[rank %d] %s", rank, line)
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


class _ThisTaskRunOnly(CachePolicy):
    """A key unique to one task run: the parent's result is written to storage (NO_CACHE would
    leave it unwritten) and no other call, even an identical one in the same flow run, can be
    served from it. Prefect's RUN_ID is keyed on the flow run, so it would do exactly that."""

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any) -> str | None:
        return f"skytasks-call-{task_ctx.task_run.id}" if task_ctx else None


_THIS_TASK_RUN_ONLY = _ThisTaskRunOnly()


def _artifact_key(label: str, suffix: str) -> str:
    # Artifact keys: lowercase letters, digits and dashes only.
    return re.sub(r"[^a-z0-9-]+", "-", f"{label}-{suffix}".lower()).strip("-")


def _summary(outcome: RankOutcome) -> str:
    if outcome.status == "failed" and outcome.failure is not None:
        text = f"{type(outcome.failure.exception).__name__}: {outcome.failure.exception}"
    elif outcome.status == "completed":
        text = repr(outcome.value)
    else:
        text = outcome.stop_reason
    return text if len(text) <= 100 else text[:97] + "..."


class CallRecord:
    """Artifacts and events of one call, across its attempts: a live progress bar, a live
    metrics table from `skytasks.report`, and a final table with one row per rank."""

    def __init__(self, label: str, pool_name: str):
        self.label, self.pool_name = label, pool_name
        self.started = time.monotonic()
        self.metrics: list[dict[str, Any]] = []
        self._metrics_written_at = 0.0
        self.progress_id = create_progress_artifact(
            0.0, key=_artifact_key(label, "progress"), description=f"{label}: progress of the distributed call"
        )

    def on_report(self, rank: int, metrics: dict[str, Any]) -> None:
        self.metrics.append({"rank": rank, **metrics})
        progress = metrics.get("progress")
        if progress is None and "epoch" in metrics and metrics.get("epochs"):
            progress = metrics["epoch"] / metrics["epochs"]
        if isinstance(progress, (int, float)):
            update_progress_artifact(self.progress_id, max(0.0, min(100.0, progress * 100 if progress <= 1 else progress)))
        if time.monotonic() - self._metrics_written_at >= METRICS_ARTIFACT_EVERY_SECONDS:
            self.write_metrics()

    def write_metrics(self) -> None:
        if self.metrics:
            self._metrics_written_at = time.monotonic()
            create_table_artifact(self.metrics, key=_artifact_key(self.label, "metrics"),
                                  description=f"{self.label}: metrics reported by the ranks (skytasks.report)")

    def on_rank_failed(self, outcome: RankOutcome) -> None:
        exc = outcome.failure.exception if outcome.failure else None
        emit("skytasks.rank.failed", rank_resource(self.label, outcome.rank),
             related=[pool_resource(self.pool_name)],
             payload={"task": self.label, "rank": outcome.rank, "node": outcome.node_rank, "address": outcome.node_addr,
                      "exception_type": type(exc).__name__, "message": str(exc)[:500]})

    def finish(self, outcomes: list[RankOutcome], error: BaseException | None) -> None:
        self.write_metrics()
        rows = [{"rank": o.rank, "node": o.node_rank, "address": o.node_addr, "outcome": o.status,
                 "seconds": round(o.ended - o.started, 3) if o.started and o.ended else None,
                 "summary": _summary(o)} for o in outcomes]
        create_table_artifact(rows, key=_artifact_key(self.label, "ranks"),
                              description=f"{self.label}: one row per rank")
        if error is None:
            update_progress_artifact(self.progress_id, 100.0)
        emit("skytasks.call.failed" if error else "skytasks.call.completed",
             {"prefect.resource.id": f"skytasks.call.{self.label}", "prefect.resource.name": self.label},
             related=[pool_resource(self.pool_name)],
             payload={"task": self.label, "ranks": len(outcomes), "seconds": round(time.monotonic() - self.started, 3),
                      "error": repr(error)[:500] if error else None})


class PrefectObserver:
    """Routes one attempt's rank output to the rank task runs, and starts those runs."""

    def __init__(self, label: str, world: int, run_tags: tuple[str, ...], record: CallRecord):
        self.record = record
        self.views = {r: RankView() for r in range(world)}
        self.threads: list[threading.Thread] = []
        token = _VIEWS.set(self.views)
        try:
            for r in range(world):
                ctx = contextvars.copy_context()
                t = threading.Thread(target=ctx.run, args=(self._run_rank, label, r, world, run_tags),
                                     daemon=True, name=f"skytasks-rank-run-{r}")
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
        if outcome.status == "failed":
            self.record.on_rank_failed(outcome)

    def on_report(self, rank: int, metrics: dict[str, Any]) -> None:
        self.record.on_report(rank, metrics)

    def close(self, reason: str) -> list[RankOutcome]:
        """Whatever happened, every rank run ends and is joined before the parent ends."""
        for r, view in self.views.items():
            if not view.closed:
                view.finish(RankOutcome(rank=r, node_rank=-1, node_addr="", status="stopped", stop_reason=reason))
        for t in self.threads:
            t.join(timeout=RANK_RUN_JOIN_SECONDS)
        return [self.views[r].outcome for r in sorted(self.views)]  # type: ignore[misc]


def run_as_parent_task(label: str, pool_name: str, run_tags: tuple[str, ...],
                       body: Callable[[Callable[[int, int], PrefectObserver]], list[Any]]) -> list[Any]:
    """Run `body` inside a parent task run named after the task; its result is persisted."""

    def parent(label: str) -> list[Any]:
        record = CallRecord(label, pool_name)
        observers: list[PrefectObserver] = []

        def observer_for_attempt(attempt: int, world: int) -> PrefectObserver:
            if observers:
                observers[-1].close(f"attempt {attempt - 1} ended")
            observers.append(PrefectObserver(label, world, run_tags, record))
            return observers[-1]

        error: BaseException | None = None
        try:
            return body(observer_for_attempt)
        except BaseException as exc:
            error = exc
            raise
        finally:
            reason = f"the call ended: {type(error).__name__}" if error else "the call ended"
            outcomes = [o.close(reason) for o in observers][-1] if observers else []
            record.finish(outcomes, error)

    parent_task = Task(
        parent,
        name=label,
        task_run_name=label,
        tags=["skytasks", *run_tags],
        cache_policy=_THIS_TASK_RUN_ONLY,
        persist_result=True,
        result_serializer="pickle",  # Prefect's pickle serializer is cloudpickle
        retries=0,
    )
    return parent_task(label=label)
