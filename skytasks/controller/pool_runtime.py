"""What a pool is while it is in use: its session, nesting, SIGTERM handling, and which pool a
call without `pool=` gets. The `GPUPool` block is configuration; this is its runtime, built
from the block's frozen `PoolSpec`, and owned by skytasks, not by the block's fields.
"""

from __future__ import annotations

import asyncio
import contextvars
import signal
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

from skytasks.controller.pool_relay import PoolRelay
from skytasks.controller.session import PoolSession
from skytasks.controller.warm import WarmPool, WarmStore, who_am_i
from skytasks.errors import PoolConfigError
from skytasks.events import PoolDown, PoolUp
from skytasks.pool_spec import PoolSpec
from skytasks.providers import NodeProvider, PreloadsImports
from skytasks.providers.registry import provider_for
from skytasks.event_bus import PoolReporter

if TYPE_CHECKING:
    from skytasks.controller.runner import HealthCheck

# The pools entered with `with pool:` in this context, innermost last. A contextvar follows async
# tasks, Prefect's task threads and `asyncio.to_thread` (they copy the context); a thread started
# without a copy has no default pool, rather than whichever pool another thread entered last.
_ACTIVE: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar("skytasks_active_pools", default=())


def active_pool() -> Any:
    """The innermost pool of `with pool:` in this context (a GPUPool), or None."""
    stack = _ACTIVE.get()
    return stack[-1] if stack else None


class TerminationRequested(SystemExit):
    """SIGTERM arrived while a pool was up: unwind so teardown runs, then exit 143."""


