"""Hangs are shown and stopped: every rank's stack where people look, and a HangError in seconds."""

from __future__ import annotations

import os
import re
import time

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterTaskRunId,
)

from skytasks import DistributedTaskError, GPUPool, HangError, distributed_task, rank_info
from tests.conftest import started_here

HANG = 8


def one_waits_in_barrier_the_other_sleeps() -> None:
    import torch.distributed as dist

    if rank_info().rank == 0:
        dist.barrier()  # rank 1 never gets here
    else:
        time.sleep(600)


def test_a_hang_fails_the_call_naming_where_each_rank_is(capsys):
    task = distributed_task(one_waits_in_barrier_the_other_sleeps, pool=GPUPool(nodes=2), hang_timeout_seconds=HANG)
    started = time.monotonic()
    with pytest.raises(DistributedTaskError) as caught:
        task()
    took = time.monotonic() - started
    assert took < 30, took
    members = {e.rank: e for e in caught.value.exceptions}
    assert sorted(members) == [0, 1] and all(isinstance(e, HangError) and isinstance(e, TimeoutError)
                                             for e in members.values())
    assert "in `barrier`" in str(members[0]) and "one_waits_in_barrier_the_other_sleeps" in str(members[0])
    assert "in `one_waits_in_barrier_the_other_sleeps`" in str(members[1])  # asleep in the user's own frame
    # The user's own file and line, as on the caller's machine (never cloudpickle's "<dynamic-code>")
    assert re.search(r"called from test_hangs\.py:\d+ in `one_waits_in_barrier_the_other_sleeps`", str(members[0]))
    assert re.search(r"\(test_hangs\.py:\d+\)", str(members[1])) and "dynamic-code" not in members[1].stack
    assert "barrier" in members[0].stack and "Thread 0x" in members[0].stack
    assert "the call hung" in str(caught.value)
    err = capsys.readouterr().err
    assert "[rank 0] was in `barrier`" in err
    assert started_here() == []


def hang_after_printing() -> None:
    print("started", flush=True)
    one_waits_in_barrier_the_other_sleeps()


def fail_fast_with_a_rank_left_waiting(marker: str) -> None:
    if rank_info().rank == 1:
        # Rank 0 marks the moment it starts waiting; its stack is read a second after this
        # failure, when it is still waiting whatever the machine's speed.
        while not os.path.exists(marker):
            time.sleep(0.02)
        raise ValueError("rank 1 gives up")
    open(marker, "w").close()
    wait_for_rank_1()


def wait_for_rank_1() -> None:
    time.sleep(60)  # not a collective: rank 1's exit cannot fail it first, only our stop ends it


def test_stacks_reach_the_rank_logs_on_hang_and_on_fail_fast(tmp_path):
    hang = distributed_task(hang_after_printing, pool=GPUPool(nodes=2), hang_timeout_seconds=3, name="hangs")
    fails = distributed_task(fail_fast_with_a_rank_left_waiting, pool=GPUPool(nodes=2), name="fails")

    @flow
    def both():
        for task, args in ((hang, ()), (fails, (str(tmp_path / "rank0-waiting"),))):
            try:
                task(*args)
            except DistributedTaskError:
                pass

    state = both(return_state=True)

    async def logs_by_run():
        async with get_client() as client:
            runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
            out = {}
            for r in runs:
                logs = await client.read_logs(LogFilter(task_run_id=LogFilterTaskRunId(any_=[r.id])))
                out[r.name] = "\n".join(entry.message for entry in logs)
            artifacts = await client.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
            return out, [a for a in artifacts if a.key == "hangs-stacks"]

    import asyncio

    deadline = time.monotonic() + 20
    while True:
        logs, artifacts = asyncio.run(logs_by_run())
        # Logs reach the API in batches: wait until everything asserted below has arrived.
        ready = ("wait_for_rank_1" in logs.get("fails[rank 0/2]", "") and "barrier" in logs.get("hangs[rank 0/2]", "")
                 and "hang_after_printing" in logs.get("hangs[rank 1/2]", "") and artifacts)
        if ready or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "stack (no rank wrote output" in logs["hangs[rank 0/2]"] and "barrier" in logs["hangs[rank 0/2]"]
    assert "hang_after_printing" in logs["hangs[rank 1/2]"]
    # fail-fast: rank 0 was stopped where it waited, and its log says so
    assert "stack (stopped because rank 1 failed)" in logs["fails[rank 0/2]"]
    assert "wait_for_rank_1" in logs["fails[rank 0/2]"]
    assert artifacts and any("barrier" in str(a.data) for a in artifacts)


def head_returns_the_other_keeps_going() -> int:
    if rank_info().rank == 1:
        time.sleep(6)  # the user's own loop, still running long after rank 0 returned
    return rank_info().rank


def test_ranks_left_running_after_another_returned_are_named_in_a_warning_and_the_call_goes_on(capsys, monkeypatch):
    monkeypatch.setenv("SKYTASKS_STRAGGLER_WARN_SECONDS", "1.5")
    task = distributed_task(head_returns_the_other_keeps_going, pool=GPUPool(nodes=2), init_torch=False)
    assert task() == [0, 1]  # a warning, never a failure
    err = capsys.readouterr().err
    assert re.search(r"1 rank\(s\) still running 1.5s after rank 0 returned: rank 1 in test_hangs\.py:\d+ in "
                     r"head_returns_the_other_keeps_going\. .*hang_timeout_seconds", err), err
