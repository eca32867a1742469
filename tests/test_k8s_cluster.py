"""The Kubernetes test cluster itself (tests/harness/k8s/), through the `kubernetes` client:
two nodes, pods across them, a lost node, and the autoscaler stand-in's Events."""

from __future__ import annotations

import copy
import ipaddress
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.harness.autoscaler_standin import AutoscalerStandIn
from tests.conftest import gone, running
from tests.harness.k8s import NODE_GRACE, NODE_NAME, NODES, SERVICE_IP, K8sCluster, _v1_hierarchies

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


def on(node: str) -> dict:
    """The pod spec's part that puts it on that node (the label each kubelet sets on its Node)."""
    return {"nodeSelector": {"kubernetes.io/hostname": node}}


def in_subnet(ip: str, node: str) -> bool:
    subnet = next(n[2] for n in NODES if n[0] == node)
    return ipaddress.ip_address(ip) in ipaddress.ip_network(subnet)


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


def test_both_nodes_are_ready_with_their_own_addresses(api, k8s_cluster):
    nodes = api.list_node().items
    assert k8s_cluster.nodes == ["skytasks-node", "skytasks-node-2"] and k8s_cluster.node_name == NODE_NAME
    assert sorted(n.metadata.name for n in nodes) == k8s_cluster.nodes
    for node in nodes:
        assert [c.status for c in node.status.conditions if c.type == "Ready"] == ["True"]
        addresses = {a.type: a.address for a in node.status.addresses}
        assert addresses["InternalIP"] == k8s_cluster.node(node.metadata.name).ip
    assert {k8s_cluster.node(n).ip for n in k8s_cluster.nodes} == {"192.0.2.2", "192.0.2.3"}
    # both started with the control plane, and when each was Ready is on record
    assert {f"node_ready:{n}" for n in k8s_cluster.nodes} <= set(k8s_cluster.timings)
    assert k8s_cluster.timings["start"] >= max(k8s_cluster.timings[f"node_ready:{n}"] for n in k8s_cluster.nodes)


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
    node1, node2 = k8s_cluster.nodes  # one rank on each node: gloo's TCP across the nodes' link
    first = python_pod(k8s_cluster, "rank0", code, {"RANK": "0"}, hostname="rank0", subdomain="ranks", **on(node1))
    first["metadata"]["labels"] = {"app": "ranks"}
    first["spec"]["containers"][0]["env"].append(pod_ip)
    api.create_namespaced_pod(namespace, first)
    master = wait_phase(api, namespace, "rank0", ("Running", "Succeeded")).status.pod_ip
    assert master
    lookup = f"import socket; print(socket.gethostbyname('rank0.ranks.{namespace}.svc.cluster.local'))\n"
    api.create_namespaced_pod(namespace, python_pod(k8s_cluster, "rank1", lookup + code,
                                                    {"RANK": "1", "MASTER": master}, **on(node2)))
    second = wait_phase(api, namespace, "rank1", ("Succeeded",))
    assert second.status.pod_ip != master
    assert in_subnet(master, node1) and in_subnet(second.status.pod_ip, node2)
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


@pytest.mark.parametrize("node", [n[0] for n in NODES])
def test_a_pod_reaches_the_apiserver_with_its_in_cluster_config(api, k8s_cluster, namespace, node):
    grant_pod_reading(k8s_cluster, namespace, "reader")
    code = f"""
import socket
print(socket.gethostbyname("kubernetes.default.svc.cluster.local"))
from kubernetes import client, config
config.load_incluster_config()
v1 = client.CoreV1Api()
print(sorted(p.metadata.name for p in v1.list_namespaced_pod({namespace!r}).items))
try:
    v1.list_namespaced_secret({namespace!r})
except client.rest.ApiException as e:
    print("secrets", e.status)
"""
    pod = python_pod(k8s_cluster, "incluster", code, k8s_cluster.in_cluster_env(), serviceAccountName="reader",
                     **on(node))
    api.create_namespaced_pod(namespace, pod)
    assert wait_phase(api, namespace, "incluster", ("Succeeded",)).spec.node_name == node
    # the node's DNS server names the `kubernetes` Service; its socat takes 443 to the apiserver
    assert api.read_namespaced_pod_log("incluster", namespace).split("\n")[:3] == [SERVICE_IP, "['incluster']",
                                                                                  "secrets 403"]


