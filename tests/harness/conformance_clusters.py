"""The conformance suite's fleets that own something beyond their agents: moto's EC2 (with a
stand-in for cloud-init), the SLURM test cluster and the Kubernetes test cluster (see
`tests.harness.conformance` for the fleet's verbs)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import psutil

from skytasks import GPUPool
from skytasks.controller.session import PoolSession
from skytasks.providers import NodeProvider
from tests.harness.conformance import Fleet, kill_ssh_sessions

ROOT = Path(__file__).resolve().parents[2]


class AWSFleet(Fleet):
    name = "aws"

    def __init__(self, moto, folder, monkeypatch):
        from tests.test_aws_provider import CloudInitStandIn

        self.moto, self.monkeypatch = moto, monkeypatch
        self.stand_in = CloudInitStandIn(moto["ec2"], folder)
        self.stand_in.start()

    def pool(self, **fields: Any) -> GPUPool:
        return GPUPool(provider="aws", instance_type="t3.micro", image_id=self.moto["image"],
                       subnet_id=self.moto["subnet"], aws_credentials=self.moto["creds"],
                       ssh_ingress_cidr="127.0.0.1/32", ssh_user="root", remote_python=sys.executable,
                       **{"ready_timeout_seconds": 120, **fields})

    @contextlib.contextmanager
    def room_for(self, count: int) -> Iterator[None]:
        """EC2's own InsufficientInstanceCapacity past `count` instances, as a full region says."""
        from tests.test_aws_provider import limit_ec2_capacity

        with self.monkeypatch.context() as m:
            limit_ec2_capacity(m, {"instances": count})
            yield

    def leftovers(self) -> list[str]:
        from tests.test_aws_provider import leftovers

        held = leftovers(self.moto["ec2"])
        return [f"{kind}: {ids}" for kind, ids in held.items() if ids]

    def holdings(self) -> list[str]:
        """Its instances, security group and login key pair (made by the pool: made once)."""
        from tests.test_aws_provider import leftovers

        return sorted(f"{kind}: {i}" for kind, ids in leftovers(self.moto["ec2"]).items() for i in ids)

    def gc(self, now: datetime) -> list[str]:
        from skytasks.providers.aws.gc import sweep

        return sweep(self.moto["ec2"], now=now)

    def break_stream(self, session: PoolSession) -> set[int]:
        kill_ssh_sessions(session.nodes[1].pid)  # in the instance's sshd (the stand-in's)
        return {1}

    def end_node(self, provider: NodeProvider, node_id: int) -> str | None:
        iid = provider._node_ids[node_id]  # type: ignore[attr-defined]
        self.moto["ec2"].terminate_instances(InstanceIds=[iid])
        return f"its instance {iid} is (shutting-down|terminated)"

    def close(self) -> None:
        self.stand_in.stop()


def agent_sruns(job_id: str, node: str) -> list:
    """The srun of a node's agent step, and its shepherd (the child srun that cancels the step
    when its parent dies)."""
    parents = [p for p in psutil.process_iter(["cmdline"])
               if (p.info["cmdline"] or [])[:1] == ["srun"] and f"--jobid={job_id}" in p.info["cmdline"]
               and f"--nodelist={node}" in p.info["cmdline"] and "attach" not in " ".join(p.info["cmdline"])
               and p.parent() is not None and p.parent().name() != "srun"]
    return [q for p in parents for q in (p, *p.children())]


