"""Prefect bookkeeping for a distributed call: one parent task run, one child task run per rank,
artifacts and events.

The ranks run in their own processes; a child task run is the rank's face in Prefect. It is
created Running (linked to the parent task run), receives that rank's output in its logs while
the rank runs, and ends in the rank's state: Completed, Failed with its exception, or Cancelled
with the reason it was stopped. The runs are created concurrently while the rank processes
start, so Prefect's API latency is never on the critical path of rank start.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from prefect import Task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE, CachePolicy
from prefect.states import Cancelled, Completed, Failed

from skytasks.controller.call import ECHO_RANK_LINES
from skytasks.controller.events import emit, pool_resource, rank_resource
from skytasks.controller.rank_group import RankOutcome

RANK_RUN_JOIN_SECONDS = 60.0
METRICS_ARTIFACT_EVERY_SECONDS = 5.0  # each write is a new artifact version: keep the graph readable


def _rank_run(label: str, rank: int, world: int) -> None:
    """Never executed: rank runs are recorded straight through the API (see RankRuns)."""


# The task the rank runs belong to (its key groups them in the UI). Ranks are never served from
# Prefect's result cache: their runs are created directly, with no cache key at all.
RANK_TASK = Task(_rank_run, name="skytasks-rank", cache_policy=NO_CACHE, persist_result=False, retries=0)


class RankRun:
    """One rank's task run: created Running while the rank starts, fed its lines live, and set
    Completed, Failed or Cancelled when the rank is done. Lines that arrive before the run
    exists wait in a buffer."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.logger: Any = None
        self.buffered: list[tuple[int, str]] = []
        self.outcome: RankOutcome | None = None
        self.recorded: RankOutcome | None = None  # the outcome the API holds
        self.lock = threading.Lock()

    def log(self, level: int, line: str) -> None:
        with self.lock:
            if self.logger is None:
                self.buffered.append((level, line))
                return
        self.logger.log(level, "[rank %d] %s", self.rank, line)