@pytest.mark.parametrize("node", [n[0] for n in NODES])
def test_exec_into_a_pod(api, k8s_cluster, namespace, node):
    """exec (and logs) reach each kubelet through the apiserver: each node's bridge works."""
    from kubernetes.stream import stream

    pod = python_pod(k8s_cluster, "sleeper", "import time; time.sleep(60)", **on(node))
    api.create_namespaced_pod(namespace, pod)
    wait_phase(api, namespace, "sleeper", ("Running",))
    # an exec stream takes over the client it is given: one of its own
    own = client.CoreV1Api(config.new_client_from_config(str(k8s_cluster.admin_kubeconfig)))
    out = stream(own.connect_get_namespaced_pod_exec, "sleeper", namespace, command=["/bin/echo", "hello"],
                 stderr=True, stdin=False, stdout=True, tty=False)
    assert out == "hello\n"
    api.delete_namespaced_pod("sleeper", namespace, grace_period_seconds=0)


ECHO_SERVER = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 7000))
s.listen()
conn, peer = s.accept()
conn.sendall(conn.recv(100) + b" from " + socket.gethostname().encode())
print("peer", peer[0], flush=True)
"""
ECHO_CLIENT = """
import os, socket, time
deadline = time.monotonic() + 30
while True:
    try:
        conn = socket.create_connection((os.environ["SERVER"], 7000), timeout=5)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
conn.sendall(b"hello")
print(conn.recv(100).decode(), flush=True)
"""


def test_pods_on_the_two_nodes_reach_each_other_by_pod_ip(api, k8s_cluster, namespace):
    node1, node2 = k8s_cluster.nodes
    api.create_namespaced_pod(namespace, python_pod(k8s_cluster, "server", ECHO_SERVER, **on(node2)))
    server = wait_phase(api, namespace, "server", ("Running", "Succeeded"))
    api.create_namespaced_pod(namespace, python_pod(k8s_cluster, "client", ECHO_CLIENT,
                                                    {"SERVER": server.status.pod_ip}, **on(node1)))
    client_pod = wait_phase(api, namespace, "client", ("Succeeded",))
    wait_phase(api, namespace, "server", ("Succeeded",))
    assert (client_pod.spec.node_name, server.spec.node_name) == (node1, node2)
    assert in_subnet(client_pod.status.pod_ip, node1) and in_subnet(server.status.pod_ip, node2)
    assert api.read_namespaced_pod_log("client", namespace).strip() == "hello from server"
    # the server saw the client's own pod IP: routed between the nodes, no address translation
    assert api.read_namespaced_pod_log("server", namespace).strip() == f"peer {client_pod.status.pod_ip}"


def pending_pod(api, k8s_cluster, namespace: str, name: str, limits: dict | None = None, **spec) -> client.V1Pod:
    """A pod no node can take yet, once the scheduler has said so (FailedScheduling)."""
    pod = python_pod(k8s_cluster, name, "print('ran', flush=True)", **spec)
    if limits:
        pod["spec"]["containers"][0]["resources"] = {"limits": limits}
    api.create_namespaced_pod(namespace, pod)
    deadline = time.monotonic() + 30
    # kube-scheduler 1.20 posts through events.k8s.io: listed here with no `source`, and
    # reportingComponent "default-scheduler" (the product reads either)
    while not [e for e in api.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
               if (e.reason, e.reporting_component, e.source.component) == ("FailedScheduling", "default-scheduler", None)]:
        assert time.monotonic() < deadline, "the scheduler said nothing about the pod"
        time.sleep(0.2)
    pod = api.read_namespaced_pod(name, namespace)
    assert pod.status.phase == "Pending" and not pod.spec.node_name
    return pod


def test_the_stand_in_posts_the_autoscalers_events_and_a_node_joins_for_the_pod(api, k8s_cluster, namespace):
    standin = AutoscalerStandIn(k8s_cluster)
    node = k8s_cluster.nodes[1]
    k8s_cluster.taint_node(node, "skytasks.io/booting")  # a node that is not up yet
    k8s_cluster.label_node(node, {"skytasks.io/pool": "gpu-pool"})
    try:
        pod = pending_pod(api, k8s_cluster, namespace, "waiter", nodeSelector={"skytasks.io/pool": "gpu-pool"})
        standin.not_triggered("waiter", namespace, {"max node group size reached": 1,
                                                    "node(s) didn't match Pod's node affinity/selector": 2})
        standin.triggered_scale_up("waiter", namespace, group="gpu-pool", from_=0, to=1, max=4)
        standin.triggered_scale_up("waiter", namespace, groups=[("pool-a", 1, 3, 10), ("pool-b", 0, 2, 5)])
        standin.karpenter_nominated("waiter", namespace, "default-x7k2p")
        standin.karpenter_nominated("waiter", namespace, "default-x7k2p", node)
        standin.karpenter_failed("waiter", namespace, ['incompatible with nodepool "gpu", daemonset overhead={"pods":"1"}'
                                                       ', no instance type satisfied resources', "did not tolerate taint"])
        events = [e for e in api.list_namespaced_event(namespace, field_selector="involvedObject.name=waiter").items
                  if e.source.component in ("cluster-autoscaler", "karpenter")]
        assert [(e.type, e.reason, e.source.component, e.message) for e in events] == [
            ("Normal", "NotTriggerScaleUp", "cluster-autoscaler", "pod didn't trigger scale-up: 1 max node group size "
                                                                  "reached, 2 node(s) didn't match Pod's node affinity/selector"),
            ("Normal", "TriggeredScaleUp", "cluster-autoscaler", "pod triggered scale-up: [{gpu-pool 0->1 (max: 4)}]"),
            ("Normal", "TriggeredScaleUp", "cluster-autoscaler",
             "pod triggered scale-up: [{pool-a 1->3 (max: 10)} {pool-b 0->2 (max: 5)}]"),
            ("Normal", "Nominated", "karpenter", "Pod should schedule on: nodeclaim/default-x7k2p"),
            ("Normal", "Nominated", "karpenter", f"Pod should schedule on: nodeclaim/default-x7k2p, node/{node}"),
            ("Warning", "FailedScheduling", "karpenter", 'Failed to schedule pod, incompatible with nodepool "gpu", '
             'daemonset overhead={"pods":"1"}, no instance type satisfied resources; did not tolerate taint'),
        ]
        for e in events:  # as client-go's EventRecorder writes them
            assert (e.involved_object.kind, e.involved_object.uid, e.reporting_component, e.count) == (
                "Pod", pod.metadata.uid, e.source.component, 1)
            assert e.metadata.name.startswith("waiter.") and e.first_timestamp == e.last_timestamp
        assert [e["reason"] for e in standin.events("waiter", namespace, "karpenter")] == [
            "Nominated", "Nominated", "FailedScheduling"]
        assert api.read_namespaced_pod("waiter", namespace).status.phase == "Pending"
        standin.node_joins(node, untaint="skytasks.io/booting")
        ran = wait_phase(api, namespace, "waiter", ("Succeeded",))
        assert ran.spec.node_name == node and api.read_namespaced_pod_log("waiter", namespace).strip() == "ran"
    finally:
        k8s_cluster.untaint_node(node, "skytasks.io/booting")
        k8s_cluster.label_node(node, {"skytasks.io/pool": None})


def test_a_node_joins_with_gpus_for_a_pod_that_asks_for_them(api, k8s_cluster, namespace):
    node = k8s_cluster.nodes[1]
    product = "NVIDIA-H100-80GB-HBM3"
    try:  # no node has a GPU yet
        pending_pod(api, k8s_cluster, namespace, "gpu", {"nvidia.com/gpu": "1"},
                    nodeSelector={"nvidia.com/gpu.product": product})
        AutoscalerStandIn(k8s_cluster).triggered_scale_up("gpu", namespace, group="h100", to=1, max=2)
        AutoscalerStandIn(k8s_cluster).node_joins(node, gpus=2, gpu_product=product)
        got = api.read_node(node)
        assert got.status.allocatable["nvidia.com/gpu"] == "2"
        assert (got.metadata.labels["nvidia.com/gpu.product"], got.metadata.labels["nvidia.com/gpu.count"]) == (product, "2")
        assert wait_phase(api, namespace, "gpu", ("Succeeded",)).spec.node_name == node
    finally:
        k8s_cluster.set_gpus(node, 0)
    got = api.read_node(node)
    assert "nvidia.com/gpu" not in got.status.allocatable and "nvidia.com/gpu.product" not in got.metadata.labels


# -- a cluster of the test's own: a lost node, and what stop() leaves --------------------------


def namespaces_of(pid: int) -> set[tuple[str, int]]:
    return {(kind, os.stat(f"/proc/{pid}/ns/{kind}").st_ino) for kind in ("pid", "mnt", "net", "uts")}


def processes_in(namespaces: set[tuple[str, int]]) -> list[int]:
    """Every process on the machine that is in one of these namespaces."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if any(os.stat(f"/proc/{entry}/ns/{kind}").st_ino == ino for kind, ino in namespaces):
                    found.append(int(entry))
            except OSError:
                pass
    return found


