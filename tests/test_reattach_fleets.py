"""Re-attach through each provider's own way in (issue 52): `provider.reattach(node_id, door,
timeout)` runs `python -c attach.CLIENT DOOR` on the node through a new SSH session, an `srun
--overlap` step in the same allocation, or a new exec into the same pod, and hands back a stream
whose first bytes are what the door said. Checked against a stand-in door (a unix socket that
greets and echoes, where the node's processes can reach it) on the real fleets: the real sshd,
the SLURM test cluster and the Kubernetes test cluster; and `NodeGone` when nothing is behind the
door, or the fleet knows the node is gone.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from skytasks import GPUPool, distributed_task, rank_info
from skytasks.errors import NodeGone
from skytasks.events import AttemptRestarted, NodeLost, NodeReconnected, listen
from skytasks.protocol import Op
from skytasks.providers.registry import provider_for
from skytasks.wire import read_frame
from tests.harness import ssh_pools
from tests.harness.sshd import SSHServer

GREETING = b"door says hello\n"


class StandInDoor:
    """A unix socket that says GREETING to whoever connects, then echoes what it is sent."""

    def __init__(self, folder: Path):
        self.path = str(folder / "door.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(4)
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        with conn:
            conn.sendall(GREETING)
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def close(self) -> None:
        self.sock.close()


def read_exactly(stream, n: int, timeout: float = 20) -> bytes:
    got = b""
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        chunk = os.read(stream.fileno(), n - len(got))
        if not chunk:
            break
        got += chunk
    return got


def round_trip(link) -> None:
    """The stream reaches the door and back: its greeting first, then an echo of what we send."""
    assert read_exactly(link.inbound, len(GREETING)) == GREETING
    link.outbound.write(b"ping 123\n")
    link.outbound.flush()
    assert read_exactly(link.inbound, 9) == b"ping 123\n"


@pytest.fixture
def door():
    folder = Path(tempfile.mkdtemp(prefix="skytasks-door-test-"))
    os.chmod(folder, 0o755)
    made = StandInDoor(folder)
    yield made
    made.close()


def started_provider(pool: GPUPool):
    provider = provider_for(pool.spec())
    links = provider.start()
    assert [read_frame(link.inbound)["op"] for link in links] == [Op.HELLO] * len(links)
    return provider, links


def lease(link, window: float = 30.0) -> None:
    """A LEASE to the link's agent (as a controller sends it), then wait for the agent's first
    heartbeat that acknowledges it: from then on the agent outlives a break of its stream."""
    from skytasks.protocol import message
    from skytasks.wire import FrameParser, encode

    link.outbound.write(b"".join(bytes(c) for c in encode(message(
        Op.LEASE, key=os.urandom(32).hex(), reattach_seconds=window, keep_warm_seconds=0.0, holder="test"))))
    link.outbound.flush()
    parser, deadline = FrameParser(), time.monotonic() + 20
    while time.monotonic() < deadline:
        data = link.inbound.read1(1 << 16)  # after what read_frame left in its buffer
        assert data, "the agent's stream ended"
        if any(f["op"] == Op.HEARTBEAT and "got" in f for f in parser.feed(data)):
            return
    raise AssertionError("the agent never acknowledged its LEASE")


def reattach_checks(provider, node_id: int, door: StandInDoor) -> None:
    """A stream through the provider's way in reaches the door; an absent door is NodeGone at once."""
    assert provider.reattaches is True
    link = provider.reattach(node_id, door.path, timeout=30)
    try:
        assert link.node_id == node_id and door.accepted == 1
        round_trip(link)
    finally:
        link.close()
    t0 = time.monotonic()
    with pytest.raises(NodeGone, match="its agent is gone"):
        provider.reattach(node_id, door.path + ".nobody", timeout=30)
    assert time.monotonic() - t0 < 20


# -- ssh ---------------------------------------------------------------------------------------

def ssh_pool(server: SSHServer, **fields) -> GPUPool:
    return ssh_pools.ssh_pool(server, ready_timeout_seconds=30, **fields)


def sessions_of(server: SSHServer) -> list:
    import psutil

    return psutil.Process(server.proc.pid).children()


def test_ssh_reattach_opens_a_new_session_to_the_door_and_finds_a_missing_agent_gone(sshd, door):
    provider, links = started_provider(ssh_pool(sshd))
    try:
        reattach_checks(provider, 1, door)
    finally:
        provider.stop()


