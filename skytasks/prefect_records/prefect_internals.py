"""Every part of Prefect that skytasks uses and Prefect does not promise to keep, in one place.

skytasks records a rank's task run the way Prefect's own task engine records one, and starts
Prefect's ephemeral server the way Prefect would. Both take things from inside Prefect. Everything
else in skytasks reaches them through this module, and `tests/test_prefect_internals.py` checks
each one against the installed Prefect, failing with its name when Prefect moves or reshapes it.

Nothing here imports Prefect when this module is imported: `skytasks run` starts the server
(`ephemeral_server_command`, `nothing_configures_an_api`) before anything imports `prefect`.

The internals, and what each is for:

1. `prefect.utilities.engine.emit_task_run_state_change_event(task_run, initial_state,
   validated_state, follows=None)`: a rank's task run is only its state-change events, as the
   sync task engine reports its own runs (one event per state, no REST call per run); the
   server's TaskRunRecorder writes the run from them. (`emit_state_change`)
2. The fields of `prefect.client.schemas.objects.TaskRun`, `State` and `StateDetails` that a rank
   run's copies set: each run is a pydantic `model_copy` of one template Prefect built, which
   skips validation, so a renamed field would be set without error and never sent.
   (`task_run_template`, `copy_state`, `copy_task_run`, `enter_final_state`)
3. Prefect's run and state ids are version-7 UUIDs (`prefect._internal.uuid7`; version 4 in
   Prefect 3.4): skytasks makes its own as version 7 (`run_states.new_id`), time-ordered like
   Prefect's. The server takes any UUID; only their order depends on it.
4. `prefect.logging.loggers.task_run_logger(task_run, task=)`: the log of a task run that
   Prefect's engine never entered, so no run context finds it. (`run_logger`)
5. `prefect.logging.handlers.APILogHandler`, by its class name: lines meant for the API only
   (a rank's whole stack) are kept off every other handler. (`is_api_log_handler`)
6. The engine's loggers `prefect.task_runs` and `prefect.flow_runs`, which each log a failed
   task's exception. (`ENGINE_LOGGERS`)
7. `prefect.events.worker.EventsWorker` and `prefect.logging.handlers.APILogWorker`, their
   `drain_all(timeout=, at_exit=)` and their loggers' names: `skytasks run` sends what they hold
   while its server still runs, without their "Still processing items" warning. (`drain_workers`)
8. `prefect.server.api.server.SubprocessASGIServer._run_uvicorn_command`: the command and
   environment of Prefect's ephemeral server, which `skytasks run` starts itself, before Prefect
   is imported, so the server comes up while the ranks do. (`ephemeral_server_command`)
9. Where Prefect reads its settings from (`prefect.settings.models.root.Settings.model_config`
   and the profiles file): the server is started early only when nothing could configure an API.
   (`nothing_configures_an_api`)
10. `PREFECT_FLOWS_HEARTBEAT_FREQUENCY` set to None: the flow engine joins its heartbeat thread,
    which sleeps in whole seconds, at the end of every flow run (a Prefect without the setting
    sends no flow heartbeats). (`without_flow_heartbeats`)
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from uuid import UUID

from pydantic import BaseModel

if TYPE_CHECKING:
    from prefect.client.schemas.objects import TaskRun
    from prefect.states import State

ENGINE_LOGGERS = ("prefect.task_runs", "prefect.flow_runs")
WORKER_LOGGERS = ("EventsWorker", "APILogWorker")


# 1. A rank run's state changes, as events.

def emit_state_change(task_run: TaskRun, before: State | None, after: State, follows: Any = None) -> Any:
    """Say that `task_run` went from `before` (None: its first word) to `after`; the event, for
    the next one to follow."""
    from prefect.utilities.engine import emit_task_run_state_change_event

    return emit_task_run_state_change_event(task_run, before, after, follows=follows)


# 2. Task runs and states, copied from templates.

def task_run_template(run_id: UUID, flow_run_id: Any, parent_id: Any, task_key: str) -> TaskRun:
    """A task run of `flow_run_id`, child of the task run `parent_id`, for copies to start from."""
    from prefect.client.schemas.objects import TaskRun, TaskRunPolicy, TaskRunResult

    return TaskRun(id=run_id, name="-", flow_run_id=flow_run_id, task_key=task_key, dynamic_key="-",
                   empirical_policy=TaskRunPolicy(), run_count=1,
                   task_inputs={"__parents__": [TaskRunResult(id=parent_id)]})


def copy_state(template: State, *, state_id: UUID, timestamp: datetime, task_run_id: Any, flow_run_id: Any,
               message: str | None) -> State:
    """`template` (made by Prefect's `Completed()`, ...) as a state of another run, at another time."""
    details = BaseModel.model_copy(template.state_details, update={"task_run_id": task_run_id,
                                                                   "flow_run_id": flow_run_id})
    return BaseModel.model_copy(template, update={"id": state_id, "timestamp": timestamp,
                                                  "state_details": details, "message": message})


def copy_task_run(template: TaskRun, *, run_id: UUID, name: str, dynamic_key: str, tags: list[str],
                  state: State) -> TaskRun:
    """`template` as another run, started in `state`."""
    at = state.timestamp
    return BaseModel.model_copy(template, update={
        "id": run_id, "name": name, "dynamic_key": dynamic_key, "tags": tags,
        "expected_start_time": at, "start_time": at, "created": at, "updated": at,
        "state": state, "state_id": state.id, "state_type": state.type, "state_name": state.name})


def enter_final_state(run: TaskRun, before: State, after: State) -> None:
    """`run` moves from `before` into `after`, as the engine updates its own run in memory."""
    if before.is_running():
        run.total_run_time += after.timestamp - before.timestamp
    run.end_time = cast(Any, after.timestamp)  # Prefect types it as its own DateTime
    run.state, run.state_id, run.state_type, run.state_name = after, after.id, after.type, after.name


# 4-6. Logging.

def run_logger(task_run: TaskRun, task: Any) -> Any:
    """The logger of `task_run` (a `logging.LoggerAdapter`), its lines sent to the run's log."""
    from prefect.logging.loggers import task_run_logger

    return task_run_logger(task_run, task=task)


def is_api_log_handler(handler: logging.Handler) -> bool:
    """Whether `handler` is Prefect's, sending records to the API (the others print them)."""
    return type(handler).__name__.startswith("APILogHandler")


# 7. Prefect's background senders.

def drain_workers(timeout: float) -> None:
    """Send what Prefect's event and log workers still hold (task-run events first: logs name their
    runs), with their progress line at WARNING quiet. Nothing to do when Prefect was never imported."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    quiet = [logging.getLogger(name) for name in WORKER_LOGGERS]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        EventsWorker.drain_all(timeout=timeout, at_exit=False)
        APILogWorker.drain_all(timeout=timeout, at_exit=False)
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)


# 8-9. Prefect's ephemeral server, without importing Prefect.

# Prefect's own environment for the subprocess (SubprocessASGIServer): no UI, and the server knows
# it is an ephemeral one.
EPHEMERAL_SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
EPHEMERAL_SERVER_APP = "prefect.server.api.server:create_app"
# What Prefect's own ephemeral server does at every start and this one skips (unless the user's
# environment says otherwise): importing every installed Prefect collection (prefect-aws,
# prefect-kubernetes: over a thousand modules, a second of CPU on 2 cores while the ranks start) to
# register their block types. A run's record needs no block type, and a pool the run loads was
# saved, which registered its types; a server of the usual kind registers them all at its start.
SKIPPED_AT_START_ENV = {"PREFECT_API_BLOCKS_REGISTER_ON_START": "false",
                        "PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION": "false"}


def ephemeral_server_command(port: int) -> tuple[list[str], dict[str, str]]:
    """The command and environment with which Prefect starts its ephemeral server on `port`."""
    prefect_dir = Path(importlib.util.find_spec("prefect").origin).parent  # type: ignore[union-attr, arg-type]
    argv = [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect_dir.parent), "--factory", EPHEMERAL_SERVER_APP,
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"]
    return argv, {**SKIPPED_AT_START_ENV, **os.environ, **EPHEMERAL_SERVER_ENV}


# Environment variables that may point Prefect at an API, or forbid the ephemeral one.
CONFIGURING_ENV = ("PREFECT_API_", "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE", "PREFECT_PROFILE", "PREFECT_CLOUD_",
                   "PREFECT_UI_URL")
SETTINGS_TOML = "prefect.toml"  # in the working directory
SETTINGS_DOTENV = ".env"  # in the working directory, PREFECT_ variables
SETTINGS_PYPROJECT_TABLE = "tool.prefect"  # in the working directory's pyproject.toml


def nothing_configures_an_api() -> bool:
    """True when Prefect would start its own ephemeral server; False when in any doubt."""
    if any(k.startswith(CONFIGURING_ENV) for k in os.environ):
        return False
    home = Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser()
    profiles = Path(os.environ.get("PREFECT_PROFILES_PATH", home / "profiles.toml")).expanduser()
    if profiles.exists():
        import tomllib

        try:
            data = tomllib.loads(profiles.read_text())
        except (OSError, ValueError):
            return False
        active = data.get("profiles", {}).get(data.get("active", "ephemeral"), {})
        if any("API_" in k or (k.endswith("ALLOW_EPHEMERAL_MODE") and str(v).lower() != "true")
               for k, v in active.items()):
            return False
    cwd = Path.cwd()
    if (cwd / SETTINGS_TOML).exists():
        return False
    for name, mark in ((SETTINGS_DOTENV, "PREFECT_"), ("pyproject.toml", SETTINGS_PYPROJECT_TABLE)):
        try:
            if mark in (cwd / name).read_text(errors="replace"):
                return False
        except OSError:
            pass
    return True


# 10. The flow engine's heartbeats.

HEARTBEAT_ENV = ("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "PREFECT_RUNNER_HEARTBEAT_FREQUENCY")


@contextlib.contextmanager
def without_flow_heartbeats() -> Iterator[None]:
    """Flow runs without heartbeats (each would add up to 1 s at its end), unless whoever runs
    this chose a frequency: heartbeats only serve an automation that marks silent runs crashed."""
    try:
        from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    except ImportError:  # a Prefect whose flow engine sends none (3.4)
        yield
        return
    if any(k in os.environ for k in HEARTBEAT_ENV):
        yield
        return
    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield
