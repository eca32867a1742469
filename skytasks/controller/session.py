"""A pool that is up: its nodes' agent streams, and the one rank group that lives on them.

Built from a provider's `NodeLink`s; it waits for every agent's hello (with the GPUs its node has)
before a rank is placed, runs one call at a time on its rank group, and replaces a group that
failed, or whose spec (backend, workdir, ...) differs, with a fresh one.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from skytasks.controller.call_run import CallRun, drive
from skytasks.controller.outcome import CallOutcome
from skytasks.controller.channel import NodeChannel, broadcast, keep_heartbeats
from skytasks.controller.rank_group import CallObserver, GroupSpec, NodeShape, RankGroup
from skytasks.errors import PoolStartError
from skytasks.protocol import NODE_FAILURES, Op
from skytasks.providers import NodeProvider
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

    def alive(self) -> set[int]:
        return {n.link.node_rank for n in self.nodes if n.alive}

    def is_current(self, node_rank: int, msg: dict[str, Any]) -> bool:
        # A node that left an elastic pool may still have news in the queue, under its old number.
        return node_rank < len(self.nodes) and self.nodes[node_rank].sent(msg)


class PoolSession:
    """The nodes of a pool that is up, and the rank group that lives on them."""

    def __init__(self, provider: NodeProvider, procs_per_node: int, env: dict[str, str], nodes: tuple[int, int]):
        self.provider = provider
        self.procs_per_node = procs_per_node
        self.env = dict(env)
        self.counts = nodes  # (min, max): an elastic pool runs on what it has between the two
        self.events: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.group: RankGroup | None = None
        self.nodes: list[NodeChannel] = []
        self.bus = ChannelBus(self.nodes)
        self._closed = threading.Event()
        self._members: tuple[int, ...] = ()  # the channels the group was placed on
        self._short_since = -float("inf")  # when an elastic pool last tried to grow and could not

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.procs_per_node

    @property
    def elastic(self) -> bool:
        return self.counts[0] < self.counts[1]

    def start(self) -> PoolSession:
        """Bring the nodes up, and wait for every agent's hello; all or nothing."""
        try:
            for position, link in enumerate(self.provider.start()):
                link.node_rank = position
                self.nodes.append(NodeChannel(link, self.events).start())
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
                del waiting[node_rank]
            elif msg["op"] in NODE_FAILURES:
                detail = msg.get("reason") or msg.get("error", "")
                raise PoolStartError(f"node {node_rank} ({node.link.address}): the node agent did not start: {detail}")

    def prepare(self, observer: CallObserver, *, first_attempt: bool) -> None:
        """The nodes the next attempt runs on. Lost and going nodes leave (replaced, or on an
        elastic pool dropped while at least min_nodes are left); before each call, never between
        the attempts of one, an elastic pool short of its most tries to grow back."""
        with self._lock:
            self._mend(observer)
            if first_attempt:
                self._grow(observer)

    def call(self, payload: Any, spec: GroupSpec, *, attempt: int, deadline: float | None,
             observer: CallObserver, label: str, hang_timeout: float | None = None) -> CallOutcome:
        # One call at a time on a pool's ranks: two calls cannot share one process group.
        with self._lock:
            g = self.group
            members = tuple(n.serial for n in self.nodes)  # a node replaced, dropped or added: a new group
            if g is None or g.broken or g.spec != spec or self._members != members or not all(n.usable for n in self.nodes):
                if g is not None and not g.broken:
                    g.close(self.bus)
                self._mend(observer)
                node_dir = self._workdir_on_nodes(spec.workdir, observer) if spec.workdir else None
                shapes = [NodeShape(n.link.node_rank, n.link.address, n.link.machine, tuple(n.gpus),
                                    tuple(n.link.env.items())) for n in self.nodes]
                self.group = g = RankGroup(shapes, self.procs_per_node, spec,
                                           self.provider.free_port(self.nodes[0].link.node_id), self.env, node_dir)
                self._members = tuple(n.serial for n in self.nodes)
                g.start(self.bus)
            knobs = settings()
            run = CallRun(g, self.bus, observer, label=label, attempt=attempt, deadline=deadline,
                          hang_timeout=hang_timeout, stop_confirm_seconds=knobs.stop_confirm_seconds,
                          stop_grace_seconds=knobs.stop_grace_seconds, now=time.monotonic(),
                          straggler_warn_seconds=knobs.straggler_warn_seconds)
            try:
                return drive(run, self.events, payload)
            finally:
                if g.broken:
                    self.group = None

    def _mend(self, observer: CallObserver) -> None:
        """Lost nodes (the agent stream closed or fell silent) and going ones (a preemption
        notice) leave before the next group starts. Each is replaced, except on an elastic pool,
        where they are dropped while at least min_nodes are left: torchrun's elastic agent too
        restarts on the members it has rather than wait for new ones."""
        gone = [n for n in self.nodes if not n.usable]
        if not gone:
            return
        left = len(self.nodes) - len(gone)
        wanted = len(gone) if not self.elastic else max(0, self.counts[0] - left)
        for old in gone[wanted:]:
            self._drop(old)
            why = old.why_gone() + (f": {old.lost_reason}" if old.notice is None and old.lost_reason else "")
            observer.on_notice(f"node {old.link.node_rank} ({old.link.address}) {why}; "
                               f"the elastic pool goes on with the {left} node{'s' * (left != 1)} left, "
                               f"{left * self.procs_per_node} rank{'s' * (left * self.procs_per_node != 1)}, and grows back toward {self.counts[1]} "
                               f"nodes before a later call")
        fresh = []
        for old in gone[:wanted]:
            started = time.monotonic()
            old.link.close()
            link = self.provider.replace(old.link.node_id)
            link.node_rank = old.link.node_rank
            new = NodeChannel(link, self.events).start()
            self.nodes[self.nodes.index(old)] = new
            keep_heartbeats([new], self._closed)
            fresh.append((old, new, started))
        self._await_agents([new for _, new, _ in fresh])
        for old, new, started in fresh:
            observer.on_notice(f"node {old.link.node_rank} ({old.link.address}) {old.why_gone()}; replaced by a new "
                               f"node ({new.link.address}) in {time.monotonic() - started:.2f}s")
        self._renumber()

    def _drop(self, node: NodeChannel) -> None:
        self.nodes.remove(node)
        self._let_go(node)

    def _let_go(self, node: NodeChannel) -> None:
        """The pool no longer uses this node: its stream closing is no news, and what holds it ends."""
        node.retire()
        node.link.close()
        self.provider.release(node.link.node_id)

    def _grow(self, observer: CallObserver) -> None:
        """Back toward the most nodes, with what the provider can get now; a shortfall is said,
        never raised: the pool still has at least min_nodes."""
        missing = self.counts[1] - len(self.nodes)
        if missing <= 0 or time.monotonic() < self._short_since + settings().grow_retry_seconds:
            return  # full, or it just tried: a call does not pay for the same shortfall twice a minute
        started = self._short_since = time.monotonic()  # cleared below when it grew back
        fresh: list[NodeChannel] = []
        try:
            links = self.provider.grow(missing)
            for position, link in enumerate(links, start=len(self.nodes)):
                link.node_rank = position
                fresh.append(NodeChannel(link, self.events).start())
            self._await_agents(fresh)
        except PoolStartError as exc:
            for node in fresh:
                self._let_go(node)
            observer.on_notice(f"the pool could not grow back toward {self.counts[1]} nodes and stays at "
                               f"{len(self.nodes)}: {exc}; it tries again before a call "
                               f"{settings().grow_retry_seconds:g}s from now or later")
            return
        self.nodes.extend(fresh)
        keep_heartbeats(fresh, self._closed)
        if fresh:
            observer.on_notice(f"the pool grew back to {len(self.nodes)} of {self.counts[1]} nodes "
                               f"({', '.join(n.link.address for n in fresh)}) in {time.monotonic() - started:.2f}s; "
                               f"this call runs on {self.world_size} ranks")
        if len(self.nodes) < self.counts[1]:
            observer.on_notice(f"the pool has {len(self.nodes)} of {self.counts[1]} nodes: no more could be had now "
                               f"(see the pool's log for why); it tries again before a call "
                               f"{settings().grow_retry_seconds:g}s from now or later")
        else:
            self._short_since = -float("inf")

    def _renumber(self) -> None:
        for position, node in enumerate(self.nodes):
            node.link.node_rank = position

    def _workdir_on_nodes(self, request: WorkdirRequest, observer: CallObserver) -> str:
        """Where the workdir is on every node, sent there first if it must travel."""
        path, note = self.provider.prepare_workdir(request)
        if note:
            observer.on_notice(note)
        return path

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            if self.group is not None and not self.group.broken:
                self.group.close(self.bus)
            self.group = None
            try:
                self.provider.stop()
            finally:
                for n in self.nodes:
                    n.link.close()
