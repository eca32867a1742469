"""How a call's attempt ends short of every rank's result: a rank's failure recorded with its
cause and kind, the group stopped (STOP to every node, each agent's confirmation awaited, where each
rank was brought back when asked), failures that race the stop kept, and after a hang each stopped
rank failed with a HangError naming its place.

The ending half of `CallRun` (call_run.py), its base: what a call does while its ranks run, and its
clocks, are there; `Phase` is here, as both halves move it.
"""

from __future__ import annotations

import signal
import time
from enum import Enum
from typing import Any

from skytasks.controller.failures import echoes, rebuild_exception
from skytasks.controller.outcome import EndReason, RankState
from skytasks.controller.rank_group import CallObserver, NodeBus, RankGroup, RankOutcome
from skytasks.errors import HangError, RankFailure, RankProcessDied
from skytasks.preemption import Preempted
from skytasks.flight_recorder import hang_evidence, records_of
from skytasks.protocol import Op, message
from skytasks.stacks import where

PREEMPTED_TYPE = f"{Preempted.__module__}.{Preempted.__qualname__}"  # as a rank describes its exception
# How a rank ends when our stop reaches it (SIGUSR1: our own stack request, to a rank whose
# faulthandler was not set up yet): the stop's doing, never the rank's failure.
_OUR_STOP_CODES = (-signal.SIGTERM, -signal.SIGKILL, -signal.SIGUSR1)


def failure_kind(msg: dict[str, Any]) -> EndReason:
    """A rank's FAILED message: a save-and-end for a preemption, or the code's failure."""
    return EndReason.PREEMPTED if msg["type"] == PREEMPTED_TYPE else EndReason.RANK_FAILED


def _killed(exc: BaseException) -> bool:
    """A rank's process killed from outside (SIGKILL, SIGTERM), as a vanishing node's are; not a
    crash of its own (SIGSEGV, SIGABRT), whose retry is the code's."""
    return isinstance(exc, RankProcessDied) and exc.returncode in (-signal.SIGKILL, -signal.SIGTERM)


class Phase(Enum):
    RUNNING = "running"
    STOPPING = "stopping"
    DONE = "done"


