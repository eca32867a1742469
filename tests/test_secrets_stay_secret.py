"""Secrets stay secret (issue #47): a pool with an SSH private key, AWS credentials, an `env`
secret (and its own relay TLS key) runs a call in a flow, on every provider of the suite; then
everything skytasks wrote is searched for the secret values: the console, the Prefect records
(logs, artifacts, events, task and flow runs with their parameters), files under
~/.cache/skytasks, and every process's command line while the call ran (srun's steps included);
on Kubernetes also the pods' manifests (and ConfigMaps) as the API server holds them, on AWS the
instances' user-data. None may hold one. (Kubernetes pools have no SSH key; a SLURM pool has one only with
`slurm_login`, tested both ways.)"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect_aws import AwsCredentials

from skytasks import GPUPool, distributed_task, rank_info
from tests.harness.ssh_pools import ssh_pool

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


def _files_under(root: Path) -> Iterator[Path]:
    """Every file under `root`, as other workers' processes write and remove theirs: os.walk
    passes over a folder removed while it is read (Path.rglob raised FileNotFoundError in CI)."""
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder) / name
            if path.is_file():
                yield path


def cache_files(since: float) -> str:
    """Every file under ~/.cache/skytasks made or changed since `since` (its ctime, which an
    unpacked archive cannot set back): what this run wrote there. Not the whole cache: it holds
    every version of the package the suite ever shipped, and the test cluster's binaries."""
    out = []
    for f in _files_under(Path.home() / ".cache" / "skytasks"):
        try:
            if f.stat().st_ctime >= since:
                out.append(f.read_bytes().decode("utf-8", "replace"))
        except OSError:
            pass
    return "\n".join(out)


@dataclass
class Setup:
    pool: GPUPool
    ssh_key: str = ""  # the private key the pool logs in with, where it has one
    during: Callable[[], str] = lambda: ""  # what the provider holds while the pool is up (pod specs)
    after: Callable[[], str] = lambda: ""  # and after (user-data)
    close: Callable[[], None] = lambda: None


def _setup(provider: str, request) -> Setup:
    common: dict[str, Any] = dict(nodes=3, env={"MY_TOKEN": ENV_SECRET})
    creds = dict(aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)
    if provider == "local":
        return Setup(GPUPool(aws_credentials=AwsCredentials(**creds), **common))
    if provider == "ssh":
        sshd = request.getfixturevalue("sshd")
        hosts = [*sshd.addresses, sshd.addresses[0]]
        return Setup(ssh_pool(sshd, hosts, aws_credentials=AwsCredentials(**creds), **common),
                     ssh_key=sshd.client_key)
    if provider.startswith("slurm"):
        request.getfixturevalue("cluster")
        login: dict[str, Any] = {}
        if provider == "slurm_login":
            server = request.getfixturevalue("login_node")
            login = dict(slurm_login=f"root@127.0.0.1:{server.port}", ssh_private_key=server.client_key,
                         known_hosts=server.known_hosts())
        return Setup(GPUPool(provider="slurm", remote_python=sys.executable, ready_timeout_seconds=60,
                             aws_credentials=AwsCredentials(**creds), **login, **common),
                     ssh_key=login.get("ssh_private_key", ""))
    if provider == "kubernetes":
        from tests.harness.kube import kube_pool

        k8s = request.getfixturevalue("k8s_cluster")
        return Setup(kube_pool(k8s, aws_credentials=AwsCredentials(**creds), **common),
                     during=lambda: k8s.kubectl("get", "pods,configmaps", "-A", "-o", "json").stdout)
    assert provider == "aws"
    return _aws_setup(request, creds, common)


