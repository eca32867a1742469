"""Warm pools across processes on the real fleets (issue 52, part 3): a saved pool with
keep_warm_minutes, used by one controller process that then exits, is attached to by the next
process (the same agents, the same pods) instead of being started again; a node lost while nobody
held the pool is replaced before the next holder's first call; and an unheld pool ends itself,
leaving nothing.

Each controller is a process of its own (tests/programs/warm_call.py, a Prefect flow run),
as a deployment's runs are: the real sshd on loopback and the Kubernetes test cluster.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psutil
from prefect.client.orchestration import get_client

from skytasks import GPUPool
from tests.conftest import gone
from tests.harness.ssh_pools import ssh_pool
from tests.harness.sshd import SSHServer
from tests.harness.warm import api_env as _env
from tests.harness.warm import pools_down

PROGRAM = Path(__file__).parent / "programs" / "warm_call.py"
ROOT = Path(__file__).resolve().parent.parent


def use(name: str, out: Path, timeout: float = 300) -> dict:
    """One controller process uses the saved pool once, and exits."""
    proc = subprocess.run([sys.executable, str(PROGRAM), name, str(out)], env=_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return json.loads(out.read_text())


def events(name: str, since: datetime, kind: str, timeout: float = 20) -> list[dict]:
    """The pool's `skytasks.pool.<kind>` events since `since`, once there is one."""
    async def read() -> list[dict]:
        async with get_client() as client:
            resp = await client._client.post("/events/filter", json={
                "filter": {"event": {"name": [f"skytasks.pool.{kind}"]}, "occurred": {"since": since.isoformat()}},
                "limit": 50})
            resp.raise_for_status()
            return resp.json()["events"]

    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in asyncio.run(read()) if e["resource"]["prefect.resource.id"] == f"skytasks.pool.{name}"]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.3)


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} not within {timeout:g}s"
        time.sleep(0.2)


# -- ssh ----------------------------------------------------------------------------------------

def an_unheld_agent_killed_is_replaced(pool_name: str, first: dict, tmp_path: Path) -> dict:
    """Node 1's agent dies while nobody holds the pool: the next holder replaces it before its
    call, and node 0's agent serves on. What the next holder saw."""
    lost = first["pids"][1]
    os.kill(lost, signal.SIGKILL)
    wait_until(lambda: gone(lost), 10, "the killed agent gone")
    third = use(pool_name, tmp_path / "third.json")
    assert third["ranks"] == [0, 1]
    assert third["pids"][0] == first["pids"][0] and third["pids"][1] != lost and not gone(third["pids"][1])
    return third


def save_ssh(server: SSHServer, name: str, **fields) -> None:
    ssh_pool(server, ready_timeout_seconds=60, reattach_seconds=5,
             **{"keep_warm_minutes": 2.0, **fields}).save(name, overwrite=True)


def test_ssh_the_next_process_attaches_to_the_same_agents_and_a_node_lost_unheld_is_replaced(sshd, pool_name, tmp_path):
    save_ssh(sshd, pool_name)
    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    first = use(pool_name, tmp_path / "first.json")
    assert first["ranks"] == [0, 1]
    assert all(not gone(pid) for pid in first["pids"]), "the agents ended with their process"
    second = use(pool_name, tmp_path / "second.json")
    assert second["pids"] == first["pids"] and second["ranks"] == [0, 1]  # the same agents, and they work
    attached = events(pool_name, since, "attached")
    assert any(e["related"] and any(r["prefect.resource.id"] == f"prefect.flow-run.{second['flow_run_id']}"
                                    for r in e["related"]) for e in attached), attached
    an_unheld_agent_killed_is_replaced(pool_name, first, tmp_path)


def test_ssh_a_dead_holder_frees_the_pool_within_reattach_seconds(sshd, pool_name, tmp_path):
    """The holder SIGKILLed in the middle of a call: its SSH connections drop, each agent waits its
    re-attach window (5 s + 2), stops the dead holder's ranks and lets the next process hold it."""
    save_ssh(sshd, pool_name)
    holder = subprocess.Popen([sys.executable, str(Path(__file__).parent / "programs" / "warm_call.py"), pool_name,
                               str(tmp_path / "holder.json"), "120"], env=_env(), cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(list(tmp_path.glob("holder.json.ready*"))) == 2, 120, "the holder's ranks in its call")
        ranks = [int(p.read_text()) for p in tmp_path.glob("holder.json.ready*")]
        agents = [next(a.pid for a in psutil.Process(r).parents() if "skytasks.node.agent" in " ".join(a.cmdline()))
                  for r in ranks]
    finally:
        holder.kill()
        holder.wait()
    killed = time.monotonic()
    second = use(pool_name, tmp_path / "second.json")
    assert time.monotonic() - killed < 5 + 2 + 20  # the window, and the second process's own start
    assert sorted(second["pids"]) == sorted(agents) and second["ranks"] == [0, 1]
    assert all(gone(r) for r in ranks)  # the dead holder's ranks were stopped, not left running


