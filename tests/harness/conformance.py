"""The provider conformance suite's fleets: one `Fleet` per provider, driven the same way by every
contract (tests/test_provider_conformance*.py), and which providers each contract runs on, read
from what the provider class says it can do, never from its name.

A sixth provider gets every contract by adding its `Fleet` here (and its name to `FLEETS`): the
warm contracts run on it when its class keeps warm (it has the warm verbs: `handle`, `adopt`,
`leave_running`), the re-attach contracts when its `Capabilities` say `reattaches`; a provider
without either runs the contract that it refuses clearly. The local and ssh fleets are here, the
cloud and cluster ones in `conformance_clusters`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from datetime import datetime
from typing import Any, Iterator

import psutil

from skytasks import GPUPool
from skytasks.controller.session import PoolSession
from skytasks.pool_spec import PoolSpec
from skytasks.providers import NodeProvider, capabilities_of
from skytasks.providers.local.provider import LocalProvider
from skytasks.providers.registry import provider_class, provider_for
from tests.conftest import gone, wait_for_no_skytasks_processes
from tests.harness.ssh_pools import LOOPBACK_HOSTS

FLEETS = ("local", "ssh", "aws", "slurm", "kubernetes")
# A stand-in sixth provider that keeps the seam's defaults (no warm verbs, no re-attach): what the
# refusal contracts run on, so they check something even while every real provider can do both.
STAND_IN = "no-warm-no-reattach"
WARM_VERBS = ("handle", "adopt", "leave_running")


def keeps_warm(cls: type) -> bool:
    """Whether a provider class keeps nodes warm: it has its own warm verbs (a warm mixin's, or
    its own), not the seam's defaults that refuse keep_warm_minutes."""
    return all(getattr(cls, verb) is not getattr(NodeProvider, verb) for verb in WARM_VERBS)


def reattaches(cls: type) -> bool:
    return capabilities_of(cls).reattaches


def fleets_that(can: Any) -> list[str]:
    return [name for name in FLEETS if can(provider_class(name))]


def fleets_that_cannot(can: Any) -> list[str]:
    return [name for name in FLEETS if not can(provider_class(name))] + [STAND_IN]


class Fleet:
    """One provider's test fleet: pools on it, and what it still holds."""

    name = ""

    def pool(self, **fields: Any) -> GPUPool:
        raise NotImplementedError

    def warm_pool(self, **fields: Any) -> GPUPool:
        """A pool to save with keep_warm_minutes, as a team runs one (kubernetes: under rbac.yaml)."""
        return self.pool(**fields)

    def provider(self, spec: PoolSpec) -> NodeProvider:
        return provider_for(spec)

    @contextlib.contextmanager
    def room_for(self, count: int) -> Iterator[None]:
        """While inside, the fleet can give at most `count` nodes (local: no limit)."""
        yield

    def leftovers(self) -> list[str]:
        return []

    def holdings(self) -> list[str]:
        """What the fleet holds for its pools besides agents (instances, jobs, pods): a warm pool
        attached to again holds the same."""
        return []

    def gc(self, now: datetime) -> list[str]:
        raise NotImplementedError

    def kill_agent(self, session: PoolSession, node_rank: int) -> None:
        """The node's agent dies (kill -9): the controller finds its stream closed."""
        node = session.nodes[node_rank]
        assert node.pid is not None  # every agent says its pid in its hello
        os.kill(node.pid, signal.SIGKILL)

    def identity(self, node: Any) -> Any:
        """What tells one node's agent from another's: its pid on this machine."""
        return node.pid

    # -- a warm pool, as a controller process (tests/programs/warm_call.py) saw it ---------------

    def agents_of(self, seen: dict) -> list[Any]:
        """What tells the pool's agents apart, as a controller process reported them."""
        return list(seen["pids"])

    def kill_unheld(self, seen: dict, node: int) -> None:
        """Node `node`'s agent dies while nobody holds the pool."""
        pid = seen["pids"][node]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not gone(pid):
            assert time.monotonic() < deadline, "the killed agent did not end"
            time.sleep(0.1)

    def agents_running(self, seen: dict) -> bool:
        return not any(gone(pid) for pid in seen["pids"])

    def agents_ended(self, seen: dict) -> bool:
        return all(gone(pid) for pid in seen["pids"])

    # How long an unheld pool's agents may take to end once its keep_warm_minutes ran out.
    ends_within_seconds = 30.0

    # -- re-attach ------------------------------------------------------------------------------

    def break_stream(self, session: PoolSession) -> set[int]:
        """Break the streams of a running pool's nodes as this fleet's transport breaks (its
        nodes and agents live on); the nodes broken."""
        raise NotImplementedError

    def door(self, provider: NodeProvider, node_id: int) -> Any:
        """A stand-in door where node `node_id`'s processes reach it (`path`, `accepted`, `close`)."""
        from tests.harness.conformance_doors import StandInDoor

        return StandInDoor()

    def end_node(self, provider: NodeProvider, node_id: int) -> str | None:
        """The fleet itself ends node `node_id` (not only its agent); what its NodeGone then says
        (a regular expression), or None when a missing door is this fleet's only word."""
        return None

    # Whether what the fleet holds for a warm pool (its jobs) ends with its unheld agents here;
    # elsewhere it is the node's watchdog's (an instance's, not played by the EC2 stand-in) or
    # it stays, ended, for the next process to clear (a pod).
    holdings_end_with_agents = False


