"""A node whose stream breaks is reached again, and the call goes on whole (design 52, phase 1).

Real agents and ranks on this machine: a provider that is the local one, except that it can reach a
running agent again (`reattaches`), through the agent's door with `node/attach.py`'s CLIENT run as
a process of its own, as ssh, slurm and kubernetes run it on their nodes. A test breaks node 1's
stream mid-call by closing the controller's end to the agent (the agent reads EOF, closes its end,
and the controller's reader reads EOF too), as an SSH reset or an exec cut does.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

from skytasks import DistributedTaskError, GPUPool, distributed_task, rank_info
from skytasks.controller import pool_runtime
from skytasks.controller.reconnect import ResumableOut
from skytasks.errors import NodeGone
from skytasks.events import AttemptRestarted, NodeLost, NodeReconnected, NodeReconnecting, listen
from skytasks.node.attach import CLIENT
from skytasks.providers import NodeLink
from skytasks.providers.local.provider import LOOPBACK, LocalProvider
from skytasks.providers.processes import end_child
from tests.harness.prefect_api import logs_when
from tests.test_prefect_native import _wait_for_events

LINES = 300


class ReattachingLocal(LocalProvider):
    """Local agents, reached again through their doors. `unreachable`: node ids whose way in fails
    (the next try may do better); `gone`: node ids the provider knows are gone."""

    reattaches = True

    def __init__(self, spec, reporter=None):
        super().__init__(spec, reporter)
        self.unreachable: set[int] = set()
        self.gone: set[int] = set()
        self.clients: list[subprocess.Popen] = []
        self.tries: list[int] = []
        self.gate = threading.Event()  # a way in opens only once this is set: the outage lasts until then
        self.gate.set()

    def _start_node(self, node_id: int) -> NodeLink:
        link = super()._start_node(node_id)
        # Letting the stream go leaves the agent running (as on a remote node): `release` and `stop`
        # end it, as they do the local provider's.
        link.close = link.close_lost = functools.partial(_close_pipes, link.inbound, link.outbound)
        return link

    def reattach(self, node_id: int, door: str, timeout: float) -> NodeLink:
        self.tries.append(node_id)
        self.gate.wait(timeout)
        if node_id in self.gone:
            raise NodeGone("its machine was switched off")
        if node_id in self.unreachable:
            raise ConnectionRefusedError("no way in to the node just now")
        client = subprocess.Popen([sys.executable, "-c", CLIENT, door], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.clients.append(client)
        return NodeLink(node_rank=node_id, address=LOOPBACK, inbound=client.stdout, outbound=client.stdin,  # type: ignore[arg-type]
                        node_id=node_id, machine="this machine", close=functools.partial(end_child, client, wait=2.0))

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            for client in self.clients:
                end_child(client, wait=2.0)


def _close_pipes(*streams) -> None:
    for stream in streams:
        try:
            stream.close()
        except OSError:
            pass


@pytest.fixture
def reattaching(monkeypatch):
    """Pools made in this test run on ReattachingLocal; the provider of the last one started."""
    made: list[ReattachingLocal] = []

    def provider_for(spec):
        made.append(ReattachingLocal(spec))
        return made[-1]

    monkeypatch.setattr(pool_runtime, "provider_for", provider_for)
    return made


def talk_through_a_break(folder: str) -> dict:
    """Every rank prints while node 1's stream is broken, and node 1's rank returns a few MB then
    too: its agent holds them until the stream is mended. Node 0's rank returns after that."""
    info = rank_info()
    Path(folder, f"started{info.rank}").touch()
    while not Path(folder, "broken").exists():
        time.sleep(0.02)
    for i in range(LINES):
        print(f"line {i} of rank {info.rank}", flush=True)
    Path(folder, f"returning{info.rank}").touch()
    while info.rank == 0 and not Path(folder, "go").exists():
        time.sleep(0.02)
    return {"attempt": info.attempt, "agent": os.getppid(), "blob": bytes([info.rank]) * (3 << 20)}


def _wait_for(what, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (found := what()):
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)
    return found


def _break_node_stream(pool: GPUPool, folder: Path, heard: list, node_rank: int = 1,
                       gate: threading.Event | None = None) -> threading.Thread:
    """Once every rank started: close the controller's end to the node's agent; with `gate`, keep
    the node out of reach until its rank has returned; once the node is back (or lost), let the
    ranks return."""

    def breaker() -> None:
        _wait_for(lambda: all((folder / f"started{r}").exists() for r in (0, 1)))
        session = _wait_for(lambda: pool.runtime().session)
        node = session.nodes[node_rank]
        node.link.outbound.close()
        (folder / "broken").touch()
        if gate is not None:
            _wait_for(lambda: (folder / f"returning{node_rank}").exists())
            time.sleep(1.0)  # its result reaches its agent, which holds it
            gate.set()
        _wait_for(lambda: any(isinstance(e, (NodeReconnected, NodeLost)) for e in heard))
        (folder / "go").touch()

    thread = threading.Thread(target=breaker, daemon=True)
    thread.start()
    return thread