def host_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def assert_stop_leaves_nothing(c: K8sCluster, links_before: set[str]) -> None:
    namespaces = set().union(*(namespaces_of(c.node(n).init_pid()) for n in c.nodes if c.node(n).process))
    daemons = [p.pid for p in c.daemons.values()] + [c.node(n).process.pid for n in c.nodes if c.node(n).process]
    assert processes_in(namespaces)  # the nodes' kubelets, containerds, pods...
    c.stop()
    assert processes_in(namespaces) == [] and all(gone(pid) for pid in daemons)
    for hierarchy in _v1_hierarchies(unified=True):  # the cluster's cgroups, every node's in them
        assert not (hierarchy / c.cgroup_root.lstrip("/")).exists()
    assert not [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(c.folder) in line]
    added = host_links() - links_before  # the nodes' veths never were in the machine's namespace
    assert not [name for name in added if name in ("peer", "eth0", "eth1", "cni0") or name.startswith("veth")]
    left = {p.name for p in c.folder.iterdir()} - {"log", "pki", "apiserver-hosts"}
    assert {name for name in left if not name.endswith(".kubeconfig")} == set()


def test_a_lost_node_goes_not_ready_its_pods_end_it_comes_back_and_stop_leaves_nothing(tmp_path):
    links_before = host_links()
    c = K8sCluster(tmp_path / "c", nodes=2)
    try:
        c.start()
        node1, node2 = c.nodes
        assert set(c.timings) >= {"apiserver_ready", f"node_ready:{node1}", f"node_ready:{node2}", "start"}
        api = client.CoreV1Api(config.new_client_from_config(str(c.admin_kubeconfig)))
        marker = f"lost-{uuid.uuid4().hex[:8]}"
        api.create_namespaced_pod("default", python_pod(c, "doomed", f"import time; time.sleep(600)  # {marker}",
                                                        **on(node2)))
        wait_phase(api, "default", "doomed", ("Running",))
        [process] = running(marker)  # the pod's process, as the machine sees it
        c.kill_node(node2)
        assert gone(process)  # at once, with every process of the node's namespaces
        took = c.wait_node(node2, ready=False, timeout=NODE_GRACE + 30)
        assert c.node_condition(node2) == "Unknown" and c.node_ready(node1)
        assert sorted(n.metadata.name for n in api.list_node().items) == [node1, node2]  # the Node stays
        c.timings["not_ready_after_kill"] = took
        api.delete_namespaced_pod("doomed", "default", grace_period_seconds=0)  # or its kubelet runs it again
        # restarted from a thread that ends at once: the node must outlive it
        helper = threading.Thread(target=c.restart_node, args=(node2,))
        helper.start()
        helper.join(120)
        assert c.node_ready(node2) and c.node(node2).process.poll() is None
        # back, and linked again: a pod on it reaches one on the other node
        api.create_namespaced_pod("default", python_pod(c, "server", ECHO_SERVER, **on(node1)))
        server = wait_phase(api, "default", "server", ("Running", "Succeeded"))
        api.create_namespaced_pod("default", python_pod(c, "client", ECHO_CLIENT, {"SERVER": server.status.pod_ip},
                                                        **on(node2)))
        wait_phase(api, "default", "client", ("Succeeded",))
        assert api.read_namespaced_pod_log("client", "default").strip() == "hello from server"
        print("timings", {k: round(v, 1) for k, v in c.timings.items()})
        assert_stop_leaves_nothing(c, links_before)
    finally:
        c.stop()


def test_a_one_node_cluster_still_starts_and_stop_leaves_nothing(tmp_path):
    links_before = host_links()
    c = K8sCluster(tmp_path / "c")
    try:
        c.start()
        assert c.nodes == [NODE_NAME] and c.node_ready(NODE_NAME)
        api = client.CoreV1Api(config.new_client_from_config(str(c.admin_kubeconfig)))
        assert [n.metadata.name for n in api.list_node().items] == [NODE_NAME]
        print("timings", {k: round(v, 1) for k, v in c.timings.items()})
        assert_stop_leaves_nothing(c, links_before)
    finally:
        c.stop()
