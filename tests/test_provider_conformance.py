"""What every provider promises, checked the same way on each fleet: local processes, a real sshd on
loopback, moto's EC2 (with a stand-in for cloud-init), the SLURM and the Kubernetes test clusters
(the fleets: tests/harness/conformance.py). Warm pools and re-attach have contracts of their own,
run on every provider that can: test_provider_conformance_warm.py and _reattach.py.

Each test drives a provider through the registry and the real `PoolSession`, exactly as a call
does: start N, start between min and max, lose a node, replace or drop it, tear down with
nothing left, agents that end when their controller falls silent, and `skytasks gc` for the
fleets that own something which can outlive its controller (EC2 instances, SLURM jobs; local and
ssh agents end with their stream, which the idle test checks).
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest

from skytasks.controller.session import PoolSession
from skytasks.events import NodeLost, NodeReplaced, PoolShrank
from skytasks.protocol import Op
from skytasks.providers import capabilities_of
from skytasks.providers.registry import provider_for
from skytasks.wire import ChannelClosed, read_frame
from tests.conftest import wait_for_no_skytasks_processes
from tests.harness.conformance import FLEETS, Heard, kill_agent, made_fleet, nothing_left, started
from tests.harness.conformance_clusters import AWSFleet, KubernetesFleet, SlurmFleet  # noqa: F401 - their old home


@pytest.fixture(params=FLEETS)
def fleet(request, tmp_path, monkeypatch):
    with made_fleet(request, tmp_path, monkeypatch) as made:
        yield made


def test_it_starts_n_nodes_replaces_a_lost_one_and_tears_down_to_nothing(fleet):
    session = started(fleet.pool(nodes=2))
    try:
        assert [n.link.node_rank for n in session.nodes] == [0, 1] and session.world_size == 2
        assert len({n.link.node_id for n in session.nodes}) == 2 and all(n.pid for n in session.nodes)
        before = fleet.identity(session.nodes[1])
        kill_agent(fleet, session, 1)
        heard = Heard()
        session.prepare(heard, first_attempt=True)  # a fixed pool: replaced through the provider
        [lost], [replaced] = heard.of(NodeLost), heard.of(NodeReplaced)
        assert lost.node == 1 and replaced.node == 1
        fresh = session.nodes[1]
        assert fresh.usable and fresh.pid is not None and fleet.identity(fresh) != before  # a new agent
        assert len(session.nodes) == 2
    finally:
        session.close()
    nothing_left(fleet)


def test_an_elastic_pool_starts_with_what_it_can_have_grows_back_and_drops_a_lost_node(fleet, monkeypatch):
    monkeypatch.setenv("SKYTASKS_GROW_RETRY_SECONDS", "0")  # grow before this call, whatever came before
    room = 3 if fleet.name == "local" else 2  # this machine has room for every local node
    with fleet.room_for(room):
        session = started(fleet.pool(nodes=3, min_nodes=1))
        try:
            assert 1 <= len(session.nodes) <= room  # between min_nodes and what the fleet had (SLURM: its min)
            session.prepare(Heard(), first_attempt=True)  # before a call: grown back toward nodes
            assert len(session.nodes) == room and len({fleet.identity(n) for n in session.nodes}) == room
            kill_agent(fleet, session, room - 1)
            heard = Heard()
            session.prepare(heard, first_attempt=False)  # above min_nodes: dropped, not replaced
            [shrank] = heard.of(PoolShrank)
            assert len(session.nodes) == room - 1 and session.world_size == room - 1
            assert [n.link.node_rank for n in session.nodes] == list(range(room - 1))
            assert (shrank.from_nodes, shrank.to_nodes) == (room, room - 1) and not heard.of(NodeReplaced)
        finally:
            session.close()
    nothing_left(fleet)


def test_agents_end_when_their_controller_falls_silent_and_what_it_held_is_swept(fleet, monkeypatch):
    """No heartbeat reaches the agents (the controller hung or died): each ends itself after the
    heartbeat timeout. What can outlive them (EC2 instances, a SLURM job) is then found and
    ended by `skytasks gc` once past its expiry, with nothing else to help."""
    monkeypatch.setenv("SKYTASKS_HEARTBEAT_SECONDS", "1")
    monkeypatch.setenv("SKYTASKS_HEARTBEAT_TIMEOUT_SECONDS", "2")
    provider = provider_for(fleet.pool(nodes=2).spec())
    links = provider.start()
    try:
        assert [read_frame(link.inbound)["op"] for link in links] == [Op.HELLO, Op.HELLO]
        silent_from = time.monotonic()
        for link in links:  # the agent's own heartbeats come, then its stream ends: it left
            with pytest.raises(ChannelClosed):
                while True:
                    read_frame(link.inbound)
        assert time.monotonic() - silent_from < 20
        assert wait_for_no_skytasks_processes(timeout=10) == []  # a stream ends a moment before its process
        if fleet.name in ("aws", "slurm", "kubernetes"):
            # No max_lifetime_minutes (the default): what gc goes by is the lease the controller
            # renews (aws, slurm: idle_minutes and a little more), long run out a day on.
            a_day_on = datetime.now(timezone.utc) + timedelta(days=1)
            assert len(fleet.gc(a_day_on)) == 1  # this pool's, and only it
            assert fleet.leftovers() == []
    finally:
        provider.stop()
    nothing_left(fleet)


def test_a_node_really_gone_is_lost_within_reattach_seconds(fleet):
    """A leased node whose agent is killed (kubernetes: whose pod is deleted) is not waited for:
    the provider's way in finds nothing behind the agent's door, or the fleet says the node is gone
    (NodeGone), and the node is lost well within reattach_seconds; then replaced as before."""
    spec = fleet.pool(nodes=2, reattach_seconds=20).spec()
    session = PoolSession(provider_for(spec), spec.procs_per_node, dict(spec.env), nodes=(spec.fewest, spec.nodes),
                          reattach_seconds=spec.reattach_seconds).start()
    try:
        leased = capabilities_of(session.provider).reattaches  # local agents: no stream that can break
        assert all((n.lease is not None) == leased for n in session.nodes)
        t0 = time.monotonic()
        kill_agent(fleet, session, 1)  # lost within 30 s, or this fails
        assert time.monotonic() - t0 < 15  # not the 20 s window: the node was found gone
        heard = Heard()
        session.prepare(heard, first_attempt=True)
        [lost] = heard.of(NodeLost)
        assert lost.node == 1 and heard.of(NodeReplaced)
    finally:
        session.close()
    nothing_left(fleet)
