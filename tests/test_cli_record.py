"""`skytasks run` starts the ranks at once and records the run beside them: the record is whole
(flow run, parent task run, a run per rank with its lines at the time they were printed), and the
ranks really do start before the flow run exists."""

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from prefect import get_client
from prefect.client.schemas.filters import (FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterId, LogFilter,
                                            LogFilterTaskRunId)

from skytasks.events import PoolUp
from skytasks.prefect_records.record_queue import RECORDED_AT, HeldObserver

SCRIPT = """
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
print(f"hello from {dist.get_rank()} at {time.time()}", flush=True)
if dist.get_rank() == int(os.environ.get("FAIL_RANK", "-1")):
    raise SystemExit(5)
dist.barrier()
dist.destroy_process_group()
"""


class Recorder:
    def __init__(self) -> None:
        self.heard: list[tuple] = []

    def __getattr__(self, name: str):
        return lambda *args: self.heard.append((name, args, RECORDED_AT.get()))


def test_the_record_hears_everything_in_order_at_the_time_it_happened():
    live, record = Recorder(), Recorder()
    held = HeldObserver(live)
    before = time.time()
    held.on_attempt_start(1, 2)
    held.on_output(0, "stdout", "early")
    up = PoolUp("local", 2, 2, 1, ("127.0.0.1", "127.0.0.1"))
    held.on_pool_event(up, "p")  # its reporter said it on the console already: for the record only
    assert [h[0] for h in live.heard] == ["on_attempt_start", "on_output"]
    time.sleep(0.2)
    fed = threading.Thread(target=held.feed, args=(record,))
    fed.start()
    held.on_output(1, "stderr", "late")
    held.on_call_end(None)
    held.close()
    fed.join(5)
    assert not fed.is_alive()
    assert [(name, args) for name, args, _ in record.heard] == [
        ("on_attempt_start", (1, 2)), ("on_output", (0, "stdout", "early")),
        ("on_pool_event", (up, "p")),
        ("on_output", (1, "stderr", "late")), ("on_call_end", (None,))]
    stamps = [at for _, _, at in record.heard]
    assert before <= stamps[0] <= stamps[1] < before + 0.2 <= stamps[3]  # when it happened, not when it was fed


def test_a_call_that_never_started_still_lets_the_record_end():
    held = HeldObserver(Recorder())
    held.close()
    record = Recorder()
    held.feed(record)  # returns: nothing to tell
    assert record.heard == []


def _runs(flow_name: str):
    async def read():
        async with get_client() as client:
            (flow_run,) = await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])))
            tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
            by_name = {t.name: t for t in tasks}
            logs = {}
            for name, t in by_name.items():
                found = await client.read_logs(LogFilter(task_run_id=LogFilterTaskRunId(any_=[t.id])))
                logs[name] = found
            return flow_run, by_name, logs

    return asyncio.run(read())


