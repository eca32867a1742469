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
from tests.prefect_api import settled_task_runs


@pytest.mark.parametrize("choice, world, mode", [
    (None, 2, "rank"), (None, 64, "rank"), (None, 65, "node"), (None, 1024, "node"),
    ("rank", 1024, "rank"), ("head", 2, "head"), ("node", 4, "node"),
])
def test_the_default_is_a_run_per_rank_up_to_64_ranks_and_per_node_above(choice, world, mode):
    assert rank_runs_for(choice, world) == mode


def test_an_unknown_rank_runs_is_refused_naming_it():
    with pytest.raises(PoolConfigError, match="rank_runs"):
        distributed_task(lambda: None, rank_runs="per-gpu")


def say_then_fail_on_rank_3() -> int:
    info = rank_info()
    print(f"hello from rank {info.rank}", flush=True)
    if info.rank == 3:
        time.sleep(0.3)
        raise ValueError("rank 3 broke")
    time.sleep(30)
    return info.rank


async def _logs(task_run_id) -> list[str]:
    async with get_client() as client:
        logs = await client.read_logs(LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])))
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
    node1 = asyncio.run(_logs(runs["by-node[node 1: ranks 2-3/4]"].id))
    assert {"[rank 2] hello from rank 2", "[rank 3] hello from rank 3"} <= set(node1), node1
    # Only the head's run; the failed rank's lines and failure reach the parent's log, the others' never.
    assert runs["by-head[rank 0/4]"].state.is_cancelled()
    parent = asyncio.run(_logs(runs["by-head"].id))
    assert "[rank 3] hello from rank 3" in parent and any("[rank 3] failed" in m for m in parent), parent
    assert "[rank 1] hello from rank 1" not in parent


def quick_or_slow(slow: bool) -> int:
    time.sleep(1.6 if slow else 0.0)
    return rank_info().rank


async def _state_names(task_run_id) -> list[str]:
    async with get_client() as client:
        states = await client.read_task_run_states(task_run_id)
        return [s.name for s in sorted(states, key=lambda s: s.timestamp)]


def test_a_rank_run_that_ends_at_once_sends_only_its_end_and_a_lasting_one_shows_running_first():
    """A warm call takes milliseconds: its rank runs go to the server as one final state each (a
    third fewer events at load). A call that lasts shows its runs Running in the UI meanwhile."""
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
