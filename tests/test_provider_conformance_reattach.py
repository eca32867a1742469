"""Re-attach, the same promises on every provider whose Capabilities say `reattaches`: its own
way in (a new SSH session, an `srun --overlap` step, a new exec into the pod) reaches a running
agent's door, a door with nobody behind it and a node the fleet itself ended are NodeGone, and a
call whose node streams break as the fleet's transport breaks (an sshd session killed, srun and
its shepherd killed, the kube-apiserver restarted) goes on and returns whole, nothing lost or
doubled, on the same agents. A provider that cannot re-attach never leases its agents: a broken
stream is a lost node at once.
"""

from __future__ import annotations

import os
import re
import threading
import time

import pytest

from skytasks import GPUPool, distributed_task, rank_info
from skytasks.controller.session import PoolSession
from skytasks.errors import NodeGone
from skytasks.events import AttemptRestarted, NodeLost, NodeReconnected, listen
from skytasks.protocol import Op
from skytasks.providers import capabilities_of
from skytasks.wire import read_frame
from tests.conftest import wait_for_no_skytasks_processes
from tests.harness.conformance import (fleets_that, fleets_that_cannot, kill_agent, made_fleet, nothing_left,
                                       reattaches)
from tests.harness.conformance_doors import round_trip


@pytest.fixture(params=fleets_that(reattaches))
def fleet(request, tmp_path, monkeypatch):
    with made_fleet(request, tmp_path, monkeypatch) as made:
        yield made


def node_gone_says(provider, node_id: int, door: str, timeout: float = 30) -> str:
    """What NodeGone says once the fleet's word has reached the provider (a watch may lag: any
    other failure is tried again, as the controller does)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            provider.reattach(node_id, door, timeout=5).close()
        except NodeGone as exc:
            return str(exc)
        except Exception:  # noqa: BLE001 - not yet the fleet's word: asked again
            pass
        assert time.monotonic() < deadline, "the ended node was never said to be gone"
        time.sleep(0.2)


def test_reattach_reaches_the_agent_s_door_its_own_way_and_a_missing_door_or_an_ended_node_is_node_gone(fleet):
    provider = fleet.provider(fleet.pool(nodes=2).spec())
    links = provider.start()
    try:
        assert [read_frame(link.inbound)["op"] for link in links] == [Op.HELLO] * 2
        assert capabilities_of(provider).reattaches and provider.reattaches is True
        door = fleet.door(provider, 1)
        try:
            link = provider.reattach(1, door.path, timeout=30)
            try:
                assert link.node_id == 1 and door.accepted in (None, 1)
                round_trip(link)
            finally:
                link.close()
            t0 = time.monotonic()
            with pytest.raises(NodeGone, match="its agent is gone"):
                provider.reattach(1, door.path + ".nobody", timeout=30)
            assert time.monotonic() - t0 < 20
            said = fleet.end_node(provider, 1)
            if said is not None:
                why = node_gone_says(provider, 1, door.path)
                assert re.search(said, why), why
                assert door.accepted in (None, 1)  # the fleet's word was enough: no way in was tried
        finally:
            door.close()
    finally:
        provider.stop()
    nothing_left(fleet)


def through_a_break(seconds: float) -> dict:
    """Every rank prints, sleeps through the break, prints again and returns: what it printed
    while its node's stream was broken reaches the controller once the node is reached again."""
    info = rank_info()
    print(f"rank {info.rank} before the break", flush=True)
    time.sleep(seconds)
    for i in range(50):
        print(f"line {i} of rank {info.rank}", flush=True)
    return {"attempt": info.attempt, "rank": info.rank, "agent": os.getppid(), "blob": bytes([info.rank]) * (1 << 20)}


def call_through_a_break(pool: GPUPool, break_stream, seconds: float = 15.0) -> tuple[list, list, set[int]]:
    """The call, with `break_stream(session)` run on a thread a few seconds in (the ranks are
    asleep by then); (results, events heard, the nodes broken). The same agents before and after."""
    failures: list[BaseException] = []
    broken: set[int] = set()

    def breaker() -> None:
        try:
            deadline = time.monotonic() + 120
            while (session := pool.runtime().session) is None or not session.nodes:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            time.sleep(4)
            broken.update(break_stream(session))
        except BaseException as exc:  # noqa: BLE001 - said by the test
            failures.append(exc)

    with listen() as heard, pool:
        before = [(n.pid, n.link.machine) for n in pool.runtime().session.nodes]
        thread = threading.Thread(target=breaker, daemon=True)
        thread.start()
        results = distributed_task(through_a_break, pool=pool, init_torch=False)(seconds)
        thread.join(60)
        after = [(n.pid, n.link.machine) for n in pool.runtime().session.nodes]
    assert not failures, failures
    assert after == before  # the same agents (and pods): no node was replaced
    return results, list(heard), broken


def test_a_call_goes_on_whole_when_the_fleet_s_transport_breaks_and_the_pool_s_end_reaches_every_agent(fleet,
                                                                                                      capsys):
    results, heard, broken = call_through_a_break(fleet.pool(nodes=2, reattach_seconds=60), fleet.break_stream)
    assert broken
    assert [r["attempt"] for r in results] == [1, 1]  # no retry, no node recovery spent
    assert all(r["blob"] == bytes([r["rank"]]) * (1 << 20) for r in results)
    assert not [e for e in heard if isinstance(e, (NodeLost, AttemptRestarted))]
    reconnected = [e for e in heard if isinstance(e, NodeReconnected)]
    assert {e.node for e in reconnected} == broken and all(e.down_seconds > 0 for e in reconnected)
    # The pool's end reached every agent (END), the re-attached ones too: none waits out its 60 s window.
    assert wait_for_no_skytasks_processes(timeout=15) == []
    out = capsys.readouterr()
    text = out.out + out.err
    assert all(text.count(f"line {i} of rank {r}\n") == 1 for r in (0, 1) for i in range(50))  # nothing lost or twice
    nothing_left(fleet)


@pytest.mark.parametrize("fleet", fleets_that_cannot(reattaches), indirect=True)
def test_a_provider_that_cannot_reattach_never_leases_and_a_broken_stream_is_a_lost_node_at_once(fleet):
    spec = fleet.pool(nodes=2, reattach_seconds=20).spec()
    provider = fleet.provider(spec)
    assert not capabilities_of(provider).reattaches
    session = PoolSession(provider, spec.procs_per_node, dict(spec.env), nodes=(spec.fewest, spec.nodes),
                          reattach_seconds=spec.reattach_seconds).start()
    try:
        assert session.reattach_seconds == 0 and all(n.lease is None for n in session.nodes)  # never waited for
        t0 = time.monotonic()
        kill_agent(fleet, session, 1)
        assert time.monotonic() - t0 < 5  # lost at once, not after reattach_seconds
        with pytest.raises(NodeGone, match="cannot reach a running agent again|has ended"):
            provider.reattach(1, "/nonexistent/door.sock", timeout=5)
    finally:
        session.close()
    nothing_left(fleet)