def test_a_broken_stream_is_reattached_and_the_call_returns_whole(reattaching, tmp_path, capsys):
    pool = GPUPool(nodes=2, reattach_seconds=30)
    with listen() as heard, pool:
        agents = {n.link.node_rank: n.pid for n in pool.runtime().session.nodes}
        assert all(n.lease is not None for n in pool.runtime().session.nodes)  # a provider that reattaches
        reattaching[-1].gate.clear()
        breaker = _break_node_stream(pool, tmp_path, heard, gate=reattaching[-1].gate)
        results = distributed_task(talk_through_a_break, pool=pool, init_torch=False)(str(tmp_path))
        breaker.join(5)
        again = distributed_task(talk_through_a_break, pool=pool, init_torch=False)(str(tmp_path))  # the pool is whole
    assert [r["attempt"] for r in results] == [1, 1]  # no retry, no node recovery
    assert [r["blob"] == bytes([i]) * (3 << 20) for i, r in enumerate(results)] == [True, True]
    assert [r["agent"] for r in results] == [r["agent"] for r in again] == [agents[0], agents[1]]  # the same agents
    assert not [e for e in heard if isinstance(e, (NodeLost, AttemptRestarted))]
    [reconnecting] = [e for e in heard if isinstance(e, NodeReconnecting)]
    [reconnected] = [e for e in heard if isinstance(e, NodeReconnected)]
    assert (reconnecting.node, reconnecting.seconds) == (1, 30)
    assert reconnected.node == 1 and 1.0 < reconnected.down_seconds < 30  # as long as the gate kept it out
    assert reattaching[-1].tries == [1]
    out = capsys.readouterr()
    text = out.out + out.err
    for rank in (0, 1):  # every line of the outage, once: nothing lost, nothing sent twice
        counts = [text.count(f"line {i} of rank {rank}\n") for i in range(LINES)]
        assert counts == [2] * LINES, [(i, c) for i, c in enumerate(counts) if c != 2][:5]  # two calls
    assert f"node 1 ({LOOPBACK}) was out of reach for" in text


def test_a_reattach_in_a_flow_is_said_in_the_run_log_and_is_a_prefect_event(reattaching, tmp_path):
    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    pool = GPUPool(nodes=2, reattach_seconds=30)
    task = distributed_task(wait_then_return, pool=pool, init_torch=False, name="through-a-blip")

    @flow
    def blip_flow():
        with pool:
            return task(str(tmp_path))

    with listen() as heard:
        breaker = _break_node_stream(pool, tmp_path, heard)
        state = blip_flow(return_state=True)
        breaker.join(5)
    assert state.is_completed() and state.result() == [1, 1]
    flow_run_id = str(state.state_details.flow_run_id)
    events = _wait_for_events("skytasks.node.", since, {"skytasks.node.reconnected"}, flow_run_id)
    [reconnected] = [e for e in events if e["event"] == "skytasks.node.reconnected"]
    assert set(reconnected["payload"]) == {"node", "address", "down_seconds"}
    assert (reconnected["payload"]["node"], reconnected["payload"]["address"]) == (1, LOOPBACK)
    assert 0 < reconnected["payload"]["down_seconds"] < 30
    assert not [e for e in events if e["event"] == "skytasks.node.lost"]
    said = "node 1 (127.0.0.1) was out of reach for"
    logs = logs_when(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                     lambda logs: any(said in log.message for log in logs))
    assert any(said in log.message and "re-attached, the call goes on" in log.message for log in logs)


def wait_then_return(folder: str) -> int:
    info = rank_info()
    Path(folder, f"started{info.rank}").touch()
    Path(folder, f"returning{info.rank}").touch()
    while not Path(folder, "go").exists():
        time.sleep(0.02)
    time.sleep(0.5)
    return info.attempt


def _call_through_a_break(reattaching, tmp_path, reattach_seconds: float, how: str):
    """A call on a 2-node pool whose node 1's stream breaks mid-call, where re-attaching to node 1
    finds it `how` ("unreachable" or "gone"): the call's failure, how long it took, what was heard."""
    pool = GPUPool(nodes=2, reattach_seconds=reattach_seconds)
    with listen() as heard, pool:
        getattr(reattaching[-1], how).add(1)
        breaker = _break_node_stream(pool, tmp_path, heard)
        started = time.monotonic()
        with pytest.raises(DistributedTaskError) as caught:
            distributed_task(wait_then_return, pool=pool, init_torch=False, node_recoveries=0)(str(tmp_path))
        took = time.monotonic() - started
        breaker.join(5)
    return caught, took, heard


def test_a_node_that_cannot_be_reached_again_is_lost_within_reattach_seconds(reattaching, tmp_path):
    caught, took, heard = _call_through_a_break(reattaching, tmp_path, 2, "unreachable")
    [lost] = [e for e in heard if isinstance(e, NodeLost)]
    assert lost.node == 1 and "not reached again within reattach_seconds=2" in lost.reason, lost.reason
    assert "no way in to the node just now" in lost.reason  # the last try's own words
    assert len(reattaching[-1].tries) >= 2  # tried again with backoff until the deadline
    assert took < 2 + 8, took  # the break, 2 s of tries, the stop: not the heartbeat timeout
    assert "node 1" in str(caught.value.exceptions[0])
    assert not [e for e in heard if isinstance(e, NodeReconnected)]