class PoolRuntime:
    """`warm_store`: what makes the store of warm pools' records, handed in by the composition
    root (skytasks.wiring: Prefect's secrets); called at the first warm use."""

    def __init__(self, spec: PoolSpec, owner: Any, warm_store: Callable[[], WarmStore] | None = None,
                 health_check: HealthCheck | None = None):
        self.spec = spec
        self.owner = owner  # the block, for `active_pool()`
        self.health_check = health_check  # the preflight (controller.runner.HealthCheck), from the root
        self._session: PoolSession | None = None
        self._depth = 0
        self._lock = threading.Lock()  # the depth and the session
        self._call_lock = threading.Lock()  # one call at a time on one pool, warm or not
        self._tokens: list[contextvars.Token] = []
        self._previous_sigterm: Any = None
        # A warm pool (keep_warm_minutes): which process holds its nodes is in their agents, and
        # where they are in its record (`warm_store`, made when first needed).
        self._make_warm_store = warm_store
        self.warm_store: WarmStore | None = None
        self._warm: dict[int, tuple[WarmPool, int]] = {}  # id(session) -> its warm pool, calls before it
        self._calls = 0  # calls run on this pool by this process

    @property
    def is_up(self) -> bool:
        return self._session is not None

    @property
    def session(self) -> PoolSession | None:
        """The session of `with pool:`, while it is up."""
        return self._session

    # -- sessions --------------------------------------------------------------------------

    def start_session(self, starting: dict | None = None, preload: tuple[str, ...] = ()) -> PoolSession:
        """`preload`: what the ranks of the call it starts for will import ("torch"), where known."""

        def make_provider() -> NodeProvider:
            provider = provider_for(self.spec)
            if preload and isinstance(provider, PreloadsImports):
                provider.preload(preload)
            if starting is not None:  # lets a cancelled `async with` abort a launch in progress
                starting["provider"] = provider
            return provider

        if self.spec.keep_warm_minutes > 0:
            warm = self.warm_pool(make_provider)
            session = warm.open()
            self._warm[id(session)] = (warm, self._calls)
            if warm.attached:
                return session
        else:
            session = self._new_session(make_provider(), None).start()
        PoolReporter(self.spec.name, self.spec.provider).event(PoolUp(
            self.spec.provider, len(session.nodes), self.spec.node_count, self.spec.procs_per_node,
            tuple(n.link.address for n in session.nodes)))
        return session

    def warm_pool(self, make_provider: Callable[[], NodeProvider] | None = None) -> WarmPool:
        """This saved pool as a warm pool (`skytasks pools`, and its sessions when keep_warm_minutes
        is set); PoolConfigError for a pool that was never saved."""
        if self.warm_store is None:
            if self._make_warm_store is None:
                raise PoolConfigError("keep_warm_minutes: this pool's runtime was given no store for warm pools' "
                                      "records (build it with skytasks.wiring.pool_runtime)")
            self.warm_store = self._make_warm_store()
        return WarmPool(self.spec, getattr(self.owner, "saved_name", None), self.warm_store,
                        make_provider or (lambda: provider_for(self.spec)), self._new_session)

    def _new_session(self, provider: NodeProvider, relay: PoolRelay | None) -> PoolSession:
        session = PoolSession(provider, self.spec.procs_per_node, dict(self.spec.env),
                              nodes=(self.spec.fewest, self.spec.nodes), reattach_seconds=self.spec.reattach_seconds,
                              keep_warm_seconds=self.spec.keep_warm_minutes * 60, relay=relay)
        if self.spec.keep_warm_minutes > 0:
            session.who = who_am_i()
        return session

    def close_session(self, session: PoolSession) -> None:
        warm, calls_before = self._warm.pop(id(session), (None, 0))
        if warm is not None:  # the nodes stay up for the next process; a lost pool is left to its new holder
            warm.release(session, self._calls - calls_before)
            return
        try:
            session.close()
        finally:
            PoolReporter(self.spec.name, self.spec.provider).event(PoolDown(self.spec.provider))

    @contextmanager
    def calls(self, preload: tuple[str, ...] = ()) -> Iterator[CallSessions]:
        """For one call: the pool's own session if it is up, else one started on first use and
        torn down at the end (`preload`: what that call's ranks import). Calls on one pool take
        turns (they cannot share a process group)."""
        with self._call_lock:
            sessions = CallSessions(self, preload)
            try:
                yield sessions
            finally:
                self._calls += 1  # counted before a call-scoped warm session is released
                sessions.close()

    # -- with pool: ------------------------------------------------------------------------

    def enter(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._session = self.start_session()
                self.trap_sigterm()
            self._depth += 1
        self._push_active()

    def exit(self) -> None:
        session = self._leave()
        if session is not None:
            try:
                self.close_session(session)
            finally:
                self.restore_sigterm()

    async def aenter(self) -> None:
        with self._lock:
            first = self._depth == 0
            self._depth += 1
        if first:
            starting: dict = {}
            future = asyncio.get_running_loop().run_in_executor(None, self.start_session, starting)
            try:
                self._session = await asyncio.shield(future)
            except BaseException:
                with self._lock:
                    self._depth -= 1
                # The start goes on in its thread: cut a launch short where the provider can,
                # and take down whatever still comes up.
                if starting.get("provider") is not None:
                    starting["provider"].abort()
                future.add_done_callback(self._close_late_session)
                raise
        self._push_active()

    def _push_active(self) -> None:
        self._tokens.append(_ACTIVE.set(_ACTIVE.get() + (self.owner,)))

    async def aexit(self) -> None:
        session = self._leave()
        if session is not None:
            # shield: teardown finishes even when the awaiting task is being cancelled.
            await asyncio.shield(asyncio.to_thread(self.close_session, session))

    def _leave(self) -> PoolSession | None:
        """Leave one level of `with`; the session to close when it was the last one."""
        try:
            _ACTIVE.reset(self._tokens.pop())
        except ValueError:  # left from another context than it was entered in
            pass
        with self._lock:
            self._depth -= 1
            if self._depth > 0:
                return None
            session, self._session = self._session, None
            return session

    def _close_late_session(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            threading.Thread(target=self.close_session, args=(future.result(),), name="skytasks-late-close").start()

    def trap_sigterm(self) -> None:
        # Python's default SIGTERM ends the process without unwinding, which would skip
        # teardown; turn it into an exception while the pool is up (main thread only).
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return

        def on_sigterm(signum: int, frame: Any) -> None:
            raise TerminationRequested(143)

        self._previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)

    def restore_sigterm(self) -> None:
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None


class CallSessions:
    """The session one call runs on. A call-scoped one starts on first use, inside the runner's
    attempt loop (a pool that fails to start is retried like a failed attempt)."""

    def __init__(self, runtime: PoolRuntime, preload: tuple[str, ...] = ()):
        self._runtime, self._preload = runtime, preload
        self._own: PoolSession | None = None
        self._trapped = False

    def get(self) -> PoolSession:
        warm = self._runtime._session
        if warm is not None:
            return warm
        if self._own is None:
            # A pool brought up for one call owns launched machines too: SIGTERM must unwind
            # through the teardown here exactly as it does for `with pool:`.
            if not self._trapped:
                self._runtime.trap_sigterm()
                self._trapped = True
            self._own = self._runtime.start_session(preload=self._preload)
        return self._own

    def close(self) -> None:
        try:
            if self._own is not None:
                self._runtime.close_session(self._own)
        finally:
            if self._trapped:
                self._runtime.restore_sigterm()

