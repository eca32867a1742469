"""The controller's end of the agent streams: framed messages both ways, and heartbeats.

A stream that closes is a lost node at once. A stream that merely falls silent (a cable pulled,
a VM frozen, a link down: nothing closes) is a lost node once no byte has arrived for the
heartbeat timeout; the agent at the far end applies the same rule to us and stops its ranks.

Except where the agent holds a LEASE (a provider that `reattaches`, `reattach_seconds` > 0): then
a stream that closes or falls silent is a break (`broke`), and the node is reached again over a
new stream (controller/reconnect.py) before it counts as lost.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable

from skytasks.controller.backlog import NodeEvents
from skytasks.controller.reconnect import Lease, Reconnector, ResumableOut
from skytasks.node.peers import relay_tree
from skytasks.protocol import Op, check, message
from skytasks.reactor import shared_reactor
from skytasks.providers import NodeLink, NodeProvider
from skytasks.resume import ACK_BYTES
from skytasks.settings import settings
from skytasks.silence import HeardStream
from skytasks.wire import RELAY, ChannelClosed, FrameParser, FrameWriter, encode, encoded_size, read_frame

BROADCAST_IN_PARALLEL_BYTES = 1 << 20
# A CALL at least this large, on a pool of at least RELAY_TREE_NODES nodes, goes down the relay tree
# (skytasks.node.peers): it leaves the controller once, not once per node.
RELAY_TREE_BYTES = 1 << 20
RELAY_TREE_NODES = 3
_serials = itertools.count(1)
_sent = [0]  # bytes this process wrote to node streams: what a broadcast costs the controller's link
_sent_lock = threading.Lock()


def bytes_sent() -> int:
    """Bytes the controller has written to node streams so far (a counter for benchmarks)."""
    return _sent[0]


class NodeChannel:
    """One agent stream: a writer, and a reader (the process's reactor) that feeds the session's event queue."""

    def __init__(self, link: NodeLink, events: NodeEvents):
        self.link = link
        self.inbound = HeardStream(link.inbound)
        self._out = ResumableOut(link.outbound, self.broke)
        self._writer = FrameWriter(self._out)  # type: ignore[arg-type] # writelines/flush/close is all it uses
        self._events = events
        self._lost_lock = threading.Lock()
        self.alive = True
        self.serial = next(_serials)  # events say which channel they came from: a replaced
        # node's old channel may still have news in the queue
        self.gpus: list[str] = []  # what the agent reported in its hello
        self.peer_port = 0  # its relay listener (PEER_READY); 0: none, it gets calls straight
        self.pid: int | None = None  # the agent's process id on its node, from its hello
        self.notice: dict[str, Any] | None = None  # its preemption notice: it runs, but not for long
        self.lost_reason = ""
        self.said = False  # its loss or notice was reported (NodeLost / NodePreempted): not twice
        self.on_peer_ready: Callable[[], None] | None = None  # the session's: the relay tree may be known now
        # Re-attaching (controller/reconnect.py): the agent's door and instance, from its hello;
        # the lease it holds (None: a broken stream is a lost node, as always); bytes read from it
        # (`got`, counted from its first frame) by the reader of transport `_gen` only.
        self.door = ""
        self.instance = ""
        self.lease: Lease | None = None
        self.reconnecting = False
        self.got = 0
        self._acked = 0  # the `got` our last heartbeat carried
        self.ack_due = threading.Event()  # wakes the heartbeat sender early: much was read since
        self._gen = 0
        self._in_lock = threading.Lock()
        self._parser = FrameParser()  # kept across transports: a frame cut by a break goes on
        self._threaded = False  # read by a thread of its own (no descriptor): never re-attached
        self._corrupt = False  # the stream said something unreadable: lost, whatever the lease

    def start(self) -> NodeChannel:
        """Start reading the agent's frames into the event queue: on the process's one reader
        thread (`skytasks.reactor`) when the stream has a descriptor, else on a thread of its own."""
        try:
            self.link.inbound.fileno()
        except (AttributeError, OSError, ValueError):
            self._threaded = True
            threading.Thread(target=self._read, daemon=True, name=f"skytasks-node{self.link.node_rank}").start()
            return self
        self._watch(self.link.inbound, self._gen)
        return self

    def _watch(self, inbound: Any, gen: int) -> None:
        """Read one transport of the stream on the reactor: its bytes count only while it is the
        current one (`gen`), so bytes of a transport given up are never read twice."""

        def on_data(data: bytes) -> None:
            try:
                with self._in_lock:
                    if gen != self._gen:
                        return
                    self.inbound.last_heard = time.monotonic()  # any byte proves the agent alive
                    self.got += len(data)
                    msgs = self._parser.feed(data)
                for msg in msgs:
                    self._on_message(msg)
            except Exception:
                self._corrupt = True  # no new transport mends that
                raise
            if self.lease is not None and self.got - self._acked >= ACK_BYTES:
                self.ack_due.set()  # the sender's thread acks: never a write from the reactor's

        def on_end(why: str) -> None:
            if gen != self._gen:
                return  # a transport already given up
            # Off the reader's thread: what the provider knows of a loss may take a command to learn.
            threading.Thread(target=self.broke, args=(why,), daemon=True).start()

        shared_reactor().add(inbound, on_data, on_end)

    def sent(self, msg: dict[str, Any]) -> bool:
        """Whether an event came from this channel (not from the one it replaced)."""
        return msg.get("channel", self.serial) == self.serial

    def _read(self) -> None:
        try:
            while True:
                self._on_message(read_frame(self.inbound))
        except (ChannelClosed, OSError, ValueError) as exc:
            self.mark_lost(str(exc))

    def _on_message(self, msg: dict[str, Any]) -> None:
        try:  # at the boundary: a malformed message is the node's fault, named, never a KeyError later
            check(msg)
        except ValueError as exc:
            raise ValueError(f"node {self.link.node_rank} ({self.link.address}) sent a malformed message: "
                             f"{exc}") from None
        if msg["op"] == Op.PEER_READY:  # the channel's own news: never a call's
            self.peer_port = msg["port"]
            if self.on_peer_ready is not None:
                self.on_peer_ready()
            return
        if msg["op"] == Op.HEARTBEAT and "got" in msg and self.lease is not None:
            self._out.outbox.ack(msg["got"])  # what the agent read need not be kept for a resend
        if msg["op"] == Op.HELLO:
            self.door, self.instance = msg.get("door", ""), msg.get("instance", "")
        if msg["op"] == Op.NOTICE:  # the provider may know better when the node goes
            deadline = self.link.notice_deadline()
            if deadline is not None:
                msg["deadline"] = deadline
        if msg["op"] != Op.HEARTBEAT:
            msg["channel"] = self.serial
            self._events.put((self.link.node_rank, msg))
        if msg["op"] == Op.NOTICE and self.notice is None:  # set here, not when the queue is read:
            self.notice = msg  # the next group must leave the node out even between calls
        if msg["op"] == Op.LEAVING:  # it is gone as soon as it says so: replaced before the retry
            self.mark_lost(f"the node is going away: {msg['reason']}")

    @property
    def usable(self) -> bool:
        """Whether a new rank group may be placed here: alive, and not about to be taken away."""
        return self.alive and self.notice is None

    def why_gone(self) -> str:
        return "was lost" if self.notice is None else f"was preempted ({self.notice['reason']})"

    def retire(self) -> None:
        """The pool lets this node go: its stream closing now is no news."""
        with self._lost_lock:
            self.alive = False

    def lease_to(self, provider: NodeProvider, key: str, holder: str, seconds: float,
                 keep_warm_seconds: float = 0.0, who: str = "") -> None:
        """LEASE: from now on the agent outlives a break of this stream, for `seconds`, and this
        channel reaches it again through `provider` instead of giving it up at once. With
        `keep_warm_seconds` (a warm pool) the agent also outlives its holder, unheld that long."""
        self._out.keeping = True  # the LEASE itself is kept: the agent may not have read it yet
        self.lease = Lease(provider, bytes.fromhex(key), holder, seconds)
        self.send(message(Op.LEASE, key=key, reattach_seconds=float(seconds),
                          keep_warm_seconds=float(keep_warm_seconds), holder=holder, **({"who": who} if who else {})))

    def end(self) -> None:
        """END: the pool is done with the agent (it holds a lease, so its stream closing is no goodbye)."""
        if self.lease is not None:
            self.send(message(Op.END))

    def broke(self, why: str) -> None:
        """The stream closed, failed a write or fell silent. Lost at once, as always, unless the
        agent holds a lease: then the node is reached again over a new stream (reconnect.py),
        and lost only when that fails."""
        with self._lost_lock:
            if not self.alive or self.reconnecting:
                return
            lease = self.lease if not (self._threaded or self._corrupt) else None
            if lease is not None:
                self.reconnecting = True
        if lease is None:
            self.mark_lost(why)
            return
        broke_at = time.monotonic()
        with self._in_lock:
            self._gen += 1  # the broken transport's bytes are read no more: `got` stays where it is
        self._out.detach()
        self._events.put((self.link.node_rank, {**message(Op.RECONNECTING, reason=why, seconds=float(lease.seconds)),
                                                "channel": self.serial}))
        Reconnector(self, lease, why, broke_at).start()

    def swap(self, link: NodeLink, agent_got: int, down_seconds: float) -> bool:
        """The new transport `link` carries the stream on (its handshake done): its bytes are read
        from where ours stopped, and what the agent did not read is sent again. It is read before
        the resend is written: the agent's own resend may wait for us to read. False when the
        node was let go meanwhile or the resend failed."""
        with self._lost_lock:
            if not self.alive:
                return False
            with self._in_lock:
                self._gen += 1
                gen = self._gen
                self.inbound = HeardStream(link.inbound)
        self._watch(link.inbound, gen)
        try:
            self._out.resume(link.outbound, agent_got)
        except (OSError, ValueError):
            with self._in_lock:
                if self._gen == gen:
                    self._gen += 1  # read no more of it: the next transport starts from this count
            self._out.detach()
            return False
        with self._lost_lock:
            old = self.link
            old.inbound, old.outbound, old.close, old.close_lost = link.inbound, link.outbound, link.close, link.close_lost
            old.loss_detail = link.loss_detail
            self.reconnecting = False
        self._events.put((self.link.node_rank, {**message(Op.RECONNECTED, down_seconds=down_seconds),
                                                "channel": self.serial}))
        return True

    def mark_lost(self, reason: str) -> None:
        """Report the node lost, once, however many ways it was found out."""
        with self._lost_lock:
            if not self.alive:
                return
            self.alive = False
            self.lost_reason = reason
        try:  # what the provider knows of it (SLURM: the node's state and reason)
            detail = self.link.loss_detail()
        except Exception:  # noqa: BLE001 - the loss is reported all the same
            detail = ""
        reason = f"{reason}; {detail}" if detail else reason
        self._events.put((self.link.node_rank, {**message(Op.LOST, reason=reason), "channel": self.serial}))

    def send(self, msg: dict[str, Any]) -> None:
        self.send_encoded(encode(msg))

    def send_encoded(self, chunks: list[Any]) -> None:
        if not self.alive:  # a silent link may block a write forever; nobody is listening anyway
            return
        try:
            self._writer.send_encoded(chunks)
        except ChannelClosed as exc:  # only without a lease: with one, a failed write is a break
            self.broke(str(exc))
            return
        with _sent_lock:
            _sent[0] += encoded_size(chunks)

    def send_heartbeat(self) -> None:
        if self.alive and not self.reconnecting:
            beat = message(Op.HEARTBEAT)
            if self.lease is not None:
                self._acked = got = self.got  # an ack: what we read of the agent's stream
                beat = message(Op.HEARTBEAT, got=got)
            try:
                self._writer.send_if_idle(beat)
            except ChannelClosed as exc:
                self.broke(str(exc))


def broadcast(nodes: list[NodeChannel], msg: dict[str, Any], relay: bool = False) -> None:
    """One message to every node, encoded once; large ones go to all nodes at the same time.
    With `relay`, each agent streams it on to its ranks as it arrives."""
    _send_to_all(nodes, encode(msg, flags=RELAY if relay else 0))


def _send_to_all(nodes: list[NodeChannel], chunks: list[Any]) -> None:
    if len(nodes) < 2 or encoded_size(chunks) < BROADCAST_IN_PARALLEL_BYTES:
        for node in nodes:
            node.send_encoded(chunks)
        return
    threads = [threading.Thread(target=n.send_encoded, args=(chunks,), daemon=True) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def send_call(nodes: list[NodeChannel], msg: dict[str, Any], group: int) -> None:
    """A CALL to every node, relayed on to its ranks. A large one on a pool of several nodes goes
    to the first node only, with the relay tree (ROUTE): each node passes it to its children."""
    chunks = encode(msg, flags=RELAY)  # once, whichever way it goes
    if encoded_size(chunks) < RELAY_TREE_BYTES or len(nodes) < RELAY_TREE_NODES or not all(n.peer_port for n in nodes):
        _send_to_all(nodes, chunks)
        return
    tree = relay_tree([(n.link.address, n.peer_port) for n in nodes])
    nodes[0].send(message(Op.ROUTE, group=group, children=tree))
    nodes[0].send_encoded(chunks)


def keep_heartbeats(nodes: list[NodeChannel], closed: threading.Event) -> None:
    """Until `closed`: a heartbeat to every node each interval (one sender thread per node, so
    one stuck link delays no other), and a watch that gives up a node silent past the timeout."""
    interval, timeout = settings().heartbeat

    def send(node: NodeChannel) -> None:
        while node.alive and not closed.is_set():
            if node.lease is None:
                closed.wait(interval)
            else:  # also early, as an ack once much was read (the session's close wakes it too)
                node.ack_due.wait(interval)
                node.ack_due.clear()
            if closed.is_set() or not node.alive:
                return
            node.send_heartbeat()

    def watch() -> None:
        while not closed.wait(min(1.0, interval)):
            for node in nodes:
                silent = node.inbound.silent_for()
                if node.alive and not node.reconnecting and silent > timeout:
                    node.broke(f"no heartbeat from the node for {silent:.0f}s (the network or the machine is gone)")

    for node in nodes:
        threading.Thread(target=send, args=(node,), daemon=True, name=f"skytasks-beat{node.link.node_rank}").start()
    threading.Thread(target=watch, daemon=True, name="skytasks-beat-watch").start()