def test_ssh_an_unheld_pool_ends_itself_after_keep_warm(sshd, pool_name, tmp_path):
    save_ssh(sshd, pool_name, keep_warm_minutes=0.05)  # 3 s
    first = use(pool_name, tmp_path / "first.json")
    pids = first["pids"]
    wait_until(lambda: all(gone(p) for p in pids), 30, "the unheld agents' end")
    assert not [p for p in psutil.process_iter(["cmdline"]) if "skytasks.node" in " ".join(p.info["cmdline"] or [])
                and any(p.pid == q or q in [a.pid for a in p.parents()] for q in pids)]
    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    again = use(pool_name, tmp_path / "again.json")  # started afresh, quietly
    assert again["ranks"] == [0, 1] and set(again["pids"]).isdisjoint(pids)
    assert events(pool_name, since, "expired")


# -- aws (moto's EC2 on loopback; each instance's sshd played by CloudInitStandIn) ----------------

def test_aws_the_next_process_attaches_to_the_same_instances_and_pools_down_terminates_them(moto, tmp_path,
                                                                                            monkeypatch, pool_name):
    import asyncssh

    from tests.test_aws_provider import leftovers
    from tests.test_provider_conformance import AWSFleet

    key = asyncssh.generate_private_key("ssh-ed25519")
    pair = f"warm-{uuid.uuid4().hex[:6]}"
    moto["ec2"].import_key_pair(KeyName=pair, PublicKeyMaterial=key.export_public_key())
    fleet = AWSFleet(moto, tmp_path, monkeypatch)
    try:
        fleet.pool(nodes=2, key_name=pair, ssh_private_key=key.export_private_key().decode(), reattach_seconds=10,
                   keep_warm_minutes=2.0).save(pool_name, overwrite=True)
        first = use(pool_name, tmp_path / "first.json")
        assert first["ranks"] == [0, 1] and all(not gone(pid) for pid in first["pids"])
        instances = leftovers(moto["ec2"])["instances"]
        assert len(instances) == 2
        second = use(pool_name, tmp_path / "second.json")
        assert second["pids"] == first["pids"] and second["ranks"] == [0, 1]
        assert leftovers(moto["ec2"])["instances"] == instances  # nothing launched again
        pools_down(pool_name)
        wait_until(lambda: not leftovers(moto["ec2"])["instances"], 60, "the instances terminated")
        assert leftovers(moto["ec2"])["security_groups"] == [] and all(gone(p) for p in first["pids"])
    finally:
        moto["ec2"].delete_key_pair(KeyName=pair)
        fleet.close()


def test_an_aws_pool_that_makes_its_own_login_key_keeps_warm_and_pools_down_deletes_its_key_pair(
        moto, tmp_path, monkeypatch, pool_name):
    # The key the pool made travels in the warm record (a Prefect Secret), so the next holder logs in.
    from tests.test_aws_provider import leftovers
    from tests.test_provider_conformance import AWSFleet

    fleet = AWSFleet(moto, tmp_path, monkeypatch)
    try:
        fleet.pool(nodes=2, reattach_seconds=10, keep_warm_minutes=2.0).save(pool_name, overwrite=True)
        first = use(pool_name, tmp_path / "first.json")
        made = leftovers(moto["ec2"])
        assert first["ranks"] == [0, 1] and len(made["instances"]) == 2 and len(made["key_pairs"]) == 1
        second = use(pool_name, tmp_path / "second.json")
        assert second["pids"] == first["pids"] and leftovers(moto["ec2"])["instances"] == made["instances"]
        pools_down(pool_name)
        wait_until(lambda: not leftovers(moto["ec2"])["instances"], 60, "the instances terminated")
        assert leftovers(moto["ec2"]) == {"instances": [], "security_groups": [], "key_pairs": []}
    finally:
        fleet.close()


# -- slurm --------------------------------------------------------------------------------------

def save_slurm(name: str, **fields) -> None:
    GPUPool(provider="slurm", nodes=2, remote_python=sys.executable, ready_timeout_seconds=60, reattach_seconds=10,
            **{"keep_warm_minutes": 2.0, **fields}).save(name, overwrite=True)


def skytasks_jobs(cluster) -> list[str]:
    return [ln for ln in cluster.run("squeue", "-h", "-o", "%i %j").stdout.splitlines() if "skytasks" in ln]


