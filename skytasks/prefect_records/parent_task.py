"""Inside a flow, a distributed call is a Prefect task run: called, submitted, or awaited.

The parent task run is an ordinary Prefect `Task`, so the flow treats it as one: `.submit()`
gives a `PrefectFuture`, futures and `wait_for=` are resolved by Prefect before the call starts,
and the per-rank list is its persisted result. Its body packs the (resolved) arguments and hands
the call to the runner with a `PrefectObserver`.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from typing import Any, Callable

from prefect import Task, tags
from prefect.cache_policies import CachePolicy
from prefect.futures import PrefectFuture

from skytasks.prefect_records.prefect_internals import ENGINE_LOGGERS
from skytasks.prefect_records.record_queue import HeldObserver
from skytasks.controller.packing import pack_call
from skytasks.prefect_records.observer import PrefectObserver
from skytasks.controller.runner import PreparedCall, run_call
from skytasks.errors import DistributedTaskError


class _ThisTaskRunOnly(CachePolicy):
    """A key unique to one task run: the parent's result is written to storage (NO_CACHE would
    leave it unwritten) and no other call, even an identical one in the same flow run, can be
    served from it. Prefect's RUN_ID is keyed on the flow run, so it would do exactly that."""

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any) -> str | None:
        return f"skytasks-call-{task_ctx.task_run.id}" if task_ctx else None


class _OneLineGroups(logging.Filter):
    """Prefect's task engine and its flow engine each log a failed task's exception, and Python
    prints it again when it reaches the top: for an exception group of rank tracebacks that is
    hundreds of lines. Each failing rank's traceback is already in that rank's own task run log,
    so Prefect's two engine logs get one line per root cause; the group itself is printed in full
    once, by whoever finally handles it."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, DistributedTaskError):
            causes = "; ".join(f"rank {getattr(e, 'skytasks_rank', '?')}: {type(e).__name__}: {str(e)[:300]}"
                               for e in exc.exceptions)
            # A script's exit code has no traceback: the rank's run holds its log either way.
            record.msg = f"{record.getMessage()} | root cause {causes} (see that rank's task run for its log)"
            record.args, record.exc_info, record.exc_text = (), None, None
        return True


for _name in ENGINE_LOGGERS:
    logging.getLogger(_name).addFilter(_OneLineGroups())


def _distributed_call(args: tuple, kwargs: dict, call: PreparedCall) -> list[Any]:
    payload = pack_call(call.fn, args, kwargs)
    return run_call(call.runtime, payload, call.options, _observer(call))


def _started_call(held: HeldObserver, result: Future, call: PreparedCall) -> list[Any]:
    """The body of the parent task run of a call that began before its flow run did (`skytasks
    run`): it tells the record everything the call says, from its start to its end, and then
    returns (or raises) what the call did."""
    held.feed(_observer(call))
    return result.result()


def record_started_call(call: PreparedCall, held: HeldObserver, result: Future) -> list[Any]:
    """Inside a flow: the parent task run of a call already under way elsewhere."""
    with tags(*call.tags):
        return parent_task(call.options.label, body=_started_call)(held, result, call)  # type: ignore[return-value]


def parent_task(label: str, body: Callable[..., list[Any]] = _distributed_call) -> Task:
    """The Prefect task a distributed task is in flows (made once per distributed task)."""
    return Task(
        # No tags of our own: a tagged task run acquires tag concurrency slots through the API
        # before it starts (Prefect's rule for every tagged task), which cost up to 2 s here on a
        # busy SQLite server. The user's `tags=` do go on it, with that cost, so a tag
        # concurrency limit holds for distributed calls as for any task.
        body, name=label, task_run_name=label,
        cache_policy=_ThisTaskRunOnly(), persist_result=True,
        result_serializer="pickle",  # Prefect's pickle serializer is cloudpickle
        retries=0,  # attempts are the runner's: a retry restarts the whole rank group
    )


def call_in_flow(task: Task, call: PreparedCall, args: tuple, kwargs: dict) -> list[Any]:
    with tags(*call.tags):
        return task(args, kwargs, call)  # type: ignore[return-value]  # a sync task: its value, not a coroutine


def submit_in_flow(task: Task, call: PreparedCall, args: tuple, kwargs: dict, wait_for: Any = None) -> PrefectFuture:
    with tags(*call.tags):
        return task.submit(args, kwargs, call, wait_for=wait_for)


async def call_in_async_flow(task: Task, call: PreparedCall, args: tuple, kwargs: dict) -> list[Any]:
    """In an async flow: the call runs in a thread (with this context), the event loop runs on."""
    return await asyncio.to_thread(call_in_flow, task, call, args, kwargs)


def _observer(call: PreparedCall) -> PrefectObserver:
    """The call's Prefect observer, inside its parent task run."""
    return PrefectObserver(call.options.label, call.runtime.spec.name, call.rank_tags,
                           rank_runs=call.options.rank_runs, procs_per_node=call.runtime.spec.procs_per_node)
