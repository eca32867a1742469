"""A distributed task is a Prefect task in every way a flow uses one: `.submit()` and its future,
futures and `wait_for=` as for any task, async flows that keep their event loop, and many warm
calls in one flow that each leave their whole record in the API."""

from __future__ import annotations

import asyncio
import time

import pytest
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId,
                                            LogFilter, LogFilterTaskRunId)
from prefect.futures import PrefectFuture

from skytasks import GPUPool, distributed_task, rank_info


def busy_for(seconds: float, tag: str) -> tuple[str, int, float, float]:
    started = time.time()
    time.sleep(seconds)
    return tag, rank_info().rank, started, time.time()


def _window(results) -> tuple[float, float]:
    return min(r[2] for r in results), max(r[3] for r in results)


def test_submit_on_two_pools_runs_both_at_once_and_on_one_pool_one_after_the_other():
    a, b = GPUPool(nodes=2), GPUPool(nodes=2)
    job = distributed_task(busy_for, init_torch=False, name="busy")

    @flow
    def side_by_side():
        with a, b:  # warm, so the windows measure the calls, not the pools starting
            f1 = job.with_options(pool=a).submit(1.5, "a")
            f2 = job.with_options(pool=b).submit(1.5, "b")
            assert isinstance(f1, PrefectFuture) and isinstance(f2, PrefectFuture)
            two_pools = (f1.result(), f2.result())
            g1 = job.with_options(pool=a).submit(1.0, "a1")
            g2 = job.with_options(pool=a).submit(1.0, "a2")
            one_pool = (g1.result(), g2.result())
        return two_pools, one_pool

    (ra, rb), (r1, r2) = side_by_side()
    assert [(r[0], r[1]) for r in ra] == [("a", 0), ("a", 1)] and [r[0] for r in rb] == ["b", "b"]
    (a0, a1), (b0, b1) = _window(ra), _window(rb)
    assert a0 < b1 and b0 < a1, "calls on two pools must overlap in time"
    (x0, x1), (y0, y1) = sorted([_window(r1), _window(r2)])
    assert x1 <= y0, "calls on one pool take turns"


def produce(n: int) -> int:
    return n * 10


def add_rank(base: int) -> int:
    return base + rank_info().rank


def test_futures_as_arguments_and_wait_for_behave_as_for_prefect_tasks():
    pool = GPUPool(nodes=2)
    make = task(produce)
    fan = distributed_task(add_rank, pool=pool, init_torch=False, name="fan")
    order: list[str] = []

    @task
    def mark(what: str) -> str:
        time.sleep(0.5)
        order.append(what)
        return what

    @flow
    def wiring():
        upstream = make.submit(4)
        first = mark.submit("before")
        result = fan.submit(upstream, wait_for=[first])
        order.append("submitted")
        values = result.result()
        order.append("after")
        return values, fan(make.submit(7))  # a future into a plain call too

    submitted, called = wiring()
    assert submitted == [40, 41] and called == [70, 71]
    assert order.index("before") < order.index("after")


def test_submit_outside_a_flow_says_it_needs_one():
    job = distributed_task(add_rank, pool=GPUPool(nodes=1), init_torch=False, name="lonely")
    with pytest.raises(RuntimeError, match="submit needs a flow run"):
        job.submit(1)


def test_an_async_flow_keeps_its_event_loop_while_a_call_runs():
    pool = GPUPool(nodes=2)
    job = distributed_task(busy_for, pool=pool, init_torch=False, name="async-busy")

    @flow
    async def concurrent_work():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        beat = asyncio.create_task(ticker())
        async with pool:
            results = await job(1.5, "x")
            submitted = job.submit(0.2, "y").result()
        beat.cancel()
        return results, submitted, ticks

    results, submitted, ticks = asyncio.run(concurrent_work())
    assert [r[:2] for r in results] == [("x", 0), ("x", 1)] and [r[0] for r in submitted] == ["y", "y"]
    assert ticks >= 15, f"the event loop was blocked: {ticks} ticks of 50 ms during a 1.5 s call"


def echo_rank(i: int) -> int:
    print(f"call {i} on rank {rank_info().rank}")
    return i * 100 + rank_info().rank


async def _record_of(flow_run_id, parents: int, ranks: int, timeout: float = 30.0):
    """Runs, artifacts and rank logs of a flow run, once the expected counts have arrived
    (task runs and logs reach the API through Prefect's event and log workers)."""
    async with get_client() as client:
        deadline = time.monotonic() + timeout
        while True:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            parent_runs = [r for r in runs if r.name == "echo"]
            rank_runs = [r for r in runs if r.name.startswith("echo[rank ")]
            done = [r for r in runs if r.state_type is not None and r.state_type.value == "COMPLETED"]
            if len(done) >= parents + ranks or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.3)
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
        logs = {}
        for r in rank_runs:
            logs[r.id] = [entry.message for entry in await client.read_logs(
                log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[r.id])))]
        return parent_runs, rank_runs, artifacts, logs


def test_twenty_warm_calls_in_one_flow_each_leave_their_runs_logs_and_artifacts():
    pool = GPUPool(nodes=2)
    job = distributed_task(echo_rank, pool=pool, init_torch=False, name="echo")

    @flow
    def loop():
        with pool:
            return [job(i) for i in range(20)]

    state = loop(return_state=True)
    assert state.result() == [[i * 100, i * 100 + 1] for i in range(20)]
    parents, ranks, artifacts, logs = asyncio.run(_record_of(state.state_details.flow_run_id, 20, 40))
    assert len(parents) == 20 and all(p.state_type.value == "COMPLETED" for p in parents)
    assert len(ranks) == 40 and all(r.state_type.value == "COMPLETED" for r in ranks)
    assert {tuple(sorted(r.tags)) for r in ranks} == {("pool:local-pool", "rank:0", "skytasks"),
                                                       ("pool:local-pool", "rank:1", "skytasks")}
    # Each rank run has its own call's line (logs arrive in batches: wait for the last ones).
    deadline = time.monotonic() + 20
    while True:
        lines = {line for msgs in logs.values() for line in msgs}
        wanted = {f"[rank {r}] call {i} on rank {r}" for i in range(20) for r in (0, 1)}
        if wanted <= lines or time.monotonic() > deadline:
            break
        time.sleep(0.5)
        logs = asyncio.run(_record_of(state.state_details.flow_run_id, 20, 40))[3]
    assert wanted <= lines
    rank_tables = [a for a in artifacts if a.key == "echo-ranks"]
    assert len(rank_tables) == 20  # one per call, each written before its call returned
    assert {a.task_run_id for a in rank_tables} == {p.id for p in parents}
