"""The Kubernetes test cluster itself (tests/k8s_cluster.py), through the `kubernetes` client."""

from __future__ import annotations

import copy
import sys
import time
import uuid

import pytest

kubernetes = pytest.importorskip("kubernetes")
from kubernetes import client, config  # noqa: E402
from kubernetes.client.rest import ApiException  # noqa: E402


@pytest.fixture(scope="module")
def api(k8s_cluster) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(str(k8s_cluster.admin_kubeconfig)))


@pytest.fixture
def namespace(api, k8s_cluster):
    name = k8s_cluster.create_namespace(f"t-{uuid.uuid4().hex[:8]}")
    yield name
    api.delete_namespace(name, grace_period_seconds=0)


def python_pod(k8s_cluster, name: str, code: str, env: dict | None = None, **spec) -> dict:
    """A pod whose one container runs `code` with the host's Python: the template's container
    entry (it has no name) merged into the pod's own."""
    template = copy.deepcopy(k8s_cluster.host_python_template())
    container = {**template["spec"]["containers"][0], "name": "main", "command": [sys.executable, "-c", code],
                 "env": [{"name": k, "value": v} for k, v in (env or {}).items()]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, **spec,
                     "volumes": template["spec"]["volumes"], "containers": [container]}}


def wait_phase(api, namespace: str, name: str, phases: tuple[str, ...], timeout: float = 90) -> client.V1Pod:
    deadline = time.monotonic() + timeout
    while True:
        pod = api.read_namespaced_pod(name, namespace)
        if pod.status.phase in phases:
            return pod
        if pod.status.phase == "Failed" or time.monotonic() > deadline:
            logs = ""
            try:
                logs = api.read_namespaced_pod_log(name, namespace)
            except ApiException:
                pass
            raise AssertionError(f"{name}: {pod.status.phase}, not {phases}: {pod.status}\n{logs}")
        time.sleep(0.2)


def test_node_is_ready(api, k8s_cluster):
    nodes = api.list_node().items
    assert [n.metadata.name for n in nodes] == [k8s_cluster.node_name]
    ready = [c.status for c in nodes[0].status.conditions if c.type == "Ready"]
    assert ready == ["True"]
    addresses = {a.type: a.address for a in nodes[0].status.addresses}
    assert addresses["InternalIP"] == k8s_cluster.node_ip


def test_a_pod_runs_the_hosts_python_with_torch(api, k8s_cluster, namespace):
    code = """
import socket, torch, cloudpickle, skytasks
print('torch', torch.__version__, torch.ones(2).sum().item())
try:  # nothing routes out of the node's namespace (a documentation address, never a real one)
    socket.create_connection(("203.0.113.7", 80), timeout=5)
except OSError as e:
    print("outside:", type(e).__name__)
"""
    api.create_namespaced_pod(namespace, python_pod(k8s_cluster, "py", code))
    wait_phase(api, namespace, "py", ("Succeeded",))
    logs = api.read_namespaced_pod_log("py", namespace).splitlines()  # the apiserver through to the kubelet
    assert logs[0].startswith("torch ") and logs[0].endswith(" 2.0"), logs
    assert logs[1] == "outside: OSError", logs  # no route: at once, not a timeout


