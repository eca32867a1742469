"""Prefect's view of a distributed call, as one observer of the runner.

Per attempt, a task run per rank (`rank_runs`); per call, a live progress bar, a live metrics
table from `skytasks.report`, a final table with one row per rank, a stacks table when ranks
were stopped, and `skytasks.*` events. The call itself is the parent task run
(`parent_task`), which this observer only reads from the context. Nothing here waits on the
API during the call: task runs are events, logs are batched by Prefect, artifacts are written
beside it; at its end the call waits only for artifact writes still under way.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

from prefect.context import TaskRunContext

from skytasks.events import Event, announce, level_of
from skytasks.call_options import rank_runs_for
from skytasks.controller.stack_groups import stack_lines
from skytasks.metrics import progress_percent
from skytasks.prefect_records.prefect_internals import run_logger
from skytasks.prefect_records.pool_events import emit_event, record_pool_event
from skytasks.prefect_records.artifacts import WRITER, LiveTable, ProgressBar, wait_for, write_table
from skytasks.prefect_records.events import emit, pool_resource, rank_resource
from skytasks.controller.outcome import RankState
from skytasks.controller.rank_group import RankOutcome
from skytasks.prefect_records.rank_runs import RankRuns, log_at_its_time
from skytasks.controller.runner import outcome_summary
from skytasks.controller.usage import RankUsage
from skytasks.stacks import user_frame, where

METRICS_ARTIFACT_EVERY_SECONDS = 5.0  # the live metrics table is rewritten in place at most this often
RESOURCES_ARTIFACT_EVERY_SECONDS = 5.0  # the live resources table and events: at most this often
# `skytasks.rank.resources` events per write, the ranks said longest ago first: up to 64 ranks,
# each rank's every 5 s; at 1,024 ranks each rank's every 80 s, and the server gets 13 a second,
# not 205 (each event is also a Prefect model to build here, about 1-2 ms on a slow core).
RESOURCE_EVENTS_PER_WRITE = 64
METRICS_ROWS_KEPT = 500  # the live metrics table shows the newest reports (an hour at 2 a second would be 7,200)


# When each rank's figures last went out as an event, across calls: a warm pool's short calls
# would otherwise send every sampled rank's figures at every call's end (hundreds of events a
# call at 1,024 ranks), where the promise is every few seconds.
_RESOURCES_SAID: dict[tuple[str, str, int], float] = {}


def ranks_to_announce(last_said: dict[int, float | None], now: float,
                      every: float = RESOURCES_ARTIFACT_EVERY_SECONDS,
                      limit: int = RESOURCE_EVENTS_PER_WRITE) -> list[int]:
    """Whose `skytasks.rank.resources` event goes out now: ranks not said for `every` seconds
    (never said first, then the longest ago, then by rank), at most `limit` of them."""
    due = [r for r, at in last_said.items() if at is None or now - at >= every]
    return sorted(due, key=lambda r: (last_said[r] is not None, last_said[r] or 0.0, r))[:limit]


def artifact_key(label: str, suffix: str) -> str:
    # Artifact keys: lowercase letters, digits and dashes only.
    return re.sub(r"[^a-z0-9-]+", "-", f"{label}-{suffix}".lower()).strip("-")


class PrefectObserver:
    def __init__(self, label: str, pool_name: str, run_tags: tuple[str, ...], *, rank_runs: str | None = None,
                 procs_per_node: int = 1):
        parent = TaskRunContext.get()
        assert parent is not None, "a distributed call is observed from inside its parent task run"
        self.label, self.pool_name, self.run_tags = label, pool_name, run_tags
        self.rank_runs, self.procs_per_node = rank_runs, procs_per_node
        self._said_rank_runs = False
        self._parent = parent.task_run
        self._parent_logger = run_logger(parent.task_run, parent.task)
        self._started = time.monotonic()
        self._ids: dict[str, Any] = dict(task_run_id=parent.task_run.id, flow_run_id=parent.task_run.flow_run_id)
        self._progress = ProgressBar(artifact_key(label, "progress"), f"{label}: progress of the distributed call",
                                     **self._ids)
        # At most 5 artifacts per call, whatever its length: progress, metrics, resources and stacks
        # are updated in place; the rank table is written once, at the end.
        self._metrics_table = LiveTable(artifact_key(label, "metrics"),
                                        f"{label}: metrics reported by the ranks (skytasks.report), newest last",
                                        **self._ids)
        self._resources_table = LiveTable(artifact_key(label, "resources"),
                                          f"{label}: what each rank uses (latest, peak and mean)", **self._ids)
        self._stacks_table = LiveTable(artifact_key(label, "stacks"), f"{label}: where each stopped rank was",
                                       **self._ids)
        self._stack_rows: list[dict[str, Any]] = []
        self._writes: list[Any] = []  # artifact writes of this call, waited for at its end
        self._metrics: list[dict[str, Any]] = []
        self._metrics_written_at = 0.0
        self._lock = threading.Lock()
        self.runs: RankRuns | None = None
        self.outcomes: list[RankOutcome] = []
        self._attempts: list[tuple[int, list[RankOutcome]]] = []  # (attempt, one outcome per rank of it)
        self._usage: dict[int, RankUsage] = {}  # over the whole call, every attempt
        self._resources_written_at = 0.0
        self._sampled = False  # a rank's figures were sampled during the call (RESOURCES)

    # -- the runner's steps ------------------------------------------------------------------

    def on_attempt_start(self, attempt: int, world_size: int) -> None:
        mode = rank_runs_for(self.rank_runs, world_size)
        if self.rank_runs is None and not self._said_rank_runs and mode != "rank":
            self._said_rank_runs = True  # said once, in the call's log: where a rank's lines are
            log_at_its_time(self._parent_logger, logging.INFO,
                            "[skytasks] %d ranks: one task run per node (rank_runs='node'); each rank's lines are "
                            "in its node's run, prefixed [rank R]", world_size)
        self.runs = RankRuns(self.label, world_size, attempt, self.run_tags, self._parent.flow_run_id,
                             self._parent.id, mode=mode, procs_per_node=self.procs_per_node,
                             parent_logger=self._parent_logger)

    def on_attempt_end(self, attempt: int, error: BaseException | None) -> None:
        if self.runs is not None:
            reason = f"attempt {attempt} ended" + (f": {type(error).__name__}" if error else "")
            self.outcomes = self.runs.close(reason)
            self._attempts.append((attempt, self.outcomes))

    def on_call_end(self, error: BaseException | None) -> None:
        self._write_metrics()
        if self._sampled:  # a call over before its ranks were sampled (a warm pool's quick calls)
            self._write_resources()  # has no live figures: the rank table holds what each used
        # Every attempt's ranks, with its world size: an elastic pool's retry may have fewer (the
        # parent run's log says why), and a call's history reads top to bottom.
        # The columns a person scans first come first (they fit 1,400 px); the long summary last.
        rows = [{"rank": o.rank, "outcome": "preempted" if o.preempted else o.status,
                 "seconds": round(o.ended - o.started, 3) if o.started and o.ended else None,
                 **self._usage_columns(o.rank), "attempt": attempt, "world size": len(outcomes),
                 "node": o.node_rank, "address": o.node_addr, "summary": outcome_summary(o)}
                for attempt, outcomes in self._attempts for o in outcomes]
        self._writes.append(write_table(rows, artifact_key(self.label, "ranks"),
                                        f"{self.label}: one row per rank of each attempt", **self._ids))
        if error is None and self._progress.exists:
            self._progress.set(100.0)
        emit("skytasks.call.failed" if error else "skytasks.call.completed",
             {"prefect.resource.id": f"skytasks.call.{self.label}", "prefect.resource.name": self.label},
             related=[pool_resource(self.pool_name)],
             payload={"task": self.label, "ranks": len(self.outcomes),
                      "seconds": round(time.monotonic() - self._started, 3),
                      "error": repr(error)[:500] if error else None})
        wait_for(self._writes + [w for live in (self._progress, self._metrics_table, self._resources_table,
                                                self._stacks_table) for w in live.writes])

    # -- what the ranks do -------------------------------------------------------------------

    def on_output(self, rank: int, stream: str, line: str) -> None:
        self.runs.on_output(rank, stream, line)  # type: ignore[union-attr]

    def on_log(self, rank: int, level: int, line: str) -> None:
        self.runs.on_log(rank, level, line)  # type: ignore[union-attr]

    def on_rank_done(self, rank: int, outcome: RankOutcome) -> None:
        with self._lock:
            usage = self._usage.setdefault(rank, RankUsage(rank))
            if outcome.used and outcome.started and outcome.ended:
                usage.add_own(outcome.used, outcome.ended - outcome.started)
        self.runs.on_usage(rank, usage.summary)  # type: ignore[union-attr]
        self.runs.on_rank_done(rank, outcome)  # type: ignore[union-attr]
        if outcome.status is RankState.FAILED and not outcome.preempted:
            exc = outcome.failure.exception if outcome.failure else None
            emit("skytasks.rank.failed", rank_resource(self.label, outcome.rank),
                 related=[pool_resource(self.pool_name)],
                 payload={"task": self.label, "rank": outcome.rank, "node": outcome.node_rank,
                          "address": outcome.node_addr, "exception_type": type(exc).__name__,
                          "message": str(exc)[:500]})

    def on_report(self, rank: int, metrics: dict[str, Any]) -> None:
        with self._lock:
            self._metrics.append({"rank": rank, **metrics})
            if len(self._metrics) > 2 * METRICS_ROWS_KEPT:
                del self._metrics[:-METRICS_ROWS_KEPT]
        percent = progress_percent(metrics)
        if percent is not None:
            self._progress.set(percent)
        if time.monotonic() - self._metrics_written_at >= METRICS_ARTIFACT_EVERY_SECONDS:
            self._write_metrics()

    def on_resources(self, rank: int, figures: dict[str, float]) -> None:
        """A rank's figures: its warnings into its own run's log at once, the live table and the
        events every few seconds."""
        with self._lock:
            self._sampled = True
            usage = self._usage.setdefault(rank, RankUsage(rank))
            warnings = usage.add(figures, time.monotonic())
        for line in warnings:
            self.runs.on_log(rank, logging.WARNING, line)  # type: ignore[union-attr]
        if time.monotonic() - self._resources_written_at >= RESOURCES_ARTIFACT_EVERY_SECONDS:
            self._write_resources()

    def _usage_columns(self, rank: int) -> dict[str, str]:
        usage = self._usage.get(rank)
        return usage.columns() if usage else {}

    def _write_resources(self) -> None:
        """The latest figures per rank: a table artifact (a new version of the same key each time)
        and a `skytasks.rank.resources` event per rank, at most every few seconds a rank."""
        with self._lock:
            usages = [self._usage[r] for r in sorted(self._usage)]
            self._resources_written_at = time.monotonic()
        if not usages:
            return
        rows = [{"rank": u.rank, "latest": u.line(), **u.columns()} for u in usages]
        self._resources_table.set(rows)
        now = time.monotonic()
        by_rank = {u.rank: u for u in usages}
        events = []
        for rank in ranks_to_announce({r: _RESOURCES_SAID.get((self.pool_name, self.label, r)) for r in by_rank}, now):
            _RESOURCES_SAID[(self.pool_name, self.label, rank)] = now
            u = by_rank[rank]
            events.append((rank_resource(self.label, rank),
                           {"task": self.label, "rank": rank, "latest": u.latest, "summary": u.columns()}))
        if events:
            # Sent by the artifact writer, in the call's context, beside the call rather than in
            # its loop; the call's end waits for them as for its artifacts.
            related = [pool_resource(self.pool_name)]

            def send(client: Any) -> None:
                for resource, payload in events:
                    emit("skytasks.rank.resources", resource, related=related, payload=payload)

            self._writes.append(WRITER.submit(send))

    def on_pool_event(self, event: Event, pool_name: str) -> None:
        """An event of the call's pool, said before the run existed (`skytasks run`): recorded
        now, from the parent task run, so it is related to the run like any other."""
        record_pool_event(event, pool_name)

    def on_event(self, event: Event) -> None:
        """What happened (a node lost, an attempt restarted, ...): a line in the call's log at the
        event's level, and its Prefect event, related to the pool, the flow run and this task run."""
        announce(event)
        log_at_its_time(self._parent_logger, level_of(event), "[skytasks] %s", event.text())
        emit_event(event, self.pool_name)
        table = getattr(event, "table", None)  # an event with a table of its own (the preflight's figures)
        if table is not None:
            self._writes.append(write_table(table(), artifact_key(self.label, getattr(event, "ARTIFACT", "table")),
                                            event.text(), **self._ids))

    def on_stacks(self, stacks: dict[int, str], why: str) -> None:
        """Each rank's whole stack into its own run's log; a row per rank in one artifact."""
        self.runs.on_stacks(stacks, why)  # type: ignore[union-attr]
        for line in stack_lines(stacks, why):  # grouped by place: one screen at 1,024 ranks
            log_at_its_time(self._parent_logger, logging.WARNING, "[skytasks] %s", line)
        rows = [{"rank": r, "where": where(st), "user frame": user_frame(st), "why": why}
                for r, st in sorted(stacks.items())]
        if rows:
            self._stack_rows += rows
            self._stacks_table.set(self._stack_rows)

    # -- artifacts ---------------------------------------------------------------------------

    def _write_metrics(self) -> None:
        with self._lock:
            rows = list(self._metrics)
        if rows:
            self._metrics_written_at = time.monotonic()
            self._metrics_table.set(rows[-METRICS_ROWS_KEPT:])
