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
        return self.nodes[node_rank].sent(msg)


class PoolSession:
    """The nodes of a pool that is up, and the rank group that lives on them."""

    def __init__(self, provider: NodeProvider, procs_per_node: int, env: dict[str, str]):
        self.provider = provider
        self.procs_per_node = procs_per_node
        self.env = dict(env)
        self.events: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.group: RankGroup | None = None
        self.nodes: list[NodeChannel] = []
        self.bus = ChannelBus(self.nodes)
        self._closed = threading.Event()

    def start(self) -> PoolSession:
        """Bring the nodes up, and wait for every agent's hello; all or nothing."""
        try:
            self.nodes.extend(NodeChannel(link, self.events).start() for link in self.provider.start())
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

    def call(self, payload: Any, spec: GroupSpec, *, attempt: int, deadline: float | None,
             observer: CallObserver, label: str, hang_timeout: float | None = None) -> CallOutcome:
        # One call at a time on a pool's ranks: two calls cannot share one process group.
        with self._lock:
            g = self.group
            if g is None or g.broken or g.spec != spec or not all(n.alive for n in self.nodes):
                if g is not None and not g.broken:
                    g.close(self.bus)
                self._replace_lost_nodes(observer)
                node_dir = self._workdir_on_nodes(spec.workdir, observer) if spec.workdir else None
                shapes = [NodeShape(n.link.node_rank, n.link.address, n.link.machine, tuple(n.gpus),
                                    tuple(n.link.env.items())) for n in self.nodes]
                self.group = g = RankGroup(shapes, self.procs_per_node, spec, self.provider.free_port(), self.env,
                                           node_dir)
                g.start(self.bus)
            knobs = settings()
            run = CallRun(g, self.bus, observer, label=label, attempt=attempt, deadline=deadline,
                          hang_timeout=hang_timeout, stop_confirm_seconds=knobs.stop_confirm_seconds,
                          stop_grace_seconds=knobs.stop_grace_seconds, now=time.monotonic())
            try:
                return drive(run, self.events, payload)
            finally:
                if g.broken:
                    self.group = None

    def _replace_lost_nodes(self, observer: CallObserver) -> None:
        """A lost node (its agent stream closed or fell silent) is replaced before the next group
        starts: a full pool for every retry and every later call inside `with pool:`."""
        lost = [n for n in self.nodes if not n.alive]
        if not lost:
            return
        replace = self.provider.replace
        fresh = []
        for old in lost:
            started = time.monotonic()
            old.link.close()
            new = NodeChannel(replace(old.link.node_rank), self.events).start()
            self.nodes[old.link.node_rank] = new
            keep_heartbeats([new], self._closed)
            fresh.append((old, new, started))
        self._await_agents([new for _, new, _ in fresh])
        for old, new, started in fresh:
            observer.on_notice(f"node {old.link.node_rank} ({old.link.address}) was lost; replaced by a new node "
                               f"({new.link.address}) in {time.monotonic() - started:.2f}s")

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
