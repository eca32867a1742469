"""What every provider promises, checked the same way on each fleet: local processes, a real sshd on
loopback, moto's EC2 (with a stand-in for cloud-init), and the SLURM test cluster.

Each test drives a provider through the registry and the real `PoolSession`, exactly as a call
does: start N, start between min and max, lose a node, replace or drop it, tear down with
nothing left, agents that end when their controller falls silent, and `skytasks gc` for the
fleets that own something which can outlive its controller (EC2 instances, SLURM jobs; local and
ssh agents end with their stream, which the idle test checks).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Iterator

import pytest

from skytasks import GPUPool
from skytasks.controller.session import PoolSession
from skytasks.events import NodeLost, NodeReplaced, PoolShrank
from skytasks.protocol import Op
from skytasks.providers.registry import provider_for
from skytasks.wire import ChannelClosed, read_frame
from tests.conftest import wait_for_no_skytasks_processes
from tests.harness.sshd import SSHServer, free_port


class Fleet:
    """One provider's test fleet: pools on it, and what it still holds."""

    name = ""

    def pool(self, **fields: Any) -> GPUPool:
        raise NotImplementedError

    @contextlib.contextmanager
    def room_for(self, count: int) -> Iterator[None]:
        """While inside, the fleet can give at most `count` nodes (local: no limit)."""
        yield

    def leftovers(self) -> list[str]:
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


class LocalFleet(Fleet):
    name = "local"

    def pool(self, **fields: Any) -> GPUPool:
        return GPUPool(provider="local", **fields)


class SSHFleet(Fleet):
    name = "ssh"
    HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")

    def __init__(self, folder):
        self.server = SSHServer(folder, list(self.HOSTS[:2]), free_port())
        self.hosts = list(self.HOSTS[:2])

    def pool(self, **fields: Any) -> GPUPool:
        hosts = self.hosts[:fields["nodes"]]
        return GPUPool(provider="ssh", hosts=[f"root@{h}:{self.server.port}" for h in hosts],
                       ssh_private_key=self.server.client_key, known_hosts=self.server.known_hosts(),
                       remote_python=sys.executable, ready_timeout_seconds=30, **fields)

    @contextlib.contextmanager
    def room_for(self, count: int) -> Iterator[None]:
        self.hosts = list(self.HOSTS)  # the third has no sshd: `count` is the two that answer
        assert count == 2
        try:
            yield
        finally:
            self.hosts = list(self.HOSTS[:2])


class AWSFleet(Fleet):
    name = "aws"

    def __init__(self, moto, folder, monkeypatch):
        from tests.test_aws_provider import CloudInitStandIn

        self.moto, self.monkeypatch = moto, monkeypatch
        self.stand_in = CloudInitStandIn(moto["ec2"], folder)
        self.stand_in.start()

    def pool(self, **fields: Any) -> GPUPool:
        return GPUPool(provider="aws", instance_type="t3.micro", image_id=self.moto["image"],
                       subnet_id=self.moto["subnet"], aws_credentials=self.moto["creds"],
                       ssh_ingress_cidr="127.0.0.1/32", ssh_user="root", remote_python=sys.executable,
                       ready_timeout_seconds=120, **fields)

    @contextlib.contextmanager
    def room_for(self, count: int) -> Iterator[None]:
        """EC2's own InsufficientInstanceCapacity past `count` instances, as a full region says."""
        from tests.test_aws_provider import limit_ec2_capacity

        with self.monkeypatch.context() as m:
            limit_ec2_capacity(m, {"instances": count})
            yield

    def leftovers(self) -> list[str]:
        from tests.test_aws_provider import leftovers

        held = leftovers(self.moto["ec2"])
        return [f"{kind}: {ids}" for kind, ids in held.items() if ids]

    def gc(self, now: datetime) -> list[str]:
        from skytasks.providers.aws.gc import sweep

        return sweep(self.moto["ec2"], now=now)

    def close(self) -> None:
        self.stand_in.stop()


class SlurmFleet(Fleet):
    name = "slurm"

    def __init__(self, cluster):
        self.cluster = cluster

    def pool(self, **fields: Any) -> GPUPool:
        return GPUPool(provider="slurm", remote_python=sys.executable, ready_timeout_seconds=60, **fields)

    @contextlib.contextmanager
    def room_for(self, count: int) -> Iterator[None]:
        """Someone else's job holds the other nodes."""
        names = sorted(self.cluster.node_states())
        self.cluster.wait_idle(names=names[:count])  # a job just ended may still be completing
        held = names[count:]
        blocker = self.cluster.run("sbatch", "--parsable", "-w", ",".join(held), "--exclusive", "--output=/dev/null",
                                   "--wrap", "sleep 300").stdout.strip().split(";")[0]
        self.cluster.wait_running(blocker)
        try:
            yield
        finally:
            self.cluster.run("scancel", blocker)
            self.cluster.wait_queue_empty_of(blocker)

    def leftovers(self) -> list[str]:
        return self.cluster.wait_queue_empty(timeout=30)

    def gc(self, now: datetime) -> list[str]:
        from skytasks.providers.reporting import PoolReporter
        from skytasks.providers.slurm.gc import sweep_jobs
        from skytasks.providers.slurm.shell import SlurmShell
        from skytasks.providers.slurm.spec import SlurmSpec

        return sweep_jobs(SlurmShell(self.pool(nodes=1).spec().own(SlurmSpec), PoolReporter("gc", "slurm")), now=now)