class SlurmFleet(Fleet):
    name = "slurm"
    holdings_end_with_agents = True  # the batch script ends the allocation when its agents say so

    def __init__(self, cluster):
        self.cluster = cluster

    def pool(self, **fields: Any) -> GPUPool:
        return GPUPool(provider="slurm", remote_python=sys.executable, **{"ready_timeout_seconds": 60, **fields})

    @contextlib.contextmanager
    def room_for(self, count: int) -> Iterator[None]:
        """Someone else's job holds the other nodes."""
        names = sorted(self.cluster.node_states())
        self.cluster.wait_idle(names=names[:count])  # a job just ended may still be completing
        held = names[count:]
        blocker = self.cluster.run("sbatch", "--parsable", "-w", ",".join(held), "--exclusive", "--output=/dev/null",
                                   "--wrap", "sleep 300").stdout.strip().split(";")[0]
        self.cluster.wait_running(blocker)
        try:
            yield
        finally:
            self.cluster.run("scancel", blocker)
            self.cluster.wait_queue_empty_of(blocker)

    def leftovers(self) -> list[str]:
        return self.cluster.wait_queue_empty(timeout=30)

    def holdings(self) -> list[str]:
        return [ln for ln in self.cluster.run("squeue", "-h", "-o", "%i %j").stdout.splitlines() if "skytasks" in ln]

    def gc(self, now: datetime) -> list[str]:
        from skytasks.event_bus import PoolReporter
        from skytasks.providers.slurm.gc import sweep_jobs
        from skytasks.providers.slurm.shell import SlurmShell
        from skytasks.providers.slurm.spec import SlurmSpec

        return sweep_jobs(SlurmShell(self.pool(nodes=1).spec().own(SlurmSpec), PoolReporter("gc", "slurm")), now=now)

    def break_stream(self, session: PoolSession) -> set[int]:
        """srun of node 1's agent step and its shepherd SIGKILLed (srun's I/O gone, nobody to
        cancel the step): the agent runs on in its step."""
        node = session.provider.nodes[session.nodes[1].link.node_id]  # type: ignore[attr-defined]
        sruns = [p for p in agent_sruns(node.job_id, node.name) if "skytasks.node.agent" in " ".join(p.cmdline())]
        assert len(sruns) == 2, sruns  # srun and its shepherd
        # Both stopped first, the shepherd before its parent: a shepherd that saw its parent die
        # (a moment between two kills, under load) would cancel the step, agent and all.
        for p in reversed(sruns):
            p.suspend()
        for p in sruns:
            p.kill()
        return {1}

    def end_node(self, provider: NodeProvider, node_id: int) -> str | None:
        job = provider.nodes[node_id].job_id  # type: ignore[attr-defined]
        self.cluster.run("scancel", job)
        self.cluster.wait_queue_empty_of(job)
        return f"job {job}.*SLURM says the job is no longer in the queue"


def pod_of(where: str) -> str:
    return where.split()[1]  # "pod NAME on node X"


