"""A pool that is up: its nodes' agent streams, and the one rank group that lives on them.

Built from a provider's `NodeLink`s; it waits for every agent's hello (with the GPUs its node has)
before a rank is placed, runs one call at a time on its rank group, and replaces a group that
failed, or whose spec (backend, workdir, ...) differs, with a fresh one.
"""

from __future__ import annotations

import io
import queue
import secrets
import threading
import time
from typing import Any, Sequence

from skytasks.controller.backlog import NodeEvents
from skytasks.controller.call_run import CallRun
from skytasks.controller.call_loop import drive
from skytasks.controller.outcome import CallOutcome
from skytasks.controller.channel import NodeChannel, broadcast, keep_heartbeats, send_call
from skytasks.controller.membership import Drop, GoneNode, Grow, MembershipPolicy, PoolStatus, Replace, policy_for
from skytasks.controller.packing import PackedCall
from skytasks.controller.pool_relay import PoolRelay
from skytasks.controller.rank_group import CallObserver, GroupSpec, NodeShape, RankGroup
from skytasks.errors import PoolStartError
from skytasks.events import GrowFailed, NodeLost, NodePreempted, NodeReplaced, PoolGrew, PoolShrank, WorkdirSynced
from skytasks.protocol import NODE_FAILURES, Op, message
from skytasks.providers import NodeLink, NodeProvider, capabilities_of
from skytasks.settings import settings
from skytasks.workdir import WorkdirRequest


class ChannelBus:
    """The rank group's `NodeBus` over the session's live channels."""

    def __init__(self, nodes: list[NodeChannel]):
        self.nodes = nodes

    def send(self, node_rank: int, msg: dict[str, Any]) -> None:
        self.nodes[node_rank].send(msg)

    def broadcast(self, msg: dict[str, Any], relay: bool = False) -> None:
        broadcast(self.nodes, msg, relay=relay)

    def send_call(self, msg: dict[str, Any], group: int) -> None:
        send_call(self.nodes, msg, group)

    def alive(self) -> set[int]:
        return {n.link.node_rank for n in self.nodes if n.alive}

    def is_current(self, node_rank: int, msg: dict[str, Any]) -> bool:
        # A node that left an elastic pool may still have news in the queue, under its old number.
        return node_rank < len(self.nodes) and self.nodes[node_rank].sent(msg)


