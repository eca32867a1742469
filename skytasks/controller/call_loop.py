"""Running one call to its end: the session's event queue fed to the call's state machine.

`CallRun` has no queue or clock of its own (so its tests drive it by hand); this loop gives it
both: each message as it arrives, `tick(now)` when its next clock is due, and now and then a
word on the output lines the backlog dropped (`LinesDropped`).
"""

from __future__ import annotations

import queue
import time
from typing import Any

from skytasks.controller.backlog import NodeEvents
from skytasks.controller.call_run import CallRun
from skytasks.controller.outcome import CallOutcome
from skytasks.events import LinesDropped

DROPPED_NOTE_SECONDS = 2.0  # how often lines dropped for the backlog are said, at most


def drive(call: CallRun, events: NodeEvents, payload: Any) -> CallOutcome:
    """Run a call to its end on the session's event queue; how it ended (interrupts raise)."""
    said_dropped = time.monotonic()
    try:
        call.start(payload)
        while not call.done:
            if time.monotonic() - said_dropped >= DROPPED_NOTE_SECONDS:
                said_dropped = time.monotonic()
                _say_dropped(call, events)
            now = time.monotonic()
            wake = call.wake_at()
            try:
                node_rank, msg = events.get(timeout=None if wake is None else max(0.0, wake - now))
            except queue.Empty:
                call.tick(time.monotonic())
                continue
            call.handle(node_rank, msg, time.monotonic())
            if (wake := call.wake_at()) is not None and time.monotonic() >= wake:
                call.tick(time.monotonic())  # a busy stream must not starve the clocks
    except BaseException:
        call.interrupt(time.monotonic())
        raise
    finally:
        _say_dropped(call, events)
    return call.outcome()


def _say_dropped(call: CallRun, events: NodeEvents) -> None:
    dropped = events.take_dropped()
    if dropped:
        call.observer.on_event(LinesDropped(dropped, events.limit))