def test_slurm_the_next_process_attaches_to_the_same_agents_in_the_same_job_and_a_lost_one_is_replaced(
        cluster, pool_name, tmp_path):
    save_slurm(pool_name)
    first = use(pool_name, tmp_path / "first.json")
    assert first["ranks"] == [0, 1] and all(not gone(pid) for pid in first["pids"])
    jobs = skytasks_jobs(cluster)
    second = use(pool_name, tmp_path / "second.json")  # its srun steps beside the agents, its own ended
    assert second["pids"] == first["pids"] and second["ranks"] == [0, 1] and skytasks_jobs(cluster) == jobs
    third = an_unheld_agent_killed_is_replaced(pool_name, first, tmp_path)
    pools_down(pool_name)
    wait_until(lambda: not skytasks_jobs(cluster), 60, "the pool's jobs cancelled")
    assert all(gone(p) for p in third["pids"])


def test_slurm_an_unheld_pool_ends_its_allocation_after_keep_warm(cluster, pool_name, tmp_path):
    save_slurm(pool_name, keep_warm_minutes=0.05, idle_minutes=2)
    first = use(pool_name, tmp_path / "first.json")
    assert skytasks_jobs(cluster)
    wait_until(lambda: all(gone(p) for p in first["pids"]), 30, "the unheld agents' end")
    wait_until(lambda: not skytasks_jobs(cluster), 45, "the allocation's end")  # long before idle_minutes


# -- kubernetes ---------------------------------------------------------------------------------

def save_kubernetes(k8s_cluster, name: str, **fields) -> None:
    """A warm pool whose identity holds exactly deployments/kubernetes/rbac.yaml (its service
    account `skytasks`), as a team runs it: attaching must need nothing more (issue 58)."""
    from tests.test_provider_conformance import KubernetesFleet

    k8s_cluster.kubectl("apply", "-n", "default", "-f", str(ROOT / "deployments/kubernetes/rbac.yaml"))
    kubeconfig = k8s_cluster.kubeconfig_for_service_account("default", "skytasks")
    KubernetesFleet(k8s_cluster).pool(nodes=2, kubeconfig=kubeconfig,
                                      **{"reattach_seconds": 10, "keep_warm_minutes": 2.0, **fields}).save(
        name, overwrite=True)


def pod_of(where: str) -> str:
    return where.split()[1]  # "pod NAME on node X"


def pods_of(k8s_cluster, pool_pods: list[str]) -> dict[str, str]:
    """Each of these pods that still exists, and its phase."""
    listed = json.loads(k8s_cluster.kubectl("get", "pods", "-n", "default", "-o", "json").stdout)["items"]
    found = {p["metadata"]["name"]: p["status"].get("phase", "") for p in listed}
    return {name: found[name] for name in pool_pods if name in found}


def test_kubernetes_the_next_process_attaches_to_the_same_pods_and_a_deleted_pod_is_replaced(k8s_cluster, pool_name,
                                                                                              tmp_path):
    save_kubernetes(k8s_cluster, pool_name)
    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    first = use(pool_name, tmp_path / "first.json")
    pods = [pod_of(w) for w in first["where"]]
    assert first["ranks"] == [0, 1] and set(pods_of(k8s_cluster, pods).values()) == {"Running"}
    second = use(pool_name, tmp_path / "second.json")
    assert [pod_of(w) for w in second["where"]] == pods and second["pids"] == first["pids"]
    assert second["ranks"] == [0, 1]
    assert events(pool_name, since, "attached")
    k8s_cluster.kubectl("delete", "pod", pods[1], "-n", "default", "--grace-period=0", "--force")
    wait_until(lambda: pods[1] not in pods_of(k8s_cluster, pods), 60, "the deleted pod gone")
    third = use(pool_name, tmp_path / "third.json")
    now = [pod_of(w) for w in third["where"]]
    assert third["ranks"] == [0, 1] and now[0] == pods[0] and now[1] != pods[1]
    pools_down(pool_name)
    wait_until(lambda: not pods_of(k8s_cluster, [*pods, *now]), 60, "the pool's pods deleted")


def test_kubernetes_an_unheld_pool_ends_its_pods_after_keep_warm(k8s_cluster, pool_name, tmp_path):
    save_kubernetes(k8s_cluster, pool_name, keep_warm_minutes=0.05)
    first = use(pool_name, tmp_path / "first.json")
    pods = [pod_of(w) for w in first["where"]]
    wait_until(lambda: "Running" not in pods_of(k8s_cluster, pods).values(), 60, "the unheld pods' end")
    pools_down(pool_name)  # what the next process (or skytasks pools) does with an expired pool
    wait_until(lambda: not pods_of(k8s_cluster, pods), 60, "the ended pods deleted")
