"""Everything about a distributed run is in Prefect: runs, live logs, results, artifacts, events."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterTaskRunId
from prefect.client.schemas.sorting import LogSort
from prefect.settings import PREFECT_API_URL
from prefect_aws import AwsCredentials

from tests.harness.prefect_api import logs_when, settled_task_runs
from skytasks import GPUPool, distributed_task, rank_info, report, stdout

LIVE_MARK = "line-before-the-long-sleep"


def chatty_training(epochs: int) -> dict:
    import sys

    info = rank_info()
    logging.getLogger("trainer").error("logging-record-from-%d", info.rank)
    print(f"stderr-line-from-{info.rank}", file=sys.stderr)
    for epoch in range(1, epochs + 1):
        print(f"epoch {epoch} on rank {info.rank}")
        report(epoch=epoch, epochs=epochs, loss=1.0 / epoch)
    return {"rank": info.rank, "final_loss": 1.0 / epochs}


async def _runs_of(flow_run_id):
    async with get_client() as client:
        return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def _logs_of(task_run_id, *wait_for: str) -> list:
    """The run's logs once each of `wait_for` is in one of them: a rank's stdout, stderr and
    logging records travel apart."""
    return logs_when(LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])),
                     lambda logs: all(any(w in log.message for log in logs) for w in wait_for))


def test_rank_runs_logs_results_and_artifacts_are_in_the_api():
    task = distributed_task(stdout(only="head")(chatty_training), pool=GPUPool(nodes=2), name="chatty")

    @flow
    def chatty_flow():
        return task(3)

    state = chatty_flow(return_state=True)
    assert state.is_completed()
    runs = {r.name: r for r in settled_task_runs(state.state_details.flow_run_id, expect=3)}
    assert {"chatty", "chatty[rank 0/2]", "chatty[rank 1/2]"} <= set(runs)

    # Each rank's lines are in that rank's run, with levels kept; stdout only from the head.
    head_logs = _logs_of(runs["chatty[rank 0/2]"].id, "epoch 3 on rank 0", "stderr-line-from-0", "logging-record-from-0")
    other_logs = _logs_of(runs["chatty[rank 1/2]"].id, "logging-record-from-1")
    head = {log.message: log.level for log in head_logs}
    other = {log.message: log.level for log in other_logs}
    assert head["[rank 0] epoch 1 on rank 0"] == logging.INFO
    assert head["[rank 0] stderr-line-from-0"] == logging.WARNING
    assert any("logging-record-from-0" in m and lvl == logging.ERROR for m, lvl in head.items())
    assert not any("epoch" in m for m in other)  # suppressed on the rank, never shipped
    assert any("logging-record-from-1" in m and lvl == logging.ERROR for m, lvl in other.items())

    # The gathered list is persisted as the parent's result: read it back from storage.
    async def parent_result():
        async with get_client() as client:
            parent = await client.read_task_run(runs["chatty"].id)
            return await parent.state.aresult()

    assert asyncio.run(parent_result()) == [{"rank": 0, "final_loss": 1 / 3}, {"rank": 1, "final_loss": 1 / 3}]

    async def artifacts():
        async with get_client() as client:
            found = {}
            for key in ("chatty-ranks", "chatty-metrics", "chatty-progress"):
                arts = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
                found[key] = arts
            return found

    arts = asyncio.run(artifacts())
    ranks_table = arts["chatty-ranks"][-1]
    assert ranks_table.type == "table" and ranks_table.task_run_id == runs["chatty"].id
    assert '"address": "127.0.0.1"' in ranks_table.data and '"outcome": "completed"' in ranks_table.data
    assert "final_loss" in ranks_table.data
    metrics = [a.data for a in arts["chatty-metrics"]]
    assert any('"epoch": 3' in d and '"loss": 0.333' in d for d in metrics)
    assert '"rank": 1' not in "".join(metrics)  # report() is a no-op off the head
    assert float(arts["chatty-progress"][-1].data) == 100.0


def test_logs_reach_the_rank_run_while_the_rank_is_still_running(tmp_path):
    def talks_then_waits(folder: str) -> int:
        import os

        print(LIVE_MARK, flush=True)
        release = os.path.join(folder, "release")
        while not os.path.exists(release):
            time.sleep(0.1)
        return rank_info().rank

    task = distributed_task(talks_then_waits, pool=GPUPool(nodes=2), name="live")
    seen_live: list[bool] = []

    @flow
    def live_flow():
        return task(str(tmp_path))

    def watch_then_release():
        async def watch():
            async with get_client() as client:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    # Newest first: other tests' logs share this API.
                    logs = await client.read_logs(log_filter=LogFilter(), sort=LogSort.TIMESTAMP_DESC, limit=200)
                    if any(LIVE_MARK in log.message for log in logs):
                        return True
                    await asyncio.sleep(0.3)
                return False

        try:
            seen_live.append(asyncio.run(watch()))
        finally:  # whatever the watch met, the ranks are let go: never a hang to the suite's timeout
            (tmp_path / "release").write_text("go")

    import threading

    watcher = threading.Thread(target=watch_then_release)
    watcher.start()
    assert live_flow() == [0, 1]
    watcher.join()
    assert seen_live == [True]  # the line was in the API before the rank returned


def fails_on_rank_1() -> None:
    if rank_info().rank == 1:
        raise ValueError("rank one broke")
    time.sleep(60)


def _read_events(prefix: str, since: datetime) -> list[dict]:
    async def read():
        async with get_client() as client:
            resp = await client._client.post(
                "/events/filter",
                json={"filter": {"event": {"prefix": [prefix]}, "occurred": {"since": since.isoformat()}}, "limit": 50},
            )
            resp.raise_for_status()
            return resp.json()["events"]

    return asyncio.run(read())


def _wait_for_events(prefix: str, since: datetime, names: set[str], flow_run_id: str, timeout: float = 30) -> list[dict]:
    """The events related to one flow run (other tests' events may share the time window)."""
    deadline = time.monotonic() + timeout
    while True:
        events = [e for e in _read_events(prefix, since)
                  if any(r["prefect.resource.id"] == f"prefect.flow-run.{flow_run_id}" for r in e["related"])]
        if names <= {e["event"] for e in events} or time.monotonic() > deadline:
            return events
        time.sleep(0.5)


def test_events_for_pool_up_down_rank_failed_and_call_completed():
    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    pool = GPUPool(nodes=2)
    ok = distributed_task(lambda: 1, pool=pool, name="evented", init_torch=False)
    bad = distributed_task(fails_on_rank_1, pool=pool, name="evented-bad", init_torch=False)

    @flow
    def evented_flow():
        with pool:
            ok()
            try:
                bad()
            except Exception:  # noqa: BLE001
                pass

    flow_run_id = str(evented_flow(return_state=True).state_details.flow_run_id)
    wanted = {"skytasks.pool.up", "skytasks.pool.down", "skytasks.rank.failed", "skytasks.call.completed", "skytasks.call.failed"}
    events = _wait_for_events("skytasks.", since, wanted, flow_run_id)
    by_name = {e["event"]: e for e in events}
    assert wanted <= set(by_name), [(e["event"], e["occurred"]) for e in events]
    assert by_name["skytasks.pool.up"]["resource"]["prefect.resource.id"] == "skytasks.pool.local-pool"
    failed = by_name["skytasks.rank.failed"]
    assert failed["resource"]["prefect.resource.id"] == "skytasks.rank.evented-bad.1"
    assert failed["payload"]["exception_type"] == "ValueError" and "rank one broke" in failed["payload"]["message"]
    roles = {r["prefect.resource.role"] for r in failed["related"]}
    assert {"pool", "flow-run"} <= roles
    assert by_name["skytasks.call.completed"]["payload"]["task"] == "evented"


def test_block_registration_lists_gpu_pool_and_only_it():
    env = {"PREFECT_API_URL": PREFECT_API_URL.value()}
    proc = subprocess.run([sys.executable, "-m", "prefect", "block", "register", "-m", "skytasks.blocks"],
                          capture_output=True, text=True, timeout=120, env={**__import__("os").environ, **env})
    assert proc.returncode == 0, proc.stderr
    assert "GPU Pool" in proc.stdout
    assert "Successfully registered 1 block" in proc.stdout

    async def block_type():
        async with get_client() as client:
            return await client.read_block_type_by_slug("gpu-pool")

    bt = asyncio.run(block_type())
    assert bt.name == "GPU Pool" and bt.description and bt.code_example and bt.documentation_url


def test_a_saved_pool_with_separately_saved_credentials_round_trips_and_keeps_secrets():
    creds = AwsCredentials(aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key="s3cr3t-value", region_name="eu-west-1")
    creds.save("skytasks-test-creds", overwrite=True)
    pool = GPUPool(provider="aws", nodes=2, accelerator="L4", ssh_private_key="-----PRIVATE KEY-----",
                   aws_credentials=AwsCredentials.load("skytasks-test-creds"), tags={"team": "ml"})
    pool.save("skytasks-test-aws-pool", overwrite=True)

    loaded = GPUPool.load("skytasks-test-aws-pool")
    assert loaded.aws_credentials.aws_secret_access_key.get_secret_value() == "s3cr3t-value"
    assert loaded.aws_credentials.region_name == "eu-west-1"
    assert loaded.ssh_private_key.get_secret_value() == "-----PRIVATE KEY-----"
    assert (loaded.nodes, loaded.accelerator, loaded.tags) == (2, "L4", {"team": "ml"})
    assert "s3cr3t" not in repr(loaded) and "PRIVATE KEY" not in repr(loaded)

    async def stored():
        async with get_client() as client:
            return await client.read_block_document_by_name("skytasks-test-aws-pool", "gpu-pool", include_secrets=False)

    doc = asyncio.run(stored())
    assert doc.data["settings"]["ssh_private_key"] != "-----PRIVATE KEY-----"  # obfuscated in the API
    assert "aws_credentials" in doc.block_document_references  # nested block saved separately
