"""One task run per rank, recorded the way Prefect 3's own task engine records task runs.

Prefect's sync engine builds the `TaskRun` in memory and reports each state change as a
`prefect.task-run.<State>` event (`prefect_internals.emit_state_change`); the server's
TaskRunRecorder writes the run from those events. No REST call per run, and nothing waits on the
server's database: creating each rank's run with `create_task_run` and ending it with
`set_task_run_state` would be two blocking calls per rank, each of them seconds on a busy SQLite
server.

Each rank's lines go to its run through Prefect's run logger, whose records the API log worker
batches; nothing here blocks either. The runs therefore appear in the API a moment after the
events leave, exactly as the flow's ordinary task runs do.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from datetime import timedelta
from typing import Any, Callable

from prefect import Task
from prefect.cache_policies import NO_CACHE
from prefect.states import Cancelled, Completed, Failed, Running, State

from skytasks.prefect_records.prefect_internals import emit_state_change, enter_final_state, is_api_log_handler, run_logger
from skytasks.prefect_records.record_queue import RECORDED_AT
from skytasks.prefect_records.run_states import RecordCopies, new_id
from skytasks.stacks import rank_ranges
from skytasks.controller.outcome import RankState
from skytasks.controller.rank_group import RankOutcome


# A rank run says Running once it has lasted this long; one that ends sooner sends only its end.
RUNNING_AFTER_SECONDS = 1.0


def _rank_run(label: str, rank: int, world: int) -> None:
    """Never executed: it gives the rank runs a task key that groups them in the UI."""


RANK_TASK = Task(_rank_run, name="skytasks-rank", cache_policy=NO_CACHE, persist_result=False, retries=0)


def log_at_its_time(logger: Any, level: int, msg: str, *args: Any, exc_info: Any = None,
                    api_only: bool = False) -> None:
    """`logger.log`, but a line handed over late keeps the time it was printed; `api_only` lines
    (a rank's whole stack) go to the run's log in the API and never to the console."""
    at = RECORDED_AT.get()
    if at is None and not api_only:
        logger.log(level, msg, *args, exc_info=exc_info)
        return
    base = logger.logger
    if base.isEnabledFor(level):
        _, kwargs = logger.process(msg, {})
        record = base.makeRecord(base.name, level, __file__, 0, msg, args, exc_info, extra=kwargs["extra"])
        if at is not None:
            record.created, record.msecs = at, (at % 1) * 1000
        if api_only:
            _quiet_consoles()
            record.skytasks_api_only = True
        base.handle(record)


_consoles_quieted = False


def _quiet_consoles() -> None:
    """Prefect's console handlers skip records marked api-only (its API handler keeps them)."""
    global _consoles_quieted
    if _consoles_quieted:
        return
    _consoles_quieted = True
    for name in ("prefect", ""):
        for handler in logging.getLogger(name).handlers:
            if not is_api_log_handler(handler):
                handler.addFilter(lambda record: not getattr(record, "skytasks_api_only", False))


PREEMPTED_STATE = "Preempted"  # a Cancelled-type state: the cloud's or the scheduler's doing, not the code's


def final_state(rank: int, outcome: RankOutcome) -> tuple[Callable[..., State], str | None, str | None]:
    """A run's final state for `outcome`: Prefect's constructor, the state's name, its message."""
    if outcome.status is RankState.COMPLETED:  # where it ran: a pod and its Kubernetes node, a host
        return Completed, None, (f"rank {rank} ran on node {outcome.node_rank} ({outcome.node_addr})"
                                 if outcome.node_addr else None)
    if outcome.preempted:
        why = str(outcome.failure.exception) if outcome.failure is not None else outcome.stop_reason
        return Cancelled, PREEMPTED_STATE, f"rank {rank}: the attempt ended for a preemption: {why}"
    if outcome.status is RankState.FAILED and outcome.failure is not None:
        exc = outcome.failure.exception
        return Failed, None, f"rank {rank} failed: {type(exc).__name__}: {exc}"
    return Cancelled, None, f"rank {rank}: {outcome.stop_reason or 'stopped'}"


class RankRun:
    """One task run of an attempt, for one rank or one node's ranks: Running from the start of the
    attempt, fed its lines, then final."""

    def __init__(self, name: str, key: str, attempt: int, parent_id: Any, tags: list[str], records: RecordCopies,
                 quiet: bool = False) -> None:
        self.quiet = quiet  # a node's run: "Finished" only if it failed or was preempted (see finish)
        self._records = records
        run_id = new_id()
        self.task_run = records.task_run(run_id, name, f"{parent_id}-{attempt}-{key}", tags,
                                         records.state(Running, run_id))
        self.logger = run_logger(self.task_run, RANK_TASK)
        self.outcome: RankOutcome | None = None
        self._last_event: Any = None  # Running is said only once the run lasts (say_running)

    def say_running(self) -> None:
        """The Running event, for a run that has lasted RUNNING_AFTER_SECONDS: the UI shows it live.
        A run that ends sooner (a warm call takes milliseconds) sends only its final state, with
        its start time in it: a third fewer events for the server to record."""
        state = self.task_run.state
        if self._last_event is None and self.outcome is None and state is not None:
            self._last_event = emit_state_change(self.task_run, None, state)

    def log(self, level: int, rank: int, line: str, api_only: bool = False) -> None:
        log_at_its_time(self.logger, level, "[rank %d] %s", rank, line, api_only=api_only)

    def finish(self, outcome: RankOutcome) -> None:
        """Into the final state of `outcome` (a rank's, or the worst of a node's ranks'); a failure
        that raced our stop replaces the Cancelled."""
        if self.outcome is not None and not (outcome.status is RankState.FAILED and self.outcome.status is not RankState.FAILED):
            return
        self.outcome = outcome
        if outcome.preempted:  # said as what it is: a warning, with no traceback
            why = str(outcome.failure.exception) if outcome.failure is not None else outcome.stop_reason
            log_at_its_time(self.logger, logging.WARNING, "[rank %d] the attempt ended for a preemption: %s",
                            outcome.rank, why)
        elif outcome.status is RankState.FAILED and outcome.failure is not None:
            exc = outcome.failure.exception
            log_at_its_time(self.logger, logging.ERROR, "[rank %d] failed", outcome.rank,
                            exc_info=(type(exc), exc, exc.__traceback__))
        kind, name, message = final_state(outcome.rank, outcome)
        before = self.task_run.state
        after = self._records.state(kind, self.task_run.id, name=name, message=message)
        assert before is not None  # a rank run is made Running
        if after.timestamp <= before.timestamp:
            after.timestamp = before.timestamp + timedelta(microseconds=1)
        level = logging.ERROR if after.is_failed() else logging.WARNING if outcome.preempted else logging.INFO
        if not self.quiet or level >= logging.WARNING:
            # A quiet run (one per node) that completed or was stopped says nothing more: its state
            # says it, and at 1,024 ranks those lines were 128 log records a call for the server.
            log_at_its_time(self.logger, level, "Finished in state %s", after.name)
        run = self.task_run
        enter_final_state(run, before, after)
        # A run that never said Running: its final state is its first word, following nothing.
        said = self._last_event is not None
        self._last_event = emit_state_change(run, before if said else None, after, follows=self._last_event)


def worst(outcomes: list[RankOutcome]) -> RankOutcome:
    """A node run's state: its worst rank's (failed, then preempted, then stopped, then completed)."""
    def badness(o: RankOutcome) -> tuple[int, int]:
        if o.status is RankState.FAILED and not o.preempted:
            return (3, -o.rank)
        if o.preempted:
            return (2, -o.rank)
        return (1 if o.status is RankState.STOPPED else 0, -o.rank)
    return max(outcomes, key=badness)


HEAD_LINES_KEPT = 200  # rank_runs="head": the last lines of each other rank, for the parent's log if it fails


class RankRuns:
    """The task runs of one attempt, as `mode` says: one per rank ("rank"), one per node ("node":
    named for the node and its rank range, its ranks' lines prefixed [rank R], its state the worst
    of its ranks'), or rank 0's only ("head": the other ranks' lines reach the parent's log only
    when they fail). Every method is cheap: events and log records are queued for Prefect's own
    background workers."""

    def __init__(self, label: str, world: int, attempt: int, tags: tuple[str, ...], flow_run_id: Any,
                 parent_id: Any, *, mode: str = "rank", procs_per_node: int = 1, parent_logger: Any = None):
        self._lock = threading.Lock()  # rank news comes from the call's thread; close from another
        self.mode, self.world, self.per_node = mode, world, max(1, procs_per_node)
        self._parent_logger = parent_logger
        self._outcomes: dict[int, RankOutcome] = {}
        self._held: dict[int, deque[tuple[int, str]]] = {}  # "head": the other ranks' last lines
        suffix = "" if attempt == 1 else f", attempt {attempt}"  # a later attempt says so in its names

        # Made in the call's context: the runs' states carry its traceparent.
        records = RecordCopies(flow_run_id, parent_id, RANK_TASK.task_key)

        def run(name: str, key: str, extra_tags: list[str]) -> RankRun:
            return RankRun(f"{label}[{name}{suffix}]", key, attempt, parent_id, [*extra_tags, *tags], records,
                           quiet=mode == "node")

        if mode == "node":
            self.runs = {n: run(f"node {n}: ranks {rank_ranges(self._ranks_of(n))}/{world}", f"node{n}", [f"node:{n}"])
                         for n in range((world + self.per_node - 1) // self.per_node)}
        elif mode == "head":
            self.runs = {0: run(f"rank 0/{world}", "0", ["rank:0"])}
        else:
            self.runs = {r: run(f"rank {r}/{world}", str(r), [f"rank:{r}"]) for r in range(world)}
        self._running_timer = threading.Timer(RUNNING_AFTER_SECONDS, self._say_running)
        self._running_timer.daemon = True
        self._running_timer.start()

    def _say_running(self) -> None:
        with self._lock:
            for run in self.runs.values():
                run.say_running()

    def _ranks_of(self, node: int) -> list[int]:
        return list(range(node * self.per_node, min(self.world, (node + 1) * self.per_node)))

    def _key(self, rank: int) -> int | None:
        if self.mode == "node":
            return rank // self.per_node
        return rank if rank in self.runs else None

    def _line(self, rank: int, level: int, line: str) -> None:
        key = self._key(rank)
        if key is not None:
            self.runs[key].log(level, rank, line)
        else:
            self._held.setdefault(rank, deque(maxlen=HEAD_LINES_KEPT)).append((level, line))

    def on_output(self, rank: int, stream: str, line: str) -> None:
        self._line(rank, logging.WARNING if stream == "stderr" else logging.INFO, line)

    def on_log(self, rank: int, level: int, line: str) -> None:
        self._line(rank, level, line)

    def on_usage(self, rank: int, summary: Callable[[], str]) -> None:
        """What a rank used, on its own run's page: a line per call in the API (never the console).
        With a run per node or the head's only, the rank table holds it, and the words are never
        built (1,024 of them a call)."""
        if self.mode == "rank" and (used := summary()):
            self.runs[rank].log(logging.INFO, rank, f"used over the call: {used}", api_only=True)

    def on_rank_done(self, rank: int, outcome: RankOutcome) -> None:
        with self._lock:
            self._outcomes[rank] = outcome
            key = self._key(rank)
            if key is None:
                if outcome.status is RankState.FAILED and not outcome.preempted:
                    self._tell_parent(rank, outcome)
                return
            if self.mode == "node":
                mine = [self._outcomes.get(r) for r in self._ranks_of(key)]
                if all(mine):
                    self.runs[key].finish(worst(mine))  # type: ignore[arg-type]
            else:
                self.runs[key].finish(outcome)

    def _tell_parent(self, rank: int, outcome: RankOutcome) -> None:
        """rank_runs="head": a failed rank's last lines and its failure, in the parent's log."""
        if self._parent_logger is None:
            return
        for level, line in self._held.pop(rank, ()):
            log_at_its_time(self._parent_logger, level, "[rank %d] %s", rank, line)
        exc = outcome.failure.exception if outcome.failure is not None else None
        log_at_its_time(self._parent_logger, logging.ERROR, "[rank %d] failed", rank,
                        exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None)

    def on_stacks(self, stacks: dict[int, str], why: str) -> None:
        """Each rank's whole stack into its run's log (the API only: the console and the parent's
        log get one line per place)."""
        for rank, stack in sorted(stacks.items()):
            key = self._key(rank)
            if key is not None:
                self.runs[key].log(logging.WARNING, rank, f"stack ({why}), innermost frame first:\n{stack}",
                                   api_only=True)

    def close(self, reason: str) -> list[RankOutcome]:
        """Whatever happened, every run ends before the parent does; an outcome per rank."""
        self._running_timer.cancel()
        with self._lock:
            for r in range(self.world):
                if r not in self._outcomes:
                    self._outcomes[r] = RankOutcome(rank=r, node_rank=r // self.per_node, node_addr="",
                                                    status=RankState.STOPPED, stop_reason=reason)
            for key, run in self.runs.items():
                if run.outcome is None:
                    ranks = self._ranks_of(key) if self.mode == "node" else [key]
                    run.finish(worst([self._outcomes[r] for r in ranks]))
            return [self._outcomes[r] for r in range(self.world)]

