"""provider="kubernetes" where GPUs come from on a cloud: autoscaled node pools, exact GPU types,
placement across nodes, and a node that stops reporting, on the two-node test cluster.

No node autoscaler can be installed here: `tests/harness/autoscaler_standin.py` posts the Events Cluster
Autoscaler posts (same reasons, source and message shapes, read in its source), then labels a node
as a node that joins would. Each rule is tested against it: a scale-up waited for, a refusal that
fails fast, a silent (fixed) cluster that fails after the silence (30 s by default, 10 s here), a
node that is not ready (tainted by the node controller) waited for, `"A10"` never on an A100 node,
a template that narrows, two GPU pods on two nodes, and a pod whose node stops reporting lost
within the node's grace period.
"""

from __future__ import annotations

import json
import threading
import time

import psutil
import pytest

from skytasks import PoolStartError, distributed_task, rank_info
from skytasks.events import NodeLost, listen
from skytasks.providers.kubernetes import gpu_types
from tests.harness.autoscaler_standin import AutoscalerStandIn
from tests.harness.kube import Said, kube_pool

SELECTOR = {"skytasks-test/group": "gpu-a"}  # no node carries it until "the autoscaler" adds one
SILENCE = 10  # SKYTASKS_K8S_AUTOSCALER_SILENCE_SECONDS here (30 by default): the rule, sooner


@pytest.fixture(autouse=True)
def shorter_silence(monkeypatch):
    monkeypatch.setenv("SKYTASKS_K8S_AUTOSCALER_SILENCE_SECONDS", str(SILENCE))


@pytest.fixture
def nodes(k8s):
    """The two nodes' names; whatever a test labels, taints or gives GPUs is taken back after it."""
    node1, node2 = k8s.nodes
    yield node1, node2
    for node in (node1, node2):
        k8s.label_node(node, {key: None for key in SELECTOR})
        k8s.set_gpus(node, 0)


def pool_pods(k8s) -> list[dict]:
    return json.loads(k8s.kubectl("get", "pods", "-l", "app.kubernetes.io/managed-by=skytasks", "-o",
                                  "json").stdout)["items"]


