"""Warm pools, the same promises on every provider that keeps nodes warm (its class has the warm
verbs: `handle`, `adopt`, `leave_running`), each controller a process of its own as a deployment's
runs are: the next process attaches to the same nodes, nothing is started again, a node lost
while nobody held the pool is replaced before the next holder's first call, `skytasks pools down`
leaves nothing, and a pool nobody held for keep_warm_minutes ends itself and is started afresh,
quietly. A provider that cannot keep warm refuses keep_warm_minutes by name, leaving nothing.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from skytasks import GPUPool
from skytasks.errors import PoolConfigError
from tests.conftest import wait_for_no_skytasks_processes
from tests.harness.conformance import Fleet, fleets_that, fleets_that_cannot, keeps_warm, made_fleet, nothing_left
from tests.harness.conformance_warm import events, related_to_flow_run, use, wait_until
from tests.harness.warm import pools_down


@pytest.fixture(params=fleets_that(keeps_warm))
def fleet(request, tmp_path, monkeypatch):
    with made_fleet(request, tmp_path, monkeypatch) as made:
        yield made


def save(fleet: Fleet, name: str, **fields) -> None:
    fleet.warm_pool(nodes=2, **{"reattach_seconds": 10, "keep_warm_minutes": 2.0, **fields}).save(name, overwrite=True)


def down_to_nothing(fleet: Fleet, name: str) -> None:
    pools_down(name)
    wait_until(lambda: not fleet.leftovers(), 60, "the pool's instances, jobs or pods ended")
    nothing_left(fleet)


def test_the_next_process_attaches_to_the_same_nodes_a_node_lost_unheld_is_replaced_and_down_leaves_nothing(
        fleet, pool_name, tmp_path):
    save(fleet, pool_name)
    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    first = use(pool_name, tmp_path / "first.json")
    assert first["ranks"] == [0, 1] and fleet.agents_running(first), "the agents ended with their process"
    held = fleet.holdings()
    second = use(pool_name, tmp_path / "second.json")
    assert second["ranks"] == [0, 1] and fleet.agents_of(second) == fleet.agents_of(first)  # the same, and they work
    assert fleet.holdings() == held  # nothing launched, allocated or made again
    attached = events(pool_name, since, "attached")
    assert any(related_to_flow_run(e, second["flow_run_id"]) for e in attached), attached
    fleet.kill_unheld(first, 1)  # while nobody holds the pool
    third = use(pool_name, tmp_path / "third.json")
    was, now = fleet.agents_of(first), fleet.agents_of(third)
    assert third["ranks"] == [0, 1] and now[0] == was[0] and now[1] != was[1]  # node 1 replaced, node 0 served on
    assert fleet.agents_running(third)
    down_to_nothing(fleet, pool_name)
    assert fleet.agents_ended(first) and fleet.agents_ended(third)


def test_an_unheld_pool_ends_itself_after_keep_warm_and_the_next_process_starts_it_afresh_quietly(
        fleet, pool_name, tmp_path):
    save(fleet, pool_name, keep_warm_minutes=0.05)  # 3 s
    first = use(pool_name, tmp_path / "first.json")
    assert fleet.holdings() or fleet.name in ("local", "ssh")  # what it holds besides agents, if anything
    wait_until(lambda: fleet.agents_ended(first), fleet.ends_within_seconds, "the unheld agents' end")
    assert wait_for_no_skytasks_processes() == []  # their ranks too
    if fleet.holdings_end_with_agents:
        wait_until(lambda: not fleet.holdings(), 45, "the allocation's end")  # long before idle_minutes
    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    again = use(pool_name, tmp_path / "again.json")  # started afresh, without an error
    assert again["ranks"] == [0, 1] and set(fleet.agents_of(again)).isdisjoint(fleet.agents_of(first))
    assert events(pool_name, since, "expired")
    down_to_nothing(fleet, pool_name)  # what the expired pool left (ended pods, instances) is cleared too


@pytest.mark.parametrize("fleet", fleets_that_cannot(keeps_warm), indirect=True)
def test_a_provider_that_cannot_keep_warm_refuses_keep_warm_minutes_by_name_and_leaves_nothing(fleet, pool_name):
    fleet.pool(nodes=2, keep_warm_minutes=1.0).save(pool_name, overwrite=True)
    runtime = GPUPool.load(pool_name).runtime()
    warm = runtime.warm_pool(lambda: fleet.provider(runtime.spec))
    with pytest.raises(PoolConfigError, match=r"^keep_warm_minutes: .*cannot keep nodes warm"):
        warm.open()
    nothing_left(fleet)
    assert warm.store.newest(pool_name)[1] is None  # its record is a tombstone: nothing to attach to