class KubernetesFleet(Fleet):
    """The test cluster's first node (its pods are kept there, the second node is for the tests
    of placement): pods ask for a tenth of a CPU each, and `room_for` has a pod of someone else's
    hold the rest of the node's CPU."""

    name = "kubernetes"
    CPU = 100  # millicores per pod

    def __init__(self, cluster):
        self.cluster = cluster

    def pool(self, **fields: Any) -> GPUPool:
        from tests.harness.kube import kube_pool

        template = self.cluster.host_python_template()
        template["spec"]["containers"].append({"resources": {"requests": {"cpu": f"{self.CPU}m"}}})
        template["spec"]["nodeSelector"] = {"kubernetes.io/hostname": self.cluster.nodes[0]}
        return kube_pool(self.cluster, k8s_pod_template=template, ready_timeout_seconds=60, **fields)

    @contextlib.contextmanager
    def room_for(self, count: int) -> Iterator[None]:
        import json

        node = json.loads(self.cluster.kubectl("get", "node", self.cluster.nodes[0], "-o", "json").stdout)
        from kubernetes.utils import parse_quantity

        allocatable = int(parse_quantity(node["status"]["allocatable"]["cpu"]) * 1000)
        hold = allocatable - count * self.CPU - self.CPU // 2
        template = self.cluster.host_python_template()
        container = template["spec"]["containers"][0]
        container.update(name="blocker", command=[sys.executable, "-c", "import time; time.sleep(600)"],
                         resources={"requests": {"cpu": f"{hold}m"}})
        template["spec"]["nodeSelector"] = {"kubernetes.io/hostname": self.cluster.nodes[0]}
        manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "someone-elses"}, "spec": template["spec"]}
        path = self.cluster.folder / "someone-elses.json"
        path.write_text(json.dumps(manifest))
        self.cluster.kubectl("apply", "-f", str(path))
        try:
            self.cluster.kubectl("wait", "--for=condition=Ready", "pod/someone-elses", "--timeout=60s")
            yield
        finally:
            self.cluster.kubectl("delete", "pod", "someone-elses", "--grace-period=0", "--force", check=False)

    def leftovers(self) -> list[str]:
        from tests.harness.kube import held

        deadline = time.monotonic() + 30
        while (left := held(self.cluster)) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    def gc(self, now: datetime) -> list[str]:
        from kubernetes import client

        from skytasks.providers.kubernetes import cluster
        from skytasks.providers.kubernetes.gc import sweep
        from tests.harness.kube import credentials

        cfg = cluster.configuration(credentials(self.cluster.admin_kubeconfig))
        return sweep(client.CoreV1Api(cluster.api_client(cfg)), "default", now=now)

    def kill_agent(self, session: PoolSession, node_rank: int) -> None:
        """Its pod is deleted at once (`kubectl delete --grace-period=0 --force`)."""
        self.cluster.kubectl("delete", "pod", session.nodes[node_rank].link.machine, "--grace-period=0", "--force",
                             "--wait=false")

    def identity(self, node: Any) -> Any:
        return node.link.machine  # its pod: pids are the pod's own, and repeat between pods


@pytest.fixture(params=["local", "ssh", "aws", "slurm", "kubernetes"])
def fleet(request, tmp_path, monkeypatch) -> Iterator[Fleet]:
    made: Fleet
    if request.param == "local":
        made = LocalFleet()
    elif request.param == "ssh":
        made = SSHFleet(tmp_path / "sshd")
    elif request.param == "aws":
        made = AWSFleet(request.getfixturevalue("moto"), tmp_path, monkeypatch)
    elif request.param == "slurm":
        made = SlurmFleet(request.getfixturevalue("cluster"))
    else:
        made = KubernetesFleet(request.getfixturevalue("k8s_cluster"))
    try:
        yield made
    finally:
        if isinstance(made, AWSFleet):
            made.close()
        elif isinstance(made, SSHFleet):
            made.server.stop()


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
        leased = fleet.name != "local"  # local agents are reached without a stream that can break
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
