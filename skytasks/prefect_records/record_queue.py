"""An observer for a call that starts before its record exists.

`skytasks run` starts the ranks at once and creates the Prefect flow run beside them, on another
thread (Prefect may still be importing, or its server starting). What the call says goes to the
console at once, and into a queue for the record: the recording thread, inside the parent task
run, takes every event in order and tells the record (`feed`), each under `RECORDED_AT` (when it
happened). So nothing is dropped, nothing reaches the record out of order, and only the
recording thread, with its run context, ever talks to Prefect.
"""

from __future__ import annotations

import contextvars
import queue
import time
from typing import Any

from skytasks.events import Event

# While an event is handed to the record: the wall time (time.time()) it happened. The record
# stamps its log lines and rank states with it instead of the time of the hand-over.
RECORDED_AT: contextvars.ContextVar[float | None] = contextvars.ContextVar("skytasks_recorded_at", default=None)

_END = "end"  # no more events: the call has ended, or never started


class HeldObserver:
    """Tells `live` everything at once, and holds it for whoever `feed`s a record."""

    def __init__(self, live: Any) -> None:
        self._live = live
        self._events: queue.SimpleQueue[tuple[float, str, tuple]] = queue.SimpleQueue()

    def feed(self, record: Any) -> None:
        """Tell `record` everything, in order, on this thread, until the call has ended."""
        while True:
            at, name, args = self._events.get()
            if name == _END:
                return
            token = RECORDED_AT.set(at)
            try:
                getattr(record, name)(*args)
            finally:
                RECORDED_AT.reset(token)

    def close(self) -> None:
        """The call is over (or could not start): `feed` returns once it has told all before."""
        self._events.put((time.time(), _END, ()))

    def _tell(self, name: str, *args: Any) -> None:
        getattr(self._live, name)(*args)
        self._events.put((time.time(), name, args))

    # -- the runner's observer protocol, each event told as it is ---------------------------

    def on_attempt_start(self, attempt: int, world_size: int) -> None:
        self._tell("on_attempt_start", attempt, world_size)

    def on_attempt_end(self, attempt: int, error: BaseException | None) -> None:
        self._tell("on_attempt_end", attempt, error)

    def on_call_end(self, error: BaseException | None) -> None:
        self._tell("on_call_end", error)

    def on_output(self, rank: int, stream: str, line: str) -> None:
        self._tell("on_output", rank, stream, line)

    def on_log(self, rank: int, level: int, line: str) -> None:
        self._tell("on_log", rank, level, line)

    def on_rank_done(self, rank: int, outcome: Any) -> None:
        self._tell("on_rank_done", rank, outcome)

    def on_report(self, rank: int, metrics: dict[str, Any]) -> None:
        self._tell("on_report", rank, metrics)

    def on_event(self, event: Event) -> None:
        self._tell("on_event", event)

    def on_stacks(self, stacks: dict[int, str], why: str) -> None:
        self._tell("on_stacks", stacks, why)

    def on_resources(self, rank: int, figures: dict[str, float]) -> None:
        self._tell("on_resources", rank, figures)

    def on_pool_event(self, event: Event, pool_name: str) -> None:
        """An event of the call's pool (through `EVENT_HOLDER`), said on the console by its
        reporter already: for the record only."""
        self._events.put((time.time(), "on_pool_event", (event, pool_name)))
