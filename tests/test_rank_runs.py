"""What a call records in Prefect at scale: a task run per rank, per node, or the head's only
(`rank_runs`). The default is a run per rank up to 64 ranks and a run per node above."""

from __future__ import annotations

import asyncio
import time

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId

from skytasks import GPUPool, PoolConfigError, distributed_task, rank_info
from skytasks.call_options import rank_runs_for
from skytasks.controller.outcome import RankState
from skytasks.controller.rank_group import RankOutcome
from skytasks.errors import RankFailure
from skytasks.prefect_records.rank_runs import final_state
from skytasks.prefect_records.record_queue import RECORDED_AT
from skytasks.prefect_records.run_states import RecordCopies, new_id
from tests.harness.prefect_api import logs_when, settled_task_runs


@pytest.mark.parametrize("choice, world, mode", [
    (None, 2, "rank"), (None, 64, "rank"), (None, 65, "node"), (None, 1024, "node"),
    ("rank", 1024, "rank"), ("head", 2, "head"), ("node", 4, "node"),
])
def test_the_default_is_a_run_per_rank_up_to_64_ranks_and_per_node_above(choice, world, mode):
    assert rank_runs_for(choice, world) == mode


def _outcome(status: RankState, failure: Exception | None = None, preempted: bool = False, why: str = "") -> RankOutcome:
    return RankOutcome(rank=3, node_rank=1, node_addr="127.0.0.1", status=status, preempted=preempted, stop_reason=why,
                       failure=RankFailure(3, 1, "127.0.0.1", failure, at=0.0) if failure else None)


@pytest.mark.parametrize("outcome, kind, name, message", [
    (_outcome(RankState.COMPLETED), "Completed", None, "rank 3 ran on node 1 (127.0.0.1)"),
    (_outcome(RankState.FAILED, ValueError("bad batch")), "Failed", None, "rank 3 failed: ValueError: bad batch"),
    (_outcome(RankState.STOPPED, why="stopped because rank 0 failed"), "Cancelled", None,
     "rank 3: stopped because rank 0 failed"),
    (_outcome(RankState.STOPPED), "Cancelled", None, "rank 3: stopped"),
    (_outcome(RankState.STOPPED, preempted=True, why="node 1 was reclaimed"), "Cancelled", "Preempted",
     "rank 3: the attempt ended for a preemption: node 1 was reclaimed"),
    (_outcome(RankState.FAILED, RuntimeError("spot reclaimed"), preempted=True), "Cancelled", "Preempted",
     "rank 3: the attempt ended for a preemption: spot reclaimed"),
])
def test_a_runs_final_state_follows_its_ranks_outcome(outcome, kind, name, message):
    constructor, got_name, got_message = final_state(3, outcome)
    assert (constructor.__name__, got_name, got_message) == (kind, name, message)