def test_ssh_reattach_connects_anew_when_the_node_s_connection_was_cut(sshd, door):
    """The sshd session of node 1's connection is SIGKILLed (what a reset does to it): the next
    reattach makes a new connection, and the agent started on the old one lives on."""
    import psutil

    provider, links = started_provider(ssh_pool(sshd))
    try:
        before = {p.pid for p in sessions_of(sshd)}
        agents = [p for s in sessions_of(sshd) for p in s.children(recursive=True)
                  if "skytasks.node.agent" in " ".join(p.cmdline())]
        assert len(agents) == 2
        node_1 = provider._conns[1]
        port = node_1.get_extra_info("sockname")[1]
        [session] = [p for p in sessions_of(sshd) if any(c.raddr and c.raddr.port == port for c in p.net_connections())]
        victim = next(a for a in agents if session in a.parents())
        lease(links[1])  # leased, the agent outlives its stream (unleased, it would end with it, as before)
        session.kill()
        deadline = time.monotonic() + 10
        while not node_1.is_closed() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node_1.is_closed()
        assert victim.is_running() and victim.status() != psutil.STATUS_ZOMBIE  # the agent outlived its session
        link = provider.reattach(1, door.path, timeout=30)
        try:
            assert provider._conns[1] is not node_1 and not provider._conns[1].is_closed()
            assert {p.pid for p in sessions_of(sshd)} - before  # a new session
            round_trip(link)
        finally:
            link.close()
        victim.kill()
    finally:
        provider.stop()


# -- aws ---------------------------------------------------------------------------------------


def test_aws_reattach_reaches_the_instance_s_door_and_a_terminated_instance_is_gone(moto, tmp_path, monkeypatch, door):
    from tests.test_provider_conformance import AWSFleet

    fleet = AWSFleet(moto, tmp_path, monkeypatch)
    try:
        provider, links = started_provider(fleet.pool(nodes=2))
        try:
            reattach_checks(provider, 1, door)
            iid = provider._node_ids[1]
            moto["ec2"].terminate_instances(InstanceIds=[iid])
            with pytest.raises(NodeGone, match=f"its instance {iid} is (shutting-down|terminated)"):
                provider.reattach(1, door.path, timeout=30)
            assert door.accepted == 1  # EC2's word was enough: no SSH session was tried
        finally:
            provider.stop()
    finally:
        fleet.close()


# -- slurm -------------------------------------------------------------------------------------


def slurm_agents(job_id: str) -> list:
    """The node agents running in a job's steps (on the SLURM test cluster's nodes, this machine)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "name"]):
        try:
            if ("skytasks.node.agent" in " ".join(p.info["cmdline"] or []) and p.info["name"] != "srun"
                    and p.environ().get("SLURM_JOB_ID") == job_id):
                found.append(p)
        except psutil.Error:
            pass
    return found


def agent_sruns(job_id: str, node: str) -> list:
    """The srun of a node's agent step, and its shepherd (the child srun that cancels the step
    when its parent dies)."""
    import psutil

    parents = [p for p in psutil.process_iter(["cmdline"])
               if (p.info["cmdline"] or [])[:1] == ["srun"] and f"--jobid={job_id}" in p.info["cmdline"]
               and f"--nodelist={node}" in p.info["cmdline"] and "attach" not in " ".join(p.info["cmdline"])
               and p.parent() is not None and p.parent().name() != "srun"]
    return [q for p in parents for q in (p, *p.children())]


def alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_slurm_reattach_runs_a_step_beside_the_agent_and_never_ends_the_agent_s_own(cluster, door):
    provider, links = started_provider(GPUPool(provider="slurm", nodes=2, remote_python=sys.executable,
                                               ready_timeout_seconds=60))
    try:
        name = provider.nodes[1].name
        agents = slurm_agents(provider.nodes[1].job_id)
        assert len(agents) == 2
        agent_step = provider._steps._agents[name]
        reattach_checks(provider, 1, door)
        lease(links[1])  # from now on the agent outlives a break of its stream
        link = provider.reattach(1, door.path, timeout=30)
        # What the controller does with a broken stream, at once: let it go. The agent's own srun
        # is not signalled (its shepherd would cancel the agent's step): srun and agent live on.
        links[1].let_go_lost()
        time.sleep(3)
        assert agent_step.exit_code() is None and all(alive(a) for a in agents)
        assert provider._steps._agents[name] is agent_step and provider._steps._steps[name] is not agent_step
        round_trip(link)
        link.close()
        node = provider.nodes[1]
        cluster.run("scancel", node.job_id)
        cluster.wait_queue_empty_of(node.job_id)
        with pytest.raises(NodeGone, match=f"job {node.job_id}.*SLURM says the job is no longer in the queue"):
            provider.reattach(1, door.path, timeout=30)
    finally:
        provider.stop()


def test_a_slurm_agent_outlives_its_srun_and_shepherd_and_is_reached_again(cluster, door):
    """srun and its shepherd SIGKILLed together (srun's I/O gone, nobody to cancel the step): the
    agent's step runs on, the controller's stream ends, and a step beside it reaches the door."""
    provider, links = started_provider(GPUPool(provider="slurm", nodes=2, remote_python=sys.executable,
                                               ready_timeout_seconds=60))
    try:
        node = provider.nodes[1]
        agents = slurm_agents(node.job_id)
        assert len(agents) == 2
        sruns = agent_sruns(node.job_id, node.name)
        assert len(sruns) == 2, sruns  # srun and its shepherd
        lease(links[1])  # leased, the agent outlives its stream (unleased, it would end with it, as before)
        for p in sruns:
            p.kill()
        assert links[1].inbound.read() is not None  # the stream ends (EOF), at once
        time.sleep(3)
        assert all(alive(a) for a in agents)
        link = provider.reattach(1, door.path, timeout=30)
        round_trip(link)
        link.close()
    finally:
        provider.stop()



# -- kubernetes --------------------------------------------------------------------------------

# A stand-in door inside a pod: a process exec'd there, as the agent is.
POD_DOOR = r"""
import socket, sys, threading
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1])
s.listen(4)
print("listening", flush=True)
def echo(c):
    with c:
        c.sendall(b"door says hello\n")
        while True:
            d = c.recv(65536)
            if not d:
                break
            c.sendall(d)