class PoolSession:
    """The nodes of a pool that is up, and the rank group that lives on them."""

    def __init__(self, provider: NodeProvider, procs_per_node: int, env: dict[str, str], nodes: tuple[int, int],
                 reattach_seconds: float = 0.0, keep_warm_seconds: float = 0.0, relay: PoolRelay | None = None):
        self.provider = provider
        # How long a node whose stream broke may take to be reached again; only where the provider
        # can open a new stream to a running agent (a LEASE is sent to those agents alone).
        self.reattach_seconds = reattach_seconds if capabilities_of(provider).reattaches else 0.0
        self.holder = secrets.token_hex(8)  # this session, as the agents it leases know it
        # A warm pool's agents outlive this session, unheld this long (controller/warm.py).
        self.keep_warm_seconds = keep_warm_seconds
        self._evicted_by = ""  # a warm pool taken over by another process while our stream was broken
        self.who = ""  # this process in words (a warm pool's holder, as those waiting read it)
        self.procs_per_node = procs_per_node
        self.env = dict(env)
        self.counts = nodes  # (min, max): an elastic pool runs on what it has between the two
        self.events = NodeEvents(settings().line_backlog)  # what the nodes say; waiting lines bounded
        self._lock = threading.Lock()
        self.group: RankGroup | None = None
        self.nodes: list[NodeChannel] = []
        self.bus = ChannelBus(self.nodes)
        self._closed = threading.Event()
        self._members: tuple[int, ...] = ()  # the channels the group was placed on
        self._grow_failed_at: float | None = None  # when an elastic pool last tried to grow and came up short
        self.policy: MembershipPolicy = policy_for(nodes)
        self.relay = relay or PoolRelay()  # the relay tree's key, and its links opened ahead of large calls

    @property
    def evicted_by(self) -> str:
        """Who took this warm pool's nodes while this process's streams were broken ("": nobody),
        as soon as any channel heard it: from then on this process ends nothing and writes no record."""
        return self._evicted_by or next((getattr(n, "evicted_by") for n in self.nodes if getattr(n, "evicted_by", "")), "")

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.procs_per_node

    def start(self) -> PoolSession:
        """Bring the nodes up, and wait for every agent's hello; all or nothing."""
        try:
            for position, link in enumerate(self.provider.start()):
                link.node_rank = position
                self.nodes.append(self._channel(link))
            keep_heartbeats(self.nodes, self._closed)
            self._await_agents()
        except BaseException:
            self.close()
            raise
        return self

    def _await_agents(self, nodes: list[NodeChannel] | None = None) -> None:
        """Every agent says hello, with the GPUs its node has, before a rank is placed."""
        waiting = {n.link.node_rank: n for n in (self.nodes if nodes is None else nodes)}
        _, timeout = settings().heartbeat
        deadline = time.monotonic() + timeout
        while waiting:
            try:
                node_rank, msg = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                late = ", ".join(f"node {r} ({n.link.address})" for r, n in sorted(waiting.items()))
                raise PoolStartError(f"the node agent did not answer within {timeout:g}s on {late}") from None
            node = waiting.get(node_rank)
            if node is None or not node.sent(msg):
                continue  # another node's news, or a replaced channel's
            if msg["op"] == Op.HELLO:
                node.gpus = list(msg.get("gpus") or [])
                node.pid = msg.get("pid")
                peers = self.relay.peers_message(node.link.address)
                node.send(peers)  # its relay listener
                if (self.reattach_seconds > 0 or self.keep_warm_seconds > 0) and node.door and node.instance:
                    node.lease_to(self.provider, self.relay.key, self.holder, self.reattach_seconds,
                                  self.keep_warm_seconds, self.who)
                del waiting[node_rank]
            elif msg["op"] in NODE_FAILURES:
                detail = msg.get("reason") or msg.get("error", "")
                raise PoolStartError(f"node {node_rank} ({node.link.address}): the node agent did not start: {detail}")

    def adopt(self, held: list[tuple[Any, dict[str, Any]]], gone: list[tuple[int, str, str]],
              unread: Sequence[tuple[int, str, str]] = ()) -> PoolSession:
        """Instead of `start`, for a warm pool: the nodes another process started, whose agents
        this session now holds (`held`: each new stream's link and its ATTACHED state, the door
        and instance in it), found gone (`gone`: node id, address, why) or not reached (`unread`).
        Those are lost from the start, so the first call's `prepare` replaces them (or an elastic
        pool drops them). Every held agent gets this session's key (LEASE, and PEERS: its relay
        listener opens anew): the key the record held before reaches none of them any more."""
        try:
            for link, state in held:
                node = self._channel(link)
                node.door, node.instance = state["door"], state["instance"]
                node.gpus, node.pid = list(state.get("gpus") or []), state.get("pid")
                node.peer_port = int(state.get("peer_port") or 0)
                self.nodes.append(node)
            for definite, lost in ((True, gone), (False, unread)):
                for node_id, address, why in lost:
                    node = NodeChannel(NodeLink(node_id, address, io.BytesIO(), io.BytesIO(), node_id=node_id),
                                       self.events)
                    node.mark_lost(why)
                    node.said = False  # said once, before the first call (`_mend`)
                    setattr(node, "gone_for_sure", definite)
                    self.nodes.append(node)
            self.nodes.sort(key=lambda n: n.link.node_id)
            self._renumber()
            keep_heartbeats([n for n in self.nodes if n.alive], self._closed)
            key = self.relay.key
            for node in self.nodes:
                if node.alive:
                    node.lease_to(self.provider, key, self.holder, self.reattach_seconds, self.keep_warm_seconds,
                                  self.who)
                    node.peer_port = 0  # calls go straight until its listener opens anew, on the new key
                    node.send(self.relay.peers_message(node.link.address))
        except BaseException:
            self.close()
            raise
        return self

    def release(self) -> None:
        """Instead of `close`, for a warm pool: the ranks end, the agents stay up for the next
        process (RELEASE), and the provider lets go of this process's streams, not the nodes."""
        self._closed.set()
        with self._lock:
            if self.group is not None and not self.group.broken:
                self.group.close(self.bus)
            self.group = None
            for n in self.nodes:
                if n.alive and n.lease is not None:
                    n.send(message(Op.RELEASE))
                n.retire()
                n.ack_due.set()
            self.provider.leave_running()

    def _channel(self, link: Any) -> NodeChannel:
        node = NodeChannel(link, self.events)
        node.on_peer_ready = self._peer_ready
        return node.start()

    def _peer_ready(self) -> None:
        # On the reader's thread: a send may wait behind a large call's, so it goes on its own.
        threading.Thread(target=self.relay.open_links, args=(self.nodes,), daemon=True,
                         name="skytasks-links").start()

    def prepare(self, observer: CallObserver, *, first_attempt: bool) -> None:
        """The nodes the next attempt runs on: the pool's policy decides from its status (lost and
        going nodes replaced or dropped; before a call, never between the attempts of one, an
        elastic pool short of its most grows back), and the session carries that out."""
        with self._lock:
            self._mend(observer, before_call=first_attempt)

    def status(self, before_call: bool = False) -> PoolStatus:
        """The pool's members as a value, for its membership policy."""
        gone = tuple(GoneNode(n.link.node_id, n.link.node_rank, n.link.address, _why_gone(n), n.notice is not None)
                     for n in self.nodes if not n.usable)
        return PoolStatus(live=tuple(n.link.node_id for n in self.nodes if n.usable), gone=gone, counts=self.counts,
                          now=time.monotonic(), grow_failed_at=self._grow_failed_at,
                          grow_retry_seconds=settings().grow_retry_seconds, before_call=before_call)

    def call(self, payload: PackedCall, spec: GroupSpec, *, attempt: int, deadline: float | None,
             observer: CallObserver, label: str, hang_timeout: float | None = None) -> CallOutcome:
        # One call at a time on a pool's ranks: two calls cannot share one process group.
        with self._lock:
            g = self.group
            members = tuple(n.serial for n in self.nodes)  # a node replaced, dropped or added: a new group
            if g is None or g.broken or g.spec != spec or self._members != members or not all(n.usable for n in self.nodes):
                if g is not None and not g.broken:
                    g.close(self.bus)
                self._mend(observer, before_call=False)
                node_dir = self._workdir_on_nodes(spec.workdir, observer) if spec.workdir else None
                shapes = [NodeShape(n.link.node_rank, n.link.address, n.link.machine, tuple(n.gpus),
                                    tuple(n.link.env.items()), n.link.where) for n in self.nodes]
                self.group = g = RankGroup(shapes, self.procs_per_node, spec,
                                           self.provider.free_port(self.nodes[0].link.node_id), self.env, node_dir)
                self._members = tuple(n.serial for n in self.nodes)
                g.start(self.bus)
                self.relay.open_links(self.nodes)  # the members changed, or their listeners opened before they joined
            knobs = settings()
            run = CallRun(g, self.bus, observer, label=label, attempt=attempt, deadline=deadline,
                          hang_timeout=hang_timeout, stop_confirm_seconds=knobs.stop_confirm_seconds,
                          stop_grace_seconds=knobs.stop_grace_seconds, now=time.monotonic(),
                          straggler_warn_seconds=knobs.straggler_warn_seconds)
            try:
                return drive(run, self.events, payload)
            finally:
                for node_rank in run.lost | set(run.notices):  # said during the call: not again
                    if node_rank < len(self.nodes):
                        self.nodes[node_rank].said = True
                if g.broken:
                    self.group = None

    # -- carrying out the policy's decisions ---------------------------------------------------

    def _mend(self, observer: CallObserver, *, before_call: bool) -> None:
        taker = next((getattr(n, "evicted_by", "") for n in self.nodes if getattr(n, "evicted_by", "")), "")
        if taker:  # its nodes are another process's now: never replaced from here
            self._evicted_by = taker
            raise PoolStartError(f"the warm pool was taken over by {taker} while this process was out of reach")
        status = self.status(before_call)
        for node in self.nodes:  # what happened to each gone node, once (a call may have said it)
            if not node.usable and not node.said:
                node.said = True
                if node.notice is not None:
                    observer.on_event(NodePreempted(node.link.node_rank, node.link.address, node.notice["reason"],
                                                    node.notice.get("deadline")))
                else:
                    observer.on_event(NodeLost(node.link.node_rank, node.link.address, node.lost_reason))
        for decision in self.policy.decide(status):
            if isinstance(decision, Drop):
                self._drop(decision.node_ids, status, observer)
            elif isinstance(decision, Replace):
                self._replace(decision.node_ids, observer)
            elif isinstance(decision, Grow):
                self._grow(decision.count, observer)
        self._renumber()

    def _by_id(self, node_id: int) -> NodeChannel:
        return next(n for n in self.nodes if n.link.node_id == node_id)

    def _drop(self, node_ids: tuple[int, ...], status: PoolStatus, observer: CallObserver) -> None:
        """An elastic pool goes on without these: torchrun's elastic agent too restarts on the
        members it has rather than wait for new ones."""
        gone = {g.node_id: g for g in status.gone}
        before = len(self.nodes)
        for node_id in node_ids:
            node = self._by_id(node_id)
            self.nodes.remove(node)
            self._let_go(node)
        reason = "; ".join(f"node {gone[i].node_rank} ({gone[i].address}) {gone[i].reason}" for i in node_ids)
        observer.on_event(PoolShrank(before, len(self.nodes), reason, self.counts[1], self.procs_per_node))

    def _replace(self, node_ids: tuple[int, ...], observer: CallObserver) -> None:
        fresh = []
        for node_id in node_ids:
            old = self._by_id(node_id)
            started = time.monotonic()
            old.link.let_go_lost()
            link = self.provider.replace(old.link.node_id)
            link.node_rank = old.link.node_rank
            new = self._channel(link)
            self.nodes[self.nodes.index(old)] = new
            keep_heartbeats([new], self._closed)
            fresh.append((old, new, started))
        self._await_agents([new for _, new, _ in fresh])
        for old, new, started in fresh:
            observer.on_event(NodeReplaced(old.link.node_rank, old.link.address, new.link.address, old.why_gone(),
                                           time.monotonic() - started))

    def _let_go(self, node: NodeChannel) -> None:
        """The pool no longer uses this node: its stream closing is no news, and what holds it ends."""
        node.end()
        node.retire()
        node.link.close()
        self.provider.release(node.link.node_id)

    def _grow(self, missing: int, observer: CallObserver) -> None:
        """Back toward the most nodes, with what the provider can get now; a shortfall is said,
        never raised: the pool still has at least min_nodes."""
        started = self._grow_failed_at = time.monotonic()  # cleared below when it grew back
        retry = settings().grow_retry_seconds
        before = len(self.nodes)
        fresh: list[NodeChannel] = []
        try:
            links = self.provider.grow(missing)
            for position, link in enumerate(links, start=len(self.nodes)):
                link.node_rank = position
                fresh.append(self._channel(link))
            self._await_agents(fresh)
        except PoolStartError as exc:
            for node in fresh:
                self._let_go(node)
            observer.on_event(GrowFailed(self.counts[1], len(self.nodes), str(exc), retry))
            return
        self.nodes.extend(fresh)
        keep_heartbeats(fresh, self._closed)
        if fresh:
            observer.on_event(PoolGrew(before, len(self.nodes), self.counts[1], tuple(n.link.address for n in fresh),
                                       time.monotonic() - started, self.world_size))
        if len(self.nodes) < self.counts[1]:
            observer.on_event(GrowFailed(self.counts[1], len(self.nodes),
                                         "no more could be had now (the pool's log says why)", retry))
        else:
            self._grow_failed_at = None

    def _renumber(self) -> None:
        for position, node in enumerate(self.nodes):
            node.link.node_rank = position

    def _workdir_on_nodes(self, request: WorkdirRequest, observer: CallObserver) -> str:
        """Where the workdir is on every node, sent there first if it must travel."""
        path, note = self.provider.prepare_workdir(request)
        if note:
            observer.on_event(WorkdirSynced(note))
        return path

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            if self.group is not None and not self.group.broken:
                self.group.close(self.bus)
            self.group = None
            for n in self.nodes:  # a leased agent outlives its stream closing: END is its goodbye
                n.end()
                n.retire()  # and the streams closing below are no news (never a re-attach)
                n.ack_due.set()
            try:
                if not self.evicted_by:  # another process holds the nodes now: not ours to end
                    self.provider.stop()
            finally:
                for n in self.nodes:
                    n.link.close()


def _why_gone(node: NodeChannel) -> str:
    why = node.why_gone()
    return why + (f": {node.lost_reason}" if node.notice is None and node.lost_reason else "")
