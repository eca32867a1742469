"""Each Prefect internal that skytasks uses (`skytasks/prefect_records/prefect_internals.py`) is
still where skytasks reaches for it, with the shape it relies on. A Prefect release that moves
one fails here, with its name and what skytasks needs it for, rather than as a record that
silently goes missing in a flow."""

from __future__ import annotations

import importlib
import inspect
import logging
from datetime import datetime, timedelta, timezone
from typing import Any, NoReturn

import pytest

from skytasks.prefect_records import prefect_internals as internals
from skytasks.prefect_records.run_states import new_id


def moved(what: str, why: str) -> NoReturn:
    pytest.fail(f"Prefect moved {what}: skytasks needs it for {why}", pytrace=False)


def reach(module: str, name: str, why: str) -> Any:
    """`module.name` (a dotted name reaches an attribute of an attribute), or fail by its name."""
    try:
        found: Any = importlib.import_module(module)
    except ImportError:
        moved(f"{module} (module)", why)
    for part in name.split("."):
        found = getattr(found, part, None)
        if found is None:
            moved(f"{module}.{name}", why)
    return found


def takes(fn: Any, what: str, why: str, positional: tuple[str, ...] = (), keywords: tuple[str, ...] = ()) -> None:
    """`fn` takes `positional` first, in that order, and accepts each of `keywords` by name."""
    params = inspect.signature(fn).parameters
    names = list(params)
    if names[:len(positional)] != list(positional):
        moved(f"{what}'s parameters (now {names}, skytasks passes {list(positional)} in that order)", why)
    for name in keywords:
        if name not in params:
            moved(f"{what}'s parameter {name!r} (now {names})", why)


def has_fields(model: Any, fields: tuple[str, ...], what: str, why: str) -> None:
    missing = [f for f in fields if f not in model.model_fields]
    if missing:
        moved(f"{what}'s fields {missing}", why)


def _states_and_run() -> tuple[Any, Any, Any]:
    from prefect.states import Completed, Running

    now = datetime.now(timezone.utc)
    flow_run_id, parent_id, run_id = new_id(), new_id(), new_id()
    template = internals.task_run_template(new_id(), flow_run_id, parent_id, "skytasks-rank-key")
    running = internals.copy_state(Running(), state_id=new_id(), timestamp=now, task_run_id=run_id,
                                   flow_run_id=flow_run_id, message=None)
    done = internals.copy_state(Completed(), state_id=new_id(), timestamp=now + timedelta(seconds=2),
                                task_run_id=run_id, flow_run_id=flow_run_id, message="ok")
    run = internals.copy_task_run(template, run_id=run_id, name="train[rank 0/2]", dynamic_key="p-1-0",
                                  tags=["rank:0"], state=running)
    return run, running, done


def test_a_rank_runs_state_changes_are_sent_as_the_task_engine_sends_its_own():
    why = "a rank's task run, recorded as its state-change events (prefect_internals.emit_state_change)"
    fn = reach("prefect.utilities.engine", "emit_task_run_state_change_event", why)
    takes(fn, "prefect.utilities.engine.emit_task_run_state_change_event", why,
          positional=("task_run", "initial_state", "validated_state"), keywords=("follows",))


