"""The Prefect record under load: 16 flows at once, each making 50 warm calls on a pool of its own,
against `prefect server start` backed by PostgreSQL, both on loopback, started here and stopped after.

    .venv/bin/python benchmarks/run.py --only load [--quick]

It reports how long after the last flow ended the record settled. Settled means three things:
- every task run of those flows is in a final state;
- they number what the calls made: a parent run, plus a run per rank, for each call;
- their count and the logs' count stopped growing.

It also reports what the server was sent per call (task runs, logs). `TUNED_SERVER` is the same run
against a server whose task-run recorder and event persister write in batches (Prefect's
defaults write each task-run event on its own).

`plain=True` is the baseline, Prefect alone: the same flows make as many task runs with Prefect's
own `@task` (a parent and one per rank, each printing its line), no skytasks anywhere. The settle
time of skytasks' record is read against that one, on the same kind of server in the same run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.harness.processes import end

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STOPPED_AFTER_SECONDS = 60.0
RANKS_PER_FLOW = 4  # 2 nodes x 2: one task run per rank ("rank" runs up to 64 ranks)
# The server's own knobs (Prefect's defaults: a batch of 1 for the task-run recorder, 20 for
# the event persister, each flushed every 5 s).
TUNED_SERVER = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "500",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_READ_BATCH_SIZE": "500",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "1",
}


def _free_port() -> int:
    from skytasks.node.ports import free_port  # imported here: as a script, skytasks is on the path only in main

    return free_port("127.0.0.1")


def _as_postgres(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: as root, run its programs as the `postgres` user."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def _pg_bin(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for version in sorted(Path("/usr/lib/postgresql").glob("*"), reverse=True):
        if (version / "bin" / name).exists():
            return str(version / "bin" / name)
    raise RuntimeError(f"PostgreSQL's {name} is not installed (apt-get install postgresql)")


class Servers:
    """PostgreSQL and a Prefect server on it, on loopback; both stopped and removed on exit."""

    def __init__(self, server_settings: dict[str, str] | None = None):
        self.server_settings = server_settings or {}

    def __enter__(self) -> Servers:
        self.tmp = tempfile.mkdtemp(prefix="skytasks-load-")
        os.chmod(self.tmp, 0o777)
        self.procs: list[subprocess.Popen] = []
        with contextlib.ExitStack() as on_failure:  # a start that fails half-way leaves nothing running
            on_failure.callback(self.__exit__)
            self._start()
            on_failure.pop_all()
        return self

    def _start(self) -> None:
        data = os.path.join(self.tmp, "pg")
        subprocess.run(_as_postgres([_pg_bin("initdb"), "-D", data, "-A", "trust", "-U", "postgres"]),
                       check=True, capture_output=True)
        self.pg_port = pg_port = _free_port()
        self.procs.append(subprocess.Popen(
            _as_postgres([_pg_bin("postgres"), "-D", data, "-h", "127.0.0.1", "-p", str(pg_port), "-k", self.tmp,
                          "-c", "max_connections=200", "-c", "fsync=off"]),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        while subprocess.run(["pg_isready", "-h", "127.0.0.1", "-p", str(pg_port)], capture_output=True).returncode:
            if time.monotonic() > deadline:
                raise RuntimeError("PostgreSQL did not start")
            time.sleep(0.2)
        port = _free_port()
        self.api = f"http://127.0.0.1:{port}/api"
        self.env = {**os.environ, "PREFECT_API_URL": self.api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "PREFECT_HOME": os.path.join(self.tmp, "prefect-home")}
        server_env = {**self.env, **self.server_settings, "PREFECT_API_DATABASE_CONNECTION_URL":
                      f"postgresql+asyncpg://postgres@127.0.0.1:{pg_port}/postgres"}
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=server_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        import httpx

        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.api}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the Prefect server did not start")
            time.sleep(0.5)

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self.procs):  # the server first, then its database
            end(proc, 30)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _plain_flow_process(calls: int) -> None:
    """The baseline flow: as many task runs and lines as `_flow_process`'s, by Prefect's own tasks."""
    from prefect import flow, task
    from prefect.context import get_run_context

    @task(log_prints=True)
    def rank_step(i: int, rank: int) -> int:
        print(f"call {i}")
        return i

    @task
    def step(i: int) -> list[int]:
        return [rank_step(i, r) for r in range(RANKS_PER_FLOW)]

    @flow
    def many_calls() -> str:
        for i in range(calls):
            step(i)
        return str(get_run_context().flow_run.id)

    print(f"FLOW {many_calls()} {time.time()!r}", flush=True)


def _flow_process(calls: int) -> None:
    """One of the flows (run in a process of its own): `calls` warm calls on a 2-node pool."""
    from prefect import flow
    from prefect.context import get_run_context

    from skytasks import GPUPool, distributed_task

    def step(i: int) -> int:
        print(f"call {i}")  # one line per rank per call: the record carries logs too
        return i

    pool = GPUPool(nodes=2, procs_per_node=2)
    task = distributed_task(step, pool=pool, init_torch=False)

    @flow
    def many_calls() -> str:
        with pool:
            for i in range(calls):
                task(i)
        return str(get_run_context().flow_run.id)

    print(f"FLOW {many_calls()} {time.time()!r}", flush=True)


def _rank_run_condition(plain: bool) -> str:
    """SQL naming the runs of one rank each: skytasks' rank runs, or the baseline's `rank_step` runs."""
    if plain:
        return "name LIKE 'rank\\_step-%'"
    from skytasks.prefect_records.rank_runs import RANK_TASK

    return f"task_key = '{RANK_TASK.task_key}'"


def _counts(servers: Servers, flow_run_ids: list[str], plain: bool = False) -> tuple[int, int, int, int]:
    """(task runs, final ones, logs, rank runs) of these flows, read from PostgreSQL itself: paging
    thousands of rows through the API twice a second would load the very server being measured."""
    ids = ",".join(f"'{i}'" for i in flow_run_ids)
    sql = (f"SELECT count(*), count(*) FILTER (WHERE state_type IN ('COMPLETED','FAILED','CANCELLED','CRASHED')),"
           f" (SELECT count(*) FROM log WHERE flow_run_id IN ({ids})),"
           f" count(*) FILTER (WHERE {_rank_run_condition(plain)})"
           f" FROM task_run WHERE flow_run_id IN ({ids})")
    out = subprocess.run([_pg_bin("psql"), "-h", "127.0.0.1", "-p", str(servers.pg_port), "-U", "postgres", "-d",
                          "postgres", "-tAc", sql], check=True, capture_output=True, text=True).stdout
    runs, final, logs, rank_runs = (int(x) for x in out.strip().split("|"))
    return runs, final, logs, rank_runs


def load(flows: int, calls: int, timeout: float = 300.0, server_settings: dict[str, str] | None = None,
         plain: bool = False) -> dict:
    expected_runs = flows * calls * (1 + RANKS_PER_FLOW)
    with Servers(server_settings) as servers:
        started = time.time()
        procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.load", "--plain-flow" if plain else "--flow", str(calls)],
                                  cwd=ROOT, env=servers.env,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                 for _ in range(flows)]
        ids, ended = [], []
        for proc in procs:
            out, _ = proc.communicate(timeout=1800)
            line = next((x for x in out.splitlines() if x.startswith("FLOW ")), None)
            if proc.returncode != 0 or line is None:
                raise RuntimeError(f"a load flow failed (exit {proc.returncode}):\n{out[-2000:]}")
            _, run_id, at = line.split()
            ids.append(run_id)
            ended.append(float(at))
        flows_ended = max(ended)
        last, last_change = None, time.time()
        at_end: tuple[int, int, int, int] | None = None
        while True:
            now = time.time()
            counts = _counts(servers, ids, plain)
            # What was recorded once every flow process had exited (its event and log workers drained,
            # a few seconds after the last flow returned): shows whether the lag is in or behind the server.
            at_end = at_end or counts
            if counts != last:
                last, last_change = counts, now
                if os.environ.get("SKYTASKS_LOAD_TRACE"):
                    print(f"  +{now - flows_ended:6.1f} s  runs {counts[0]}  final {counts[1]}  logs {counts[2]}",
                          flush=True)
            runs, final, logs, _ = counts
            if runs >= expected_runs and final == runs and now - last_change >= 3.0:
                break
            # A record that stopped growing short of complete for a minute gets no more (Prefect's
            # own tasks under this load lose some: the baseline).
            if now - flows_ended > timeout or now - last_change >= STOPPED_AFTER_SECONDS:
                break
            time.sleep(0.5)
    runs, final, logs, rank_runs = last or (0, 0, 0, 0)
    return {"what": "Prefect's own @task, as many task runs (the baseline)" if plain else "skytasks",
            "flows": flows, "calls_per_flow": calls, "ranks_per_call": RANKS_PER_FLOW,
            "server_settings": server_settings or "Prefect's defaults",
            "flows_took_s": flows_ended - started, "settled_after_flows_s": max(0.0, last_change - flows_ended),
            "task_runs_when_flow_processes_exited": at_end[0] if at_end else 0, "logs_when_flow_processes_exited": at_end[2] if at_end else 0,
            "complete": runs == expected_runs and final == runs,
            "task_runs": runs, "task_runs_expected": expected_runs, "rank_runs": rank_runs,
            "rank_runs_expected": flows * calls * RANKS_PER_FLOW, "task_runs_final": final, "logs": logs,
            "logs_per_call": logs / (flows * calls)}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--flow"]:
        _flow_process(int(sys.argv[2]))
    elif sys.argv[1:2] == ["--plain-flow"]:
        _plain_flow_process(int(sys.argv[2]))
    else:
        print(load(int(sys.argv[1]), int(sys.argv[2]), server_settings=TUNED_SERVER if "--tuned" in sys.argv else None,
                   plain="--plain" in sys.argv))