def test_two_pods_all_reduce_over_gloo_by_pod_ip(api, k8s_cluster, namespace):
    code = """
import os, torch, torch.distributed as dist
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER']}:29500", rank=rank, world_size=2)
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
print("sum", t.item(), flush=True)
dist.destroy_process_group()
"""
    pod_ip = {"name": "MASTER", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    # rank0 is also `rank0.ranks.<namespace>.svc.cluster.local`, by a headless Service
    api.create_namespaced_service(namespace, {"metadata": {"name": "ranks"},
                                              "spec": {"clusterIP": "None", "selector": {"app": "ranks"}}})
    first = python_pod(k8s_cluster, "rank0", code, {"RANK": "0"}, hostname="rank0", subdomain="ranks")
    first["metadata"]["labels"] = {"app": "ranks"}
    first["spec"]["containers"][0]["env"].append(pod_ip)
    api.create_namespaced_pod(namespace, first)
    master = wait_phase(api, namespace, "rank0", ("Running", "Succeeded")).status.pod_ip
    assert master
    lookup = f"import socket; print(socket.gethostbyname('rank0.ranks.{namespace}.svc.cluster.local'))\n"
    api.create_namespaced_pod(namespace, python_pod(k8s_cluster, "rank1", lookup + code,
                                                    {"RANK": "1", "MASTER": master}))
    second = wait_phase(api, namespace, "rank1", ("Succeeded",))
    assert second.status.pod_ip != master
    wait_phase(api, namespace, "rank0", ("Succeeded",))
    assert api.read_namespaced_pod_log("rank0", namespace).strip() == "sum 3.0"
    assert api.read_namespaced_pod_log("rank1", namespace).split() == [master, "sum", "3.0"]


def grant_pod_reading(k8s_cluster, namespace: str, account: str) -> None:
    """A service account that may read pods in `namespace`, and nothing else."""
    k8s_cluster.kubectl("-n", namespace, "create", "serviceaccount", account)
    k8s_cluster.kubectl("-n", namespace, "create", "role", "pod-reader", "--verb=get,list,watch", "--resource=pods")
    k8s_cluster.kubectl("-n", namespace, "create", "rolebinding", "pod-reader", "--role=pod-reader",
                        f"--serviceaccount={namespace}:{account}")


def test_a_service_account_kubeconfig_is_held_to_its_role(api, k8s_cluster, namespace):
    grant_pod_reading(k8s_cluster, namespace, "reader")
    limited = client.CoreV1Api(config.new_client_from_config(
        str(k8s_cluster.kubeconfig_for_service_account(namespace, "reader"))))
    assert limited.list_namespaced_pod(namespace).items == []
    for denied in (lambda: limited.list_namespaced_secret(namespace), lambda: limited.list_namespaced_pod("default"),
                   lambda: limited.create_namespaced_pod(namespace, python_pod(k8s_cluster, "x", "pass"))):
        with pytest.raises(ApiException) as e:
            denied()
        assert e.value.status == 403


def test_a_pod_reaches_the_apiserver_with_its_in_cluster_config(api, k8s_cluster, namespace):
    grant_pod_reading(k8s_cluster, namespace, "reader")
    code = f"""
from kubernetes import client, config
config.load_incluster_config()
v1 = client.CoreV1Api()
print(sorted(p.metadata.name for p in v1.list_namespaced_pod({namespace!r}).items))
try:
    v1.list_namespaced_secret({namespace!r})
except client.rest.ApiException as e:
    print("secrets", e.status)
"""
    pod = python_pod(k8s_cluster, "incluster", code, k8s_cluster.in_cluster_env(), serviceAccountName="reader")
    api.create_namespaced_pod(namespace, pod)
    wait_phase(api, namespace, "incluster", ("Succeeded",))
    assert api.read_namespaced_pod_log("incluster", namespace).split("\n")[:2] == ["['incluster']", "secrets 403"]


def test_exec_into_a_pod(api, k8s_cluster, namespace):
    """exec (and logs) reach the kubelet through the apiserver: the kubelet's bridge works."""
    from kubernetes.stream import stream

    pod = python_pod(k8s_cluster, "sleeper", "import time; time.sleep(60)")
    api.create_namespaced_pod(namespace, pod)
    wait_phase(api, namespace, "sleeper", ("Running",))
    # an exec stream takes over the client it is given: one of its own
    own = client.CoreV1Api(config.new_client_from_config(str(k8s_cluster.admin_kubeconfig)))
    out = stream(own.connect_get_namespaced_pod_exec, "sleeper", namespace, command=["/bin/echo", "hello"],
                 stderr=True, stdin=False, stdout=True, tty=False)
    assert out == "hello\n"
    api.delete_namespaced_pod("sleeper", namespace, grace_period_seconds=0)
