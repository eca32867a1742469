"""Ids, task runs and states for many runs at once, without what Prefect's constructors cost each.

At 1,024 ranks a call in a flow records 128 node runs, each an id, a `TaskRun`, a Running state and
a final state. Prefect's constructors validate each new model (about 140 µs for a `TaskRun`), a
state's asks OpenTelemetry for the context's traceparent, its `model_copy` inspects a default
factory's signature, and its uuid7 takes `os.urandom`, which releases the GIL: in a controller
whose reader and Prefect's event and log workers are busy with the same call, the call's thread
may then wait a switch interval (5 ms) to get it back, for each of hundreds of `os.urandom`
calls per warm call.

So each kind is made once per attempt by Prefect's own constructor, in the call's context (its
traceparent, its defaults), and each run's is a copy of it (pydantic's `model_copy`: no
validation) with its own id, name, time and run ids. Copies share the template's nested parts
(the retry policy, the parent link), which nothing changes after. Times are the standard
library's aware UTC datetimes; they serialise as Prefect's own do. Ids are version-7 UUIDs, as
Prefect's are, from a generator seeded once from the system and again in a forked child.
"""

from __future__ import annotations

import os
import random
import time
from datetime import datetime, timezone
from typing import Any, Callable
from uuid import UUID

from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from skytasks.prefect_records.prefect_internals import copy_state, copy_task_run, task_run_template
from skytasks.prefect_records.record_queue import RECORDED_AT

_random = random.Random()  # seeded from os.urandom; a forked child must not repeat its parent's ids
os.register_at_fork(after_in_child=_random.seed)
_RAND_B = (1 << 62) - 1


def new_id() -> UUID:
    """A version-7 UUID (RFC 9562): 48 bits of Unix milliseconds, then 74 random bits around
    the version and variant bits. Time-ordered like Prefect's own run and state ids."""
    ms = time.time_ns() // 1_000_000
    r = _random.getrandbits(74)
    return UUID(int=(ms << 80) | (0x7 << 76) | ((r >> 62) << 64) | (0b10 << 62) | (r & _RAND_B))


class RecordCopies:
    """The task runs and states of one attempt's runs: each kind made once, then copied per run."""

    def __init__(self, flow_run_id: Any, parent_id: Any, task_key: str) -> None:
        self.flow_run_id = flow_run_id
        self._states: dict[tuple[Callable[..., State], str | None], State] = {}
        self._run = task_run_template(new_id(), flow_run_id, parent_id, task_key)

    def state(self, kind: Callable[..., State], task_run_id: Any, *, name: str | None = None,
              message: str | None = None) -> State:
        """A state made by `kind` (Prefect's `Completed`, ...), of the run `task_run_id`: now, or
        when its news happened if it is handed over late (`RECORDED_AT`)."""
        template = self._states.get((kind, name))
        if template is None:
            template = self._states[(kind, name)] = kind(name=name) if name else kind()
        at = RECORDED_AT.get()
        stamp = datetime.fromtimestamp(time.time() if at is None else at, tz=timezone.utc)
        return copy_state(template, state_id=new_id(), timestamp=stamp, task_run_id=task_run_id,
                          flow_run_id=self.flow_run_id, message=message)

    def task_run(self, run_id: Any, name: str, dynamic_key: str, tags: list[str], state: State) -> TaskRun:
        """A run of this attempt's flow run and parent, started in `state`."""
        return copy_task_run(self._run, run_id=run_id, name=name, dynamic_key=dynamic_key, tags=tags, state=state)
