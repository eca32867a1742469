"""Artifacts, written beside the call rather than in its way.

An artifact is a REST call, and on Prefect's SQLite server each costs about ten times a whole
plain task run (which is events only). So artifacts go to one writer thread per process: progress and
metrics are written while the ranks work, and the call waits at its end only for what is still
unwritten (usually just the rank table). It waits, rather than leaving them for later, so that
when a call returns its artifacts are in the API, whatever the flow process does next (a test
harness or an ephemeral server may stop right after). Writes are linked to the call's task run
and flow run by id, with a client of the writer's own.
"""

from __future__ import annotations

import json
import math
import queue
import threading
from concurrent.futures import Future
from contextvars import copy_context
from typing import Any, Callable
from uuid import UUID

from skytasks.event_bus import console_logger



class ArtifactWriter:
    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[Any], Any]) -> Future:
        """Run `job(client)` on the writer thread, in the caller's context (its Prefect settings)
        with a client of the writer's own: the caller's may be closed by then."""
        fut: Future = Future()
        self._jobs.put((copy_context(), job, fut))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="skytasks-artifacts")
                self._thread.start()
        return fut

    def _run(self) -> None:
        while True:
            ctx, job, fut = self._jobs.get()
            try:
                fut.set_result(ctx.run(_with_own_client, job))
            except Exception as exc:  # noqa: BLE001 - bookkeeping never fails a call
                fut.set_exception(exc)
                console_logger().warning(f"could not write an artifact: {exc!r}")


_CLIENTS: dict[str, Any] = {}  # API URL -> the writer thread's client for it (only it uses them)


def _with_own_client(job: Callable[[Any], Any]) -> Any:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = str(PREFECT_API_URL.value())
    client = _CLIENTS.get(url)
    if client is None:
        # httpx_settings={} never matches a context's client: a fresh one, kept open for the
        # writer, with the context's API settings.
        client = get_client(sync_client=True, httpx_settings={})
        client.__enter__()
        _CLIENTS[url] = client
    try:
        return job(client)
    except Exception:
        _CLIENTS.pop(url, None)  # a stopped server: start over with a new client next time
        raise


WRITER = ArtifactWriter()


def wait_for(futures: list[Future], timeout: float = 60.0) -> None:
    """Until these writes are done (their errors were already said by the writer)."""
    for fut in futures:
        try:
            fut.result(timeout=timeout)
        except Exception:  # noqa: BLE001
            pass


def _clean(item: Any) -> Any:
    if isinstance(item, list):
        return [_clean(i) for i in item]
    if isinstance(item, dict):
        return {k: _clean(v) for k, v in item.items()}
    return None if isinstance(item, float) and math.isnan(item) else item


def table_data(rows: list[dict[str, Any]]) -> str:
    """As prefect's TableArtifact.format, NaN as null. Rows seldom hold a NaN: json's own C
    encoder refuses one, and only then is every cell walked (a 1,024-row table took 70 ms)."""
    try:
        return json.dumps(rows, default=str, allow_nan=False)
    except ValueError:
        return json.dumps(_clean(rows), default=str)


def write_table(rows: list[dict[str, Any]], key: str, description: str, task_run_id: UUID, flow_run_id: UUID) -> Future:
    """A table written once (the rank table at the call's end)."""
    from prefect.client.schemas.actions import ArtifactCreate

    data = table_data(rows)
    return WRITER.submit(lambda client: client.create_artifact(ArtifactCreate(
        type="table", key=key, description=description, data=data, task_run_id=task_run_id,
        flow_run_id=flow_run_id)))


class LiveArtifact:
    """One artifact of a call, created on its first write and updated in place after.

    Each `create_artifact` with a key is a new version, and every version is a badge over the
    run graph and a card in the Artifacts tab: a 10-minute call that re-created its live tables
    every 5 s left 126 of them. Updated in place (PATCH /artifacts/{id}, which also updates the
    key's latest version), a call leaves one artifact per kind, whatever its length."""

    def __init__(self, kind: str, key: str, description: str, task_run_id: UUID, flow_run_id: UUID):
        self.kind, self.key, self.description = kind, key, description
        self.task_run_id, self.flow_run_id = task_run_id, flow_run_id
        self._created: Future | None = None
        self.writes: list[Future] = []

    def write(self, data: Any) -> None:
        from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

        if self._created is None:
            self._created = fut = WRITER.submit(lambda client: client.create_artifact(ArtifactCreate(
                type=self.kind, key=self.key, description=self.description, data=data,
                task_run_id=self.task_run_id, flow_run_id=self.flow_run_id)).id)
        else:
            created = self._created
            fut = WRITER.submit(lambda client: client.update_artifact(created.result(), ArtifactUpdate(data=data)))
        self.writes = [w for w in self.writes if not w.done()] + [fut]

    @property
    def exists(self) -> bool:
        return self._created is not None


class ProgressBar(LiveArtifact):
    """A progress artifact, created with the first progress a rank reports and updated after:
    a call that reports none has none (as it has no metrics table)."""

    def __init__(self, key: str, description: str, task_run_id: UUID, flow_run_id: UUID):
        super().__init__("progress", key, description, task_run_id, flow_run_id)

    def set(self, percent: float) -> None:
        self.write(max(0.0, min(100.0, percent)))


class LiveTable(LiveArtifact):
    def __init__(self, key: str, description: str, task_run_id: UUID, flow_run_id: UUID):
        super().__init__("table", key, description, task_run_id, flow_run_id)

    def set(self, rows: list[dict[str, Any]]) -> None:
        self.write(table_data(rows))
