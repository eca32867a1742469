"""A pool's typed events (`skytasks.events`) as Prefect records them.

Added to the pool event bus (`skytasks.event_bus.add_sink`) by the composition root
(`skytasks.wiring`) when a pool's runtime is built, so neither providers nor the controller import
Prefect.
Inside a flow run each event becomes a line in the run's log at its level, a provider's progress
updates the pool's progress artifact in place, and an event with a Prefect name is emitted with
its payload, related to the pool, the flow run and the task run:

    skytasks.pool.up / .down / .teardown-failed, skytasks.node.lost / .preempted / .replaced,
    skytasks.pool.shrank / .grew / .grow-failed, skytasks.attempt.restarted,
    skytasks.pool.attached / .released / .expired (warm pools; emitted outside a flow run too)
"""

from __future__ import annotations

import threading
from typing import Any

from skytasks.events import Event, PoolAttached, PoolExpired, PoolReleased, ProviderProgress, level_of
from skytasks.prefect_records.events import emit, pool_resource
from skytasks.event_bus import flow_run_id

WARM_EVENTS = (PoolAttached, PoolReleased, PoolExpired)
_progress_artifacts: dict[tuple[str, Any], Any] = {}  # (pool, flow run) -> its progress artifact's id
_lock = threading.Lock()


def emit_event(event: Event, pool_name: str) -> None:
    """The Prefect event of a typed event, if it has one."""
    if event.PREFECT_EVENT is not None:
        emit(event.PREFECT_EVENT, pool_resource(pool_name), payload=event.payload())


def record_pool_event(event: Event, pool_name: str) -> None:
    """A provider's or a pool's event, in the flow run this process is in (if any)."""
    if flow_run_id() is None:
        if isinstance(event, WARM_EVENTS):  # said by `skytasks pools` too: an automation still hears it
            _emit_outside_a_run(event, pool_name)
        return
    try:
        from prefect import get_run_logger

        get_run_logger().log(level_of(event), event.text())
    except Exception:  # noqa: BLE001 - a display problem never fails the pool
        pass
    if isinstance(event, ProviderProgress):
        _show_progress(event)
    try:
        emit_event(event, pool_name)
    except Exception:  # noqa: BLE001 - an event never fails the pool
        pass


def _emit_outside_a_run(event: Event, pool_name: str) -> None:
    try:
        from prefect.events import emit_event

        resource = {k: v for k, v in pool_resource(pool_name).items() if k != "prefect.resource.role"}
        emit_event(event=event.PREFECT_EVENT or "", resource=resource, payload=event.payload())
    except Exception:  # noqa: BLE001 - an event never fails the pool
        pass


def _show_progress(event: ProviderProgress) -> None:
    try:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact
        from prefect.context import FlowRunContext

        run = FlowRunContext.get().flow_run.id  # type: ignore[union-attr]
        percent = 100.0 * event.ready / max(event.total, 1)
        with _lock:
            artifact = _progress_artifacts.get((event.pool, run))
            if artifact is None:
                key = "".join(c if c.isalnum() else "-" for c in f"{event.pool}-launch".lower())
                _progress_artifacts[(event.pool, run)] = create_progress_artifact(
                    percent, key=key, description=f"nodes of {event.pool} ready")
            else:
                update_progress_artifact(artifact, percent)
    except Exception:  # noqa: BLE001 - progress display never fails a launch
        pass