while True:
    c, _ = s.accept()
    threading.Thread(target=echo, args=(c,), daemon=True).start()
"""


def door_in_pod(provider, node_id: int, path: str):
    """The stand-in door, exec'd into the node's pod; returns its exec stream once it listens."""
    from skytasks.providers.kubernetes import exec_stream
    from skytasks.providers.kubernetes.pods import CONTAINER

    stream = exec_stream.PodExec(provider._cfg, provider.namespace, provider.nodes[node_id], CONTAINER,
                                 [sys.executable, "-c", POD_DOOR, path])
    assert stream.inbound.readline() == b"listening\n", stream.last_words()
    return stream


def kube_provider(k8s_cluster, nodes: int):
    from tests.test_provider_conformance import KubernetesFleet

    return started_provider(KubernetesFleet(k8s_cluster).pool(nodes=nodes))


def test_kubernetes_reattach_execs_into_the_same_pod_after_the_apiserver_restarted(k8s_cluster):
    """The exec'd process outlives its exec stream cut by a kube-apiserver restart; a new exec into
    the same pod reaches its door. Letting the first link go never ends the newer stream."""
    provider, links = kube_provider(k8s_cluster, 1)
    try:
        first = door_in_pod(provider, 0, "/tmp/stand-in-door.sock")
        k8s_cluster.restart_apiserver()
        assert first.ended.wait(10)  # its stream was cut with the apiserver
        link = provider.reattach(0, "/tmp/stand-in-door.sock", timeout=30)
        links[0].let_go_lost()  # what the controller does with the broken stream once swapped
        links[0].close()
        round_trip(link)
        with pytest.raises(NodeGone, match="its agent is gone"):
            provider.reattach(0, "/tmp/nobody-here.sock", timeout=30)
        link.close()
    finally:
        provider.stop()


def test_kubernetes_reattach_to_a_deleted_pod_is_node_gone_in_kubernetes_words(k8s_cluster):
    provider, links = kube_provider(k8s_cluster, 1)
    try:
        pod = provider.nodes[0]
        k8s_cluster.kubectl("delete", "pod", pod, "--grace-period=0", "--force", "--wait=false")
        deadline, said = time.monotonic() + 20, None
        while said is None and time.monotonic() < deadline:
            try:
                provider.reattach(0, "/tmp/door.sock", timeout=5).close()
            except NodeGone as exc:
                said = str(exc)
            except Exception:  # noqa: BLE001 - the watch has not seen it yet: tried again, as the controller does
                time.sleep(0.2)
        assert said is not None and pod in said and "Kubernetes" in said
    finally:
        provider.stop()


# -- a call through a break, on each fleet, with the real controller ---------------------------


def through_a_break(seconds: float) -> dict:
    """Every rank prints, sleeps through the break, prints again and returns: what it printed
    while its node's stream was broken reaches the controller once the node is reached again."""
    info = rank_info()
    print(f"rank {info.rank} before the break", flush=True)
    time.sleep(seconds)
    for i in range(50):
        print(f"line {i} of rank {info.rank}", flush=True)
    return {"attempt": info.attempt, "rank": info.rank, "agent": os.getppid(), "blob": bytes([info.rank]) * (1 << 20)}