class CallEnding:
    # The call's own, set by CallRun.__init__: what the ending reads and moves.
    group: RankGroup
    bus: NodeBus
    observer: CallObserver
    id: int
    hang_timeout: float | None
    stop_grace_seconds: float
    stop_confirm_seconds: float
    outcomes: dict[int, RankOutcome]
    failures: list[RankFailure]
    notices: dict[int, dict[str, Any]]
    phase: Phase
    aborted_at: float | None
    lost: set[int]

    def _init_ending(self) -> None:
        self._stacks: dict[int, str] = {}
        self._flight_records: dict[int, dict[str, Any]] = {}  # rank -> its flight recorder summary, at a hang
        self._stacks_why = ""
        self._hung = False
        self._stop_waiting: set[int] = set()
        self._stop_until = 0.0
        self._untold_stopped: list[RankOutcome] = []  # stopped, not yet said: the observer hears of them with their stacks
        # A stop waits for every member whose loss was not read yet, alive or not: a channel is
        # marked dead before its LOST reaches the queue, and that LOST may name the root cause
        # (_lost_while_stopping). Each member was usable when the session chose this group (it
        # mends the pool otherwise), so one dead since has its LOST on the way or read.
        self._members = set(self.group.addresses)

    def _on_node_failure(self, node_rank: int, msg: dict[str, Any], now: float, *,
                         take: tuple[RankState, ...] = (RankState.PENDING,)) -> None:
        raise NotImplementedError  # CallRun's: a node lost, failed or going away

    def _record(self, o: RankOutcome, exc: BaseException, ended: float | None,
                kind: EndReason = EndReason.RANK_FAILED) -> None:
        self.group.broken = True
        now = time.time()
        o.status, o.ended = RankState.FAILED, ended or now
        o.preempted = kind == EndReason.PREEMPTED or (kind == EndReason.NODE_LOST and o.node_rank in self.notices)
        exc.add_note(f"[skytasks] rank {o.rank} failed (node {o.node_rank}, {o.node_addr}, device {o.device})")
        exc.skytasks_rank = o.rank  # type: ignore[attr-defined]
        exc.skytasks_node = o.node_rank  # type: ignore[attr-defined]
        o.failure = RankFailure(o.rank, o.node_rank, o.node_addr, exc, at=ended or now, kind=kind)
        self.failures.append(o.failure)
        self.observer.on_rank_done(o.rank, o)

    def _stop(self, reason: str, now: float, stacks: bool = False, hung: bool = False) -> None:
        """Stop every rank of the group now; they never wait for a collective to time out. With
        `stacks`, the agents say where each rank was as it stopped, and the observer hears of the
        stopped ranks once they have (`_stopped`): their stacks first, then that they stopped."""
        self.group.broken = True
        self.aborted_at = time.time()
        self.bus.broadcast(message(Op.STOP, group=self.group.id, grace=self.stop_grace_seconds, stacks=stacks,
                                   **({"hung": True} if hung else {})))
        preempted = bool(self.failures) and self.failures[0].rank >= 0 and \
            self.outcomes[self.failures[0].rank].preempted
        for o in self.outcomes.values():
            if o.status is RankState.PENDING:
                o.status, o.stop_reason, o.ended = RankState.STOPPED, f"stopped because {reason}", time.time()
                o.preempted = preempted
                self._untold_stopped.append(o)
        if not stacks:
            self._tell_stopped()
        self._stop_waiting = set(self.bus.alive()) | (self._members - self.lost)
        self._stop_until = now + self.stop_confirm_seconds
        self.phase = Phase.STOPPING
        if not self._stop_waiting:
            self._stopped()

    def _tell_stopped(self) -> None:
        for o in self._untold_stopped:
            if o.status is RankState.STOPPED:  # not since recorded as a failure that raced the stop
                self.observer.on_rank_done(o.rank, o)
        self._untold_stopped = []

    def _stopped(self) -> None:
        """Every agent confirmed (or the wait is over): the stacks the stop brought, then done.
        After a hang, each rank that was stopped fails with a HangError naming where it was, at
        the moment the hang was declared (so it is a root cause, not collateral of the stop)."""
        if self._untold_stopped:
            self.observer.on_stacks(self._stacks, self._stacks_why)
            if self._hung:
                evidence = hang_evidence(self._flight_records)  # which rank never joined, by torch's record
                for o in self._untold_stopped:
                    if o.status is RankState.STOPPED:
                        stack = self._stacks.get(o.rank, "")
                        o.stop_reason = ""
                        place = "; ".join(w for w in (where(stack), evidence) if w)
                        self._record(o, HangError(o.rank, self.hang_timeout or 0.0, place, stack),
                                     self.aborted_at, EndReason.HANG)
                self._untold_stopped = []
            self._tell_stopped()
        self._killed_with_their_nodes()
        self.phase = Phase.DONE

    def _while_stopping(self, node_rank: int, msg: dict[str, Any], now: float) -> None:
        """Until every agent confirms its ranks are gone, keeping failures that raced the stop."""
        op, rank = msg["op"], msg.get("rank", -1)
        if op == Op.LOST:
            self._lost_while_stopping(node_rank, msg, now)
        if op in (Op.STOPPED, Op.LOST):
            for r, stack in (msg.get("stacks") or {}).items():
                if int(r) in self.outcomes and self.outcomes[int(r)].status is RankState.STOPPED:
                    self._stacks[int(r)] = stack
            self._flight_records.update(records_of(msg))
            self._stop_waiting.discard(node_rank)
            if not self._stop_waiting:
                self._stopped()
        elif op == Op.FAILED and msg["call"] in (self.id, None) and self.outcomes[rank].status is RankState.STOPPED:
            # Its own kind, as in RUNNING: every rank raises Preempted from the same step, and one
            # whose clock is earlier than the rank that triggered the stop is the root cause.
            self._record(self.outcomes[rank], rebuild_exception(msg), msg.get("ended"), failure_kind(msg))
        elif op == Op.EXITED and self.outcomes[rank].status is RankState.STOPPED and msg["returncode"] not in _OUR_STOP_CODES:
            # it ended by itself while the stop was on its way
            self._record(self.outcomes[rank], RankProcessDied(rank, msg["returncode"]), msg.get("at"))
        elif op in (Op.OUTPUT, Op.LOG):
            self._relay_line(msg)

    def _lost_while_stopping(self, node_rank: int, msg: dict[str, Any], now: float) -> None:
        """A node's loss read after the stop began is said all the same (NodeLost). It is the root
        cause, its stopped ranks failing with it, when every failure so far is a peer's "connection
        closed": that can beat the news of the node that vanished under it (a busy controller
        reads the streams in either order), and the attempt is then a node recovery, not a retry.
        After a failure of the code's own the loss is collateral: its ranks stay stopped."""
        if node_rank in self.lost:
            return
        echo = self._stopped_by_collateral_only()
        self._on_node_failure(node_rank, msg, now, take=(RankState.PENDING, RankState.STOPPED) if echo else ())

    def _killed_with_their_nodes(self) -> None:
        """Ranks killed from outside on nodes this call lost, just before each node's stream was seen
        to end (a deleted pod's processes, an OOM-killed machine's), are their nodes' loss, when
        they and peers' "connection closed" are all the failures: a node recovery, not a retry."""
        killed = [f for f in self.failures if f.node_rank in self.lost and _killed(f.exception)]
        if killed and all(f in killed or (f.rank >= 0 and echoes(f)) for f in self.failures):
            for f in killed:
                f.kind = EndReason.NODE_LOST
                self.outcomes[f.rank].preempted = f.node_rank in self.notices

    def _stopped_by_collateral_only(self) -> bool:
        """Every failure so far is a peer's vanishing under a collective, not a cause of its own."""
        return bool(self.failures) and all(f.rank >= 0 and echoes(f) for f in self.failures)

    def _relay_line(self, msg: dict[str, Any]) -> None:
        """A rank's output line or logging record to the observer, in every phase."""
        if msg["op"] == Op.OUTPUT:
            self.observer.on_output(msg["rank"], msg["stream"], msg["line"])
        else:
            self.observer.on_log(msg["rank"], msg["level"], msg["line"])
