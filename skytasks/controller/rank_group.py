"""The rank lifecycle, shared by every provider: spawn a rank group on the nodes, run calls on
it, fail fast, and stop it.

Layers, after torch.distributed.elastic: a provider gives `NodeLink`s (agent streams); a
`PoolSession` (`skytasks.controller.session`) owns the links of a pool that is up and at most one live
`RankGroup`; a `RankGroup` is one set of rank processes with one process group, reused across calls in a warm
pool until a call fails. A failure is a value (`RankFailure`) until the call ends, when the
first failures become the members of one `DistributedTaskError` (`skytasks.controller.failures`).
"""

from __future__ import annotations

import itertools
import queue
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from skytasks.errors import HangError, RankFailure, RankProcessDied
from skytasks.controller.failures import failure_error, rebuild_exception
from skytasks.controller.channel import broadcast
from skytasks.devices import choose_backend, device_environment, place_ranks
from skytasks.serialization import Blob, loads_out_of_band, same_blob, snapshot
from skytasks.rank import rank_environment
from skytasks.stacks import where
from skytasks.workdir import WorkdirRequest

if TYPE_CHECKING:
    from skytasks.controller.session import PoolSession

# How long stopped ranks may take to be confirmed gone before the call returns anyway.
STOP_CONFIRM_SECONDS = 10.0
DEFAULT_INIT_TIMEOUT_SECONDS = 120.0

# How a rank ends when our own stop reaches it (SIGTERM, then SIGKILL after the grace).
_OUR_STOP_CODES = (-signal.SIGTERM, -signal.SIGKILL)

# What shows a call is not hung (with hang_timeout_seconds): a rank starting, writing or finishing.
_SIGNS_OF_PROGRESS = frozenset({"output", "log", "report", "result", "ready", "joining"})

# How often a call with no deadline wakes to re-check its clocks; waking changes nothing else.
IDLE_WAKE_SECONDS = 3600.0

_group_ids = itertools.count(1)
_call_ids = itertools.count(1)
_blob_ids = itertools.count(1)


class CallObserver(Protocol):
    """What the caller side (console, Prefect) hears while a call runs."""

    def on_output(self, rank: int, stream: str, line: str) -> None: ...
    def on_log(self, rank: int, level: int, line: str) -> None: ...
    def on_rank_done(self, rank: int, outcome: RankOutcome) -> None: ...
    def on_report(self, rank: int, metrics: dict[str, Any]) -> None: ...
    def on_notice(self, text: str) -> None: ...
    def on_stacks(self, stacks: dict[int, str], why: str) -> None: ...


@dataclass
class GroupSpec:
    backend: str | None
    init_torch: bool
    init_timeout_seconds: float = DEFAULT_INIT_TIMEOUT_SECONDS
    workdir: WorkdirRequest | None = None


@dataclass
class RankOutcome:
    rank: int
    node_rank: int
    node_addr: str
    device: str = "cpu"
    status: str = "pending"  # pending | completed | failed | stopped
    value: Any = None
    failure: RankFailure | None = None
    started: float | None = None
    ended: float | None = None
    stop_reason: str = ""


def _passed(when: float | None, now: float) -> bool:
    return when is not None and now >= when


