"""The example DDP training flow trains for real: the loss falls and the head checkpoints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from flows.ddp_train import ddp_train, summarize

ROOT = Path(__file__).resolve().parent.parent


def test_example_flow_loss_falls_and_head_saves_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = ddp_train(epochs=3, samples=384)
    assert [r["rank"] for r in results] == [0, 1]
    # The same code trains on the CPU, or (on a GPU machine) on the one GPU both local nodes share.
    assert {r["device"] for r in results} == {"cuda:0" if torch.cuda.is_available() else "cpu"}
    losses = results[0]["epoch_losses"]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.3, losses
    assert results[1]["epoch_losses"] == losses  # all_reduce: every rank reports the global mean
    assert results[0]["param_checksum"] == results[1]["param_checksum"]  # DDP kept replicas equal
    assert results[0]["steps"] == results[1]["steps"] > 0
    ckpt = Path(results[0]["checkpoint"])
    assert ckpt.parent == tmp_path / "checkpoints" and results[1]["checkpoint"] is None
    saved = torch.load(ckpt)
    assert saved["epoch_losses"] == losses and "tok.weight" in saved["model"]
    assert "rank" in summarize(results)


def test_example_flow_on_one_node_trains_on_this_machines_device(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = ddp_train(epochs=2, nodes=1, samples=256)
    assert [r["rank"] for r in results] == [0]
    assert results[0]["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    losses = results[0]["epoch_losses"]
    assert losses[-1] < losses[0]


def test_example_flow_resumes_a_failed_attempt_from_its_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = ddp_train(epochs=3, nodes=2, samples=256, fail_once_at_epoch=2)
    assert [(r["attempt"], r["first_epoch"]) for r in results] == [(2, 3), (2, 3)]  # epochs 1-2 not redone
    losses = results[0]["epoch_losses"]
    assert len(losses) == 3 and losses[-1] < losses[0]  # the whole history, across both attempts
    assert results[0]["steps"] < results[0]["samples"]  # only the last epoch ran on attempt 2


def test_example_flow_runs_as_a_script():
    """`python flows/ddp_train.py` works from a clone, with a readable summary. It records to this
    session's API; Prefect's own temporary server (what `make run` gets with no API set) is
    tested by test_cli_record's no-API test."""
    from prefect.settings import PREFECT_API_URL

    proc = subprocess.run(
        [sys.executable, str(ROOT / "flows" / "ddp_train.py")],
        capture_output=True, text=True, timeout=400, cwd=ROOT,
        env={**__import__("os").environ, "SKYTASKS_EXAMPLE_EPOCHS": "2", "SKYTASKS_EXAMPLE_SAMPLES": "256",
             "PREFECT_API_URL": PREFECT_API_URL.value()},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert output.count("per-rank summary") == 1  # the table once, not twice
    assert output.count("→") == 4  # the header and a row per rank, once, and the closing line
    assert "skytasks ddp_train: 2 rank(s), loss" in proc.stdout


def test_example_flow_on_an_elastic_pool_loses_a_node_after_a_notice_and_finishes_every_epoch_once(
        tmp_path, monkeypatch):
    """The brief's "done": the example flow on its elastic pool (1 to 2 nodes). Mid-training node 1
    gets a preemption notice (SIGUSR2 to its agent, as SLURM's --signal sends it) and is taken
    away after a grace. The head saves at the epoch's end and ends the attempt; the retry runs on the
    one node left from the epoch after that checkpoint. Every epoch's loss is there once, and the
    flow run's log and rank table say why the world size changed."""
    import asyncio
    import json
    import os
    import signal
    import threading
    import time

    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        LogFilter,
        LogFilterFlowRunId,
        LogFilterTaskRunId,
    )

    from flows.ddp_train import pool
    from tests.conftest import gone, started_here

    monkeypatch.chdir(tmp_path)
    assert (pool.min_nodes, pool.nodes) == (1, 2)
    sent: dict = {}

    def notice_then_take_node_1_away() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list(tmp_path.glob("checkpoints/runs/*/step-000000000000.pt")):
            time.sleep(0.05)
        # The agents start in node order. (A rank's /proc environ would not say: ranks are forked
        # from a template, and /proc shows the environment a process was exec'd with.)
        agents = sorted(started_here("skytasks.node.agent"), key=lambda p: p.create_time())
        agent = agents[1]
        sent["at"] = time.time()
        os.kill(agent.pid, signal.SIGUSR2)  # the notice
        # The node is taken away after a grace, as a cloud's spot notice (30 s to 2 min) or SLURM's
        # --signal=USR2@N gives one: long enough for the epoch in flight to end on a busy 2-core
        # machine (an epoch here can take over 2 s). The pool normally lets the node go first.
        grace_ends = time.monotonic() + 15.0
        while time.monotonic() < grace_ends and not gone(agent):
            time.sleep(0.05)
        if not gone(agent):
            os.kill(agent.pid, signal.SIGKILL)  # the node is taken away

    threading.Thread(target=notice_then_take_node_1_away, daemon=True).start()
    state = ddp_train(epochs=5, nodes=2, samples=384, return_state=True)
    results = state.result()
    epochs = 5
    [r] = results  # attempt 2 ran on the one node left
    assert (r["attempt"], r["world_size"]) == (2, 1)
    losses = r["epoch_losses"]
    assert len(losses) == epochs and losses[-1] < losses[0], losses  # every epoch once: none lost, none repeated
    assert 2 <= r["first_epoch"] <= epochs  # resumed after the notice's checkpoint
    assert r["steps"] == (epochs - r["first_epoch"] + 1) * 12  # attempt 2 ran exactly the epochs left

    from tests.harness.prefect_api import logs_when, settled_task_runs

    flow_run_id = state.state_details.flow_run_id

    async def rank_tables():
        async with get_client() as client:
            tables = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["train-ranks"])))
            return [t for t in tables if t.flow_run_id == flow_run_id]

    logs = logs_when(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                     lambda found: any("goes on with the 1 node left" in log.message for log in found))
    tables = asyncio.run(rank_tables())
    text = "\n".join(log.message for log in logs)
    assert "node 1 (127.0.0.1) will be taken away: SIGUSR2 reached the node agent" in text, text
    assert "node 1 (127.0.0.1) was preempted" in text and "goes on with the 1 node left, 1 rank" in text, text
    rows = json.loads(max(tables, key=lambda t: t.created).data)
    assert [(row["attempt"], row["world size"]) for row in rows] == [(1, 2), (1, 2), (2, 1)], rows
    assert any(row["attempt"] == 1 and row["outcome"] == "preempted" and "Preempted" in row["summary"] for row in rows), rows
    # The Task Runs tab: the first attempt's ranks end Preempted (Cancelled-type), never Failed;
    # the retry's rank run says its attempt; the head's log says it at WARNING, with no traceback.
    runs = {r.name: r for r in settled_task_runs(flow_run_id, expect=4)}
    assert {n: (r.state.type.value, r.state.name) for n, r in runs.items() if "[rank" in n} == {
        "train[rank 0/2]": ("CANCELLED", "Preempted"), "train[rank 1/2]": ("CANCELLED", "Preempted"),
        "train[rank 0/1, attempt 2]": ("COMPLETED", "Completed")}, runs
    assert not any(r.state.is_failed() for r in runs.values())

    head = logs_when(LogFilter(task_run_id=LogFilterTaskRunId(any_=[runs["train[rank 0/2]"].id])),
                     lambda found: any("the attempt ended for a preemption" in log.message for log in found))
    assert any(log.level == 30 and "the attempt ended for a preemption" in log.message for log in head), head
    assert not any(log.level >= 40 or "Traceback" in log.message for log in head), head


