"""Node health before user code on the real SLURM and Kubernetes test clusters: a node made slow
for real (held by a cgroup v1 cpu quota to 3% of a CPU: on SLURM its slurmd, and so every
step and rank it starts; on Kubernetes its kubelet's pods' cgroup) fails `preflight="full"` before
any user code, and is replaced by one that avoids it (SLURM: `--exclude`; Kubernetes: a required
node affinity keeping the new pod off it): the call runs on healthy nodes only, nothing left behind."""

from __future__ import annotations

import json
import time
import socket
import sys
from pathlib import Path

import pytest

from skytasks import GPUPool, distributed_task
from skytasks.events import NodeReplaced, listen
from skytasks.preflight.report import NodeUnhealthy
from tests.conftest import wait_for_no_skytasks_processes
from tests.harness import slow_cpu
from tests.harness.kube import held, kube_pool, sharing

SLOW_CPUS = 0.03  # of one CPU
# The floor a node's matmul must reach, in TFLOPS (5 GFLOPS). A core here does about 96 GFLOPS
# alone; the slow node measured 0.7-1.7 (at most about 2.7, were each of its quota's slices to fall
# in the 0.25 s window), a healthy one under the suite's load far more.
FLOOR_TFLOPS = 0.005


def host(marker: str) -> str:
    """User code: says, in a shared file, which SLURM node it ran on."""
    name = socket.gethostname()
    with open(marker, "a") as out:
        out.write(name + "\n")
    return name


@pytest.fixture
def slow_node(cluster):
    """n0 made slow: its slurmd moved into a slow cgroup, so every step it forks from now on
    (proctrack/linuxproc, task/none: no cgroup of SLURM's own) inherits it."""
    if not slow_cpu.available():
        pytest.skip("a cgroup v1 cpu controller (and root) is needed to make a slow node")
    name = "n0"
    with slow_cpu.slow_group(SLOW_CPUS, "slow-slurmd") as group:
        slow_cpu.join(group, slurmd_pid(cluster, name))
        yield name


def slurmd_pid(cluster, name: str) -> int:
    """The slurmd process itself (the cluster's daemon handle is nsenter's, which execs into it)."""
    parent = cluster.daemons[name].pid
    for pid in [parent, *_descendants(parent)]:
        if Path(f"/proc/{pid}/comm").read_text().strip() == "slurmd":
            return pid
    raise AssertionError(f"no slurmd under {parent}")


def _descendants(pid: int) -> list[int]:
    found = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        found += [int(child), *_descendants(int(child))]
    return found


def excluded_nodes(cluster) -> list[str]:
    """Every running job's ExcNodeList, as slurmctld holds it."""
    shown = cluster.run("scontrol", "show", "job", "--oneliner", check=False).stdout
    lists = [field.split("=", 1)[1] for line in shown.splitlines() for field in line.split()
             if field.startswith("ExcNodeList=") and field != "ExcNodeList=(null)"]
    # SLURM's hostlist form ("n[0-1]"), each expanded to names
    return [",".join(cluster.run("scontrol", "show", "hostnames", names).stdout.split()) for names in lists]


def test_slurm_a_slow_node_is_replaced_by_an_allocation_that_excludes_it_before_user_code(
        cluster, slow_node, tmp_path):
    marker = tmp_path / "ran"
    # The slow node is found by the floor, as on Kubernetes below. Two nodes' median is their mean,
    # and a 2-core machine running the suite beside this can leave one healthy node under half of it.
    pool = GPUPool(provider="slurm", nodes=2, remote_python=sys.executable, preflight="full",
                   preflight_min_tflops=FLOOR_TFLOPS, preflight_min_ratio=0.1,
                   preflight_timeout_seconds=240, ready_timeout_seconds=240)
    task = distributed_task(host, pool=pool)
    with pool, listen() as heard:
        hosts = task(str(marker))
        excluded = excluded_nodes(cluster)  # while the replacement's allocation runs
    assert wait_for_no_skytasks_processes(timeout=120) == []  # the slow node's processes end at its pace
    unhealthy = [e for e in heard if isinstance(e, NodeUnhealthy)]
    assert unhealthy and {e.check for e in unhealthy} >= {"compute"}, unhealthy
    assert any(slow_node in e.address or e.address == cluster.addresses[slow_node] for e in unhealthy), unhealthy
    assert [e for e in heard if isinstance(e, NodeReplaced)], "the slow node was not replaced"
    assert slow_node not in hosts and len(set(hosts)) == 2, hosts  # the call ran on two healthy nodes
    assert slow_node not in marker.read_text().split()  # user code never ran on the slow node
    assert any(slow_node in names.split(",") for names in excluded), excluded  # sbatch --exclude
    assert cluster.wait_queue_empty(timeout=30) == []


# -- Kubernetes ---------------------------------------------------------------------------------

def test_kubernetes_a_slow_node_is_replaced_by_a_pod_kept_off_it_before_user_code(k8s_cluster, tmp_path):
    k8s = k8s_cluster
    if len(k8s.nodes) < 2 or not slow_cpu.available():
        pytest.skip("two Kubernetes nodes and a cgroup v1 cpu controller are needed")
    healthy, slow = k8s.nodes[0], k8s.nodes[1]
    # The kubelet's cgroupRoot on the slow node: every pod it starts is under it (the kubelet is not).
    group = slow_cpu.CPU_CGROUP / k8s.node(slow).cgroup_root.strip("/")
    template = sharing(k8s, tmp_path)  # the marker's folder, read-write in the pods
    template["spec"]["containers"][0]["env"] = [  # the downward API: which node the pod is on
        {"name": "SKYTASKS_TEST_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    # The first pod prefers the slow node (so the preflight meets it); the replacement's required
    # affinity (the preflight's doing) must overrule that preference.
    template["spec"]["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "preference": {"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": [slow]}]}}]}}
    marker = tmp_path / "ran"
    # One pod: no median to compare with, so the floor.
    pool = kube_pool(k8s, nodes=1, k8s_pod_template=template, preflight="full", preflight_min_tflops=FLOOR_TFLOPS,
                     preflight_timeout_seconds=240, ready_timeout_seconds=240)
    task = distributed_task(node_name, pool=pool)
    # The preference alone may lose to the scheduler's other scores (a CI run found no slow node: its pod likely went to the
    # healthy node): the healthy node is also one pods should avoid, which the replacement, kept off
    # the slow one, still may not.
    k8s.taint_node(healthy, "skytasks-test/prefer-the-slow-node", effect="PreferNoSchedule")
    deadline = time.monotonic() + 60
    while held(k8s) and time.monotonic() < deadline:  # earlier tests' pods still ending count against a node
        time.sleep(0.5)
    slow_cpu.limit(group, SLOW_CPUS)
    try:
        with pool, listen() as heard:
            ran_on = task(str(marker))
            pods = json.loads(k8s.kubectl("get", "pods", "-l", "app.kubernetes.io/managed-by=skytasks",
                                          "-o", "json").stdout)["items"]
    finally:
        slow_cpu.limit(group, None)
        k8s.untaint_node(healthy, "skytasks-test/prefer-the-slow-node")
    unhealthy = [e for e in heard if isinstance(e, NodeUnhealthy)]
    assert unhealthy and unhealthy[0].check == "compute" and unhealthy[0].figure < unhealthy[0].threshold, unhealthy
    assert [e for e in heard if isinstance(e, NodeReplaced)], "the slow node's pod was not replaced"
    assert ran_on == [healthy]  # the call ran on the healthy node
    assert marker.read_text().split() == [healthy]  # user code never ran on the slow one
    [pod] = [p for p in pods if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
    assert pod["spec"]["nodeName"] == healthy
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": [slow]} in [
        e for t in terms["nodeSelectorTerms"] for e in t.get("matchExpressions", [])], terms
    deadline = time.monotonic() + 60
    while (left := held(k8s)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == []
    assert wait_for_no_skytasks_processes(timeout=120) == []


def node_name(marker: str) -> str:
    """User code: says, in a shared file, which Kubernetes node its pod runs on (the downward API)."""
    import os as os_

    name = os_.environ.get("SKYTASKS_TEST_NODE_NAME", "")
    with open(marker, "a") as out:
        out.write(name + "\n")
    return name
