"""Membership events reach Prefect as Prefect events, with their payloads and the runs they
belong to, so that an Automation can act on them: docs/fault-tolerance.md's "tell me when a node of my pool
is preempted", against the session's real Prefect server."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

from prefect import flow
from prefect.automations import Automation
from prefect.client.orchestration import get_client
from prefect.events.actions import DoNothing
from prefect.events.schemas.automations import EventTrigger

from skytasks import GPUPool, distributed_task
from tests.test_elastic import train_steps
from tests.test_prefect_native import _wait_for_events

NAMES = {"skytasks.node.preempted", "skytasks.attempt.restarted", "skytasks.pool.shrank"}


def test_a_preemption_in_a_flow_is_a_prefect_event_an_automation_can_match(tmp_path):
    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    # The automation of docs/fault-tolerance.md, as a user writes it (DoNothing here: no notification block in tests).
    automation = Automation(
        name="node of spot-pool preempted",
        trigger=EventTrigger(expect={"skytasks.node.preempted"},
                             match={"prefect.resource.id": "skytasks.pool.spot-pool"},
                             posture="Reactive", threshold=1, within=0),
        actions=[DoNothing()],
    ).create()
    pool = GPUPool(nodes=2, min_nodes=1)
    pool._block_document_name = "spot-pool"  # as GPUPool.load("spot-pool") names it
    task = distributed_task(train_steps, pool=pool, name="spot-train")

    @flow
    def spot_flow():
        return task(str(tmp_path / "ckpt"), str(tmp_path / "noticed"))

    state = spot_flow(return_state=True)
    assert state.is_completed() and [r["attempt"] for r in state.result()] == [2]
    flow_run_id = str(state.state_details.flow_run_id)
    events = {e["event"]: e for e in _wait_for_events("skytasks.", since, NAMES, flow_run_id)}
    assert NAMES <= set(events), sorted(events)

    preempted = events["skytasks.node.preempted"]
    assert preempted["resource"]["prefect.resource.id"] == "skytasks.pool.spot-pool"  # what the trigger matches
    assert preempted["payload"] == {"node": 1, "address": "127.0.0.1", "source": "SIGUSR2 reached the node agent",
                                    "deadline": None}
    roles = {r["prefect.resource.role"] for r in preempted["related"]}
    assert {"flow-run", "task-run"} <= roles  # related to the flow run and the call's task run
    assert events["skytasks.attempt.restarted"]["payload"] == {
        "task": "spot-train", "attempt": 1, "reason": "preempted", "retries_left": 0, "node_recoveries_left": 2}
    shrank = events["skytasks.pool.shrank"]["payload"]
    assert (shrank["from_nodes"], shrank["to_nodes"]) == (2, 1) and "was preempted" in shrank["reason"]

    async def stored():
        async with get_client() as client:
            return await client.read_automations_by_name("node of spot-pool preempted")

    [saved] = asyncio.run(stored())
    assert saved.id == automation.id and saved.trigger.expect == {"skytasks.node.preempted"}
