"""One task run per rank, recorded the way Prefect 3's own task engine records task runs.

Prefect 3.8's sync engine builds the `TaskRun` in memory (`_create_task_run_locally`) and reports
each state change as a `prefect.task-run.<State>` event (`emit_task_run_state_change_event`);
the server's TaskRunRecorder writes the run from those events. No REST call per run, and
nothing waits on the server's database. The first version of skytasks created each rank's run
with `create_task_run` and ended it with `set_task_run_state`: two blocking calls per rank,
which on the SQLite server took 1-2.5 s per call and 7.7 s for 64 ranks.

Each rank's lines go to its run through Prefect's run logger, whose records the API log worker
batches; nothing here blocks either. The runs therefore appear in the API a moment after the
events leave, exactly as the flow's ordinary task runs do.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta, timezone
from typing import Any

from prefect import Task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun, TaskRunPolicy, TaskRunResult
from prefect.logging.loggers import task_run_logger
from prefect.states import Cancelled, Completed, Failed, Running, State
from prefect.utilities.engine import emit_task_run_state_change_event

from skytasks.prefect_records.held_observer import RECORDED_AT
from skytasks.controller.outcome import RankState
from skytasks.controller.rank_group import RankOutcome

try:  # Prefect's run ids are time-ordered; fall back to random ones on older releases
    from prefect._internal.uuid7 import uuid7 as _new_id
except ImportError:  # pragma: no cover
    from uuid import uuid4 as _new_id


def _rank_run(label: str, rank: int, world: int) -> None:
    """Never executed: it gives the rank runs a task key that groups them in the UI."""


RANK_TASK = Task(_rank_run, name="skytasks-rank", cache_policy=NO_CACHE, persist_result=False, retries=0)


def stamped(state: State) -> State:
    """The state at the time its event happened, when it is handed over late (`RECORDED_AT`)."""
    at = RECORDED_AT.get()
    if at is not None:
        state.timestamp = type(state.timestamp).fromtimestamp(at, tz=timezone.utc)
    return state


def log_at_its_time(logger: Any, level: int, msg: str, *args: Any, exc_info: Any = None) -> None:
    """`logger.log`, but a line handed over late keeps the time it was printed."""
    at = RECORDED_AT.get()
    if at is None:
        logger.log(level, msg, *args, exc_info=exc_info)
        return
    base = logger.logger
    if base.isEnabledFor(level):
        _, kwargs = logger.process(msg, {})
        record = base.makeRecord(base.name, level, __file__, 0, msg, args, exc_info, extra=kwargs["extra"])
        record.created, record.msecs = at, (at % 1) * 1000
        base.handle(record)


PREEMPTED_STATE = "Preempted"  # a Cancelled-type state: the cloud's or the scheduler's doing, not the code's


def final_state(rank: int, outcome: RankOutcome) -> State:
    if outcome.status is RankState.COMPLETED:
        return Completed()
    if outcome.preempted:
        why = str(outcome.failure.exception) if outcome.failure is not None else outcome.stop_reason
        return Cancelled(name=PREEMPTED_STATE, message=f"rank {rank}: the attempt ended for a preemption: {why}")
    if outcome.status is RankState.FAILED and outcome.failure is not None:
        exc = outcome.failure.exception
        return Failed(message=f"rank {rank} failed: {type(exc).__name__}: {exc}")
    return Cancelled(message=f"rank {rank}: {outcome.stop_reason or 'stopped'}")


class RankRun:
    """One rank's task run: Running from the start of the attempt, fed its lines, then final."""

    def __init__(self, label: str, rank: int, world: int, flow_run_id: Any, parent_id: Any, attempt: int,
                 tags: list[str]) -> None:
        self.rank = rank
        running = stamped(Running())
        # A later attempt says so in its name: attempts of one rank are told apart at a glance.
        name = f"{label}[rank {rank}/{world}]" if attempt == 1 else f"{label}[rank {rank}/{world}, attempt {attempt}]"
        self.task_run = TaskRun(
            id=_new_id(), name=name, flow_run_id=flow_run_id,
            task_key=RANK_TASK.task_key, dynamic_key=f"{parent_id}-{attempt}-{rank}",
            empirical_policy=TaskRunPolicy(), tags=tags, run_count=1,
            task_inputs={"__parents__": [TaskRunResult(id=parent_id)]},
            expected_start_time=running.timestamp, start_time=running.timestamp,
            state=running, state_id=running.id, state_type=running.type, state_name=running.name,
            created=running.timestamp, updated=running.timestamp,
        )
        running.state_details.task_run_id, running.state_details.flow_run_id = self.task_run.id, flow_run_id
        self.logger = task_run_logger(self.task_run, task=RANK_TASK)
        self.outcome: RankOutcome | None = None
        self._last_event = emit_task_run_state_change_event(self.task_run, None, running)

    def log(self, level: int, line: str) -> None:
        log_at_its_time(self.logger, level, "[rank %d] %s", self.rank, line)

    def finish(self, outcome: RankOutcome) -> None:
        """Into the rank's final state; a failure that raced our stop replaces the Cancelled."""
        if self.outcome is not None and not (outcome.status is RankState.FAILED and self.outcome.status is not RankState.FAILED):
            return
        self.outcome = outcome
        if outcome.preempted:  # said as what it is: a warning, with no traceback
            why = str(outcome.failure.exception) if outcome.failure is not None else outcome.stop_reason
            log_at_its_time(self.logger, logging.WARNING, "[rank %d] the attempt ended for a preemption: %s",
                            self.rank, why)
        elif outcome.status is RankState.FAILED and outcome.failure is not None:
            exc = outcome.failure.exception
            log_at_its_time(self.logger, logging.ERROR, "[rank %d] failed", self.rank,
                            exc_info=(type(exc), exc, exc.__traceback__))
        before, after = self.task_run.state, stamped(final_state(self.rank, outcome))
        if after.timestamp <= before.timestamp:
            after.timestamp = before.timestamp + timedelta(microseconds=1)
        after.state_details.task_run_id, after.state_details.flow_run_id = self.task_run.id, self.task_run.flow_run_id
        level = logging.ERROR if after.is_failed() else logging.WARNING if outcome.preempted else logging.INFO
        log_at_its_time(self.logger, level, "Finished in state %s", after.name)
        run = self.task_run
        if before.is_running():
            run.total_run_time += after.timestamp - before.timestamp
        run.end_time = after.timestamp
        run.state, run.state_id, run.state_type, run.state_name = after, after.id, after.type, after.name
        self._last_event = emit_task_run_state_change_event(run, before, after, follows=self._last_event)


