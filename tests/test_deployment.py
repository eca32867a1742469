"""`prefect deploy` from deployments/prefect.yaml, a deployment run, and a process worker that runs
it, against the session's real Prefect server on loopback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def prefect_server(tmp_path):
    """The session's Prefect server (a real one, on loopback: what `prefect server start` runs),
    and the environment the `prefect` commands below get: its API, a home of their own."""
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": api}
    yield api, env


def prefect(env, *args, timeout=300) -> str:
    proc = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    said = f"{proc.stdout[:1500]}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"  # the first lines say why
    assert proc.returncode == 0, f"prefect {' '.join(args)}\n{said}"
    return proc.stdout + proc.stderr


def test_deploy_schedule_and_run_through_a_worker(prefect_server):
    api, env = prefect_server
    # The package's prefect.collections entry point: the server knows GPU Pool unasked.
    assert httpx.get(f"{api}/block_types/slug/gpu-pool").status_code == 200

    # The work pool, as `prefect work-pool create skytasks-local --type process` makes it (through
    # the API: one Prefect start-up fewer; deploying and running are the CLI's, below).
    from prefect.workers.process import ProcessWorker

    made = httpx.post(f"{api}/work_pools/", json={"name": "skytasks-local", "type": "process",
                                                  "base_job_template": ProcessWorker.get_default_base_job_template()})
    assert made.status_code == 201, made.text
    out = prefect(env, "--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml")
    assert "ddp-train/ddp-train-nightly" in out

    deployment = httpx.get(f"{api}/deployments/name/ddp-train/ddp-train-nightly").json()
    assert deployment["work_pool_name"] == "skytasks-local"
    assert [s["schedule"]["cron"] for s in deployment["schedules"]] == ["0 3 * * *"]
    assert deployment["parameters"]["nodes"] == 2
    assert deployment["enforce_parameter_schema"] is False  # else the server refuses a picked pool (prefect.yaml)
    # The EC2 sweep is deployed too, its schedule off until someone points it at an account.
    gc = httpx.get(f"{api}/deployments/name/skytasks-gc/skytasks-gc-hourly").json()
    assert gc["entrypoint"] == "flows/gc_sweep.py:skytasks_gc"
    assert [(s["schedule"]["cron"], s["active"]) for s in gc["schedules"]] == [("17 * * * *", False)]

    # `pool` is a GPU Pool block parameter: the run form's schema refers to the block type, which is
    # what makes Prefect's custom run form show a picker of the saved pools.
    schema = deployment["parameter_openapi_schema"]
    [ref] = [s["$ref"] for s in schema["properties"]["pool"]["anyOf"] if "$ref" in s]
    assert schema["definitions"][ref.rsplit("/", 1)[1]]["block_type_slug"] == "gpu-pool"

    # A run on a saved pool, as the form sends the one picked: a reference to its block document.
    from skytasks import GPUPool

    pool_name = f"deployment-picked-{os.getpid()}"
    pool_id = GPUPool(provider="local", nodes=2).save(pool_name, overwrite=True)
    picked = '{"$ref": {"block_document_id": "%s"}}' % pool_id
    out = prefect(env, "deployment", "run", "ddp-train/ddp-train-nightly", "--param", "epochs=2", "--param", "samples=256",
                  "--param", f"pool={picked}")
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
    prefect(env, "worker", "start", "--pool", "skytasks-local", "--run-once", timeout=400)

    run = httpx.get(f"{api}/flow_runs/{flow_run_id}").json()
    assert run["state"]["type"] == "COMPLETED", run["state"]
    task_runs = httpx.post(f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [flow_run_id]}}}).json()
    names = {t["name"]: t["state"]["type"] for t in task_runs}
    assert names.get("train[rank 0/2]") == "COMPLETED" and names.get("train[rank 1/2]") == "COMPLETED"
    assert names.get("train") == "COMPLETED"
    head = next(t for t in task_runs if t["name"] == "train[rank 0/2]")
    assert f"pool:{pool_name}" in head["tags"], head["tags"]  # the picked pool ran the call
