"""The preflight on a pool's nodes: run before the first user call on any node it has not checked
(at bring-up, after a replacement or growth, and in a process that attached to a warm pool).

The probe travels as an ordinary call (`session.call`), a system call: it builds the very rank
group the user's call then reuses (same backend, same forks), so a healthy "basic" costs one
round trip and a small all-reduce. Its ranks' outcomes go to a `ProbeObserver`, never to the
call's observer: no rank runs are recorded for it, and no user-visible attempt is spent. What it
found is said as events; an unhealthy node is dropped (elastic) or replaced before user code
runs, and a pool that cannot be made healthy is a PoolStartError naming each node and figure.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from typing import Any, Callable

from skytasks.controller.outcome import CallOutcome, RankState
from skytasks.controller.packing import pack_call
from skytasks.controller.rank_group import CallObserver, GroupSpec, RankGroup, RankOutcome
from skytasks.controller.session import PoolSession
from skytasks.errors import PoolStartError
from skytasks.events import Event
from skytasks.pool_spec import PoolSpec
from skytasks.providers import capabilities_of
from skytasks.preflight.probe import probe
from skytasks.preflight.report import NodeUnhealthy, PoolHealthy, PreflightTable
from skytasks.preflight.rules import (DropNodes, FailStart, NodeFigures, RankFigures, Rules, Verdict, fold, judge,
                                      one_figure_per_link, plan, spread)

# Which of a session's node channels passed (their serials): a replaced or added node is a new
# channel, a warm pool attached in another process a new session, so both are checked again.
_PASSED: weakref.WeakKeyDictionary[PoolSession, set[int]] = weakref.WeakKeyDictionary()


def rules_of(spec: PoolSpec, level: str | None = None) -> Rules:
    return Rules(level or spec.preflight, spec.accelerator, spec.accelerators_per_node, spec.preflight_min_ratio,
                 spec.preflight_min_tflops, spec.preflight_min_gbps, spec.preflight_timeout_seconds)


def due(session: Any, spec: PoolSpec) -> bool:
    """Whether this session has nodes no preflight has passed yet."""
    if spec.preflight == "off" or not isinstance(session, PoolSession):
        return False
    passed = _PASSED.get(session, set())
    return any(n.serial not in passed for n in session.nodes)


def node_health_check(session: Any, spec: PoolSpec, group_spec: GroupSpec, observer: CallObserver, *,
                      replacements: int) -> None:
    """The pool's preflight as the runner runs it before each attempt (a `HealthCheck`, handed in
    by `skytasks/wiring.py`): only where the session has nodes no preflight has passed yet."""
    if due(session, spec):
        ensure_healthy(session, spec, group_spec, observer, replacements=replacements)


def ensure_healthy(session: PoolSession, spec: PoolSpec, group_spec: GroupSpec, observer: CallObserver, *,
                   replacements: int, level: str | None = None) -> Verdict:
    """Check every node at once until all pass: unhealthy ones dropped or replaced in between
    (at most `replacements` replaced), never charged to retries or node_recoveries. The last
    verdict; PoolStartError when the pool cannot be made healthy."""
    rules = rules_of(spec, level)
    started = time.monotonic()
    # The ranks of the group the probe builds try the head first (skytasks.node.head_reach), for
    # half the preflight's time: a node that cannot reach it fails, named, inside the probe's clock.
    session.env["SKYTASKS_PREFLIGHT"] = f"{rules.timeout_seconds / 2:g}"
    rows: list[dict[str, Any]] = []  # every round's, in one table: what this start found
    round_ = 0
    while True:
        round_ += 1
        verdict = measure(session, rules, group_spec, observer)
        rows += [{"round": round_, **row} for row in verdict.rows()]
        if verdict.nodes and not any(n.answered for n in verdict.nodes):
            # Nothing to tell the nodes apart by (the call's own setup failed on all of them, say):
            # the user's call runs as it would without a preflight, and says why in its own words.
            observer.on_event(PreflightTable(rules.level, tuple(rows)))
            return verdict
        if verdict.healthy:
            _PASSED[session] = {n.serial for n in session.nodes}
            observer.on_event(PreflightTable(rules.level, tuple(rows)))
            observer.on_event(PoolHealthy(len(session.nodes), time.monotonic() - started, rules.level,
                                          spread(verdict.nodes)))
            return verdict
        for f in verdict.findings:
            observer.on_event(NodeUnhealthy(f.node, f.address, f.check, f.figure, f.threshold, f.unit, f.detail))
        action = plan(verdict, nodes=len(session.nodes), fewest=session.counts[0],
                      replaces_elsewhere=capabilities_of(session.provider).replaces_elsewhere,
                      replacements_left=replacements)
        if isinstance(action, FailStart):
            observer.on_event(PreflightTable(rules.level, tuple(rows)))
            raise PoolStartError(action.reason)
        if not isinstance(action, DropNodes):
            replacements -= len(action.nodes)
        why = {f.node: f.text() for f in reversed(verdict.findings)}
        avoid = getattr(session.provider, "avoid", None)  # kubernetes: later pods keep off its machine
        for node in list(session.nodes):
            if node.link.node_rank in action.nodes:
                if avoid is not None:
                    avoid(node.link.node_id)
                node.said = True  # said as NodeUnhealthy, not again as a lost node
                node.end()  # a leased agent would wait out its lease for a holder coming back: it ends now
                node.mark_lost(f"failed the preflight: {why[node.link.node_rank]}")
        # The pool's own membership policy carries it out: an elastic pool drops what it can
        # spare (PoolShrank), the rest is replaced (NodeReplaced); then every node again.
        session.prepare(observer, first_attempt=False)


def measure(session: PoolSession, rules: Rules, group_spec: GroupSpec, observer: CallObserver) -> Verdict:
    """Run the probe on every rank at once, and judge what came back."""
    gpu = bool(rules.accelerator or rules.accelerators_per_node)
    payload = pack_call(probe, (rules.level, gpu), {})
    watch = ProbeObserver(observer, lambda: session.group)
    nodes = {n.link.node_rank: n for n in session.nodes}
    outcome = session.call(payload, group_spec, attempt=0, deadline=time.monotonic() + rules.timeout_seconds,
                           observer=watch, label="preflight", hang_timeout=rules.timeout_seconds)
    figures = node_figures(outcome, watch, {r: n.link.address for r, n in nodes.items()},
                           {r: len(n.gpus) for r, n in nodes.items()}, rules.timeout_seconds)
    return judge(figures, rules)


def node_figures(outcome: CallOutcome, watch: ProbeObserver, addresses: dict[int, str], gpus: dict[int, int],
                 timeout: float) -> list[NodeFigures]:
    """Each node's figures; a node whose ranks failed or never answered, with why. When a rank
    raised, its node is named (the others were only stopped because of it); when the call ran out
    of time, the nodes whose ranks never joined the process group, else those still running."""
    if outcome.ok:
        by_node: dict[int, list[RankFigures]] = defaultdict(list)
        for ranks in one_figure_per_link([RankFigures.from_probe(value) for value in outcome.values or []]):
            by_node[ranks.node_rank].append(ranks)
        found = []
        for node, address in sorted(addresses.items()):
            folded = fold(node, address, by_node.get(node, []))
            found.append(folded if gpus.get(node, 0) <= folded.gpus else
                         NodeFigures(**{**folded.__dict__, "gpus": gpus[node]}))
        return found
    failures = sorted((o for o in watch.outcomes.values() if o.status is RankState.FAILED and o.failure),
                      key=lambda o: o.failure.at if o.failure else 0.0)
    # The first to fail is the cause; its peers may fail after it only because it left.
    failed = {o.node_rank: o for o in failures[:1]}
    group = watch.group
    if not failed and group is not None:
        never = {group.placement[r][0] for r in group.placement if r not in group.ready}
        still = {o.node_rank for o in watch.outcomes.values() if o.status is not RankState.COMPLETED}
        blamed = never or still or set(addresses)
        why = (f"its ranks did not join the process group within {timeout:g}s" if never else
               f"its ranks did not finish the all-reduce within {timeout:g}s")
        return [NodeFigures(n, a, answered=n not in blamed, problem=why if n in blamed else "")
                for n, a in sorted(addresses.items())]
    if not failed:
        error = outcome.error
        return [NodeFigures(n, a, answered=False, problem=f"{type(error).__name__}: {error}")
                for n, a in sorted(addresses.items())]
    return [NodeFigures(n, a, answered=n not in failed, problem=_failure_text(failed[n]) if n in failed else "")
            for n, a in sorted(addresses.items())]


def _failure_text(outcome: RankOutcome) -> str:
    assert outcome.failure is not None
    exc = outcome.failure.exception
    return f"rank {outcome.rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


class ProbeObserver:
    """The probe's observer: keeps each rank's outcome, passes events on (a backend's choice is the
    user's news), and records nothing else: no rank runs, no output, no metrics."""

    def __init__(self, observer: CallObserver, group: Callable[[], RankGroup | None]):
        self._observer, self._group = observer, group
        self.outcomes: dict[int, RankOutcome] = {}
        self.group: RankGroup | None = None  # the group the probe ran on, seen while it ran
        self.stacks: dict[int, str] = {}

    def on_output(self, rank: int, stream: str, line: str) -> None:
        pass

    def on_log(self, rank: int, level: int, line: str) -> None:
        pass

    def on_rank_done(self, rank: int, outcome: RankOutcome) -> None:
        self.group = self.group or self._group()
        self.outcomes[rank] = outcome

    def on_report(self, rank: int, metrics: dict[str, Any]) -> None:
        pass

    def on_event(self, event: Event) -> None:
        self._observer.on_event(event)

    def on_stacks(self, stacks: dict[int, str], why: str) -> None:
        self.stacks.update(stacks)

    def on_resources(self, rank: int, figures: dict[str, float]) -> None:
        pass