def test_the_fields_a_rank_runs_copies_set_are_still_prefects_fields():
    why = "a rank's task run and states, copied without validation from one template"
    task_run = reach("prefect.client.schemas.objects", "TaskRun", why)
    has_fields(task_run, ("id", "name", "flow_run_id", "task_key", "dynamic_key", "empirical_policy", "run_count",
                          "task_inputs", "tags", "expected_start_time", "start_time", "created", "updated", "state",
                          "state_id", "state_type", "state_name", "total_run_time", "end_time"),
               "prefect.client.schemas.objects.TaskRun", why)
    reach("prefect.client.schemas.objects", "TaskRunPolicy", why)
    reach("prefect.client.schemas.objects", "TaskRunResult", why)
    state = reach("prefect.client.schemas.objects", "State", why)
    has_fields(state, ("id", "timestamp", "state_details", "message", "type", "name"),
               "prefect.client.schemas.objects.State", why)
    details = reach("prefect.client.schemas.objects", "StateDetails", why)
    has_fields(details, ("task_run_id", "flow_run_id"), "prefect.client.schemas.objects.StateDetails", why)

    run, running, done = _states_and_run()
    internals.enter_final_state(run, running, done)
    for model in (run, running, done, done.state_details):
        strays = set(vars(model)) - set(type(model).model_fields)
        if strays:
            moved(f"{type(model).__name__}'s fields {sorted(strays)} (set by skytasks, no longer Prefect's)", why)
    # Each copy is what Prefect would have validated, and says what it was given.
    assert type(run).model_validate(run.model_dump()).model_dump() == run.model_dump()
    assert (run.state_name, run.state_type, run.total_run_time) == ("Completed", done.type, timedelta(seconds=2))
    assert done.state_details.task_run_id == run.id and done.message == "ok"


def test_prefects_ids_are_uuids_that_skytasks_own_version_7_ids_sort_with():
    from prefect.states import Running

    why = "rank runs' and states' ids made as Prefect makes its own (run_states.new_id), time-ordered"
    version = Running().id.version
    if version not in (4, 7):  # 4: the Prefect 3 releases before its ids were time-ordered
        moved(f"its ids off UUIDv7 (a State's id is now version {version})", why)
    assert new_id().version == 7


def test_a_task_runs_logger_is_made_for_a_run_the_engine_never_entered():
    why = "each rank run's log lines (prefect_internals.run_logger)"
    fn = reach("prefect.logging.loggers", "task_run_logger", why)
    takes(fn, "prefect.logging.loggers.task_run_logger", why, positional=("task_run",), keywords=("task",))
    run, _, _ = _states_and_run()
    logger = internals.run_logger(run, None)
    if not isinstance(logger, logging.LoggerAdapter):
        moved("task_run_logger's result off logging.LoggerAdapter", why)
    _, kwargs = logger.process("line", {})
    if kwargs.get("extra", {}).get("task_run_id") != str(run.id):
        moved("the task_run_id a run logger's records carry", why)
    if logger.logger.name != internals.ENGINE_LOGGERS[0]:
        moved(f"the task-run logger (now {logger.logger.name!r}, was {internals.ENGINE_LOGGERS[0]!r})",
              "one line per root cause in the engine's logs, and no console copies of rank lines")


def test_the_flow_engines_logger_is_still_prefect_flow_runs():
    why = "one line per root cause in the flow engine's log of a failed call"
    fn = reach("prefect.logging.loggers", "flow_run_logger", why)
    from prefect.client.schemas.objects import FlowRun

    name = fn(FlowRun(flow_id=new_id(), name="f")).logger.name
    if name != internals.ENGINE_LOGGERS[1]:
        moved(f"the flow-run logger (now {name!r}, was {internals.ENGINE_LOGGERS[1]!r})", why)


def test_prefects_api_log_handler_is_known_by_its_name():
    why = "rank stacks sent to the API only, never printed (prefect_internals.is_api_log_handler)"
    handler_class = reach("prefect.logging.handlers", "APILogHandler", why)
    if not (isinstance(handler_class, type) and issubclass(handler_class, logging.Handler)):
        moved("prefect.logging.handlers.APILogHandler off logging.Handler", why)
    assert internals.is_api_log_handler(handler_class())
    assert not internals.is_api_log_handler(logging.StreamHandler())


@pytest.mark.parametrize("module, name", [("prefect.events.worker", "EventsWorker"),
                                          ("prefect.logging.handlers", "APILogWorker")])
