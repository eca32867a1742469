"""Node health before user code, for real: local pools, three ssh hosts on loopback addresses (one
of them behind an sshd held by a cgroup to a fraction of a CPU: a slow node, every process under
it slow), and a network-namespace host with no route to the head.

A slow node is found by `preflight="full"` before any user code: an elastic pool runs the call on
the healthy hosts, a fixed one fails with PoolStartError naming it; a node that cannot reach the
head fails `"basic"` in seconds, named."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from skytasks import GPUPool, PoolStartError, distributed_task, rank_info
from skytasks.events import PoolShrank, listen
from skytasks.preflight.report import NodeUnhealthy, PoolHealthy, PreflightTable
from tests.conftest import wait_for_no_skytasks_processes
from tests.harness import netns, slow_cpu
from tests.harness.sshd import SSHServer, free_port

SLOW_CPUS = 0.05  # of one CPU
HEALTHY, SLOW = ("127.0.0.1", "127.0.0.2"), "127.0.0.3"


def where(marker: str) -> str:
    """User code: says, in a shared file, which host it ran on."""
    address = rank_info().peers[rank_info().node_rank]
    with open(marker, "a") as out:
        out.write(address + "\n")
    return address


def of(kind, heard):
    return [e for e in heard if isinstance(e, kind)]


# -- local pools -----------------------------------------------------------------------------

def test_basic_is_the_default_and_says_the_pool_is_healthy_before_the_call_off_says_nothing(tmp_path):
    marker = str(tmp_path / "ran")
    with listen() as heard:
        assert distributed_task(where, pool=GPUPool(nodes=2))(marker) == ["127.0.0.1", "127.0.0.1"]
    [healthy] = of(PoolHealthy, heard)
    assert (healthy.nodes, healthy.level) == (2, "basic") and healthy.seconds < 30
    with listen() as quiet:
        distributed_task(where, pool=GPUPool(nodes=2, preflight="off"))(marker)
    assert not of(PoolHealthy, quiet) and not of(PreflightTable, quiet)


def test_full_on_a_pool_kept_up_measures_every_figure_once_before_the_first_call(tmp_path):
    marker = str(tmp_path / "ran")
    # Both "nodes" are processes on this one shared machine: compared loosely, their figures only must exist.
    pool = GPUPool(nodes=2, procs_per_node=2, preflight="full", preflight_min_ratio=0.1)
    task = distributed_task(where, pool=pool)
    with pool, listen() as heard:
        task(marker)
        task(marker)
    [table] = of(PreflightTable, heard)
    assert [row["node"] for row in table.rows] == [0, 1]
    assert all(row["compute GFLOPS"] > 0 and row["pair GB/s"] > 0 and row["intra-node GB/s"] > 0
               for row in table.rows)
    [healthy] = of(PoolHealthy, heard)
    # The console's healthy line carries each figure's range, as the table has them.
    span = r"[0-9.]+(-[0-9.]+)?"
    assert re.fullmatch(rf"preflight \(full\): 2 nodes healthy in [0-9.]+s \(compute {span} GFLOPS, "
                        rf"intra-node {span} GB/s, pair {span} GB/s\)", healthy.text()), healthy.text()
    low = min(row["compute GFLOPS"] for row in table.rows)
    assert float(healthy.text().split("(compute ")[1].split("-")[0].split(" ")[0]) == pytest.approx(low, rel=0.01)


def test_check_preflight_brings_the_saved_pool_up_prints_the_full_table_and_ends_it():
    from prefect.settings import PREFECT_API_URL

    name = f"preflight-check-{os.getpid()}"
    GPUPool(nodes=2, preflight="off", preflight_min_ratio=0.1).save(name, overwrite=True)  # "full" whatever it says
    done = subprocess.run([sys.executable, "-m", "skytasks.cli", "check", "--pool", name, "--preflight"],
                          env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    header = next(line for line in done.stdout.splitlines() if line.startswith("node "))
    assert "compute GFLOPS" in header and "pair GB/s" in header and "verdict" in header
    rows = [line for line in done.stdout.splitlines() if line.startswith(("0 ", "1 "))]
    assert len(rows) == 2 and all(row.rstrip().endswith("healthy") for row in rows)
    assert "preflight passed on 2 nodes" in done.stdout


# -- three ssh hosts, one of them slow -----------------------------------------------------------

@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    if not slow_cpu.available():
        pytest.skip("a cgroup v1 cpu controller (and root) is needed to make a slow node")
    fast = SSHServer(tmp_path_factory.mktemp("sshd-fast"), list(HEALTHY), free_port())
    slow_dir = tmp_path_factory.mktemp("sshd-slow")
    key = subprocess.run(["ssh-keygen", "-y", "-f", str(fast.folder / "client_key")], capture_output=True,
                         text=True, check=True).stdout
    slow = SSHServer(slow_dir, [SLOW], free_port(SLOW), authorized_key=key)
    try:
        with slow_cpu.slow_group(SLOW_CPUS) as group:
            # Every session this sshd forks from now on (the agent, its ranks) inherits the cgroup.
            slow_cpu.join(group, slow.proc.pid)
            yield {"fast": fast, "slow": slow}
    finally:
        slow.stop()
        fast.stop()


def three_hosts(hosts, **fields) -> GPUPool:
    """The slow host runs on a twentieth of a CPU: under the suite's load a healthy one gets a third
    of a core or more, so the slow one is under 0.15 of the median. The ratio is 0.3, not the
    default 0.5: with the slow host dropped, two healthy hosts' median is their mean, and on this
    shared machine one measured under half of it (20.3 against 42.7 GFLOPS) in a loaded run."""
    fast, slow = hosts["fast"], hosts["slow"]
    return GPUPool(provider="ssh", nodes=3, hosts=[*(f"root@{h}:{fast.port}" for h in HEALTHY),
                                                  f"root@{SLOW}:{slow.port}"],
                   ssh_private_key=fast.client_key, known_hosts=fast.known_hosts() + slow.known_hosts(),
                   remote_python=sys.executable, preflight="full", preflight_timeout_seconds=240,
                   **{"preflight_min_ratio": 0.3, **fields})


def slow_host_ended() -> None:
    """The slow host's agent and ranks end as slowly as they do everything (a twentieth of a CPU):
    waited for here, longer than the suite's own leak check waits."""
    assert wait_for_no_skytasks_processes(timeout=120) == []