def test_a_runs_records_are_prefects_own_each_with_its_own_id_time_and_run():
    """The task runs and states of 128 node runs are copies of one made by Prefect's
    constructors, not 128 of each."""
    from prefect.client.schemas.objects import TaskRun
    from prefect.states import Cancelled, Completed, Running, StateType

    flow_run, parent = new_id(), new_id()
    records, run = RecordCopies(flow_run, parent, "skytasks-rank"), new_id()
    token = RECORDED_AT.set(1_700_000_000.0)  # news handed over late keeps the time it happened
    try:
        first = records.state(Completed, run)
    finally:
        RECORDED_AT.reset(token)
    second = records.state(Completed, new_id())
    assert first.is_completed() and first.name == "Completed" and first.message is None
    assert (first.state_details.task_run_id, first.state_details.flow_run_id) == (run, flow_run)
    assert first.id != second.id and first.id.version == 7
    assert first.timestamp.timestamp() == 1_700_000_000.0 and second.timestamp > first.timestamp
    assert first.state_details is not second.state_details  # a copy each: the template is not shared
    preempted = records.state(Cancelled, run, name="Preempted", message="rank 3: reclaimed")
    assert (preempted.type, preempted.name, preempted.message) == (StateType.CANCELLED, "Preempted", "rank 3: reclaimed")
    token = RECORDED_AT.set(1_600_000_000.5)
    try:
        assert records.state(Completed, run).timestamp.timestamp() == 1_600_000_000.5
    finally:
        RECORDED_AT.reset(token)
    running = records.state(Running, run)
    task_run = records.task_run(run, "step[node 1: ranks 8-15/16]", "key-1", ["node:1"], running)
    other = records.task_run(new_id(), "step[node 0: ranks 0-7/16]", "key-0", ["node:0"], records.state(Running, run))
    assert (task_run.id, task_run.name, task_run.tags, task_run.flow_run_id) == (run, "step[node 1: ranks 8-15/16]",
                                                                                 ["node:1"], flow_run)
    assert task_run.state is running and task_run.start_time == running.timestamp and other.id != task_run.id
    assert task_run.task_inputs["__parents__"][0].id == parent
    # What Prefect's event carries is the same as for a run it validated itself.
    dumped = task_run.model_dump(mode="json", exclude_none=True)
    assert TaskRun.model_validate(dumped).model_dump(mode="json", exclude_none=True) == dumped


def test_run_ids_are_time_ordered_version_7_uuids_and_a_forked_child_never_repeats_its_parents():
    import os
    import uuid

    ids = []
    for _ in range(3):
        ids.append(new_id())
        time.sleep(0.002)
    assert ids == sorted(ids, key=lambda u: u.int) and all(u.version == 7 and u.variant == uuid.RFC_4122 for u in ids)
    assert abs((ids[0].int >> 80) - time.time() * 1000) < 5_000  # its first 48 bits: Unix milliseconds
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the ids it makes go back over the pipe
        os.write(write, b"".join(new_id().bytes for _ in range(100)))
        os._exit(0)
    os.close(write)
    theirs = b""
    while chunk := os.read(read, 65536):
        theirs += chunk
    os.waitpid(pid, 0)
    os.close(read)
    mine = {new_id().bytes[6:] for _ in range(100)}  # the random bits: the time may match
    assert len(theirs) == 1600 and not mine & {theirs[i + 6:i + 16] for i in range(0, 1600, 16)}


def test_an_unknown_rank_runs_is_refused_naming_it():
    with pytest.raises(PoolConfigError, match="rank_runs"):
        distributed_task(lambda: None, rank_runs="per-gpu")


def say_then_fail_on_rank_3() -> int:
    info = rank_info()
    print(f"hello from rank {info.rank}", flush=True)
    if info.rank == 3:
        time.sleep(2)  # the other ranks have said hello: no rendezvous here to make sure of it
        raise ValueError("rank 3 broke")
    time.sleep(30)
    return info.rank


def _logs_once_finished(task_run_id) -> list[str]:
    """A run's log once its "Finished in state" line is in: logs are sent in order, so every line
    before that one is in too."""
    logs = logs_when(LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])),
                     lambda found: any(log.message.startswith("Finished in state") for log in found))
    return [log.message for log in logs]


