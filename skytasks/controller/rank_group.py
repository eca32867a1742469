"""A rank group: one set of rank processes across the nodes, with one process group.

Layers, after torch.distributed.elastic: a provider gives `NodeLink`s (agent streams); a
`PoolSession` (`skytasks.controller.session`) owns the channels of a pool that is up and at most one
live `RankGroup`; a `RankGroup` is reused across the calls of a warm pool until a call fails.
Each call on it is a `CallRun` (`skytasks.controller.call_run`), a state machine driven one event
at a time.

Building a group does no I/O: it settles placement, devices, backend and every rank's
environment. `start` is the one step that sends (the spawn), and `close` the one that ends it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from skytasks.devices import choose_backend, device_environment, place_ranks
from skytasks.controller.outcome import RankState
from skytasks.events import Event
from skytasks.errors import RankFailure
from skytasks.protocol import Op, message
from skytasks.settings import settings
from skytasks.rank import rank_environment
from skytasks.serialization import Blob, same_blob, snapshot
from skytasks.workdir import WorkdirRequest

_group_ids = itertools.count(1)
_blob_ids = itertools.count(1)


class CallObserver(Protocol):
    """What the caller side (console, Prefect) hears while a call runs."""

    def on_output(self, rank: int, stream: str, line: str) -> None: ...
    def on_log(self, rank: int, level: int, line: str) -> None: ...
    def on_rank_done(self, rank: int, outcome: RankOutcome) -> None: ...
    def on_report(self, rank: int, metrics: dict[str, Any]) -> None: ...
    def on_event(self, event: Event) -> None: ...  # skytasks.events: what happened, as a value
    def on_stacks(self, stacks: dict[int, str], why: str) -> None: ...
    def on_resources(self, rank: int, figures: dict[str, float]) -> None: ...


class NodeBus(Protocol):
    """The group's way to its nodes: the session's channels, or a fake one in unit tests."""

    def send(self, node_rank: int, msg: dict[str, Any]) -> None: ...
    def broadcast(self, msg: dict[str, Any], relay: bool = False) -> None: ...
    def send_call(self, msg: dict[str, Any], group: int) -> None: ...
    def alive(self) -> set[int]: ...
    def is_current(self, node_rank: int, msg: dict[str, Any]) -> bool: ...


@dataclass(frozen=True)
class NodeShape:
    """What a group needs to know of a node to place ranks on it."""

    node_rank: int
    address: str
    machine: str
    gpus: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    where: str = ""  # NodeLink.where


@dataclass(frozen=True)
class GroupSpec:
    backend: str | None
    init_torch: bool
    init_timeout_seconds: float
    workdir: WorkdirRequest | None = None
    runs_script: bool = False


@dataclass
class RankOutcome:
    rank: int
    node_rank: int
    node_addr: str
    device: str = "cpu"
    status: RankState = RankState.PENDING
    value: Any = None
    failure: RankFailure | None = None
    started: float | None = None
    ended: float | None = None
    stop_reason: str = ""
    preempted: bool = False  # its attempt was ended by a preemption (not by a failure of the code)
    used: dict[str, float] | None = None  # the rank's own figures for the call: peak_rss, cpu_seconds


class RankGroup:
    """One generation of rank processes across the nodes, with one process group."""

    def __init__(self, nodes: Sequence[NodeShape], procs_per_node: int, spec: GroupSpec, port: int,
                 pool_env: dict[str, str], workdir_on_nodes: str | None = None):
        self.spec = spec
        self.id = next(_group_ids)
        self.broken = False
        self.calls = 0
        self.blobs_held: dict[str, Blob] = {}  # what the ranks keep from the last call
        self.ready: set[int] = set()
        self.joining: set[int] = set()
        ppn = procs_per_node
        self.world_size = len(nodes) * ppn
        # Devices and backend are settled before any rank starts: a layout NCCL would refuse
        # either runs gloo (auto, said once in the call's logs) or is refused here.
        devices = place_ranks([n.gpus for n in nodes], ppn, [n.machine or n.address for n in nodes])
        choice = choose_backend(spec.backend, devices)
        self.backend, self.notice = choice.backend, choice.note
        self.devices = {d.rank: d.device for d in devices}
        self.placement: dict[int, tuple[int, str]] = {}  # rank -> (node_rank, node address and where it runs)
        self.spawns: dict[int, dict[str, Any]] = {}  # node_rank -> its SPAWN message
        peers = tuple(n.address for n in nodes)
        self.addresses = {n.node_rank: n.address for n in nodes}
        for node in nodes:
            ranks = []
            for local in range(ppn):
                rank = node.node_rank * ppn + local
                self.placement[rank] = (node.node_rank, f"{node.address} ({node.where})" if node.where else node.address)
                env = rank_environment(rank=rank, world_size=self.world_size, local_rank=local, local_world_size=ppn,
                                       node_rank=node.node_rank, peers=peers, head_port=port,
                                       accelerators=len(node.gpus))
                env.update(device_environment(devices[rank], choice.backend))
                ranks.append({"rank": rank, "env": env})
            common = {**pool_env, **dict(node.env), "SKYTASKS_INIT_TORCH": "1" if spec.init_torch else "0",
                      "SKYTASKS_INIT_TIMEOUT_SECONDS": str(spec.init_timeout_seconds)}
            if spec.runs_script:  # read by the node (rank_template.SCRIPT_ENV): torch warm for the script
                common["SKYTASKS_SCRIPT"] = "1"
            if workdir_on_nodes is not None:
                common["SKYTASKS_WORKDIR"] = workdir_on_nodes
            self.spawns[node.node_rank] = message(Op.SPAWN, group=self.id, ranks=ranks, env=common)

    def start(self, bus: NodeBus) -> None:
        """Start every rank process (the agents spawn them in parallel)."""
        for node_rank, msg in self.spawns.items():
            bus.send(node_rank, msg)

    def call_message(self, call_id: int, payload: Any, attempt: int) -> dict[str, Any]:
        """The CALL for this payload. Large arguments the ranks still hold from the last call are
        not sent again. Equality of the bytes decides, not a digest: hashing 500 MB costs half a
        second, comparing it a fraction of that."""
        refs, fresh, kept = [], {}, {}
        for data in payload.blobs:
            key = next((k for k, old in self.blobs_held.items() if same_blob(old, data)), None)
            if key is None:
                key = f"{self.id}.{next(_blob_ids)}"
                fresh[key] = data
            refs.append(key)
            # A snapshot: the blob's buffers are views of the caller's own arrays, which it may
            # change before the next call; compare against what the ranks really hold.
            kept[key] = snapshot(data) if key in fresh else self.blobs_held[key]
        self.blobs_held = kept
        return message(Op.CALL, call=call_id, head=payload.head, refs=refs, blobs=fresh, attempt=attempt)

    def outcomes(self) -> dict[int, RankOutcome]:
        return {r: RankOutcome(rank=r, node_rank=n, node_addr=a, device=self.devices[r])
                for r, (n, a) in self.placement.items()}

    def close(self, bus: NodeBus) -> None:
        bus.broadcast(message(Op.CLOSE, group=self.id, grace=settings().close_grace_seconds))