def test_prefects_senders_can_be_drained_before_the_server_stops(module, name):
    why = "`skytasks run` sending its last events and logs while its server still runs (drain_workers)"
    worker = reach(module, name, why)
    takes(worker.drain_all, f"{module}.{name}.drain_all", why, keywords=("timeout", "at_exit"))
    if name not in internals.WORKER_LOGGERS:
        moved(f"{name}'s logger", why)
    service_init = inspect.getsource(reach("prefect._internal.concurrency.services", "_QueueServiceBase.__init__", why))
    if 'logging.getLogger(f"{type(self).__name__}")' not in service_init:
        moved("the name of a queue service's logger (its class's name)", why)
    internals.drain_workers(timeout=5)  # nothing queued: returns at once


def test_skytasks_starts_the_ephemeral_server_as_prefect_would():
    why = "`skytasks run` starting Prefect's ephemeral server itself, before importing Prefect"
    start = reach("prefect.server.api.server", "SubprocessASGIServer._run_uvicorn_command", why)
    source = inspect.getsource(start)
    argv, env = internals.ephemeral_server_command(4242)
    literals = [a for a in argv[1:] if a not in ("4242", argv[4])]  # not the port or Prefect's folder
    for word in literals:
        if f'"{word}"' not in source:
            moved(f"the ephemeral server's command (no {word!r} in SubprocessASGIServer._run_uvicorn_command)", why)
    for key, value in internals.EPHEMERAL_SERVER_ENV.items():
        if f'"{key}": "{value}"' not in source:
            moved(f"the ephemeral server's environment (no {key}={value} in SubprocessASGIServer)", why)
        assert env[key] == value
    import prefect

    assert argv[4] == str(prefect.__module_path__.parent)
    reach("prefect.server.api.server", "create_app", why)


def test_prefect_reads_its_settings_where_skytasks_looks_for_an_api():
    why = "starting the ephemeral server early only when nothing configures an API (nothing_configures_an_api)"
    settings = reach("prefect.settings.models.root", "Settings", why)
    config = settings.model_config
    expected = {"env_prefix": "PREFECT_", "env_file": internals.SETTINGS_DOTENV, "toml_file": internals.SETTINGS_TOML,
                "pyproject_toml_table_header": tuple(internals.SETTINGS_PYPROJECT_TABLE.split("."))}
    for key, value in expected.items():
        found = config.get(key)
        if (tuple(found or ()) if isinstance(value, tuple) else found) != value:
            moved(f"its settings' {key} (now {config.get(key)!r}, skytasks reads {value!r})", why)
    has_fields(settings, ("home", "profiles_path"), "prefect.settings.models.root.Settings", why)


def test_a_profile_file_is_found_where_skytasks_looks_for_it(tmp_path, monkeypatch):
    from prefect.settings.models.root import Settings

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    monkeypatch.delenv("PREFECT_PROFILES_PATH", raising=False)
    if Settings().profiles_path != tmp_path / "profiles.toml":
        moved("its profiles file (no longer PREFECT_HOME/profiles.toml)", "finding an API set in the active profile")


def test_flow_heartbeats_can_be_turned_off_for_one_run():
    why = "a flow run of `skytasks run` ending without joining its heartbeat thread (without_flow_heartbeats)"
    import prefect.flow_engine

    if "heartbeat" not in inspect.getsource(prefect.flow_engine):
        with internals.without_flow_heartbeats():  # nothing to turn off, and nothing fails
            return
    setting = reach("prefect.settings", "PREFECT_FLOWS_HEARTBEAT_FREQUENCY", why)
    reach("prefect.settings", "temporary_settings", why)
    aliases = str(reach("prefect.settings.models.flows", "FlowsSettings", why).model_fields["heartbeat_frequency"])
    for name in internals.HEARTBEAT_ENV:
        if name.lower() not in aliases:
            moved(f"the heartbeat setting's variable {name}", why)
    with internals.without_flow_heartbeats():
        assert setting.value() is None