def test_a_run_per_node_or_the_heads_only_with_the_failed_ranks_lines_in_the_parents_log():
    pool = GPUPool(nodes=2, procs_per_node=2)
    per_node = distributed_task(say_then_fail_on_rank_3, pool=pool, init_torch=False, rank_runs="node",
                                name="by-node")
    head_only = distributed_task(say_then_fail_on_rank_3, pool=pool, init_torch=False, rank_runs="head",
                                 name="by-head")

    @flow
    def both():
        for task in (per_node, head_only):
            try:
                task()
            except Exception:  # noqa: BLE001 - the record is what this test reads
                pass

    state = both(return_state=True)
    runs = {r.name: r for r in settled_task_runs(state.state_details.flow_run_id, expect=5)}  # 2 parents, 3 runs
    names = sorted(n for n in runs if n.startswith(("by-node[", "by-head[")))
    assert names == ["by-head[rank 0/4]", "by-node[node 0: ranks 0-1/4]", "by-node[node 1: ranks 2-3/4]"], names
    # A node's run: its ranks' lines, prefixed; its state the worst of its ranks'.
    assert runs["by-node[node 1: ranks 2-3/4]"].state.is_failed()
    assert runs["by-node[node 0: ranks 0-1/4]"].state.is_cancelled()
    node1 = _logs_once_finished(runs["by-node[node 1: ranks 2-3/4]"].id)
    assert {"[rank 2] hello from rank 2", "[rank 3] hello from rank 3"} <= set(node1), node1
    # A node's run says it finished only when that is news: failed here, not when stopped.
    assert "Finished in state Failed" in node1
    node0 = [log.message for log in logs_when(LogFilter(task_run_id=LogFilterTaskRunId(
        any_=[runs["by-node[node 0: ranks 0-1/4]"].id])), lambda found: any("[rank 0] hello" in log.message for log in found))]
    assert "[rank 0] hello from rank 0" in node0 and not any(m.startswith("Finished") for m in node0), node0
    # Only the head's run; the failed rank's lines and failure reach the parent's log, the others' never.
    assert runs["by-head[rank 0/4]"].state.is_cancelled()
    parent = _logs_once_finished(runs["by-head"].id)
    assert "[rank 3] hello from rank 3" in parent and any("[rank 3] failed" in m for m in parent), parent
    assert "[rank 1] hello from rank 1" not in parent


def quick_or_slow(slow: bool) -> int:
    time.sleep(4.0 if slow else 0.0)
    return rank_info().rank


async def _state_names(task_run_id) -> list[str]:
    async with get_client() as client:
        states = await client.read_task_run_states(task_run_id)
        return [s.name for s in sorted(states, key=lambda s: s.timestamp)]


def test_a_rank_run_that_ends_at_once_sends_only_its_end_and_a_lasting_one_shows_running_first(monkeypatch):
    """A warm call takes milliseconds: its rank runs go to the server as one final state each (a
    third fewer events at load). A call that lasts shows its runs Running in the UI meanwhile."""
    from skytasks.prefect_records import rank_runs

    monkeypatch.setattr(rank_runs, "RUNNING_AFTER_SECONDS", 2.5)  # a loaded machine's first call stays under it
    pool = GPUPool(nodes=1, procs_per_node=2)
    task = distributed_task(quick_or_slow, pool=pool, init_torch=False)

    @flow
    def calls() -> tuple:
        from prefect.context import get_run_context

        with pool:
            task(False)
            task(True)
        return get_run_context().flow_run.id

    flow_run_id = calls()
    runs = [r for r in settled_task_runs(flow_run_id, expect=6) if "[rank " in r.name]
    assert len(runs) == 4
    histories = sorted(asyncio.run(_state_names(r.id)) for r in runs)
    assert histories == [["Completed"], ["Completed"], ["Running", "Completed"], ["Running", "Completed"]]
    assert all(r.start_time is not None and r.end_time is not None and r.state_name == "Completed" for r in runs)


def test_prefects_engine_logs_say_a_failed_call_in_one_line_per_root_cause_whatever_it_was():
    import logging

    from skytasks.errors import DistributedTaskError, ScriptFailed
    from skytasks.prefect_records.parent_task import _OneLineGroups

    exited = ScriptFailed(1, 3)
    exited.skytasks_rank = 1
    failed = DistributedTaskError("1 rank failed", [exited])
    record = logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, "Task run failed", (),
                               (DistributedTaskError, failed, None))
    assert _OneLineGroups().filter(record) and record.exc_info is None
    said = record.getMessage()
    assert said.startswith("Task run failed | root cause rank 1: ScriptFailed: rank 1: the script exited with code 3")
    assert "traceback" not in said and said.endswith("(see that rank's task run for its log)")