def _aws_setup(request, creds: dict, common: dict) -> Setup:
    """moto's EC2, with the stand-in for cloud-init; the pool logs in with a key pair of its own
    (key_name), so that the test knows the private key to look for."""
    import base64

    import asyncssh
    from prefect_aws.client_parameters import AwsClientParameters

    from tests.test_aws_provider import CloudInitStandIn

    moto = request.getfixturevalue("moto")
    ec2 = moto["ec2"]
    key = asyncssh.generate_private_key("ssh-ed25519")
    key_name = f"secrets-{time.time_ns()}"
    ec2.import_key_pair(KeyName=key_name, PublicKeyMaterial=key.export_public_key())
    stand_in = CloudInitStandIn(ec2, request.getfixturevalue("tmp_path"))
    stand_in.start()
    aws = AwsCredentials(region_name="us-east-1", aws_client_parameters=AwsClientParameters(
        endpoint_url=moto["endpoint"]), **creds)
    pool = GPUPool(provider="aws", instance_type="t3.micro", image_id=moto["image"], subnet_id=moto["subnet"],
                   ssh_ingress_cidr="127.0.0.1/32", ssh_user="root", remote_python=sys.executable,
                   key_name=key_name, ssh_private_key=key.export_private_key().decode(), ready_timeout_seconds=120,
                   aws_credentials=aws, **common)

    def user_data() -> str:
        every = [i for r in ec2.describe_instances(Filters=[{"Name": "key-name", "Values": [key_name]}])["Reservations"]
                 for i in r["Instances"]]
        assert len(every) == 3, every
        raw = [ec2.describe_instance_attribute(InstanceId=i["InstanceId"], Attribute="userData")["UserData"]
               .get("Value", "") for i in every]
        return "\n".join(base64.b64decode(r).decode(errors="replace") for r in raw)

    def close() -> None:
        stand_in.stop()
        ec2.delete_key_pair(KeyName=key_name)

    return Setup(pool, ssh_key=key.export_private_key().decode(), after=user_data, close=close)


PROVIDERS = ["local", "ssh", "slurm", "slurm_login", "kubernetes", "aws"]


def _secret_lines(private_key: str) -> list[str]:
    """A private key's lines that are its own: not the armor, nor a line every key of its kind
    starts with (an OpenSSH key's first line is its format's header: an instance's host key in
    the user-data has it too)."""
    if not private_key:
        return []
    import asyncssh

    kind = asyncssh.import_private_key(private_key).algorithm.decode()
    generic = set(asyncssh.generate_private_key(kind).export_private_key().decode().splitlines())
    return [line for line in private_key.splitlines() if line and "PRIVATE KEY" not in line and line not in generic]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_no_secret_appears_in_anything_skytasks_wrote(provider, request, capfd):
    setup = _setup(provider, request)
    request.addfinalizer(setup.close)
    pool = setup.pool
    tls_key: list[str] = []
    held: list[str] = []

    @flow(name=f"secrets-{provider}")
    def run() -> list:
        with pool:
            task = distributed_task(secrets_reached_the_rank, pool=pool, init_torch=False)
            out = task()
            tls = pool.runtime().session.relay._tls
            tls_key.append(tls.key if tls else "")
            held.append(setup.during())  # while the pool is up: its pods, say
            return out

    started = time.time() - 1
    with CommandLines() as ps:
        state = run(return_state=True)
    assert state.result() == [True, True, True]  # the secrets did reach every rank
    console = capfd.readouterr()
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from tests.harness.prefect_api import logs_when

    logs_when(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])),
              lambda found: sum("has its secrets: True" in log.message for log in found) >= 3)
    time.sleep(1.5)  # the event worker's last batch
    records = asyncio.run(_records(state.state_details.flow_run_id))
    key_lines = _secret_lines(setup.ssh_key)
    tls_lines = [line for line in tls_key[0].splitlines() if line and "PRIVATE KEY" not in line]
    assert tls_lines, "the pool made its relay key"
    assert bool(key_lines) == (provider in ("ssh", "slurm_login", "aws"))
    secrets = {"aws access key": ACCESS_KEY, "aws secret key": SECRET_KEY, "env secret": ENV_SECRET,
               **{f"ssh key line {i}": s for i, s in enumerate(key_lines)},
               **{f"relay key line {i}": s for i, s in enumerate(tls_lines)}}
    places = {"console": console.out + console.err, "prefect": records, "cache": cache_files(started),
              "command lines": "\n".join(ps.seen), "the provider's records": held[0] + "\n" + setup.after()}
    if provider == "kubernetes":
        assert held[0].count('"app.kubernetes.io/managed-by": "skytasks"') >= 3, "the search reads the pods it means to"
    if provider == "aws":
        assert "ssh_keys" in places["the provider's records"]  # the user-data it means to read
    assert "has its secrets: True" in records  # the search reads the records it means to
    leaks = [(what, where) for what, value in secrets.items() for where, text in places.items() if value in text]
    shown = {w: [line[:300] for line in places[w].splitlines() if any(v in line for v in secrets.values())][:3] for _, w in leaks}
    assert leaks == [], shown