def read_artifacts(flow_run_id) -> list:
    async def read():
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return asyncio.run(read())


def test_full_on_an_elastic_pool_drops_the_slow_host_before_user_code_and_names_it(hosts, tmp_path):
    marker = tmp_path / "ran"
    task = distributed_task(where, pool=three_hosts(hosts, min_nodes=2))

    @flow
    def training() -> list:
        return task(str(marker))

    with listen() as heard:
        state = training(return_state=True)
    slow_host_ended()
    assert sorted(state.result()) == sorted(HEALTHY)
    assert sorted(marker.read_text().split()) == sorted(HEALTHY)  # user code never ran on the slow host
    unhealthy = of(NodeUnhealthy, heard)
    assert unhealthy and {e.address for e in unhealthy} == {SLOW}
    compute = next(e for e in unhealthy if e.check == "compute")
    assert compute.unit == "GFLOPS" and compute.figure < compute.threshold
    [shrank] = of(PoolShrank, heard)
    assert (shrank.from_nodes, shrank.to_nodes) == (3, 2)
    deadline = time.monotonic() + 20
    while True:
        tables = [a for a in read_artifacts(state.state_details.flow_run_id) if a.key == "where-preflight"]
        if tables or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    [table] = tables  # one per start, every round in it
    rows = json.loads(table.data)
    assert [(r["round"], r["address"], r["verdict"] == "healthy") for r in rows] == [
        (1, HEALTHY[0], True), (1, HEALTHY[1], True), (1, SLOW, False), (2, HEALTHY[0], True), (2, HEALTHY[1], True)]
    assert rows[2]["compute GFLOPS"] < rows[0]["compute GFLOPS"] / 2 and "GFLOPS" in rows[2]["verdict"]


def test_full_on_a_fixed_pool_fails_the_start_naming_the_slow_host_before_user_code(hosts, tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(PoolStartError) as caught:
        distributed_task(where, pool=three_hosts(hosts))(str(marker))
    slow_host_ended()
    assert SLOW in str(caught.value) and "GFLOPS" in str(caught.value) and "threshold" in str(caught.value)
    assert not marker.exists()


# -- a namespace host with no route to the head ----------------------------------------------

@pytest.fixture(scope="module")
def split_hosts(tmp_path_factory):
    """Two hosts in network namespaces, each on a link of its own to this machine: the controller
    reaches both, neither reaches the other (no route)."""
    with netns.split_hosts(tmp_path_factory.mktemp, ("10.231.81", "10.231.82"), "skp") as made:
        yield made


def test_a_node_that_cannot_reach_the_head_fails_basic_in_seconds_named(split_hosts, tmp_path):
    servers, addresses = split_hosts["servers"], split_hosts["addresses"]
    pool = GPUPool(provider="ssh", nodes=2, hosts=[f"root@{a}" for a in addresses],
                   ssh_private_key=servers[0].client_key, remote_python=sys.executable,
                   known_hosts="".join(s.known_hosts() for s in servers), preflight_timeout_seconds=60)
    marker = tmp_path / "ran"
    task = distributed_task(where, pool=pool)
    with pool:  # timed from the nodes being up: the preflight, not the start
        started = time.monotonic()
        with listen() as heard, pytest.raises(PoolStartError) as caught:
            task(str(marker))
        took = time.monotonic() - started
    assert f"node 1 ({addresses[1]})" in str(caught.value) and "cannot reach the head" in str(caught.value)
    assert [(e.node, e.address, e.check) for e in of(NodeUnhealthy, heard)] == [(1, addresses[1], "collective")]
    assert took < 25, took  # the rank's own no-route grace, not torch's rendezvous timeout (minutes)
    assert not marker.exists()
