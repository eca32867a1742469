"""Reading a flow run's task runs back from the API, as a user would in the UI.

Task runs reach the API through events (Prefect's own runs and skytasks' rank runs alike): the
server's recorder writes them a moment after the flow returns. Tests wait for the record to
settle instead of racing it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId


def settled_task_runs(flow_run_id, expect: int, timeout: float = 30.0) -> list:
    """The flow run's task runs once at least `expect` exist and none is still Pending/Running."""
    def settled(runs: list) -> bool:
        final = [r for r in runs if r.state is not None and r.state.is_final()]
        return len(runs) >= expect and len(final) == len(runs)

    flow_runs = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    return _polled(lambda client: client.read_task_runs(flow_run_filter=flow_runs), settled, timeout)


def logs_when(log_filter, ready: Callable[[list], bool], timeout: float = 20.0) -> list:
    """The logs `log_filter` finds, once `ready(logs)` holds (or at the timeout, for the test's own
    assertion to say what was missing): logs reach the API in batches, apart from the runs' states."""
    return _polled(lambda client: client.read_logs(log_filter=log_filter), ready, timeout)


def _polled(read: Callable[[Any], Awaitable[list]], ready: Callable[[list], bool], timeout: float) -> list:
    """`read(client)` every 0.2 s until `ready` holds of what it read, or `timeout` s have passed,
    on one client: a client's TLS context alone costs tens of milliseconds of CPU to make."""
    async def poll() -> list:
        deadline = time.monotonic() + timeout
        async with get_client() as client:
            while True:
                found = await read(client)
                if ready(found) or time.monotonic() > deadline:
                    return found
                await asyncio.sleep(0.2)

    return asyncio.run(poll())