def _wait_for(flow_name: str, ready, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = _runs(flow_name)
            if ready(*found):
                return found
        except ValueError:  # the flow run not there yet
            found = None
        if time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def _cli(tmp_path: Path, script_name: str, *extra: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    from prefect.settings import PREFECT_API_URL

    (tmp_path / f"{script_name}.py").write_text(SCRIPT)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "skytasks.cli", "run", "--nodes", "2", *extra, f"{script_name}.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def test_the_cli_run_is_recorded_whole_with_each_line_at_its_time(tmp_path):
    started = time.time()
    done = _cli(tmp_path, "recorded_whole")
    ended = time.time()
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):  # printed live once, never again by Prefect's console copy of the record
        assert (done.stdout + done.stderr).count(f"hello from {rank} at") == 1, done.stdout + done.stderr
    ranks = ["recorded_whole[rank 0/2]", "recorded_whole[rank 1/2]"]

    def ready(flow_run, by_name, logs):
        return set(ranks) <= set(by_name) and all(
            any("hello from" in entry.message for entry in logs[r]) and by_name[r].state.is_final() for r in ranks)

    flow_run, by_name, logs = _wait_for("recorded_whole", ready)
    assert flow_run.state.is_completed()
    assert by_name["recorded_whole"].state.is_completed()
    parent_id = by_name["recorded_whole"].id
    for rank, name in enumerate(ranks):
        run = by_name[name]
        assert run.state.is_completed() and run.task_inputs["__parents__"][0].id == parent_id
        (line,) = [e for e in logs[name] if "hello from" in e.message]
        printed_at = float(line.message.rsplit(" ", 1)[1])
        # The log line carries the time the rank printed it, not the time it reached the record.
        assert abs(line.timestamp.timestamp() - printed_at) < 0.5
        assert started < run.start_time.timestamp() <= line.timestamp.timestamp() <= run.end_time.timestamp() < ended
    # The ranks began as soon as both were there: the flow run, and the pool, up and past its
    # preflight (which on a pool started for the call includes the node's one import of torch, so
    # the pool is usually the later). Nothing else stood before them: not the rest of the record.
    (preflight,) = [e for e in logs["recorded_whole"] if "preflight" in e.message]
    ready_at = max(flow_run.start_time.timestamp(), preflight.timestamp.timestamp())
    assert min(by_name[r].start_time for r in ranks).timestamp() < ready_at + 0.25


def test_a_failing_rank_under_the_cli_fails_its_records_too(tmp_path):
    done = _cli(tmp_path, "failing_rank", env_extra={"FAIL_RANK": "1"})
    assert done.returncode == 5, done.stderr[-3000:]
    assert "root cause: rank 1: the script exited with code 5" in done.stderr

    def ready(flow_run, by_name, logs):
        return flow_run.state.is_final() and "failing_rank[rank 1/2]" in by_name and by_name[
            "failing_rank[rank 1/2]"].state.is_final()

    flow_run, by_name, _ = _wait_for("failing_rank", ready)
    assert flow_run.state.is_failed()
    assert by_name["failing_rank"].state.is_failed()
    assert by_name["failing_rank[rank 1/2]"].state.is_failed()
    assert "exited with code 5" in by_name["failing_rank[rank 1/2]"].state.message


def test_with_no_api_configured_the_run_is_in_prefects_own_database_and_no_server_is_left(tmp_path,
                                                                                         empty_prefect_database):
    import shutil
    import sqlite3

    import psutil

    home = tmp_path / "prefect-home"
    home.mkdir()
    shutil.copy(empty_prefect_database, home / "prefect.db")  # migrated already: Prefect's first start skipped
    (tmp_path / "no_api.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    done = subprocess.run([sys.executable, "-m", "skytasks.cli", "run", "--nodes", "2", "no_api.py"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "View at" not in done.stdout + done.stderr  # no link to a server that is gone
    assert "items remaining" not in done.stderr and "WARNING" not in done.stderr, done.stderr  # nothing reads as an error
    servers = [p for p in psutil.process_iter(["cmdline", "environ"])
               if "prefect.server.api.server:create_app" in " ".join(p.info["cmdline"] or [])
               and (p.info["environ"] or {}).get("PREFECT_HOME") == str(home)]
    assert servers == []
    db = sqlite3.connect(home / "prefect.db")
    flows = db.execute("select name, state_type from flow_run").fetchall()
    tasks = dict(db.execute("select name, state_type from task_run").fetchall())
    lines = [m for (m,) in db.execute("select message from log") if "hello from" in m]
    assert [state for _, state in flows] == ["COMPLETED"]
    assert tasks == {"no_api": "COMPLETED", "no_api[rank 0/2]": "COMPLETED", "no_api[rank 1/2]": "COMPLETED"}
    assert sorted(line.split(" at ")[0] for line in lines) == ["[rank 0] hello from 0", "[rank 1] hello from 1"]


def test_the_early_server_is_only_started_when_nothing_configures_an_api(tmp_path, monkeypatch):
    from skytasks.prefect_records.ephemeral_server import nothing_configures_an_api

    for key in [k for k in os.environ if k.startswith("PREFECT_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert nothing_configures_an_api()
    (tmp_path / "home").mkdir()
    profiles = tmp_path / "home" / "profiles.toml"
    profiles.write_text('active = "ephemeral"\n[profiles.ephemeral]\nPREFECT_SERVER_ALLOW_EPHEMERAL_MODE = "true"\n')
    assert nothing_configures_an_api()  # Prefect's own default profile
    profiles.write_text('active = "team"\n[profiles.team]\nPREFECT_API_URL = "http://prefect.internal/api"\n')
    assert not nothing_configures_an_api()
    profiles.unlink()
    (tmp_path / "pyproject.toml").write_text('[tool.prefect]\napi.url = "http://x/api"\n')
    assert not nothing_configures_an_api()
    (tmp_path / "pyproject.toml").unlink()
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")
    assert not nothing_configures_an_api()


def test_bad_shape_on_the_command_line_is_refused_naming_it_before_anything_starts(tmp_path):
    from tests.conftest import skytasks_processes

    (tmp_path / "never.py").write_text("raise SystemExit('this script must never run')\n")
    home = tmp_path / "prefect-home"  # no API configured: Prefect's own server would make its database here
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    for flag, value, said in (("--nodes", "0", "nodes: must be an integer ≥ 1, got 0"),
                              ("--procs-per-node", "-1", "procs_per_node: must be an integer ≥ 1, got -1"),
                              ("--nodes", "2:1", "--nodes: 2:1: MIN must be at least 1 and at most MAX"),
                              ("--nodes", "two", "--nodes: 'two' is not a count (N) or a range (MIN:MAX)")):
        done = subprocess.run([sys.executable, "-m", "skytasks.cli", "run", flag, value, "never.py"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr[-2000:]
        assert f"skytasks run: {said}" in done.stderr, done.stderr
        assert "never run" not in done.stdout + done.stderr
    assert skytasks_processes() == []
    assert not (home / "prefect.db").exists()  # not even Prefect's server was started
