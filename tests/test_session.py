"""The session carries out its membership policy through the provider: no processes, a fake
provider whose "agents" are pipes that say hello, as `CallRun` is tested with its `FakeBus`.

What is checked is what the session asked of the provider (replace, release, grow) and the
events it said, for a fixed pool and an elastic one."""

from __future__ import annotations

import os
import threading
import time

from skytasks.controller.session import PoolSession
from skytasks.errors import PoolStartError
from skytasks.events import GrowFailed, NodeLost, NodePreempted, NodeReplaced, PoolGrew, PoolShrank
from skytasks.protocol import Op, message
from skytasks.providers import NodeLink
from skytasks.wire import ChannelClosed, FrameWriter, read_frame


class FakeAgent:
    """A node agent as the controller sees it: a stream that says hello, then listens."""

    def __init__(self, node_id: int):
        up_r, up_w = os.pipe()  # agent -> controller
        down_r, down_w = os.pipe()  # controller -> agent
        self._to_controller = os.fdopen(up_w, "wb")
        self._from_controller = os.fdopen(down_r, "rb")
        self.link = NodeLink(node_rank=node_id, address=f"10.0.0.{node_id}", inbound=os.fdopen(up_r, "rb"),
                             outbound=os.fdopen(down_w, "wb"), node_id=node_id, close=self.close)
        FrameWriter(self._to_controller).send(message(Op.HELLO, pid=node_id, python="python3", gpus=[]))
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        try:
            while True:
                read_frame(self._from_controller)
        except (ChannelClosed, OSError, ValueError):
            pass

    def close(self) -> None:
        for stream in (self._to_controller, self.link.outbound):
            try:
                stream.close()
            except OSError:
                pass


class FakeProvider:
    reshape_is_cheap, runs_on_this_machine, gpus_from_config = True, True, False

    def __init__(self, nodes: int, capacity: int = 100):
        self.nodes, self.capacity = nodes, capacity  # capacity: how many more nodes `grow` can get
        self.calls: list[tuple[str, object]] = []
        self._next = nodes

    def start(self) -> list[NodeLink]:
        return [FakeAgent(i).link for i in range(self.nodes)]

    def replace(self, node_id: int) -> NodeLink:
        self.calls.append(("replace", node_id))
        return FakeAgent(node_id).link

    def grow(self, count: int) -> list[NodeLink]:
        got = min(count, self.capacity)
        self.capacity -= got
        self.calls.append(("grow", count))
        links = [FakeAgent(self._next + i).link for i in range(got)]
        self._next += got
        return links

    def release(self, node_id: int) -> None:
        self.calls.append(("release", node_id))

    def free_port(self, head: int) -> int:
        return 29500

    def stop(self) -> None:
        self.calls.append(("stop", None))


class Heard:
    def __init__(self):
        self.events = []

    def on_event(self, event):
        self.events.append(event)

    def of(self, kind):
        return [e for e in self.events if isinstance(e, kind)]


def session(nodes: int, counts: tuple[int, int], capacity: int = 100) -> tuple[PoolSession, FakeProvider]:
    provider = FakeProvider(nodes, capacity)
    return PoolSession(provider, 1, {}, counts).start(), provider  # type: ignore[arg-type]


def lose(s: PoolSession, node_rank: int) -> None:
    s.nodes[node_rank].mark_lost("stream closed")
    while not s.events.empty():  # the loss's own message: a call would read it
        s.events.get()


def test_a_fixed_pool_replaces_a_lost_node_through_the_provider_and_says_so():
    s, provider = session(2, (2, 2))
    try:
        lose(s, 1)
        heard = Heard()
        s.prepare(heard, first_attempt=True)
        assert provider.calls == [("replace", 1)]
        assert [n.link.node_id for n in s.nodes] == [0, 1] and all(n.usable for n in s.nodes)
        [lost], [replaced] = heard.of(NodeLost), heard.of(NodeReplaced)
        assert (lost.node, lost.reason) == (1, "stream closed") and (replaced.node, replaced.why) == (1, "was lost")
    finally:
        s.close()
    assert provider.calls[-1] == ("stop", None)


def test_an_elastic_pool_drops_a_going_node_then_grows_back_before_a_call():
    s, provider = session(2, (1, 2))
    try:
        s.nodes[1].notice = {"op": "notice", "reason": "spot interruption", "deadline": None, "at": time.time()}
        heard = Heard()
        s.prepare(heard, first_attempt=True)
        assert provider.calls == [("release", 1), ("grow", 1)]
        assert [n.link.node_id for n in s.nodes] == [0, 2] and [n.link.node_rank for n in s.nodes] == [0, 1]
        [notice], [shrank], [grew] = heard.of(NodePreempted), heard.of(PoolShrank), heard.of(PoolGrew)
        assert notice.source == "spot interruption" and (shrank.from_nodes, shrank.to_nodes) == (2, 1)
        assert (grew.from_nodes, grew.to_nodes, grew.addresses) == (1, 2, ("10.0.0.2",))
    finally:
        s.close()


def test_between_attempts_an_elastic_pool_only_drops_and_a_shortfall_throttles_growing():
    s, provider = session(3, (1, 3), capacity=0)
    try:
        lose(s, 2)
        heard = Heard()
        s.prepare(heard, first_attempt=False)  # between attempts of one call: never grow
        assert provider.calls == [("release", 2)] and len(s.nodes) == 2
        s.prepare(heard, first_attempt=True)  # before a call: try, and come up short
        [failed] = heard.of(GrowFailed)
        assert (failed.wanted, failed.have) == (3, 2) and provider.calls[-1] == ("grow", 1)
        s.prepare(heard, first_attempt=True)  # within the retry window: not asked again
        assert provider.calls.count(("grow", 1)) == 1
    finally:
        s.close()


def test_a_replacement_that_cannot_be_had_is_the_callers_pool_start_error():
    class NoReplacement(FakeProvider):
        def replace(self, node_id):
            raise PoolStartError(f"node {node_id} (10.0.0.{node_id}) was lost and cannot be reached")

    provider = NoReplacement(2)
    s = PoolSession(provider, 1, {}, (2, 2)).start()  # type: ignore[arg-type]
    try:
        lose(s, 0)
        try:
            s.prepare(Heard(), first_attempt=True)
        except PoolStartError as exc:
            assert "node 0 (10.0.0.0) was lost and cannot be reached" in str(exc)
        else:
            raise AssertionError("no PoolStartError")
    finally:
        s.close()
