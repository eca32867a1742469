"""The runner: one distributed call from payload to result, owning its attempts and retries.

It tells one observer everything that happens (attempt start and end, every rank's output,
logs, reports and outcome, notices, stacks, the call's end). The console and Prefect are two
such observers; neither wraps the call nor is called back into by it.
"""

from __future__ import annotations

import contextvars
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol

from skytasks.call_options import CallOptions
from skytasks.controller.packing import PackedCall
from skytasks.controller.outcome import CallOutcome, EndReason, FailurePolicy, RankState, Spent
from skytasks.controller.rank_group import CallObserver, GroupSpec, RankOutcome
from skytasks.devices import check_backend_before_launch
from skytasks.errors import PoolStartError
from skytasks.pool_spec import PoolSpec
from skytasks.events import AttemptRestarted
from skytasks.providers.registry import provider_class
from skytasks.settings import settings
from skytasks.workdir import WorkdirRequest, read_workdir

# Set by `skytasks run --resources`: each rank's latest CPU, memory and GPU figures on the console.
SHOW_RESOURCES: contextvars.ContextVar[bool] = contextvars.ContextVar("skytasks_show_resources", default=False)


# -- the seam between the runner and the pool: what an attempt needs of it ---------------------


class Session(Protocol):
    """The pool's nodes for one attempt (`PoolSession`): membership mended before it, then the
    call run on a rank group to its outcome."""

    @property
    def world_size(self) -> int: ...

    def prepare(self, observer: CallObserver, *, first_attempt: bool) -> None: ...

    def call(self, payload: PackedCall, spec: GroupSpec, *, attempt: int, deadline: float | None,
             observer: CallObserver, label: str, hang_timeout: float | None = None) -> CallOutcome: ...


class Sessions(Protocol):
    """A call's way to its session (`CallSessions`): the pool's own, or one it starts."""

    def get(self) -> Session: ...


class HealthCheck(Protocol):
    """The pool's node health check before user code (`skytasks.preflight`, handed in by the
    composition root, `skytasks/wiring.py`: it runs calls through this controller, so the controller
    never imports it). Returns once every node of the session passed; PoolStartError when the pool
    cannot be made healthy (at most `replacements` nodes replaced)."""

    def __call__(self, session: Any, spec: PoolSpec, group_spec: GroupSpec, observer: CallObserver, *,
                 replacements: int) -> None: ...


class Runtime(Protocol):
    """A pool as the runner sees it (`PoolRuntime`): its spec, its health check (None: none is
    run), and sessions for one call."""

    spec: PoolSpec
    health_check: HealthCheck | None

    def calls(self, preload: tuple[str, ...] = ()) -> ContextManager[Sessions]: ...


class PreparedCall:
    """What a call needs besides its arguments. A plain object: Prefect's input resolution
    treats it as one opaque value, and never walks into it."""

    def __init__(self, fn: Callable, runtime: Runtime, options: CallOptions):
        self.fn, self.runtime, self.options = fn, runtime, options

    @property
    def tags(self) -> tuple[str, ...]:
        """The user's tags: on the parent task run (as any tagged Prefect task) and every rank run."""
        return self.options.tags

    @property
    def rank_tags(self) -> tuple[str, ...]:
        """Every rank run's tags: `skytasks`, `rank:R` (added per rank), the pool's, the user's."""
        return ("skytasks", f"pool:{self.runtime.spec.name}", *self.options.tags)


class RunObserver(CallObserver, Protocol):
    """A call observer that also hears the runner's own steps."""

    def on_attempt_start(self, attempt: int, world_size: int) -> None: ...
    def on_attempt_end(self, attempt: int, error: BaseException | None) -> None: ...
    def on_call_end(self, error: BaseException | None) -> None: ...


