"""The kubernetes provider's rules, without a cluster: the pod it makes, the template's merge, the
GPU label chosen from the nodes' labels, a pod's status read, when a pool may start, what gc
deletes, and that the RBAC file grants exactly what the provider uses."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from skytasks import GPUPool, PoolConfigError
from skytasks.providers.kubernetes import gc, pod_status, pods
from skytasks.providers.kubernetes.check import NEEDED
from skytasks.providers.kubernetes.spec import KubernetesSpec

OWNER = {"apiVersion": "v1", "kind": "ConfigMap", "name": "skytasks-abc", "uid": "u-1"}


def manifest(**fields):
    pool = GPUPool(provider="kubernetes", k8s_image="reg/train:1", **fields)
    spec = pool.spec()
    return pods.pod_manifest(spec, spec.own(KubernetesSpec), "skytasks-abc", 3, OWNER)


def test_a_pod_holds_its_identity_shm_and_no_secret():
    pod = manifest(env={"TOKEN": "s3cret"}, aws_credentials={"aws_access_key_id": "AKIA", "aws_secret_access_key": "zz9"})
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "skytasks-abc-3"
    assert meta["labels"][pods.POOL_LABEL] == "skytasks-abc" and meta["labels"][pods.NODE_LABEL] == "3"
    assert meta["ownerReferences"] == [OWNER]
    assert spec["restartPolicy"] == "Never" and spec["activeDeadlineSeconds"] == 720 * 60
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in spec["volumes"]
    (container,) = spec["containers"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert container["command"][:2] == ["python3", "-c"] and container["command"][-2:] == ["900", "30"]
    assert spec["automountServiceAccountToken"] is False
    for secret in ("s3cret", "zz9", "AKIA"):
        assert secret not in repr(pod)


def test_gpus_resources_selector_and_tolerations():
    pod = manifest(accelerator="H100", accelerators_per_node=8, k8s_cpu="16", k8s_memory="64Gi", k8s_shm_size="8Gi",
                   k8s_node_selector={"pool": "gpu"}, k8s_tolerations=[{"key": "team", "operator": "Exists"}],
                   k8s_service_account="trainer", k8s_image_pull_secrets=["regcred"])
    spec = pod["spec"]
    res = spec["containers"][0]["resources"]
    assert res["limits"] == {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "8"}
    assert res["requests"] == {"cpu": "16", "memory": "64Gi"}
    assert spec["nodeSelector"] == {"pool": "gpu"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert {"key": "team", "operator": "Exists"} in spec["tolerations"]
    assert spec["serviceAccountName"] == "trainer" and spec["automountServiceAccountToken"] is True
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in spec["volumes"]


def test_the_template_merges_but_never_replaces_the_pods_identity():
    template = {"metadata": {"name": "mine", "labels": {"team": "nlp"}, "annotations": {"a": "b"}},
                "spec": {"priorityClassName": "high", "restartPolicy": "Always",
                         "volumes": [{"name": "data", "hostPath": {"path": "/data"}}],
                         "containers": [{"volumeMounts": [{"name": "data", "mountPath": "/data"}],
                                         "env": [{"name": "HF_HOME", "value": "/data/hf"}], "command": ["sleep"]},
                                        {"name": "sidecar", "image": "busybox"}]}}
    pod = manifest(k8s_pod_template=template)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "skytasks-abc-3" and meta["labels"]["team"] == "nlp" and meta["annotations"]["a"] == "b"
    assert spec["priorityClassName"] == "high" and spec["restartPolicy"] == "Never"
    assert [v["name"] for v in spec["volumes"]] == ["dshm", "data"]
    own, sidecar = spec["containers"]
    assert own["name"] == "node" and own["image"] == "reg/train:1" and sidecar["name"] == "sidecar"
    assert [m["name"] for m in own["volumeMounts"]] == ["dshm", "data"]
    assert own["env"] == [{"name": "HF_HOME", "value": "/data/hf"}]
    assert own["command"][1] == "-c"  # the keeper, whatever the template said


@pytest.mark.parametrize("labels, want", [
    ([{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}],
     ("nvidia.com/gpu.product", ["NVIDIA-H100-80GB-HBM3"])),
    ([{"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}, {"cloud.google.com/gke-accelerator": "nvidia-h100-mega-80gb"}],
     ("cloud.google.com/gke-accelerator", ["nvidia-h100-80gb", "nvidia-h100-mega-80gb"])),
    ([{"karpenter.k8s.aws/instance-gpu-name": "h100"}], ("karpenter.k8s.aws/instance-gpu-name", ["h100"])),
    ([{"nvidia.com/gpu.product": "Tesla-T4"}], None),
    ([{}], None),
])
def test_the_gpu_product_label_comes_from_the_nodes(labels, want):
    assert pods.gpu_product_affinity("H100", labels) == want


def test_an_affinity_becomes_a_required_node_affinity():
    pool = GPUPool(provider="kubernetes", k8s_image="x", accelerator="H100")
    spec = pool.spec()
    pod = pods.pod_manifest(spec, spec.own(KubernetesSpec), "p", 0, OWNER, ("nvidia.com/gpu.product", ["A", "B"]))
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["A", "B"]}]}]


@pytest.mark.parametrize("fields, field", [
    ({"k8s_namespace": "ML_team"}, "k8s_namespace"),
    ({"k8s_cpu": "eight"}, "k8s_cpu"),
    ({"k8s_tolerations": [{"key": "a", "colour": "red"}]}, "k8s_tolerations"),
    ({"k8s_pod_template": {"containers": []}}, "k8s_pod_template"),
    ({"k8s_image_pull_secrets": ["Not A Name"]}, "k8s_image_pull_secrets"),
])
def test_bad_fields_are_refused_by_name(fields, field):
    with pytest.raises(PoolConfigError, match=f"^{field}"):
        GPUPool(provider="kubernetes", k8s_image="x", **fields)


def test_the_image_is_required():
    with pytest.raises(PoolConfigError, match="^k8s_image"):
        GPUPool(provider="kubernetes")


def pod(phase="Pending", scheduled=None, waiting=None, running=False, terminated=None, ready=None, deleting=False,
        name="p-0"):
    conditions = []
    if scheduled:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": scheduled})
    if ready:
        conditions.append({"type": "Ready", "status": "False", "reason": ready})
    state = {"running": {}} if running else {"waiting": waiting} if waiting else {"terminated": terminated} \
        if terminated else {}
    return {"metadata": {"name": name, **({"deletionTimestamp": "now"} if deleting else {})},
            "spec": {"nodeName": "n1"},
            "status": {"phase": phase, "podIP": "10.0.0.5", "conditions": conditions,
                       "containerStatuses": [{"state": state}] if state else []}}


def test_why_a_pod_waits_in_the_clusters_words():
    v = pod_status.view(pod(scheduled="0/3 nodes are available: 3 Insufficient nvidia.com/gpu."))
    assert v.waiting == "Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu." and v.never is None
    v = pod_status.view(pod(scheduled="0/1 nodes are available: 1 node(s) didn't match node selector."))
    assert v.never == ("k8s_node_selector", "0/1 nodes are available: 1 node(s) didn't match node selector.")
    v = pod_status.view(pod(scheduled="0/2 nodes are available: 1 Insufficient cpu, 1 node(s) didn't match node selector."))
    assert v.never is None
    v = pod_status.view(pod(scheduled="0/1 nodes are available: 1 node(s) had taint {gpu: yes}, that the pod didn't "
                                      "tolerate."))
    assert v.never and v.never[0] == "k8s_tolerations"
    v = pod_status.view(pod(waiting={"reason": "ErrImagePull", "message": 'rpc error: "reg/nope:1": not found'}))
    assert v.never and v.never[0] == "k8s_image" and "ErrImagePull" in v.waiting
    v = pod_status.view(pod(waiting={"reason": "ErrImagePull", "message": "i/o timeout"}))
    assert v.never is None
    v = pod_status.view(pod(phase="Running", running=True))
    assert v.running and not v.waiting and v.gone is None and v.ip == "10.0.0.5"


def test_when_a_running_pod_is_lost():
    assert "failed" in pod_status.view(pod(phase="Failed", terminated={"exitCode": 137, "reason": "OOMKilled"})).gone
    assert "not ready" in pod_status.view(pod(phase="Running", running=True, ready="NodeNotReady")).gone
    assert pod_status.view(pod(phase="Running", running=True, deleting=True)).leaving


def test_when_a_pool_may_start():
    up = pod_status.view(pod(phase="Running", running=True, name="a"))
    room = pod_status.view(pod(scheduled="0/1 nodes are available: 1 Insufficient cpu.", name="b"))
    never = pod_status.view(pod(waiting={"reason": "InvalidImageName", "message": "bad"}, name="c"))
    decide = pod_status.start_decision
    assert decide([up, up], 2, 0, 10) == pod_status.Go(("a", "a"))
    assert isinstance(decide([up, room], 2, 1, 10), pod_status.Wait)
    assert "Insufficient cpu" in decide([up, room], 2, 1, 10).detail
    assert decide([up, room], 1, 1, 10) == pod_status.Go(("a",))  # elastic: the other waits for room
    failed = decide([up, never], 2, 0, 10)
    assert isinstance(failed, pod_status.Fail) and failed.field == "k8s_image"
    late = decide([up, room], 2, 11, 10)
    assert isinstance(late, pod_status.Fail) and late.field == "ready_timeout_seconds"


def test_what_gc_deletes():
    now = datetime(2026, 11, 27, 12, tzinfo=timezone.utc)
    owner = {"metadata": {"name": "skytasks-x", "creationTimestamp": "2026-11-27T11:00:00Z",
                          "annotations": {pods.EXPIRES_ANNOTATION: "2026-11-27T13:00:00Z"}}}
    running, ended = {"status": {"phase": "Running"}}, {"status": {"phase": "Succeeded"}}
    grace = timedelta(minutes=15)
    assert gc.why_stale(owner, [running], now, grace) is None
    assert "ended" in gc.why_stale(owner, [ended, {"status": {"phase": "Failed"}}], now, grace)
    assert "no pod" in gc.why_stale(owner, [], now, grace)
    assert "expired" in gc.why_stale(owner, [running], now + timedelta(hours=2), grace)


def test_the_rbac_file_grants_exactly_what_the_provider_uses():
    docs = list(yaml.safe_load_all((Path(__file__).parent.parent / "deployments/kubernetes/rbac.yaml").read_text()))
    (role,) = [d for d in docs if d["kind"] == "Role"]
    granted = {(verb, *(res.split("/") + [""])[:2]) for rule in role["rules"] for res in rule["resources"]
               for verb in rule["verbs"]}
    assert granted == set(NEEDED)
    assert not any(d["kind"].startswith("Cluster") for d in docs)


def test_without_the_extra_a_kubernetes_pool_names_it_and_other_pools_work():
    import subprocess
    import sys

    code = ("import sys; sys.modules['kubernetes'] = sys.modules['prefect_kubernetes'] = None\n"
            "from skytasks import GPUPool, PoolConfigError\n"
            "GPUPool(provider='local', nodes=2).spec()\n"
            "try:\n    GPUPool(provider='kubernetes', k8s_image='x')\n"
            "except PoolConfigError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "provider: provider='kubernetes' needs its extra: pip install \"skytasks[kubernetes]\""