def _env_digest(name: str) -> str:
    """What a rank has in `name`, as a digest: the flow's result says the value arrived without
    holding it (a result is persisted, and this test searches everything Prefect persisted)."""
    import hashlib
    import os

    return hashlib.sha256(os.environ[name].encode()).hexdigest()


def _env_value(name: str) -> str:
    import os

    return os.environ[name]


def _prefect_files() -> dict[str, bytes]:
    """Every file of the test Prefect server's database (the sqlite file, its WAL and shared
    memory) and of the Prefect home (results, local storage, logs), by path."""
    from prefect.settings import PREFECT_HOME, PREFECT_LOCAL_STORAGE_PATH, PREFECT_SERVER_DATABASE_CONNECTION_URL

    database = Path(PREFECT_SERVER_DATABASE_CONNECTION_URL.value().split(":///", 1)[1])
    roots = {database.parent, Path(PREFECT_HOME.value()), Path(PREFECT_LOCAL_STORAGE_PATH.value())}
    found: dict[str, bytes] = {}
    for root in roots:
        for f in _files_under(root):
            try:
                found[str(f)] = f.read_bytes()
            except OSError:
                pass
    return found


def test_a_saved_pool_s_env_is_secret_at_rest_in_the_api_and_the_records_and_still_reaches_the_ranks(capfd):
    import hashlib
    import uuid

    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    marker = f"env-at-rest-{uuid.uuid4().hex}"
    name = f"secret-env-{uuid.uuid4().hex[:8]}"
    GPUPool(nodes=2, env={"SKYTASKS_TEST_MARKER": marker}).save(name)

    @flow(name="secret-env-at-rest")
    def run() -> list:
        pool = GPUPool.load(name)
        return distributed_task(_env_digest, pool=pool, init_torch=False)("SKYTASKS_TEST_MARKER")

    state = run(return_state=True)
    assert state.result() == [hashlib.sha256(marker.encode()).hexdigest()] * 2  # every rank has the value
    # Outside a flow nothing is recorded: the ranks may hand the value itself back.
    assert distributed_task(_env_value, pool=GPUPool.load(name), init_torch=False)("SKYTASKS_TEST_MARKER") == [marker] * 2

    async def stored() -> Any:
        async with get_client() as client:
            return await client.read_block_document_by_name(name, "gpu-pool", include_secrets=False)

    shown = asyncio.run(stored())
    assert set(shown.data["env"]) == {"SKYTASKS_TEST_MARKER"} and marker not in json.dumps(shown.data)  # obfuscated
    assert "env.*" in shown.block_schema.fields["secret_fields"]
    time.sleep(1.5)  # the event worker's last batch
    records = asyncio.run(_records(state.state_details.flow_run_id))
    console = capfd.readouterr()
    files = _prefect_files()
    database = Path(PREFECT_SERVER_DATABASE_CONNECTION_URL.value().split(":///", 1)[1])
    in_database = b"".join(v for k, v in files.items() if k.startswith(str(database)))
    assert name.encode() in in_database  # the search reads the database it means to (a name is no secret)
    assert state.state_details.flow_run_id.hex[:8] in records.replace("-", "")  # and the records
    leaks = [path for path, content in files.items() if marker.encode() in content]
    leaks += [where for where, text in {"records": records, "console": console.out + console.err,
                                        "cache": cache_files(time.time() - 600)}.items() if marker in text]
    assert leaks == []