def test_example_flow_takes_a_saved_pool_as_a_block_parameter(tmp_path, monkeypatch):
    """`pool` is a GPU Pool block parameter: the flow's parameter schema refers to the block type
    (what gives a deployment's run form its picker of saved pools), a reference to a saved pool (what
    the form sends) trains on that pool, and from Python the block or its name work as before."""
    from skytasks import GPUPool

    monkeypatch.chdir(tmp_path)
    schema = ddp_train.parameters.model_dump()
    [ref] = [s["$ref"] for s in schema["properties"]["pool"]["anyOf"] if "$ref" in s]
    assert schema["definitions"][ref.rsplit("/", 1)[1]]["block_type_slug"] == "gpu-pool"

    name = f"example-one-node-{__import__('os').getpid()}"
    GPUPool(provider="local", nodes=1).save(name, overwrite=True)  # the default would be 2 nodes
    picked = ddp_train(epochs=2, samples=64, pool={"$ref": {"block_document_slug": f"gpu-pool/{name}"}})
    assert [(r["rank"], r["world_size"]) for r in picked] == [(0, 1)]
    saved = GPUPool.load(name)
    with saved:  # one node up for both calls: the name finds the pool the `with` keeps up
        by_block = ddp_train(epochs=2, samples=64, pool=saved)
        by_name = ddp_train(epochs=2, samples=64, pool=name)
    assert [r["world_size"] for r in by_block + by_name] == [1, 1]
