"""Prefect events for automations: skytasks.pool.up / .down, skytasks.rank.failed,
skytasks.call.completed (and .failed), with the pool and rank as related resources.

Emitted only inside a Prefect run, where an API is configured; a plain script stays offline.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence


def _run_resources() -> list[dict[str, str]] | None:
    if "prefect.context" not in sys.modules:
        return None  # no Prefect, no run (and no import of Prefect just to find that out)
    from prefect.context import FlowRunContext, TaskRunContext

    flow_ctx, task_ctx = FlowRunContext.get(), TaskRunContext.get()
    if flow_ctx is None and task_ctx is None:
        return None
    related = []
    if flow_ctx is not None and flow_ctx.flow_run is not None:
        related.append({"prefect.resource.id": f"prefect.flow-run.{flow_ctx.flow_run.id}",
                        "prefect.resource.role": "flow-run", "prefect.resource.name": flow_ctx.flow_run.name})
    if task_ctx is not None:
        related.append({"prefect.resource.id": f"prefect.task-run.{task_ctx.task_run.id}",
                        "prefect.resource.role": "task-run", "prefect.resource.name": task_ctx.task_run.name})
    return related


def pool_resource(pool_name: str) -> dict[str, str]:
    return {"prefect.resource.id": f"skytasks.pool.{pool_name}", "prefect.resource.role": "pool",
            "prefect.resource.name": pool_name}


def rank_resource(task: str, rank: int) -> dict[str, str]:
    return {"prefect.resource.id": f"skytasks.rank.{task}.{rank}", "prefect.resource.role": "rank",
            "prefect.resource.name": f"{task}[rank {rank}]"}


def emit(event: str, resource: dict[str, str], related: Sequence[dict[str, str]] = (),
         payload: dict[str, Any] | None = None) -> None:
    run_related = _run_resources()
    if run_related is None:
        return
    from prefect.events import emit_event

    primary = {k: v for k, v in resource.items() if k != "prefect.resource.role"}
    emit_event(event=event, resource=primary, related=[*related, *run_related], payload=payload or {})