def test_a_node_its_provider_knows_is_gone_is_lost_at_once(reattaching, tmp_path):
    _, took, heard = _call_through_a_break(reattaching, tmp_path, 60, "gone")
    [lost] = [e for e in heard if isinstance(e, NodeLost)]
    assert "the node is gone: its machine was switched off" in lost.reason
    assert took < 15, took  # not the 60 s of reattach_seconds


def test_a_local_pool_never_leases_its_agents():
    with GPUPool(nodes=2) as pool:
        nodes = pool.runtime().session.nodes
        assert [n.lease for n in nodes] == [None, None]
        assert all(n.door for n in nodes)  # the agents have doors; nobody is let in without a lease


# -- the writing end, on its own ------------------------------------------------------------------

def test_without_a_lease_a_failed_write_raises_and_nothing_is_kept():
    broke: list[str] = []
    r, w = os.pipe()
    out = ResumableOut(os.fdopen(w, "wb"), broke.append)
    out.writelines([b"abc", b"def"])
    assert os.read(r, 10) == b"abcdef" and out.outbox.sent == 6 and out.outbox.size == 0
    os.close(r)
    with pytest.raises(BrokenPipeError):
        out.writelines([b"x"])
    assert broke == []


def test_with_a_lease_a_break_keeps_the_bytes_and_a_new_transport_gets_them_from_the_agents_count():
    broke: list[str] = []
    r, w = os.pipe()
    out = ResumableOut(os.fdopen(w, "wb"), broke.append)
    out.writelines([b"hello"])  # before the lease: not kept
    out.keeping = True
    out.writelines([b"lease", b"-frame"])
    out.outbox.ack(8)  # the agent said it read 8 bytes
    os.close(r)
    out.writelines([b"lost?"])  # the transport broke: a break, the bytes kept
    assert len(broke) == 1 and "write" in broke[0]
    out.writelines([b"more"])  # while broken: kept, nothing raised, no second break
    assert len(broke) == 1
    r2, w2 = os.pipe()
    out.resume(os.fdopen(w2, "wb"), 10)  # the agent read 10 bytes: "hello" + "lease"
    assert os.read(r2, 100) == b"-framelost?more"
    out.writelines([b"!"])
    assert os.read(r2, 100) == b"!"
    with pytest.raises(ValueError):
        out.resume(os.fdopen(os.pipe()[1], "wb"), 5)  # bytes it already acknowledged are gone


# -- the call while a node is out of reach (the state machine, driven by hand) --------------------

def test_a_node_out_of_reach_pauses_the_hang_clock_and_the_call_goes_on_whole():
    from skytasks.controller.call_run import Phase
    from skytasks.protocol import Op, message
    from tests.test_call_run import make_call, result

    call, _, bus, heard = make_call(hang=5.0, now=0.0)
    assert call.wake_at() == 5.0
    call.handle(1, message(Op.RECONNECTING, reason="the stream closed", seconds=60.0), now=1.0)
    assert call.wake_at() is None  # an outage is no hang: nothing the ranks send can arrive meanwhile
    call.tick(now=30.0)
    assert call.phase is Phase.RUNNING and "stop" not in bus.ops()
    call.handle(1, message(Op.RECONNECTED, down_seconds=31.5), now=32.0)
    assert call.wake_at() == 37.0  # the hang clock starts again from the node's return
    call.handle(*result(call, 0, "a"), now=33.0)
    call.handle(*result(call, 1, "b"), now=34.0)
    assert call.done and call.result() == ["a", "b"] and call.lost == set()
    reconnecting, reconnected = heard.events
    assert isinstance(reconnecting, NodeReconnecting) and (reconnecting.node, reconnecting.seconds) == (1, 60.0)
    assert reconnecting.address == "10.0.0.1" and "re-attaching for up to 60s" in reconnecting.text()
    assert isinstance(reconnected, NodeReconnected) and (reconnected.node, reconnected.down_seconds) == (1, 31.5)
    assert reconnected.payload() == {"node": 1, "address": "10.0.0.1", "down_seconds": 31.5}


def test_a_node_lost_while_out_of_reach_is_a_node_recovery_and_the_hang_clock_runs_again():
    from skytasks.protocol import Op, message
    from tests.test_call_run import make_call

    call, _, _, heard = make_call(nodes=3, hang=5.0, now=0.0)
    call.handle(1, message(Op.RECONNECTING, reason="no heartbeat", seconds=2.0), now=1.0)
    call.handle(2, message(Op.RECONNECTING, reason="the stream closed", seconds=2.0), now=1.0)
    call.handle(1, message(Op.LOST, reason="not reached again within reattach_seconds=2"), now=3.0)
    assert call.unreachable == {2}  # node 2 is still out of reach: still no hang
    assert call.outcome().reason == "node lost"
    assert [type(e) for e in heard.events] == [NodeReconnecting, NodeReconnecting, NodeLost]