class KubernetesFleet(Fleet):
    """The test cluster's first node (its pods are kept there, the second node is for the tests
    of placement): pods ask for a tenth of a CPU each, and `room_for` has a pod of someone else's
    hold the rest of the node's CPU."""

    name = "kubernetes"
    CPU = 100  # millicores per pod

    def __init__(self, cluster):
        self.cluster = cluster

    def pool(self, **fields: Any) -> GPUPool:
        from tests.harness.kube import kube_pool

        template = self.cluster.host_python_template()
        template["spec"]["containers"].append({"resources": {"requests": {"cpu": f"{self.CPU}m"}}})
        template["spec"]["nodeSelector"] = {"kubernetes.io/hostname": self.cluster.nodes[0]}
        return kube_pool(self.cluster, k8s_pod_template=template, **{"ready_timeout_seconds": 60, **fields})

    def warm_pool(self, **fields: Any) -> GPUPool:
        """Under exactly deployments/kubernetes/rbac.yaml (its service account `skytasks`), as a
        team runs it: attaching must need nothing more (issue 58)."""
        self.cluster.kubectl("apply", "-n", "default", "-f", str(ROOT / "deployments/kubernetes/rbac.yaml"))
        kubeconfig = self.cluster.kubeconfig_for_service_account("default", "skytasks")
        return self.pool(kubeconfig=kubeconfig, **fields)

    @contextlib.contextmanager
    def room_for(self, count: int) -> Iterator[None]:
        from kubernetes.utils import parse_quantity

        node = json.loads(self.cluster.kubectl("get", "node", self.cluster.nodes[0], "-o", "json").stdout)
        allocatable = int(parse_quantity(node["status"]["allocatable"]["cpu"]) * 1000)
        hold = allocatable - count * self.CPU - self.CPU // 2
        template = self.cluster.host_python_template()
        container = template["spec"]["containers"][0]
        container.update(name="blocker", command=[sys.executable, "-c", "import time; time.sleep(600)"],
                         resources={"requests": {"cpu": f"{hold}m"}})
        template["spec"]["nodeSelector"] = {"kubernetes.io/hostname": self.cluster.nodes[0]}
        manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "someone-elses"}, "spec": template["spec"]}
        path = self.cluster.folder / "someone-elses.json"
        path.write_text(json.dumps(manifest))
        self.cluster.kubectl("apply", "-f", str(path))
        try:
            self.cluster.kubectl("wait", "--for=condition=Ready", "pod/someone-elses", "--timeout=60s")
            yield
        finally:
            self.cluster.kubectl("delete", "pod", "someone-elses", "--grace-period=0", "--force", check=False)

    def leftovers(self) -> list[str]:
        from tests.harness.kube import held

        deadline = time.monotonic() + 30
        while (left := held(self.cluster)) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    def holdings(self) -> list[str]:
        from tests.harness.kube import held

        return sorted(held(self.cluster))  # its pods and their owner

    def gc(self, now: datetime) -> list[str]:
        from kubernetes import client

        from skytasks.providers.kubernetes import cluster
        from skytasks.providers.kubernetes.gc import sweep
        from tests.harness.kube import credentials

        cfg = cluster.configuration(credentials(self.cluster.admin_kubeconfig))
        return sweep(client.CoreV1Api(cluster.api_client(cfg)), "default", now=now)

    def kill_agent(self, session: PoolSession, node_rank: int) -> None:
        """Its pod is deleted at once (`kubectl delete --grace-period=0 --force`)."""
        self.cluster.kubectl("delete", "pod", session.nodes[node_rank].link.machine, "--grace-period=0", "--force",
                             "--wait=false")

    def identity(self, node: Any) -> Any:
        return node.link.machine  # its pod: pids are the pod's own, and repeat between pods

    def phases(self, pods: list[str]) -> dict[str, str]:
        """Each of these pods that still exists, and its phase."""
        listed = json.loads(self.cluster.kubectl("get", "pods", "-n", "default", "-o", "json").stdout)["items"]
        found = {p["metadata"]["name"]: p["status"].get("phase", "") for p in listed}
        return {name: found[name] for name in pods if name in found}

    def agents_of(self, seen: dict) -> list[Any]:
        return [(pod_of(where), pid) for where, pid in zip(seen["where"], seen["pids"])]  # the same pods, agents

    def kill_unheld(self, seen: dict, node: int) -> None:
        """Its pod is deleted."""
        pod = pod_of(seen["where"][node])
        self.cluster.kubectl("delete", "pod", pod, "-n", "default", "--grace-period=0", "--force")
        deadline = time.monotonic() + 60
        while pod in self.phases([pod]):
            assert time.monotonic() < deadline, "the deleted pod did not go"
            time.sleep(0.5)

    def agents_running(self, seen: dict) -> bool:
        return set(self.phases([pod_of(w) for w in seen["where"]]).values()) == {"Running"}

    def agents_ended(self, seen: dict) -> bool:
        return "Running" not in self.phases([pod_of(w) for w in seen["where"]]).values()

    ends_within_seconds = 60.0  # the pod's own end, seen through the API server

    def break_stream(self, session: PoolSession) -> set[int]:
        """The kube-apiserver SIGKILLed and started again: every exec stream is cut."""
        self.cluster.restart_apiserver()
        return {n.link.node_id for n in session.nodes}

    def door(self, provider: NodeProvider, node_id: int) -> Any:
        from tests.harness.conformance_doors import PodDoor

        return PodDoor(provider, node_id)

    def end_node(self, provider: NodeProvider, node_id: int) -> str | None:
        pod = provider.nodes[node_id]  # type: ignore[attr-defined]
        self.cluster.kubectl("delete", "pod", pod, "--grace-period=0", "--force", "--wait=false")
        return f"(?s)(?=.*{pod})(?=.*Kubernetes)"
