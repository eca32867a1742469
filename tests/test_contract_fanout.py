"""The core contract: a distributed task called in a flow reaches every rank and comes back."""

from __future__ import annotations

import asyncio
import os

import pytest
from prefect import flow

from tests.harness.prefect_api import settled_task_runs
from skytasks import GPUPool, distributed_task, rank_info

ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")


def where_am_i(tag: str) -> dict:
    import torch.distributed as dist

    info = rank_info()
    return {
        "tag": tag,
        "info": info,
        "env": {k: os.environ[k] for k in ENV_NAMES},
        "pid": os.getpid(),
        "initialized": dist.is_initialized(),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "dist_rank": dist.get_rank() if dist.is_initialized() else None,
    }


@pytest.mark.parametrize("nodes", [2, 3])
def test_flow_fans_out_to_every_rank_and_returns_results_in_rank_order(nodes):
    task = distributed_task(where_am_i, pool=GPUPool(nodes=nodes))

    @flow
    def fan_out():
        return task("hi")

    results = fan_out()
    assert [r["info"].rank for r in results] == list(range(nodes))
    assert all(r["tag"] == "hi" for r in results)
    ports = {r["env"]["MASTER_PORT"] for r in results}
    assert len(ports) == 1 and ports != {"29500"}
    for rank, r in enumerate(results):
        assert r["initialized"] and r["backend"] == "gloo" and r["dist_rank"] == rank
        assert r["env"] == {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": r["env"]["MASTER_PORT"], "WORLD_SIZE": str(nodes),
            "RANK": str(rank), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": str(rank),
        }
        info = r["info"]
        assert (info.world_size, info.num_nodes, info.node_rank, info.is_head) == (nodes, nodes, rank, rank == 0)
        assert info.peers == ("127.0.0.1",) * nodes and info.head_port == int(r["env"]["MASTER_PORT"])
        assert info.attempt == 1 and info.accelerators == 0
    assert len({r["pid"] for r in results}) == nodes


def test_two_nodes_of_two_processes_each():
    results = distributed_task(where_am_i, pool=GPUPool(nodes=2, procs_per_node=2))("x")
    got = [(r["info"].rank, r["info"].node_rank, r["info"].local_rank, r["info"].local_world_size) for r in results]
    assert got == [(0, 0, 0, 2), (1, 0, 1, 2), (2, 1, 0, 2), (3, 1, 1, 2)]
    assert all(r["env"]["WORLD_SIZE"] == "4" for r in results)


def ddp_one_step() -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # different initial weights: DDP must broadcast rank 0's
    model = DDP(torch.nn.Linear(4, 1))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.full((8, 4), float(rank + 1))  # different data per rank: gradients must be averaged
    model(x).pow(2).mean().backward()
    opt.step()
    return {"params": [p.detach().tolist() for p in model.parameters()],
            "moved": any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))}


def test_ddp_parameters_are_identical_across_ranks_after_a_step():
    @flow
    def one_step():
        return distributed_task(ddp_one_step, pool=GPUPool(nodes=3))()

    results = one_step()
    assert all(r["moved"] for r in results)
    assert results[0]["params"] == results[1]["params"] == results[2]["params"]


def test_parent_and_rank_task_runs_are_recorded_and_never_cached():
    task = distributed_task(where_am_i, pool=GPUPool(nodes=2), name="probe", tags=("team:ml",))

    @flow
    def twice():
        return task("same"), task("same")  # identical inputs on every rank and call

    state = twice(return_state=True)
    first, second = state.result()
    assert [r["info"].rank for r in first] == [0, 1] == [r["info"].rank for r in second]

    runs = settled_task_runs(state.state_details.flow_run_id, expect=6)
    parents = [r for r in runs if r.name == "probe"]
    ranks = [r for r in runs if r.name.startswith("probe[rank")]
    assert len(parents) == 2 and len(ranks) == 4
    assert sorted(r.name for r in ranks) == ["probe[rank 0/2]"] * 2 + ["probe[rank 1/2]"] * 2
    for r in ranks:
        rank = r.name.split()[1].split("/")[0]
        assert {"skytasks", f"rank:{rank}", "team:ml", "pool:local-pool"} <= set(r.tags)
        assert r.state.type.value == "COMPLETED" and r.state.name == "Completed"
    for p in parents:
        assert set(p.tags) == {"team:ml"} and p.state.name == "Completed"  # the user's tags, no others
        assert p.state.data is not None  # the gathered list is persisted as the parent's result
    # Rank runs are children of their parent task run.
    parent_ids = {p.id for p in parents}
    assert all({i.id for i in r.task_inputs.get("__parents__", [])} & parent_ids for r in ranks)


def test_with_pool_keeps_ranks_up_across_calls_and_tears_down_on_exit():
    pool = GPUPool(nodes=2)
    task = distributed_task(where_am_i, pool=pool)
    with pool:
        assert pool.is_up
        a, b = task("a"), task("b")
        assert [r["pid"] for r in a] == [r["pid"] for r in b]  # warm: the same rank processes
    assert not pool.is_up
    c = task("c")  # not up: brought up for this call only, with new processes
    assert {r["pid"] for r in c}.isdisjoint(r["pid"] for r in a)


def test_no_pool_argument_uses_the_active_pool():
    task = distributed_task(where_am_i)
    with GPUPool(nodes=3):
        results = task("active")
    assert [r["info"].world_size for r in results] == [3, 3, 3]


def test_pool_by_saved_block_name():
    GPUPool(nodes=2, env={"FROM_BLOCK": "yes"}).save("two-nodes-test", overwrite=True)

    def read_env() -> str:
        return os.environ["FROM_BLOCK"]

    assert distributed_task(read_env, pool="two-nodes-test")() == ["yes", "yes"]


def test_async_with_pool():
    pool = GPUPool(nodes=2)
    task = distributed_task(where_am_i, pool=pool)

    async def main():
        async with pool:
            assert pool.is_up
            return await asyncio.to_thread(task, "async")

    results = asyncio.run(main())
    assert [r["info"].rank for r in results] == [0, 1]
    assert not pool.is_up


def test_with_options_and_fn():
    task = distributed_task(where_am_i, pool=GPUPool(nodes=2))
    assert task.fn is where_am_i
    three = task.with_options(nodes=3, name="three")
    assert three.name == "three" and task.name == "where_am_i"
    assert [r["info"].rank for r in three("w")] == [0, 1, 2]
    no_torch = task.with_options(init_torch=False)
    assert [r["initialized"] for r in no_torch("n")] == [False, False]


def test_backend_option_is_used():
    results = distributed_task(where_am_i, pool=GPUPool(nodes=2), backend="gloo")("b")
    assert [r["backend"] for r in results] == ["gloo", "gloo"]
