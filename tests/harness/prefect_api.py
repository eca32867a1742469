"""Reading a flow run's task runs back from the API, as a user would in the UI.

Task runs reach the API through events (Prefect's own runs and skytasks' rank runs alike): the
server's recorder writes them a moment after the flow returns. Tests wait for the record to
settle instead of racing it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId


async def _read(flow_run_id):
    async with get_client() as client:
        return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def settled_task_runs(flow_run_id, expect: int, timeout: float = 30.0) -> list:
    """The flow run's task runs once at least `expect` exist and none is still Pending/Running."""
    deadline = time.monotonic() + timeout
    while True:
        runs = asyncio.run(_read(flow_run_id))
        final = [r for r in runs if r.state is not None and r.state.is_final()]
        if (len(runs) >= expect and len(final) == len(runs)) or time.monotonic() > deadline:
            return runs
        time.sleep(0.2)


async def _read_logs(log_filter) -> list:
    async with get_client() as client:
        return await client.read_logs(log_filter=log_filter)


def logs_when(log_filter, ready: Callable[[list], bool], timeout: float = 20.0) -> list:
    """The logs `log_filter` finds, once `ready(logs)` holds (or at the timeout, for the test's own
    assertion to say what was missing): logs reach the API in batches, apart from the runs' states."""
    deadline = time.monotonic() + timeout
    while True:
        logs = asyncio.run(_read_logs(log_filter))
        if ready(logs) or time.monotonic() > deadline:
            return logs
        time.sleep(0.2)