class RankRuns:
    """The rank task runs of one attempt. Every method is cheap: events and log records are
    queued for Prefect's own background workers."""

    def __init__(self, label: str, world: int, attempt: int, tags: tuple[str, ...], flow_run_id: Any,
                 parent_id: Any):
        self._lock = threading.Lock()  # rank news comes from the call's thread; close from another
        self.runs = {r: RankRun(label, r, world, flow_run_id, parent_id, attempt, [f"rank:{r}", *tags])
                     for r in range(world)}

    def on_output(self, rank: int, stream: str, line: str) -> None:
        self.runs[rank].log(logging.WARNING if stream == "stderr" else logging.INFO, line)

    def on_log(self, rank: int, level: int, line: str) -> None:
        self.runs[rank].log(level, line)

    def on_rank_done(self, rank: int, outcome: RankOutcome) -> None:
        with self._lock:
            self.runs[rank].finish(outcome)

    def on_stacks(self, stacks: dict[int, str], why: str) -> None:
        for rank, stack in sorted(stacks.items()):
            self.runs[rank].log(logging.WARNING, f"stack ({why}), innermost frame first:\n{stack}")

    def close(self, reason: str) -> list[RankOutcome]:
        """Whatever happened, every rank run ends before the parent does."""
        with self._lock:
            for r, run in self.runs.items():
                if run.outcome is None:
                    run.finish(RankOutcome(rank=r, node_rank=-1, node_addr="", status=RankState.STOPPED, stop_reason=reason))
            return [self.runs[r].outcome for r in sorted(self.runs)]  # type: ignore[misc]