class RankRuns:
    """The rank task runs of one attempt, recorded straight through the Prefect API.

    Why not run each rank as a Prefect task in a thread: the task engine makes several API calls
    per run, and acquires tag concurrency slots for every tagged run (`rank:R`, `skytasks`,
    ...); run concurrently, those calls contend for the server's database. Direct creation is
    one or two API calls per rank, made in order on one thread, off the ranks' critical path."""

    def __init__(self, label: str, world: int, attempt: int, run_tags: tuple[str, ...], record: CallRecord):
        from prefect.client.orchestration import get_client
        from prefect.context import TaskRunContext
        from prefect.logging.loggers import task_run_logger

        parent = TaskRunContext.get()
        assert parent is not None, "rank runs are recorded inside the parent task run"
        self.record = record
        self.runs = {r: RankRun(r) for r in range(world)}
        # Inside a flow, get_client hands out the flow's own client: entered and exited here, it
        # would be closed under the flow (the next attempt's or the artifacts' calls then fail).
        from prefect.context import SyncClientContext

        shared = SyncClientContext.get()
        self._client = get_client(sync_client=True)
        self._owns_client = shared is None or shared.client is not self._client
        if self._owns_client:
            self._client.__enter__()
        # One bookkeeping thread, in order: measured here against Prefect's SQLite server, 16
        # concurrent task-run creations took 13 s (write-lock contention), 16 in sequence 0.9 s.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skytasks-rank-runs")
        self._created: dict[int, Future] = {}
        self._finished: list[Future] = []
        self._flow_run = parent.task_run.flow_run_id
        self._parent_logger = task_run_logger(parent.task_run, task=parent.task)
        self._echo = ECHO_RANK_LINES.get()
        for r in range(world):
            self._created[r] = self._pool.submit(
                self._create, parent.task_run.id, label, r, world, attempt, ("skytasks", f"rank:{r}", *run_tags)
            )

    def _create(self, parent_id, label: str, rank: int, world: int, attempt: int, tags: tuple[str, ...]):
        from prefect.client.schemas.objects import TaskRunResult
        from prefect.logging.loggers import task_run_logger
        from prefect.states import Running

        run = self.runs[rank]
        # A rank that already ended (a short call) is created in its final state: one API call.
        outcome = run.outcome
        task_run = self._client.create_task_run(
            task=RANK_TASK, flow_run_id=self._flow_run, dynamic_key=f"{parent_id}-{attempt}-{rank}",
            name=f"{label}[rank {rank}/{world}]", extra_tags=list(tags),
            state=Running() if outcome is None else self._final_state(rank, outcome),
            task_inputs={"__parents__": [TaskRunResult(id=parent_id)]},
        )
        logger = task_run_logger(task_run, task=RANK_TASK)
        with run.lock:
            pending, run.buffered = run.buffered, []
            run.logger = logger
        for level, line in pending:
            logger.log(level, "[rank %d] %s", rank, line)
        if outcome is not None:
            self._log_end(rank, outcome)
            run.recorded = outcome
        return task_run

    @staticmethod
    def _final_state(rank: int, outcome: RankOutcome) -> Any:
        if outcome.status == "completed":
            return Completed()
        if outcome.status == "failed" and outcome.failure is not None:
            exc = outcome.failure.exception
            return Failed(message=f"rank {rank} failed: {type(exc).__name__}: {exc}")
        return Cancelled(message=f"rank {rank}: {outcome.stop_reason or 'stopped'}")

    def _log_end(self, rank: int, outcome: RankOutcome) -> None:
        logger = self.runs[rank].logger
        state = self._final_state(rank, outcome)
        if outcome.status == "failed" and outcome.failure is not None:
            exc = outcome.failure.exception
            logger.error("[rank %d] failed", rank, exc_info=(type(exc), exc, exc.__traceback__))
        logger.log(logging.ERROR if state.is_failed() else logging.INFO, "Finished in state %s", state.name)

    def _finish(self, rank: int, outcome: RankOutcome) -> None:
        task_run = self._created[rank].result()
        run = self.runs[rank]
        if run.recorded is outcome:  # created in this very state
            return
        self._log_end(rank, outcome)
        self._client.set_task_run_state(task_run.id, self._final_state(rank, outcome), force=True)
        run.recorded = outcome

    def on_output(self, rank: int, stream: str, line: str) -> None:
        self.runs[rank].log(logging.WARNING if stream == "stderr" else logging.INFO, line)
        if self._echo:
            print(f"[rank {rank}] {line}", file=sys.stderr if stream == "stderr" else sys.stdout, flush=True)

    def on_log(self, rank: int, level: int, line: str) -> None:
        self.runs[rank].log(level, line)

    def on_rank_done(self, rank: int, outcome: RankOutcome) -> None:
        run = self.runs[rank]
        first = run.outcome is None
        run.outcome = outcome
        if outcome.status == "failed":
            self.record.on_rank_failed(outcome)
        if first or outcome.status == "failed":  # a failure that raced the stop replaces it
            self._finished.append(self._pool.submit(self._finish, rank, outcome))

    def on_report(self, rank: int, metrics: dict[str, Any]) -> None:
        self.record.on_report(rank, metrics)

    def on_notice(self, text: str) -> None:
        self._parent_logger.warning("[skytasks] %s", text)

    def on_stacks(self, stacks: dict[int, str], why: str) -> None:
        """Each rank's whole stack into its own run's log; a row per rank in one artifact."""
        from skytasks.stacks import user_frame, where

        for rank, stack in sorted(stacks.items()):
            self.runs[rank].log(logging.WARNING, f"stack ({why}), innermost frame first:\n{stack}")
        rows = [{"rank": r, "where": where(st), "user frame": user_frame(st)} for r, st in sorted(stacks.items())]
        if rows:
            create_table_artifact(rows, key=_artifact_key(self.record.label, "stacks"),
                                  description=f"{self.record.label}: where each rank was ({why})")

    def close(self, reason: str) -> list[RankOutcome]:
        """Whatever happened, every rank run ends before the parent does."""
        for r, run in self.runs.items():
            if run.outcome is None:
                self.on_rank_done(r, RankOutcome(rank=r, node_rank=-1, node_addr="", status="stopped", stop_reason=reason))
        deadline = time.monotonic() + RANK_RUN_JOIN_SECONDS
        for fut in list(self._created.values()) + self._finished:
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - bookkeeping must not hide the call's outcome
                print(f"[skytasks] could not record a rank run: {exc!r}", file=sys.stderr)
        self._pool.shutdown(wait=False)
        if self._owns_client:
            self._client.__exit__(None, None, None)
        return [self.runs[r].outcome for r in sorted(self.runs)]  # type: ignore[misc]


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


def run_as_parent_task(label: str, pool_name: str, run_tags: tuple[str, ...],
                       body: Callable[[Callable[[int, int], RankRuns]], list[Any]]) -> list[Any]:
    """Run `body` inside a parent task run named after the task; its result is persisted."""

    def parent(label: str) -> list[Any]:
        record = CallRecord(label, pool_name)
        observers: list[RankRuns] = []

        def observer_for_attempt(attempt: int, world: int) -> RankRuns:
            if observers:
                observers[-1].close(f"attempt {attempt - 1} ended")
            observers.append(RankRuns(label, world, attempt, run_tags, record))
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
