"""One call on a rank group, as a state machine driven one event at a time.

    RUNNING --a rank fails / the call hangs: stop, with stacks--> STOPPING --agents confirm, with them--> DONE
    RUNNING --timeout / init timeout---------------------------> STOPPING --agents confirm--> DONE
    RUNNING --every rank returned---------------------------------------------------------> DONE
    RUNNING --straggler probe--> (STACKS, then a warning; the call runs on)

`handle(node_rank, msg, now)` takes one message from the nodes, `tick(now)` lets the clocks act,
and `wake_at()` says when the next clock runs out. The machine's own clocks are the `now` it is
given; the wall clock (`time.time()`) only stamps when a rank started, ended or failed, for the
records and the root-cause order. `drive` reads the queue and the monotonic clock for real calls;
the unit tests drive it by hand with a fake bus.

An attempt ends with a `CallOutcome` (`outcome()`): completed with every rank's value, or why it
failed (the root cause's `EndReason`) and the caller's error. A call can stop early only through
`_record` (a failure with its cause and kind) or an interrupt, which raises: so "ended with no
result and no recorded cause" cannot happen. `outcome()` checks it anyway. How a failure is
recorded and how the group stops (STOPPING) are call_ending.py's, `CallRun`'s base.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from skytasks.controller.call_ending import CallEnding, Phase, failure_kind
from skytasks.controller.failures import failure_error, rebuild_exception
from skytasks.controller.outcome import CallOutcome, EndReason, RankState
from skytasks.controller.rank_group import CallObserver, NodeBus, RankGroup
from skytasks.controller.stragglers import StragglerWatch
from skytasks.errors import RankFailure, RankProcessDied
from skytasks.events import BackendChosen, NodeLost, NodePreempted, NodeReconnected, NodeReconnecting, RanksStillRunning
from skytasks.protocol import RANK_MESSAGES, SIGNS_OF_PROGRESS, Op, message
from skytasks.serialization import loads_out_of_band

_call_ids = itertools.count(1)


class CallRun(CallEnding):
    def __init__(self, group: RankGroup, bus: NodeBus, observer: CallObserver, *, label: str, attempt: int,
                 deadline: float | None, hang_timeout: float | None, stop_confirm_seconds: float,
                 stop_grace_seconds: float, now: float, straggler_warn_seconds: float | None = None):
        self.group, self.bus, self.observer, self.label = group, bus, observer, label
        self.attempt, self.deadline, self.hang_timeout = attempt, deadline, hang_timeout
        self.stop_confirm_seconds, self.stop_grace_seconds = stop_confirm_seconds, stop_grace_seconds
        self.id = next(_call_ids)
        self.outcomes = group.outcomes()
        self._returned = 0  # ranks whose outcome is COMPLETED
        self.failures: list[RankFailure] = []
        self.phase = Phase.RUNNING
        self.aborted_at: float | None = None  # wall clock of the stop, for the root-cause cut
        self.last_heard = now
        self.init_deadline: float | None = None
        if group.spec.init_torch and len(group.ready) < group.world_size:
            # The clock starts when the first rank is ready to rendezvous, so a slow torch import
            # on a busy machine is not mistaken for a missing peer; a group where no rank ever
            # gets that far is still bounded, at three times the timeout.
            self.init_deadline = now + 3 * group.spec.init_timeout_seconds
        self._init_ending()
        self.notices: dict[int, dict[str, Any]] = {}  # node rank -> its preemption notice
        self.lost: set[int] = set()  # node ranks whose loss this call reported (NodeLost)
        self.unreachable: set[int] = set()  # node ranks whose stream broke, being re-attached: no hang meanwhile
        self.stragglers = StragglerWatch(straggler_warn_seconds)

    # -- the machine's inputs --------------------------------------------------------------

    def start(self, payload: Any) -> None:
        if self.group.notice is not None and self.group.calls == 0:
            self.observer.on_event(BackendChosen(self.group.notice))
        self.group.calls += 1
        self.bus.send_call(self.group.call_message(self.id, payload, self.attempt), group=self.group.id)

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    def wake_at(self) -> float | None:
        """The next moment `tick` has something to do; None: only a message can change things."""
        if self.phase is Phase.STOPPING:
            return self._stop_until
        hang_at = self._hang_at()
        times = [t for t in (self.deadline, self.init_deadline, hang_at, self.stragglers.wake_at()) if t is not None]
        return min(times) if times else None

    def _hang_at(self) -> float | None:
        """When the call counts as hung. Not while its group is still starting: that is the init
        timeout's (a slow torch import on a busy machine is no hang), and the last rank's READY
        starts the clock."""
        if self.hang_timeout is None or self.init_deadline is not None or self.unreachable:
            return None  # a node out of reach is no hang: its ranks' news waits for it
        return self.last_heard + self.hang_timeout

    def tick(self, now: float) -> None:
        if self.phase is Phase.STOPPING and now >= self._stop_until:
            self._stopped()  # the agents did not confirm in time: return anyway
        elif self.phase is Phase.RUNNING:
            if self.deadline is not None and now >= self.deadline:
                running = sorted(self._pending())
                self._record_call_error(TimeoutError(
                    f"the call timed out (timeout_seconds); ranks {running} were still running and were stopped"),
                    EndReason.DEADLINE)
                self._stop("the call timed out", now)
            elif self.init_deadline is not None and now >= self.init_deadline:
                self._record_call_error(self._init_timeout_error(), EndReason.INIT_TIMEOUT)
                self._stop("the call timed out", now)
            elif (hang_at := self._hang_at()) is not None and now >= hang_at:
                # Each hung rank fails with a HangError named by its place, which the stop brings
                # back (see _stopped).
                self._hung = True
                self._stacks_why = f"no rank wrote output, reported or finished for {self.hang_timeout:g}s"
                self._stacks = {}
                self._stop("the call hung", now, stacks=True, hung=True)
            elif self.stragglers.due(now):
                self.stragglers.probe(self._pending(), now)
                self.bus.broadcast(message(Op.STACKS, group=self.group.id))
            elif self.stragglers.probe_over(now):
                self._warn_stragglers()

    def handle(self, node_rank: int, msg: dict[str, Any], now: float) -> None:
        op = msg["op"]
        if msg.get("group", self.group.id) != self.group.id or not self.bus.is_current(node_rank, msg):
            return  # late news from a group already discarded, or from a replaced node
        if op in RANK_MESSAGES and (msg.get("rank") not in self.outcomes
                                    or self.outcomes[msg["rank"]].node_rank != node_rank):
            # A node speaks for its own ranks only: anything else is a broken or hostile agent.
            reason = f"it sent {op} for rank {msg.get('rank')!r}, which is not one of its ranks in this call"
            self._on_node_failure(node_rank, message(Op.LOST, reason=reason), now)
            return
        if op == Op.NOTICE:
            self._on_notice(node_rank, msg)
        elif op in (Op.RECONNECTING, Op.RECONNECTED):
            self._on_reconnect(node_rank, msg, now)
        elif self.phase is Phase.STOPPING:
            self._while_stopping(node_rank, msg, now)
        elif op == Op.STACK and self.phase is Phase.RUNNING and self.stragglers.probing:
            if self.stragglers.add_stack(msg["rank"], msg["stack"]):
                self._warn_stragglers()
        else:
            self._running(node_rank, msg, now)

    def interrupt(self, now: float) -> None:
        """Ctrl-C, SIGTERM, cancellation: the ranks go before the exception does."""
        if self.phase is Phase.RUNNING:
            self._stop("the caller was interrupted", now)
        self._tell_stopped()  # an interrupt does not wait for the stacks a stop was bringing back
        self.phase = Phase.DONE

    def outcome(self) -> CallOutcome:
        if self.failures:
            error = failure_error(self.label, self.failures, self.aborted_at)
            return CallOutcome(EndReason(error.failures[0].kind), error=error)
        unfinished = sorted(r for r, o in self.outcomes.items() if o.status is not RankState.COMPLETED)
        if unfinished:  # never a silent None: a call succeeds only when every rank returned
            raise RuntimeError(f"{self.label}: ranks {unfinished} ended without a result or a recorded cause "
                               f"(a skytasks bug; please report it)")
        return CallOutcome(EndReason.COMPLETED, values=[self.outcomes[r].value for r in sorted(self.outcomes)])

    def result(self) -> list[Any]:
        """The ranks' values, or the caller's error raised."""
        return self.outcome().unwrap()

    # -- transitions -----------------------------------------------------------------------

    def _running(self, node_rank: int, msg: dict[str, Any], now: float) -> None:
        op = Op(msg["op"])
        if op in SIGNS_OF_PROGRESS:
            self.last_heard = now
        handler = self._WHILE_RUNNING.get(op)
        if handler is not None:
            handler(self, node_rank, msg, now)
        if self.phase is Phase.RUNNING:
            if self.failures:
                first = self.failures[0]
                if first.kind == EndReason.PREEMPTED:  # saved and ended on purpose: nobody's stack is news
                    self._stop(f"rank {first.rank} ended the attempt for a preemption", now)
                else:
                    # The stop brings back where each rank was (its SIGTERM dump): one signal per
                    # rank, not a stack request and then a stop (a second at 1,024 ranks).
                    self._stacks_why, self._stacks = f"stopped because rank {first.rank} failed", {}
                    self._stop(f"rank {first.rank} failed", now, stacks=True)
            elif self._returned == len(self.outcomes):  # a count: checking every rank per message is n²
                self.phase = Phase.DONE

    def _on_line(self, node_rank: int, msg: dict[str, Any], now: float) -> None:
        self._relay_line(msg)

    def _on_report(self, node_rank: int, msg: dict[str, Any], now: float) -> None:
        self.observer.on_report(msg["rank"], msg["metrics"])
        if "checkpoint_step" in msg["metrics"]:  # a head's commit (skytasks.checkpointing.committed_event)
            from skytasks.checkpointing.committed_event import from_report

            committed = from_report(msg["metrics"])
            if committed is not None:
                self.observer.on_event(committed)

    def _on_joining(self, node_rank: int, msg: dict[str, Any], now: float) -> None:
        self.group.joining.add(msg["rank"])
        if self.init_deadline is not None and len(self.group.joining) == 1:
            self.init_deadline = min(self.init_deadline, now + self.group.spec.init_timeout_seconds)

    def _on_ready(self, node_rank: int, msg: dict[str, Any], now: float) -> None:
        rank = msg["rank"]
        self.group.ready.add(rank)
        self.outcomes[rank].started = self.outcomes[rank].started or time.time()
        if len(self.group.ready) == self.group.world_size:
            self.init_deadline = None

    def _on_result(self, node_rank: int, msg: dict[str, Any], now: float) -> None:
        o = self.outcomes[msg["rank"]]
        if msg["call"] == self.id and o.status is RankState.PENDING:
            o.status, o.started, o.ended = RankState.COMPLETED, msg["started"], msg["ended"]
            self._returned += 1
            o.used = msg.get("used")
            o.value = loads_out_of_band(msg["value"], copy=False)
            self.observer.on_rank_done(o.rank, o)
            if self.stragglers.armed:  # the ranks still running are counted at the first return only
                self.stragglers.rank_returned(now, self._pending())

    def _on_failed(self, node_rank: int, msg: dict[str, Any], now: float) -> None:
        if msg["call"] in (self.id, None):
            self.outcomes[msg["rank"]].used = msg.get("used")
            self._record(self.outcomes[msg["rank"]], rebuild_exception(msg), msg.get("ended"), failure_kind(msg))

    def _on_notice(self, node_rank: int, msg: dict[str, Any]) -> None:
        """A node will be taken away: every rank hears it at once (its peers must save too), and
        the call goes on until the head ends it (`save_if_preempted`) or the node goes."""
        if node_rank in self.notices or self.phase is Phase.DONE:
            return
        self.notices[node_rank] = msg
        address = self.group.addresses.get(node_rank, "")
        self.observer.on_event(NodePreempted(node_rank, address, msg["reason"], msg["deadline"]))
        self.bus.broadcast(message(Op.PREEMPTION, node_rank=node_rank, address=address, reason=msg["reason"],
                                   deadline=msg["deadline"], at=msg["at"]))

    def _on_reconnect(self, node_rank: int, msg: dict[str, Any], now: float) -> None:
        """A node's stream broke and is being re-attached, or was: the call goes on, said here, on
        the call's thread (where the run's log is), whatever its phase."""
        address = self.group.addresses.get(node_rank, "")
        if msg["op"] == Op.RECONNECTING:
            self.unreachable.add(node_rank)
            self.observer.on_event(NodeReconnecting(node_rank, address, msg["reason"], msg["seconds"]))
        else:
            self.unreachable.discard(node_rank)
            self.last_heard = now  # the hang clock starts again from here
            self.observer.on_event(NodeReconnected(node_rank, address, msg["down_seconds"]))

    def _on_exited(self, node_rank: int, msg: dict[str, Any], now: float) -> None:
        rank = msg["rank"]
        self.group.broken = True  # whatever the reason, a group missing a rank can serve no more
        if self.outcomes[rank].status is RankState.PENDING:
            self._record(self.outcomes[rank], RankProcessDied(rank, msg["returncode"]), msg.get("at"))

    def _on_node_failure(self, node_rank: int, msg: dict[str, Any], now: float, *,
                         take: tuple[RankState, ...] = (RankState.PENDING,)) -> None:
        op = Op(msg["op"])
        what = {Op.LOST: f"lost the agent of node {node_rank}", Op.LEAVING: f"node {node_rank} is going away",
                }.get(op, f"the agent of node {node_rank} failed")
        detail = msg.get("reason") or msg.get("error", "")
        if node_rank in self.notices:
            detail += f" (after its preemption notice: {self.notices[node_rank]['reason']})"
        self.unreachable.discard(node_rank)
        if node_rank not in self.lost:
            self.lost.add(node_rank)
            reason = {Op.LOST: detail, Op.LEAVING: f"it is going away: {detail}"}.get(op, f"its agent failed: {detail}")
            self.observer.on_event(NodeLost(node_rank, self.group.addresses.get(node_rank, ""), reason))
        if op == Op.LEAVING:
            stacks = {int(r): s for r, s in (msg.get("stacks") or {}).items() if s}
            self.observer.on_stacks(stacks, f"stopped because node {node_rank} is going away")
        for o in self.outcomes.values():
            if o.node_rank == node_rank and o.status in take:
                self._record(o, ConnectionError(f"{what} ({o.node_addr}): {detail}"), None, EndReason.NODE_LOST)

    def _on_resources(self, node_rank: int, msg: dict[str, Any], now: float) -> None:
        for rank, figures in msg["samples"].items():
            if int(rank) in self.outcomes:
                self.observer.on_resources(int(rank), figures)

    # What each message does while the ranks run (dispatch by op; the rest change nothing).
    _WHILE_RUNNING = {
        Op.OUTPUT: _on_line, Op.LOG: _on_line, Op.REPORT: _on_report, Op.JOINING: _on_joining,
        Op.READY: _on_ready, Op.RESULT: _on_result, Op.FAILED: _on_failed, Op.EXITED: _on_exited,
        Op.RESOURCES: _on_resources, Op.LOST: _on_node_failure, Op.AGENT_ERROR: _on_node_failure, Op.LEAVING: _on_node_failure,
    }

    def _pending(self) -> set[int]:
        return {r for r, o in self.outcomes.items() if o.status is RankState.PENDING}

    def _warn_stragglers(self) -> None:
        running = self._pending()
        if running:
            returned = sorted(r for r, o in self.outcomes.items() if o.status is RankState.COMPLETED)
            self.observer.on_event(RanksStillRunning(self.stragglers.warning(returned, running)))


    def _record_call_error(self, exc: BaseException, kind: EndReason) -> None:
        self.failures.append(RankFailure(-1, -1, "", exc, time.time(), kind=kind))  # the call's own clock, not a rank

    def _init_timeout_error(self) -> TimeoutError:
        g = self.group
        missing = sorted(set(g.placement) - g.joining - g.ready)
        waiting = sorted(g.joining - g.ready)
        return TimeoutError(f"process group initialisation timed out after {g.spec.init_timeout_seconds:g}s: "
                            f"ranks {missing} never joined; ranks {waiting} were waiting for them")