def unschedulable(k8s, count: int, timeout: float = 60) -> list[str]:
    """The names of the pool's pods, once `count` of them wait for a node (the scheduler said so)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        waiting = [p["metadata"]["name"] for p in pool_pods(k8s)
                   if any(c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
                          for c in p.get("status", {}).get("conditions") or [])]
        if len(waiting) >= count:
            return waiting
        time.sleep(0.2)
    raise AssertionError(f"the pool's pods never waited for a node: {[p['metadata']['name'] for p in pool_pods(k8s)]}")


def in_background(fn) -> threading.Thread:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test through `errors`
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.errors = errors  # type: ignore[attr-defined]
    t.start()
    return t


def hostname() -> str:
    import socket

    return socket.gethostname()


def test_a_scale_up_is_waited_for_in_the_autoscalers_words_past_the_silence_rule(k8s, nodes):
    standin = AutoscalerStandIn(k8s)

    def autoscaler() -> None:
        pods = unschedulable(k8s, 2)
        first = time.monotonic()
        for pod in pods:
            standin.triggered_scale_up(pod, "default", group="gpu-pool", from_=0, to=2, max=4)
        # A real scale-up takes minutes: past the time in which a silent cluster is taken as fixed.
        time.sleep(max(0.0, SILENCE + 3 - (time.monotonic() - first)))
        for node in nodes:
            standin.node_joins(node, labels=SELECTOR)

    with Said() as said:
        started = time.monotonic()
        helper = in_background(autoscaler)
        pool = kube_pool(k8s, k8s_node_selector=SELECTOR, ready_timeout_seconds=120)
        with pool:
            up = time.monotonic() - started
            out = distributed_task(hostname, pool=pool, init_torch=False)()
        helper.join(5)
    assert not helper.errors, helper.errors
    assert len(out) == 2 and up > SILENCE + 3
    words = "waiting for a node the autoscaler is adding: cluster-autoscaler: pod triggered scale-up: " \
            "[{gpu-pool 0->2 (max: 4)}]"
    assert said.first(words) is not None, said.lines


def test_an_autoscalers_refusal_fails_the_start_within_seconds_in_its_words(k8s, nodes):
    standin = AutoscalerStandIn(k8s)

    def autoscaler() -> None:
        pod = unschedulable(k8s, 1)[0]
        standin.not_triggered(pod, "default", {"max node group size reached": 1})

    helper = in_background(autoscaler)
    started = time.monotonic()
    with pytest.raises(PoolStartError) as caught:
        with kube_pool(k8s, k8s_node_selector=SELECTOR):
            pass
    took = time.monotonic() - started
    helper.join(5)
    assert not helper.errors, helper.errors
    text = str(caught.value)
    assert "cluster-autoscaler: pod didn't trigger scale-up: 1 max node group size reached" in text, text
    assert text.startswith("k8s_node_selector:") and "every pod was deleted" in text
    assert "taken as fixed" not in text  # the autoscaler's refusal, not the silence rule
    assert took < SILENCE + 5, took  # not the silence rule, nor the ready timeout


def test_a_cluster_where_no_autoscaler_speaks_is_taken_as_fixed_after_the_silence(k8s, nodes):
    started = time.monotonic()
    with pytest.raises(PoolStartError, match="^k8s_node_selector") as caught:
        with kube_pool(k8s, k8s_node_selector=SELECTOR):
            pass
    took = time.monotonic() - started
    assert "didn't match" in str(caught.value) and "taken as fixed" in str(caught.value)
    assert SILENCE - 1 < took < SILENCE + 25, took  # the silence rule, not the ready timeout (90 s)


def _kubelet(k8s, node: str) -> psutil.Process:
    """The kubelet of this cluster's `node` (its configuration lies in the cluster's own folder:
    another test cluster on the machine may have a node of the same name)."""
    for p in psutil.process_iter(["cmdline"]):
        cmdline = p.info["cmdline"] or []
        if (any(a.endswith("kubelet") for a in cmdline[:1]) and f"--hostname-override={node}" in cmdline
                and any(str(k8s.folder) in a for a in cmdline)):
            return p
    raise AssertionError(f"no kubelet of {node}")


def test_a_node_that_is_not_ready_is_waited_for_even_on_a_fixed_cluster(k8s, nodes):
    """Its taint (`node.kubernetes.io/unreachable`, as a booting node's `not-ready`) is passing:
    the start waits, and goes on once the node reports again."""
    _, node2 = nodes
    kubelet = _kubelet(k8s, node2)
    kubelet.suspend()
    try:
        k8s.wait_node(node2, ready=False, timeout=60)
        deadline = time.monotonic() + 30
        while "node.kubernetes.io/unreachable" not in k8s.kubectl("get", "node", node2, "-o", "json").stdout:
            assert time.monotonic() < deadline, "the node controller never tainted the node"
            time.sleep(0.5)

        def comes_back() -> None:
            unschedulable(k8s, 2)
            time.sleep(3)
            kubelet.resume()

        helper = in_background(comes_back)
        with Said() as said:
            pool = kube_pool(k8s, k8s_node_selector={"kubernetes.io/hostname": node2}, k8s_autoscaler="none",
                             ready_timeout_seconds=120)
            with pool:
                out = distributed_task(hostname, pool=pool, init_torch=False)()
        helper.join(5)
        assert not helper.errors, helper.errors
    finally:
        kubelet.resume()
    assert len(out) == 2
    assert said.first("node.kubernetes.io/unreachable") is not None, said.lines
    k8s.wait_node(node2, ready=True, timeout=60)


def _placed(k8s) -> dict[str, str]:
    return {p["metadata"]["name"]: p["spec"].get("nodeName", "") for p in pool_pods(k8s)}


def test_gpu_pods_go_to_distinct_nodes_of_exactly_their_product_and_a_template_narrows(k8s, nodes):
    node1, node2 = nodes
    for node in nodes:  # room for both pods on either node: placement, not room, decides
        k8s.set_gpus(node, 2, "NVIDIA-A100-SXM4-80GB")
    pool = kube_pool(k8s, accelerator="A100", accelerators_per_node=1)
    with pool:
        placed = _placed(k8s)
        specs = pool_pods(k8s)
        out = distributed_task(hostname, pool=pool, init_torch=False)()
    assert len(out) == 2 and sorted(placed.values()) == sorted(nodes), placed  # one pod per node
    for pod in specs:
        spec = pod["spec"]
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert gpu_types.node_matches(terms, {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"})
        assert not gpu_types.node_matches(terms, {"nvidia.com/gpu.product": "NVIDIA-A10G"})

    # "A10" is a product of its own: an A100 node never takes it. On a fixed cluster, at once.
    started = time.monotonic()
    with pytest.raises(PoolStartError, match="^accelerator") as caught:
        with kube_pool(k8s, accelerator="A10", k8s_autoscaler="none"):
            pass
    assert time.monotonic() - started < 20 and "didn't match" in str(caught.value)

    # A template's affinity narrows where pods go (AND), never widens it (OR).
    template = k8s.host_python_template()
    template["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                                                     "values": [node2]}]}]}}}
    with kube_pool(k8s, accelerator="A100", k8s_pods_per_host=2, k8s_pod_template=template):
        assert set(_placed(k8s).values()) == {node2}


def sleep_unless_restarted() -> int:
    if rank_info().attempt == 1:
        time.sleep(150)
    return rank_info().world_size


def test_a_pod_whose_node_stops_reporting_is_lost_within_the_nodes_grace_period(k8s, nodes):
    _, node2 = nodes
    pool = kube_pool(k8s, min_nodes=1, k8s_pods_per_host=1)
    kubelet = _kubelet(k8s, node2)
    try:
        with Said() as said, listen() as heard, pool:
            assert sorted(_placed(k8s).values()) == sorted(nodes)
            stopped: list[float] = []

            marked: list[float] = []  # when the node controller marked the pod not ready
            found: list[float] = []  # when the pool found the node lost

            def stop_node2() -> None:
                time.sleep(3)  # the call is under way
                stopped.append(time.monotonic() - said.started)
                kubelet.suspend()  # its pods run on, but the node no longer reports
                deadline = time.monotonic() + 90
                while time.monotonic() < deadline and not found:
                    for pod in pool_pods(k8s) if not marked else ():
                        ready = [c for c in pod["status"].get("conditions") or [] if c["type"] == "Ready"]
                        if pod["spec"].get("nodeName") == node2 and ready and ready[0]["status"] == "False":
                            marked.append(time.monotonic() - said.started)
                    if any(isinstance(e, NodeLost) for e in heard):
                        found.append(time.monotonic() - said.started)
                    time.sleep(0.2)

            helper = in_background(stop_node2)
            out = distributed_task(sleep_unless_restarted, pool=pool, init_torch=False, node_recoveries=1)()
            helper.join(5)
            lost = [e for e in heard if isinstance(e, NodeLost)]
    finally:
        kubelet.resume()
    assert out == [1], out  # the elastic pool went on with the node it had
    assert len(lost) == 1 and "not ready" in lost[0].reason, lost
    # Found by the node controller's word (16 s grace here), not the pool's 60 s heartbeat.
    assert found and found[0] - stopped[0] < 45, (stopped, marked, found)
    k8s.wait_node(node2, ready=True, timeout=60)
