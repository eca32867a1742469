"""Prefect's view of a distributed call, as one observer of the runner.

Per attempt, a task run per rank (`rank_runs`); per call, a live progress bar, a live metrics
table from `skytasks.report`, a final table with one row per rank, a stacks table when ranks
were stopped, and `skytasks.*` events. The call itself is the parent task run
(`prefect_task`), which this observer only reads from the context.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import copy_context
from typing import Any, Callable

from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.context import TaskRunContext
from prefect.logging.loggers import task_run_logger

from skytasks.controller.events import emit, pool_resource, rank_resource
from skytasks.controller.rank_group import RankOutcome
from skytasks.controller.rank_runs import RankRuns
from skytasks.controller.runner import ECHO_RANK_LINES, outcome_summary
from skytasks.stacks import user_frame, where

METRICS_ARTIFACT_EVERY_SECONDS = 5.0  # each write is a new artifact version: keep the graph readable


def artifact_key(label: str, suffix: str) -> str:
    # Artifact keys: lowercase letters, digits and dashes only.
    return re.sub(r"[^a-z0-9-]+", "-", f"{label}-{suffix}".lower()).strip("-")


class _ArtifactWriter:
    """Artifact writes are REST calls: they run in order on one thread, off the call's path,
    and the call waits for them only at its very end (they overlap with the ranks' work)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skytasks-artifacts")
        self._pending: list[Future] = []

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        ctx = copy_context()  # the parent task run's context: artifacts are linked to it
        fut = self._pool.submit(ctx.run, fn, *args, **kwargs)
        self._pending.append(fut)
        return fut

    def join(self) -> None:
        for fut in self._pending:
            try:
                fut.result(timeout=60)
            except Exception as exc:  # noqa: BLE001 - bookkeeping must not hide the call's outcome
                print(f"[skytasks] could not write an artifact: {exc!r}", flush=True)
        self._pool.shutdown(wait=False)


class PrefectObserver:
    def __init__(self, label: str, pool_name: str, run_tags: tuple[str, ...]):
        parent = TaskRunContext.get()
        assert parent is not None, "a distributed call is observed from inside its parent task run"
        self.label, self.pool_name, self.run_tags = label, pool_name, run_tags
        self._parent = parent.task_run
        self._parent_logger = task_run_logger(parent.task_run, task=parent.task)
        self._echo = ECHO_RANK_LINES.get()
        self._started = time.monotonic()
        self._artifacts = _ArtifactWriter()
        self._progress: Future = self._artifacts.submit(
            create_progress_artifact, 0.0, key=artifact_key(label, "progress"),
            description=f"{label}: progress of the distributed call")
        self._metrics: list[dict[str, Any]] = []
        self._metrics_written_at = 0.0
        self._lock = threading.Lock()
        self.runs: RankRuns | None = None
        self.outcomes: list[RankOutcome] = []

    # -- the runner's steps ------------------------------------------------------------------

    def on_attempt_start(self, attempt: int, world_size: int) -> None:
        self.runs = RankRuns(self.label, world_size, attempt, self.run_tags, self._parent.flow_run_id,
                             self._parent.id, echo=self._echo)

    def on_attempt_end(self, attempt: int, error: BaseException | None) -> None:
        if self.runs is not None:
            reason = f"attempt {attempt} ended" + (f": {type(error).__name__}" if error else "")
            self.outcomes = self.runs.close(reason)

    def on_call_end(self, error: BaseException | None) -> None:
        self._write_metrics()
        rows = [{"rank": o.rank, "node": o.node_rank, "address": o.node_addr, "outcome": o.status,
                 "seconds": round(o.ended - o.started, 3) if o.started and o.ended else None,
                 "summary": outcome_summary(o)} for o in self.outcomes]
        self._artifacts.submit(create_table_artifact, rows, key=artifact_key(self.label, "ranks"),
                               description=f"{self.label}: one row per rank")
        if error is None:
            self._artifacts.submit(self._set_progress, 100.0)
        emit("skytasks.call.failed" if error else "skytasks.call.completed",
             {"prefect.resource.id": f"skytasks.call.{self.label}", "prefect.resource.name": self.label},
             related=[pool_resource(self.pool_name)],
             payload={"task": self.label, "ranks": len(self.outcomes),
                      "seconds": round(time.monotonic() - self._started, 3),
                      "error": repr(error)[:500] if error else None})
        self._artifacts.join()

    # -- what the ranks do -------------------------------------------------------------------

    def on_output(self, rank: int, stream: str, line: str) -> None:
        self.runs.on_output(rank, stream, line)  # type: ignore[union-attr]

    def on_log(self, rank: int, level: int, line: str) -> None:
        self.runs.on_log(rank, level, line)  # type: ignore[union-attr]

    def on_rank_done(self, rank: int, outcome: RankOutcome) -> None:
        self.runs.on_rank_done(rank, outcome)  # type: ignore[union-attr]
        if outcome.status == "failed":
            exc = outcome.failure.exception if outcome.failure else None
            emit("skytasks.rank.failed", rank_resource(self.label, outcome.rank),
                 related=[pool_resource(self.pool_name)],
                 payload={"task": self.label, "rank": outcome.rank, "node": outcome.node_rank,
                          "address": outcome.node_addr, "exception_type": type(exc).__name__,
                          "message": str(exc)[:500]})

    def on_report(self, rank: int, metrics: dict[str, Any]) -> None:
        with self._lock:
            self._metrics.append({"rank": rank, **metrics})
        progress = metrics.get("progress")
        if progress is None and "epoch" in metrics and metrics.get("epochs"):
            progress = metrics["epoch"] / metrics["epochs"]
        if isinstance(progress, (int, float)):
            self._artifacts.submit(self._set_progress, max(0.0, min(100.0, progress * 100 if progress <= 1 else progress)))
        if time.monotonic() - self._metrics_written_at >= METRICS_ARTIFACT_EVERY_SECONDS:
            self._write_metrics()

    def on_notice(self, text: str) -> None:
        self._parent_logger.warning("[skytasks] %s", text)

    def on_stacks(self, stacks: dict[int, str], why: str) -> None:
        """Each rank's whole stack into its own run's log; a row per rank in one artifact."""
        self.runs.on_stacks(stacks, why)  # type: ignore[union-attr]
        rows = [{"rank": r, "where": where(st), "user frame": user_frame(st)} for r, st in sorted(stacks.items())]
        if rows:
            self._artifacts.submit(create_table_artifact, rows, key=artifact_key(self.label, "stacks"),
                                   description=f"{self.label}: where each rank was ({why})")

    # -- artifacts ---------------------------------------------------------------------------

    def _set_progress(self, value: float) -> None:
        update_progress_artifact(self._progress.result(), value)

    def _write_metrics(self) -> None:
        with self._lock:
            rows = list(self._metrics)
        if rows:
            self._metrics_written_at = time.monotonic()
            self._artifacts.submit(create_table_artifact, rows, key=artifact_key(self.label, "metrics"),
                                   description=f"{self.label}: metrics reported by the ranks (skytasks.report)")