def call_through_a_break(pool: GPUPool, break_stream, seconds: float = 15.0) -> tuple[list, list, list]:
    """The call, with `break_stream(session)` run on a thread a few seconds in (the ranks are
    asleep by then); returns (results, events heard, (agent pids, pods) before the call)."""
    failures: list[BaseException] = []

    def breaker() -> None:
        try:
            deadline = time.monotonic() + 120
            while (session := pool.runtime().session) is None or not session.nodes:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            time.sleep(4)
            break_stream(session)
        except BaseException as exc:  # noqa: BLE001 - said by the test
            failures.append(exc)

    with listen() as heard, pool:
        session = pool.runtime().session
        before = [(n.pid, n.link.machine) for n in session.nodes]
        thread = threading.Thread(target=breaker, daemon=True)
        thread.start()
        results = distributed_task(through_a_break, pool=pool, init_torch=False)(seconds)
        thread.join(60)
        after = [(n.pid, n.link.machine) for n in pool.runtime().session.nodes]
    assert not failures, failures
    assert after == before  # the same agents (and pods): no node was replaced
    return results, list(heard), before


def whole_and_reattached(results: list, heard: list, broken: set[int]) -> None:
    assert [r["attempt"] for r in results] == [1] * len(results)  # no retry, no node recovery spent
    assert all(r["blob"] == bytes([r["rank"]]) * (1 << 20) for r in results)
    assert not [e for e in heard if isinstance(e, (NodeLost, AttemptRestarted))]
    reconnected = [e for e in heard if isinstance(e, NodeReconnected)]
    assert {e.node for e in reconnected} == broken and all(e.down_seconds > 0 for e in reconnected)


def test_an_ssh_call_goes_on_whole_when_a_node_s_sshd_session_is_killed(sshd, capsys):
    """SIGKILL to node 1's sshd session (what a reset does: the TCP connection is gone): its agent,
    exec'd without a pty, runs on; a new session reaches it and the call returns whole."""
    import psutil

    def kill_sessions(session) -> None:
        agent = psutil.Process(session.nodes[1].pid)
        sessions = [p for p in agent.parents() if p.pid != sshd.proc.pid and p.name().startswith("sshd")
                    and sshd.proc.pid in {q.pid for q in p.parents()}]
        assert sessions
        for p in sessions:
            p.kill()

    results, heard, before = call_through_a_break(ssh_pool(sshd, reattach_seconds=30), kill_sessions)
    whole_and_reattached(results, heard, {1})
    # The pool's end reached both agents (END), the re-attached one too: none waits out its window.
    assert psutil.wait_procs([psutil.Process(pid) for pid, _ in before if psutil.pid_exists(pid)], timeout=15)[1] == []
    out = capsys.readouterr()
    text = out.out + out.err
    assert all(text.count(f"line {i} of rank 1\n") == 1 for i in range(50))  # once each: nothing lost, nothing twice


def test_a_slurm_call_goes_on_whole_when_the_agent_s_srun_is_killed_with_its_shepherd(cluster):
    """srun of node 1's agent step and its shepherd SIGKILLed (srun's I/O gone, nobody to cancel
    the step): the agent runs on in its step, a step beside it reaches it, the call returns whole."""
    pool = GPUPool(provider="slurm", nodes=2, remote_python=sys.executable, ready_timeout_seconds=60,
                   reattach_seconds=30)

    def kill_srun(session) -> None:
        provider = pool.runtime().session.provider
        node = provider.nodes[session.nodes[1].link.node_id]
        sruns = [p for p in agent_sruns(node.job_id, node.name) if "skytasks.node.agent" in " ".join(p.cmdline())]
        assert len(sruns) == 2, sruns
        for p in sruns:
            p.kill()

    results, heard, _ = call_through_a_break(pool, kill_srun)
    whole_and_reattached(results, heard, {1})


def test_a_kubernetes_call_goes_on_whole_through_a_kube_apiserver_restart(k8s_cluster):
    """The kube-apiserver SIGKILLed and started again mid-call: every exec stream is cut, the pods
    and their agents run on, new execs reach them, and the call returns whole."""
    from tests.test_provider_conformance import KubernetesFleet

    pool = KubernetesFleet(k8s_cluster).pool(nodes=2, reattach_seconds=60)
    results, heard, _ = call_through_a_break(pool, lambda session: k8s_cluster.restart_apiserver())
    whole_and_reattached(results, heard, {0, 1})