def run_call(runtime: Runtime, payload: PackedCall, options: CallOptions, observer: RunObserver) -> list[Any]:
    """Run the call on every rank of `runtime`'s pool (a `PoolRuntime`), restarting the whole
    group on failure up to `retries` times. Starting a call-scoped pool happens inside the
    attempt, so a pool that fails to start is retried like a failed attempt.

    As for a Prefect task: `timeout_seconds` bounds each attempt, and every failure of the code
    (a rank raising or dying, a hang, the init timeout, the attempt's deadline, a pool that did not
    start) is retried while retries are left. A node lost or preempted restarts the attempt from
    `node_recoveries` instead. Interrupts never are retried."""
    spec = runtime.spec
    world = spec.nodes * spec.procs_per_node  # what it asks for, until a session says what it has
    provider = provider_class(spec.provider)  # what it can do, never its name, decides
    check_backend_before_launch(options.backend, on_this_machine=provider.runs_on_this_machine,
                                gpus_from_config=provider.gpus_from_config, nodes=spec.nodes,
                                procs_per_node=spec.procs_per_node, accelerators_per_node=spec.accelerators_per_node)
    workdir = None
    if options.workdir is not None:
        # Read (and held to the size limit) before any node is up, when it has to travel.
        root = Path(options.workdir)
        workdir = WorkdirRequest(root, None if provider.runs_on_this_machine else read_workdir(root))
    group_spec = GroupSpec(options.backend, options.init_torch, settings().init_timeout_seconds, workdir,
                           options.runs_script)
    policy = FailurePolicy(options.retries, options.node_recoveries)
    spent = Spent()
    error: BaseException | None = None
    try:
        # A pool started for this call alone knows what its ranks import: its nodes may have it ready.
        with runtime.calls(preload=_preload(options)) as sessions:
            attempt = 0
            while True:
                attempt += 1
                started = False
                try:
                    # Timed from here: the attempt's deadline covers starting a call-scoped pool.
                    deadline = None if options.timeout_seconds is None else time.monotonic() + options.timeout_seconds
                    ready = _nodes(sessions, observer, attempt)
                    if not isinstance(ready, CallOutcome):  # new nodes pass the preflight before user code
                        ready = _healthy(runtime.health_check, ready, spec, group_spec, options, observer)
                    if not isinstance(ready, CallOutcome):
                        world = ready.world_size  # an elastic pool runs on what it has
                    observer.on_attempt_start(attempt, world)
                    started = True
                    outcome = ready if isinstance(ready, CallOutcome) else _attempt(
                        ready, payload, group_spec, options, observer, attempt, deadline)
                except BaseException as interrupted:  # Ctrl-C, SIGTERM, cancellation: never retried
                    if not started:
                        observer.on_attempt_start(attempt, world)
                    observer.on_attempt_end(attempt, interrupted)
                    raise
                observer.on_attempt_end(attempt, outcome.error)
                decision = policy.decide(outcome, spent)
                if not decision.retry:
                    if outcome.reason is EndReason.PREEMPTED and outcome.error is not None:
                        outcome.error.add_note(
                            f"[skytasks] the attempt ended for a preemption and no node recoveries are left "
                            f"(node_recoveries={options.node_recoveries}): call it again, and "
                            f"Checkpointer.load_latest() resumes from the checkpoint the head saved")
                    return outcome.unwrap()
                # A collective cannot survive a partial restart: the next attempt is a fresh group.
                spent = decision.spent(spent)
                observer.on_event(AttemptRestarted(
                    task=options.label, attempt=attempt, reason=str(outcome.reason), cause=repr(outcome.cause),
                    charged=decision.charged or "retries", retries_left=options.retries - spent.retries,
                    node_recoveries_left=options.node_recoveries - spent.node_recoveries,
                    delay=options.retry_delay_seconds))
                time.sleep(options.retry_delay_seconds)
    except BaseException as err:
        error = err
        raise
    finally:
        observer.on_call_end(error)


def _preload(options: CallOptions) -> tuple[str, ...]:
    """What a pool started for this call alone has its nodes import before any rank: torch for
    ranks that make a torch group, and for a torchrun script's ranks with torchrun's threads."""
    if options.runs_script:
        return ("torch", "torchrun")
    return ("torch",) if options.init_torch else ()


def _nodes(sessions: Sessions, observer: RunObserver, attempt: int) -> Session | CallOutcome:
    """The session this attempt runs on, its lost or going nodes dealt with (and, on a call's
    first attempt, an elastic pool grown back); or the attempt's outcome already, when the pool
    or a node's replacement did not come up."""
    try:
        session = sessions.get()
        session.prepare(observer, first_attempt=attempt == 1)
        return session
    except PoolStartError as exc:
        return CallOutcome(EndReason.POOL_START, error=exc)


def _healthy(check: HealthCheck | None, session: Session, spec: PoolSpec, group_spec: GroupSpec,
             options: CallOptions, observer: RunObserver) -> Session | CallOutcome:
    """The session once every node passed the pool's preflight (skytasks.preflight): unhealthy
    ones dropped or replaced, from neither retries nor node_recoveries; or the attempt's outcome,
    when the pool cannot be made healthy."""
    if spec.preflight == "off" or check is None:
        return session
    try:
        check(session, spec, group_spec, observer, replacements=options.node_recoveries)
    except PoolStartError as exc:
        return CallOutcome(EndReason.POOL_START, error=exc)
    return session


def _attempt(session: Session, payload: PackedCall, group_spec: GroupSpec, options: CallOptions,
             observer: RunObserver, attempt: int, deadline: float | None) -> CallOutcome:
    """One attempt on the session's nodes, to the ranks' end."""
    try:
        return session.call(payload, group_spec, attempt=attempt, deadline=deadline, observer=observer,
                            label=options.label, hang_timeout=options.hang_timeout_seconds)
    except PoolStartError as exc:  # a node lost in between, whose replacement did not come up
        return CallOutcome(EndReason.POOL_START, error=exc)


def outcome_summary(outcome: RankOutcome) -> str:
    if outcome.status is RankState.FAILED and outcome.failure is not None:
        text = f"{type(outcome.failure.exception).__name__}: {outcome.failure.exception}"
    elif outcome.status is RankState.COMPLETED:
        text = repr(outcome.value)
    else:
        text = outcome.stop_reason
    return text if len(text) <= 100 else text[:97] + "..."
