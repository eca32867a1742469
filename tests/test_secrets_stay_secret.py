"""Secrets stay secret (issue #47): a pool with an SSH private key, AWS credentials, an `env`
secret (and its own relay TLS key) runs a call in a flow; then everything skytasks wrote is
searched for the secret values: the console, the Prefect records (logs, artifacts, events, task
and flow runs with their parameters), files under ~/.cache/skytasks, and every process's command
line while the call ran. None may hold one."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect_aws import AwsCredentials

from skytasks import GPUPool, distributed_task, rank_info
from tests.sshd import SSHServer, free_port

ACCESS_KEY = "AKIASKYTASKSTEST0042"
SECRET_KEY = "aws-secret-0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c"
ENV_SECRET = "env-secret-3c1d9a7b5e2f4c6a8b0d"


def secrets_reached_the_rank() -> bool:
    import os

    ok = os.environ.get("AWS_SECRET_ACCESS_KEY") == SECRET_KEY and os.environ.get("MY_TOKEN") == ENV_SECRET
    print(f"rank {rank_info().rank} has its secrets: {ok}")  # a line to the record, and no secret in it
    return ok


class CommandLines:
    """Every process's command line, sampled while the call runs."""

    def __init__(self):
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        while not self._stop.is_set():
            for p in psutil.process_iter(["cmdline"]):
                try:
                    self.seen.add(" ".join(p.info["cmdline"] or []))
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


async def _records(flow_run_id) -> str:
    """Everything Prefect holds of the flow run, as text."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async with get_client() as client:
        parts = [await client.read_flow_run(flow_run_id)]
        parts += await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        parts += await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        parts += await client.read_artifacts()
        page = (await client._client.post("/events/filter", json={"limit": 50})).json()
        text = json.dumps(page)
        for _ in range(20):  # every page of the last hour's events
            if not page.get("next_page"):
                break
            page = (await client._client.get(page["next_page"])).json()
            text += json.dumps(page)
    return "\n".join(p.model_dump_json() for p in parts) + "\n" + text


def cache_files() -> str:
    root = Path.home() / ".cache" / "skytasks"
    out = []
    for f in root.rglob("*") if root.exists() else []:
        if f.is_file():
            try:
                out.append(f.read_bytes().decode("utf-8", "replace"))
            except OSError:
                pass
    return "\n".join(out)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    hosts = ["127.0.0.1", "127.0.0.2"]
    server = SSHServer(tmp_path_factory.mktemp("sshd"), hosts, free_port())
    yield {"hosts": hosts, "port": server.port, "key": server.client_key, "known_hosts": server.known_hosts()}
    server.stop()


def _pool(provider: str, sshd) -> GPUPool:
    common = dict(nodes=3, env={"MY_TOKEN": ENV_SECRET},
                  aws_credentials=AwsCredentials(aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY))
    if provider == "local":
        return GPUPool(**common)
    hosts = sshd["hosts"] + [sshd["hosts"][0]]
    return GPUPool(provider="ssh", hosts=[f"root@{h}:{sshd['port']}" for h in hosts], ssh_private_key=sshd["key"],
                   known_hosts=sshd["known_hosts"], remote_python=sys.executable, **common)


@pytest.mark.parametrize("provider", ["local", "ssh"])
def test_no_secret_appears_in_anything_skytasks_wrote(provider, request, capfd):
    sshd = request.getfixturevalue("sshd") if provider == "ssh" else None
    pool = _pool(provider, sshd)
    tls_key: list[str] = []

    @flow(name=f"secrets-{provider}")
    def run() -> list:
        with pool:
            task = distributed_task(secrets_reached_the_rank, pool=pool, init_torch=False)
            out = task()
            tls = pool.runtime().session._peer_tls
            tls_key.append(tls.key if tls else "")
            return out

    with CommandLines() as ps:
        state = run(return_state=True)
    assert state.result() == [True, True, True]  # the secrets did reach every rank
    console = capfd.readouterr()
    time.sleep(1.5)  # the log and event workers' last batch
    records = asyncio.run(_records(state.state_details.flow_run_id))
    key_lines = [line for line in (sshd["key"] if sshd else "").splitlines() if line and "PRIVATE KEY" not in line]
    tls_lines = [line for line in tls_key[0].splitlines() if line and "PRIVATE KEY" not in line]
    assert tls_lines, "the pool made its relay key"
    secrets = {"aws access key": ACCESS_KEY, "aws secret key": SECRET_KEY, "env secret": ENV_SECRET,
               **{f"ssh key line {i}": s for i, s in enumerate(key_lines)},
               **{f"relay key line {i}": s for i, s in enumerate(tls_lines)}}
    places = {"console": console.out + console.err, "prefect": records, "cache": cache_files(),
              "command lines": "\n".join(ps.seen)}
    assert "has its secrets: True" in records  # the search reads the records it means to
    leaks = [(what, where) for what, value in secrets.items() for where, text in places.items() if value in text]
    shown = {w: [line[:300] for line in places[w].splitlines() if any(v in line for v in secrets.values())][:3] for _, w in leaks}
    assert leaks == [], shown