def kill_ssh_sessions(agent_pid: int) -> None:
    """SIGKILL to the sshd sessions an agent was started in (what a connection reset does), not
    the listening sshd above them: the agent, exec'd without a pty, runs on."""
    sshds = [p for p in psutil.Process(agent_pid).parents() if p.name().startswith("sshd")]
    assert len(sshds) >= 2, sshds  # its sessions, and the server listening above them
    for p in sshds[:-1]:
        p.kill()


class LocalFleet(Fleet):
    name = "local"

    def pool(self, **fields: Any) -> GPUPool:
        return GPUPool(provider="local", **fields)


class SSHFleet(Fleet):
    """The module's sshd (conftest's `sshd`, two loopback addresses); a third address with no
    sshd is a host that does not answer."""

    name = "ssh"
    HOSTS = (*LOOPBACK_HOSTS, "127.0.0.3")

    def __init__(self, server):
        self.server = server
        self.hosts = list(self.HOSTS[:2])

    def pool(self, **fields: Any) -> GPUPool:
        hosts = self.hosts[:fields["nodes"]]
        return GPUPool(provider="ssh", hosts=[f"root@{h}:{self.server.port}" for h in hosts],
                       ssh_private_key=self.server.client_key, known_hosts=self.server.known_hosts(),
                       remote_python=sys.executable, **{"ready_timeout_seconds": 30, **fields})

    @contextlib.contextmanager
    def room_for(self, count: int) -> Iterator[None]:
        self.hosts = list(self.HOSTS)  # the third has no sshd: `count` is the two that answer
        assert count == 2
        try:
            yield
        finally:
            self.hosts = list(self.HOSTS[:2])

    def break_stream(self, session: PoolSession) -> set[int]:
        kill_ssh_sessions(session.nodes[1].pid)
        return {1}


class NoWarmProvider(LocalProvider):
    """A provider that says nothing beyond the seam: the warm verbs and `reattach` are the
    defaults, and its capabilities claim no re-attach."""

    handle = NodeProvider.handle
    adopt = NodeProvider.adopt
    leave_running = NodeProvider.leave_running
    reattach = NodeProvider.reattach


class StandInFleet(LocalFleet):
    name = STAND_IN

    def provider(self, spec: PoolSpec) -> NodeProvider:
        return NoWarmProvider(spec)


@contextlib.contextmanager
def made_fleet(request, tmp_path, monkeypatch) -> Iterator[Fleet]:
    """The fleet of the provider named by `request.param`, for each contract module's `fleet`
    fixture (a contract that runs on some providers only says which with
    `@pytest.mark.parametrize("fleet", fleets_that(...), indirect=True)`)."""
    from tests.harness import conformance_clusters as clusters

    made: Fleet
    if request.param == "local":
        made = LocalFleet()
    elif request.param == STAND_IN:
        made = StandInFleet()
    elif request.param == "ssh":
        made = SSHFleet(request.getfixturevalue("sshd"))
    elif request.param == "aws":
        made = clusters.AWSFleet(request.getfixturevalue("moto"), tmp_path, monkeypatch)
    elif request.param == "slurm":
        made = clusters.SlurmFleet(request.getfixturevalue("cluster"))
    else:
        made = clusters.KubernetesFleet(request.getfixturevalue("k8s_cluster"))
    try:
        yield made
    finally:
        if isinstance(made, clusters.AWSFleet):
            made.close()


class Heard:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def on_event(self, event: Any) -> None:
        self.events.append(event)

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def started(pool: GPUPool) -> PoolSession:
    spec = pool.spec()
    return PoolSession(provider_for(spec), spec.procs_per_node, dict(spec.env), nodes=(spec.fewest, spec.nodes)).start()


def kill_agent(fleet: Fleet, session: PoolSession, node_rank: int) -> None:
    node = session.nodes[node_rank]
    fleet.kill_agent(session, node_rank)
    deadline = time.monotonic() + 30
    while node.usable and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not node.usable


def nothing_left(fleet: Fleet) -> None:
    assert wait_for_no_skytasks_processes() == []
    assert fleet.leftovers() == []
