"""The pool event bus: what providers and the controller tell people while nodes come and go.

Providers never print. Each one is given a `PoolReporter` and tells it typed events
(`skytasks.events`): `progress` while nodes come up (an allocation pending with SLURM's reason,
instances booting), `note` for what happened to a node, `teardown_failed` when something it made
cannot be confirmed gone. The reporter writes each to the `skytasks` logger (which prints to
stderr unless the application configured it) and hands it to the sinks it was given: the
composition root (`skytasks.wiring`) adds Prefect's (the flow run's log, a progress artifact,
Prefect events) when it builds a pool's runtime. No Prefect here, and nothing of the providers or
the controller: both of them, and `prefect_records`, stand above this.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import threading
from typing import Callable, Sequence

from skytasks.errors import PoolTeardownError
from skytasks.events import Event, ProviderNote, ProviderProgress, TeardownFailed, announce, level_of

logger = logging.getLogger("skytasks")
_handler_lock = threading.Lock()


def console_logger() -> logging.Logger:
    """The `skytasks` logger, printing to stderr when nobody configured it (a library must not
    force output on an application that did)."""
    with _handler_lock:
        if not logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("skytasks: %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
    return logger


def flow_run_id() -> str | None:
    """The flow run this process is in, if any (tags on what a pool makes). Read from Prefect's
    context only when Prefect is already imported: a provider never imports it."""
    context = sys.modules.get("prefect.context")
    if context is None:
        return None
    try:
        ctx = context.FlowRunContext.get()
        return str(ctx.flow_run.id) if ctx and ctx.flow_run else None
    except Exception:  # noqa: BLE001
        return None


# `skytasks run`: the call starts before its Prefect record exists; the record's holder takes
# every pool event for it (skytasks.prefect_records.record_queue).
EVENT_HOLDER: contextvars.ContextVar[Callable[[Event, str], None] | None] = contextvars.ContextVar(
    "skytasks_event_holder", default=None)
_SINKS: list[Callable[[Event, str], None]] = []


def add_sink(sink: Callable[[Event, str], None]) -> None:
    """Someone else hears every pool's events too (the composition root, `skytasks.wiring`, adds
    the Prefect side: the flow run's log, progress artifacts, Prefect events). Adding one twice
    adds it once."""
    if sink not in _SINKS:
        _SINKS.append(sink)


def publish(event: Event, pool_name: str) -> None:
    holder = EVENT_HOLDER.get()
    if holder is not None:
        holder(event, pool_name)
        return
    for sink in list(_SINKS):
        try:
            sink(event, pool_name)
        except Exception:  # noqa: BLE001 - a display problem never fails the pool
            pass


class PoolReporter:
    """One pool's reporter. `key` names its progress artifact (the pool's own id). Everything
    said is an event (`skytasks.events`): printed through the `skytasks` logger, kept in
    `events` (tests and post-mortems read them), and published to the registered sinks."""

    def __init__(self, pool_name: str, provider: str):
        self.pool_name, self.provider = pool_name, provider
        self.key = pool_name
        self._last: tuple[int, str] | None = None
        self.events: list[Event] = []

    @property
    def lines(self) -> list[str]:
        return [e.text() for e in self.events]

    def event(self, event: Event) -> None:
        self.events.append(event)
        announce(event)
        console_logger().log(level_of(event), event.text())
        publish(event, self.pool_name)

    def progress(self, ready: int, total: int, detail: str) -> None:
        """Nodes coming up: `ready` of `total`, and what the rest are doing. Said on change only."""
        if (ready, detail) == self._last:
            return
        self._last = (ready, detail)
        self.event(ProviderProgress(self.key, self.provider, ready, total, detail))

    def note(self, line: str, level: int = logging.INFO) -> None:
        """A provider's word on its nodes, as a `ProviderNote`."""
        self.event(ProviderNote(self.key, self.provider, line, level))

    def teardown_failed(self, resources: Sequence[str], detail: str) -> PoolTeardownError:
        """Something the pool made may still exist (and cost money): an ERROR naming every
        resource, an event to page on, and the error the pool's exit raises."""
        event = TeardownFailed(self.key, self.provider, self.key, tuple(resources), detail)
        self.event(event)
        return PoolTeardownError(event.text())