class RankGroup:
    """One generation of rank processes across the nodes, with one process group."""

    def __init__(self, session: PoolSession, spec: GroupSpec, workdir_on_nodes: str | None = None):
        self.session, self.spec = session, spec
        self.id = next(_group_ids)
        self.broken = False
        self.calls = 0
        self.blobs_held: dict[str, Blob] = {}  # what the ranks keep from the last call
        self.ready: set[int] = set()
        self.joining: set[int] = set()
        self.placement: dict[int, tuple[int, str]] = {}  # rank -> (node_rank, node address)
        nodes = session.nodes
        ppn = session.procs_per_node
        world = len(nodes) * ppn
        self.world_size = world
        # Devices and backend are settled before any rank starts: a layout NCCL would refuse
        # either runs gloo (auto, said once in the call's logs) or is refused here.
        devices = place_ranks([n.gpus for n in nodes], ppn, [n.link.machine or n.link.address for n in nodes])
        choice = choose_backend(spec.backend, devices)
        self.backend, self.notice = choice.backend, choice.note
        self.devices = {d.rank: d.device for d in devices}
        port = session.provider.free_port()
        peers = tuple(n.link.address for n in nodes)
        for node in nodes:
            ranks = []
            for local in range(ppn):
                rank = node.link.node_rank * ppn + local
                self.placement[rank] = (node.link.node_rank, node.link.address)
                env = rank_environment(
                    rank=rank, world_size=world, local_rank=local, local_world_size=ppn,
                    node_rank=node.link.node_rank, peers=peers, head_port=port,
                    accelerators=len(node.gpus),
                )
                env.update(device_environment(devices[rank], choice.backend))
                ranks.append({"rank": rank, "env": env})
            common = {
                **session.env,
                **node.link.env,
                "SKYTASKS_INIT_TORCH": "1" if spec.init_torch else "0",
                "SKYTASKS_INIT_TIMEOUT_SECONDS": str(spec.init_timeout_seconds),
            }
            if workdir_on_nodes is not None:
                common["SKYTASKS_WORKDIR"] = workdir_on_nodes
            node.send({"op": "spawn", "group": self.id, "ranks": ranks, "env": common})

    def run(self, payload: Any, attempt: int, deadline: float | None, observer: CallObserver, label: str,
            hang_timeout: float | None = None) -> list[Any]:
        call_id = next(_call_ids)
        outcomes = {r: RankOutcome(rank=r, node_rank=n, node_addr=a, device=self.devices[r])
                    for r, (n, a) in self.placement.items()}
        if self.notice is not None and self.calls == 0:
            observer.on_notice(self.notice)
        self.calls += 1
        # Large arguments the ranks still hold from the last call are not sent again. Equality
        # of the bytes decides, not a digest: hashing 500 MB costs half a second, comparing it
        # a fraction of that.
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
        msg = {"op": "call", "call": call_id, "head": payload.head, "refs": refs, "blobs": fresh, "attempt": attempt}
        broadcast(self.session.nodes, msg, relay=True)
        self.blobs_held = kept
        init_deadline = None
        if self.spec.init_torch and len(self.ready) < self.world_size:
            # The clock starts when the first rank is ready to rendezvous, so a slow torch import
            # on a busy machine is not mistaken for a missing peer; a group where no rank ever
            # gets that far is still bounded, at three times the timeout.
            init_deadline = time.monotonic() + 3 * self.spec.init_timeout_seconds
        failures: list[RankFailure] = []
        aborted_at: float | None = None
        last_heard = time.monotonic()  # output, a report or a result from any rank
        try:
            while any(o.status == "pending" for o in outcomes.values()):
                now = time.monotonic()
                hang_at = None if hang_timeout is None or failures else last_heard + hang_timeout
                wait_until = min(d for d in (deadline, init_deadline, hang_at, now + IDLE_WAKE_SECONDS) if d is not None)
                try:
                    node_rank, msg = self.session.events.get(timeout=max(0.0, wait_until - now))
                except queue.Empty:
                    now = time.monotonic()
                    if _passed(hang_at, now) and not _passed(deadline, now):
                        self._fail_hung(call_id, outcomes, failures, observer, hang_timeout)  # type: ignore[arg-type]
                        aborted_at = self._abort(outcomes, observer, "the call hung")
                        break
                    if not _passed(deadline, now) and not _passed(init_deadline, now):
                        continue  # a rank that trains silently for hours is still a running rank
                    if deadline is not None and now >= deadline:
                        running = sorted(r for r, o in outcomes.items() if o.status == "pending")
                        err = TimeoutError(f"{label}: the call timed out (timeout_seconds); ranks {running} were "
                                           f"still running and were stopped")
                        failures.append(RankFailure(-1, -1, "", err, time.time()))
                    elif init_deadline is not None and now >= init_deadline:
                        failures.append(RankFailure(-1, -1, "", self._init_timeout_error(), time.time()))
                    aborted_at = aborted_at or self._abort(outcomes, observer, "the call timed out")
                    break
                if msg.get("group", self.id) != self.id or not self.session.nodes[node_rank].sent(msg):
                    continue  # late news from a group already discarded, or from a replaced node
                self._handle(node_rank, msg, call_id, outcomes, failures, observer)
                if msg["op"] in _SIGNS_OF_PROGRESS:
                    last_heard = time.monotonic()
                if init_deadline is not None and len(self.ready) == self.world_size:
                    init_deadline = None
                elif init_deadline is not None and msg["op"] == "joining" and len(self.joining) == 1:
                    init_deadline = min(init_deadline, time.monotonic() + self.spec.init_timeout_seconds)
                if failures and aborted_at is None:
                    first = failures[0]
                    # Where every other rank was, into its log, before it is stopped.
                    stacks = self._collect_stacks(call_id, outcomes, failures, observer, wait=1.0)
                    observer.on_stacks(stacks, f"stopped because rank {first.rank} failed")
                    aborted_at = self._abort(outcomes, observer, f"rank {first.rank} failed")
            if aborted_at is not None:
                self._drain_after_abort(call_id, outcomes, failures, observer)
        except BaseException:
            # Ctrl-C, SIGTERM, cancellation: the ranks go before the exception does.
            if aborted_at is None:
                self._abort(outcomes, observer, "the caller was interrupted")
            raise
        if failures:
            raise failure_error(label, failures, aborted_at)
        unfinished = sorted(r for r, o in outcomes.items() if o.status != "completed")
        if unfinished:  # never a silent None: a call succeeds only when every rank returned
            raise RuntimeError(f"{label}: ranks {unfinished} ended without a result or a recorded cause "
                               f"(a skytasks bug; please report it)")
        return [outcomes[r].value for r in sorted(outcomes)]

    def _handle(self, node_rank, msg, call_id, outcomes, failures, observer) -> None:
        op = msg["op"]
        rank = msg.get("rank")
        if op == "output":
            observer.on_output(rank, msg["stream"], msg["line"])
        elif op == "log":
            observer.on_log(rank, msg["level"], msg["line"])
        elif op == "report":
            observer.on_report(rank, msg["metrics"])
        elif op == "joining":
            self.joining.add(rank)
        elif op == "ready":
            self.ready.add(rank)
            outcomes[rank].started = outcomes[rank].started or time.time()
        elif op == "result" and msg["call"] == call_id:
            o = outcomes[rank]
            o.status, o.started, o.ended = "completed", msg["started"], msg["ended"]
            o.value = loads_out_of_band(msg["value"], copy=False)
            observer.on_rank_done(rank, o)
        elif op == "failed" and msg["call"] in (call_id, None):
            self._fail(outcomes[rank], rebuild_exception(msg), failures, observer, msg.get("ended"))
        elif op == "exited":
            self.broken = True  # whatever the reason, a group missing a rank can serve no more
            if outcomes[rank].status == "pending":
                self._fail(outcomes[rank], RankProcessDied(rank, msg["returncode"]), failures, observer, msg.get("at"))
        elif op in ("lost", "agent_error"):
            # The node itself failed: that is the root cause, not the ranks it took with it.
            what = f"lost the agent of node {node_rank}" if op == "lost" else f"the agent of node {node_rank} failed"
            detail = msg.get("reason") or msg.get("error", "")
            for o in outcomes.values():
                if o.node_rank == node_rank and o.status == "pending":
                    self._fail(o, ConnectionError(f"{what} ({o.node_addr}): {detail}"), failures, observer, None)

    def _fail(self, o: RankOutcome, exc: BaseException, failures, observer, ended: float | None) -> None:
        self.broken = True
        now = time.time()
        o.status, o.ended = "failed", ended or now
        exc.add_note(f"[skytasks] rank {o.rank} failed (node {o.node_rank}, {o.node_addr}, device {o.device})")
        exc.skytasks_rank = o.rank  # type: ignore[attr-defined]
        exc.skytasks_node = o.node_rank  # type: ignore[attr-defined]
        o.failure = RankFailure(o.rank, o.node_rank, o.node_addr, exc, at=ended or now)
        failures.append(o.failure)
        observer.on_rank_done(o.rank, o)

    def _collect_stacks(self, call_id, outcomes, failures, observer, wait: float) -> dict[int, str]:
        """Every running rank's stack (asked of the agents), while still handling what arrives."""
        wanted = {r for r, o in outcomes.items() if o.status == "pending"}
        stacks: dict[int, str] = {}
        if not wanted:
            return stacks
        for node in self.session.nodes:
            node.send({"op": "stacks", "group": self.id})
        until = time.monotonic() + wait
        while wanted - set(stacks) and time.monotonic() < until:
            try:
                node_rank, msg = self.session.events.get(timeout=max(0.0, until - time.monotonic()))
            except queue.Empty:
                break
            if msg.get("group", self.id) != self.id:
                continue
            if msg["op"] == "stack":
                if msg["rank"] in wanted and msg["stack"]:
                    stacks[msg["rank"]] = msg["stack"]
                continue
            self._handle(node_rank, msg, call_id, outcomes, failures, observer)
        return stacks

    def _fail_hung(self, call_id, outcomes, failures, observer, hang_timeout: float) -> None:
        stacks = self._collect_stacks(call_id, outcomes, failures, observer, wait=2.0)
        observer.on_stacks(stacks, f"no rank wrote output, reported or finished for {hang_timeout:g}s")
        for o in outcomes.values():
            if o.status == "pending":
                stack = stacks.get(o.rank, "")
                self._fail(o, HangError(o.rank, hang_timeout, where(stack), stack), failures, observer, None)

    def _abort(self, outcomes, observer, reason: str) -> float:
        """Stop every rank of the group now; they never wait for a collective to time out."""
        self.broken = True
        for node in self.session.nodes:
            node.send({"op": "stop", "group": self.id, "grace": 1.0})
        for o in outcomes.values():
            if o.status == "pending":
                o.status, o.stop_reason, o.ended = "stopped", f"stopped because {reason}", time.time()
                observer.on_rank_done(o.rank, o)
        return time.time()

    def _drain_after_abort(self, call_id, outcomes, failures, observer) -> None:
        """Wait until every agent confirms its ranks are gone, keeping failures that raced in."""
        waiting = {n.link.node_rank for n in self.session.nodes if n.alive}
        until = time.monotonic() + STOP_CONFIRM_SECONDS
        while waiting and time.monotonic() < until:
            try:
                node_rank, msg = self.session.events.get(timeout=max(0.0, until - time.monotonic()))
            except queue.Empty:
                break
            if msg["op"] in ("stopped", "lost"):
                waiting.discard(node_rank)
            elif msg["op"] == "failed" and msg.get("group") == self.id and msg["call"] in (call_id, None):
                o = outcomes[msg["rank"]]
                if o.status == "stopped":  # raced the stop: keep it, classified below
                    o.status = "pending"
                    self._fail(o, rebuild_exception(msg), failures, observer, msg.get("ended"))
            elif (msg["op"] == "exited" and msg.get("group") == self.id and outcomes[msg["rank"]].status == "stopped"
                  and msg["returncode"] not in _OUR_STOP_CODES):
                o = outcomes[msg["rank"]]  # it ended by itself while the stop was on its way
                o.status = "pending"
                self._fail(o, RankProcessDied(o.rank, msg["returncode"]), failures, observer, msg.get("at"))
            elif msg["op"] in ("output", "log") and msg.get("group") == self.id:
                self._handle(node_rank, msg, call_id, outcomes, failures, observer)

    def _init_timeout_error(self) -> TimeoutError:
        missing = sorted(set(self.placement) - self.joining - self.ready)
        waiting = sorted(self.joining - self.ready)
        return TimeoutError(
            f"process group initialisation timed out after {self.spec.init_timeout_seconds:g}s: "
            f"ranks {missing} never joined; ranks {waiting} were waiting for them"
        )

    def close(self) -> None:
        for node in self.session.nodes:
            node.send({"op": "close", "group": self.id})
