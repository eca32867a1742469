"""The kubernetes provider's manifests, without a cluster: the pod it makes (identity, GPU product,
placement, Kueue group, lifetime), the template's merge (it narrows where pods go, never widens),
the pod's keeper run as a real process, what gc deletes, and that the RBAC file grants exactly what
the provider uses. A pod's status read and the start decision are in test_k8s_start_rules.py."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from skytasks import GPUPool, PoolConfigError
from skytasks.providers.kubernetes import gc, gpu_types, pods
from skytasks.providers.kubernetes.check import NEEDED
from skytasks.providers.kubernetes.spec import KubernetesSpec

OWNER = {"apiVersion": "v1", "kind": "ConfigMap", "name": "skytasks-abc", "uid": "u-1", "controller": True}
H100_NODE = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


def manifest(node_id=3, node_labels=None, **fields):
    pool = GPUPool(provider="kubernetes", k8s_image="reg/train:1", **fields)
    spec = pool.spec()
    return pods.pod_manifest(spec, spec.own(KubernetesSpec), "skytasks-abc", node_id, OWNER, node_labels)


def required_terms(pod):
    return pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]


def test_a_pod_holds_its_identity_shm_and_no_secret():
    pod = manifest(env={"TOKEN": "s3cret"}, aws_credentials={"aws_access_key_id": "AKIA", "aws_secret_access_key": "zz9"},
                   max_lifetime_minutes=720)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "skytasks-abc-3"
    assert meta["labels"][pods.POOL_LABEL] == "skytasks-abc" and meta["labels"][pods.NODE_LABEL] == "3"
    assert meta["ownerReferences"] == [OWNER]
    assert spec["restartPolicy"] == "Never" and spec["activeDeadlineSeconds"] == 720 * 60
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in spec["volumes"]
    (container,) = spec["containers"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # argv: idle 15 min, grace 30 s, start window = ready_timeout_seconds (900) + idle (900)
    assert container["command"][:2] == ["python3", "-c"] and container["command"][-3:] == ["900", "30", "1800"]
    assert spec["automountServiceAccountToken"] is False
    assert "affinity" not in spec and "priorityClassName" not in spec  # a CPU pool: no product, no host limit
    assert not any(k.startswith("kueue.x-k8s.io/") for k in {**meta["labels"], **meta["annotations"]})
    for secret in ("s3cret", "zz9", "AKIA"):
        assert secret not in repr(pod)


def test_without_a_lifetime_a_pod_has_no_deadline_and_the_owner_carries_the_pools_lease():
    from skytasks.providers.remote_fields import lease_expiry

    pool = GPUPool(provider="kubernetes", k8s_image="x", max_lifetime_minutes=None)
    spec = pool.spec()
    k8s = spec.own(KubernetesSpec)
    assert "activeDeadlineSeconds" not in pods.pod_manifest(spec, k8s, "p", 0, OWNER)["spec"]
    now = datetime(2026, 11, 27, 12, tzinfo=timezone.utc)
    lease = lease_expiry(now, now, k8s.idle_minutes, k8s.max_lifetime_minutes)
    owner = pods.owner_manifest("p", "mine", k8s, lease)
    assert owner["metadata"]["annotations"][pods.NAME_ANNOTATION] == "mine"
    # idle_minutes (15) and two renewals (5 min each) on: what gc goes by once the controller is gone
    assert owner["metadata"]["annotations"][pods.EXPIRES_ANNOTATION] == "2026-11-27T12:25:00Z"
    owner["metadata"]["creationTimestamp"] = "2026-11-27T11:00:00Z"
    running = [{"status": {"phase": "Running"}}]
    assert gc.why_stale(owner, running, now + timedelta(minutes=20), timedelta(minutes=15)) is None
    assert "expired" in gc.why_stale(owner, running, now + timedelta(minutes=30), timedelta(minutes=15))
    timed = GPUPool(provider="kubernetes", k8s_image="x", max_lifetime_minutes=20).spec().own(KubernetesSpec)
    capped = lease_expiry(now, now, timed.idle_minutes, timed.max_lifetime_minutes)
    assert pods.owner_manifest("p", "mine", timed, capped)["metadata"]["annotations"][
        pods.EXPIRES_ANNOTATION] == "2026-11-27T12:20:00Z"  # never past the cap


def test_the_pods_declare_their_owner_as_their_controller():
    ref = pods.owner_reference({"metadata": {"name": "skytasks-abc", "uid": "u-1"}})
    assert ref == {"apiVersion": "v1", "kind": "ConfigMap", "name": "skytasks-abc", "uid": "u-1", "controller": True}
    # blockOwnerDeletion needs update on the owner's finalizers, which rbac.yaml does not grant.
    docs = list(yaml.safe_load_all((Path(__file__).parent.parent / "deployments/kubernetes/rbac.yaml").read_text()))
    granted = {res for d in docs if d["kind"] == "Role" for rule in d["rules"] for res in rule["resources"]}
    assert "configmaps/finalizers" not in granted and "blockOwnerDeletion" not in ref


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
    template = {"metadata": {"name": "mine", "labels": {"team": "nlp", pods.POOL_LABEL: "other"},
                             "annotations": {"a": "b"}},
                "spec": {"priorityClassName": "high", "restartPolicy": "Always", "activeDeadlineSeconds": 5,
                         "volumes": [{"name": "data", "hostPath": {"path": "/data"}}],
                         "containers": [{"volumeMounts": [{"name": "data", "mountPath": "/data"}],
                                         "env": [{"name": "HF_HOME", "value": "/data/hf"}], "command": ["sleep"]},
                                        {"name": "sidecar", "image": "busybox"}]}}
    pod = manifest(k8s_pod_template=template, max_lifetime_minutes=60)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "skytasks-abc-3" and meta["labels"]["team"] == "nlp" and meta["annotations"]["a"] == "b"
    assert meta["labels"][pods.POOL_LABEL] == "skytasks-abc"
    assert spec["priorityClassName"] == "high" and spec["restartPolicy"] == "Never"
    assert spec["activeDeadlineSeconds"] == 3600
    assert [v["name"] for v in spec["volumes"]] == ["dshm", "data"]
    own, sidecar = spec["containers"]
    assert own["name"] == "node" and own["image"] == "reg/train:1" and sidecar["name"] == "sidecar"
    assert [m["name"] for m in own["volumeMounts"]] == ["dshm", "data"]
    assert own["env"] == [{"name": "HF_HOME", "value": "/data/hf"}]
    assert own["command"][1] == "-c"  # the keeper, whatever the template said


def test_a_gpu_pool_requires_the_product_even_with_no_node_to_read():
    for node_labels in (None, [], [{"kubernetes.io/hostname": "cpu-1"}]):
        terms = required_terms(manifest(accelerator="H100", node_labels=node_labels))
        assert {t["matchExpressions"][0]["key"] for t in terms} == {
            "nvidia.com/gpu.product", "cloud.google.com/gke-accelerator", "karpenter.k8s.aws/instance-gpu-name"}
        assert gpu_types.node_matches(terms, H100_NODE)
        assert not gpu_types.node_matches(terms, {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"})
        assert not gpu_types.node_matches(terms, {})


def test_the_nodes_values_and_the_clusters_own_label_reach_the_pod():
    nodes = [{"nvidia.com/gpu.product": "NVIDIA-H100-SXM5-94GB"}, {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}]
    terms = required_terms(manifest(accelerator="H100", node_labels=nodes))
    assert gpu_types.node_matches(terms, nodes[0]) and not gpu_types.node_matches(terms, nodes[1])
    own = required_terms(manifest(accelerator="H100", k8s_gpu_label="example.com/gpu",
                                  node_labels=[{"example.com/gpu": "h100-sxm"}, {"example.com/gpu": "a100"}]))
    assert own == [{"matchExpressions": [{"key": "example.com/gpu", "operator": "In", "values": ["H100", "h100-sxm"]}]}]


ZONES = ("a", "b", "c")
PRODUCTS = ({"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}, {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
            {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}, {"karpenter.k8s.aws/instance-gpu-name": "h100"},
            {"karpenter.k8s.aws/instance-gpu-name": "a100"}, {})
NODES = [{**p, "topology.kubernetes.io/zone": z, "tier": t} for p in PRODUCTS for z in ZONES for t in ("spot", "ondemand")]


def test_a_templates_node_affinity_narrows_never_widens():
    template_terms = [{"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}]},
                      {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["spot"]},
                                            {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["b"]}]}]
    template = {"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": template_terms}}}}}
    pool_terms = required_terms(manifest(accelerator="H100"))
    terms = required_terms(manifest(accelerator="H100", k8s_pod_template=template))
    assert len(terms) == len(pool_terms) * len(template_terms)
    for node in NODES:
        both = gpu_types.node_matches(pool_terms, node) and gpu_types.node_matches(template_terms, node)
        assert gpu_types.node_matches(terms, node) is both, node
    may = [n for n in NODES if gpu_types.node_matches(terms, n)]
    assert may and all(n.get("topology.kubernetes.io/zone") in ("a", "b") for n in may)
    assert all(n.get("nvidia.com/gpu.product", "NVIDIA-H100").startswith("NVIDIA-H100") for n in may)
    # Without a product to require, the template's terms are the pods' own.
    assert required_terms(manifest(k8s_pod_template=template)) == template_terms
    # A term that matches no node adds none; with nothing left, the pods may go nowhere, as written.
    nowhere = {"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{}]}}}}}
    assert not any(gpu_types.node_matches(required_terms(manifest(accelerator="H100", k8s_pod_template=nowhere)), n)
                   for n in NODES)


def test_a_templates_selector_merges_key_by_key_and_a_null_erases_nothing():
    template = {"spec": {"nodeSelector": {"disk": "ssd"}, "affinity": None}}
    spec = manifest(accelerator="H100", k8s_node_selector={"pool": "gpu"}, k8s_pod_template=template)["spec"]
    assert spec["nodeSelector"] == {"pool": "gpu", "disk": "ssd"}
    assert gpu_types.node_matches(spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"], H100_NODE)
    assert spec["affinity"]["podAntiAffinity"]


def anti_affinity(pod):
    return pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]


def shuns(a, b):
    """Whether pod `a`'s required anti-affinity keeps it off a node where pod `b` runs."""
    return any(term["topologyKey"] == "kubernetes.io/hostname" and
               term["labelSelector"]["matchLabels"].items() <= b["metadata"]["labels"].items()
               for term in anti_affinity(a))


def most_on_one_node(pool_pods):
    """The largest set of the pool's pods that may share one node (no pod shuns another there)."""
    best = 0
    for mask in range(1, 1 << len(pool_pods)):
        chosen = [p for i, p in enumerate(pool_pods) if mask >> i & 1]
        if all(not shuns(a, b) for a in chosen for b in chosen if a is not b):
            best = max(best, len(chosen))
    return best


def test_a_gpu_pools_pods_go_to_distinct_nodes():
    pool_pods = [manifest(node_id=i, accelerator="H100") for i in range(4)]
    assert anti_affinity(pool_pods[0]) == [{"labelSelector": {"matchLabels": {pods.POOL_LABEL: "skytasks-abc"}},
                                            "topologyKey": "kubernetes.io/hostname"}]
    assert pods.SLOT_LABEL not in pool_pods[0]["metadata"]["labels"]
    assert most_on_one_node(pool_pods) == 1
    assert "affinity" not in manifest()["spec"]  # a CPU pool: no limit
    assert most_on_one_node([manifest(node_id=i, k8s_pods_per_host=1) for i in range(3)]) == 1


def test_pods_per_host_lets_that_many_share_a_node():
    pool_pods = [manifest(node_id=i, accelerator="H100", k8s_pods_per_host=3) for i in range(8)]
    assert [p["metadata"]["labels"][pods.SLOT_LABEL] for p in pool_pods] == ["0", "1", "2", "0", "1", "2", "0", "1"]
    assert anti_affinity(pool_pods[4])[0]["labelSelector"]["matchLabels"] == {pods.POOL_LABEL: "skytasks-abc",
                                                                               pods.SLOT_LABEL: "1"}
    assert most_on_one_node(pool_pods) == 3
    # A replacement may take its lost pod's slot.
    spec = GPUPool(provider="kubernetes", k8s_image="x", accelerator="H100", k8s_pods_per_host=3).spec()
    again = pods.pod_manifest(spec, spec.own(KubernetesSpec), "p", 9, OWNER, slot=1)
    assert again["metadata"]["labels"][pods.SLOT_LABEL] == "1"
    # A template's own anti-affinity is added to the pool's (required terms are ANDed).
    mine = {"labelSelector": {"matchLabels": {"app": "db"}}, "topologyKey": "kubernetes.io/hostname"}
    template = {"spec": {"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [mine]}}}}
    terms = anti_affinity(manifest(accelerator="H100", k8s_pod_template=template))
    assert len(terms) == 2 and mine in terms


def test_a_queued_pool_is_one_kueue_pod_group():
    fields = dict(nodes=4, accelerator="H100", k8s_pods_per_host=2, k8s_queue="team-a", k8s_priority_class="train-high")
    first, replacement = manifest(node_id=0, **fields), manifest(node_id=7, node_labels=[H100_NODE], **fields)
    for pod in (first, replacement):
        labels, notes = pod["metadata"]["labels"], pod["metadata"]["annotations"]
        assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
        assert labels["kueue.x-k8s.io/pod-group-name"] == "skytasks-abc"
        assert notes["kueue.x-k8s.io/pod-group-total-count"] == "4"
        assert notes["kueue.x-k8s.io/retriable-in-group"] == "false"
        assert pod["spec"]["priorityClassName"] == "train-high"
    # One role for every pod of the pool, though their slots' anti-affinity differs.
    assert first["spec"]["affinity"] != replacement["spec"]["affinity"]
    assert first["metadata"]["annotations"]["kueue.x-k8s.io/role-hash"] == \
        replacement["metadata"]["annotations"]["kueue.x-k8s.io/role-hash"] == "node"
    # The template cannot move a pod to another group or queue.
    template = {"metadata": {"labels": {"kueue.x-k8s.io/pod-group-name": "x"},
                             "annotations": {"kueue.x-k8s.io/pod-group-total-count": "1"}}}
    pod = manifest(k8s_pod_template=template, **fields)
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] == "skytasks-abc"
    assert pod["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "4"


def keeper(tmp_path, idle, grace, window):
    """The pod's keeper, run here as the pod runs it, with its heartbeat and notice files in tmp_path."""
    beat, notice = tmp_path / "beat", tmp_path / "notice"
    code = pods.KEEPER.replace(repr(pods.HEARTBEAT_FILE), repr(str(beat))).replace(repr(pods.NOTICE_FILE),
                                                                                   repr(str(notice)))
    assert str(beat) in code and str(notice) in code
    proc = subprocess.Popen([sys.executable, "-c", code, str(idle), str(grace), str(window)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, beat


def ended_within(proc, seconds):
    deadline = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc.poll() is not None


def test_the_idle_clock_starts_at_the_first_heartbeat(tmp_path):
    proc, beat = keeper(tmp_path, idle=1, grace=30, window=60)
    try:
        assert not ended_within(proc, 2.5)  # past the idle limit, but no controller has come yet
        beat.touch()
        touched = time.monotonic()
        assert ended_within(proc, 10)
        took = time.monotonic() - touched
        assert 0.9 <= took < 6, took
        out = proc.stdout.read()
        assert "the controller is here" in out and "silent" in out and proc.returncode == 0
    finally:
        proc.kill()
        proc.wait()


def test_a_pod_no_controller_reaches_ends_at_the_start_window(tmp_path):
    started = time.monotonic()
    proc, _ = keeper(tmp_path, idle=0.5, grace=30, window=2)
    try:
        assert ended_within(proc, 15)
        assert time.monotonic() - started >= 2
        out = proc.stdout.read()
        assert "no controller reached this pod within 2s" in out and "ready_timeout_seconds + idle" in out
    finally:
        proc.kill()
        proc.wait()


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


NETWORK_POLICY = Path(__file__).parent.parent / "deployments/kubernetes/networkpolicy.yaml"
# The two ways the file's comments say to fill it in, as written there.
PER_POOL = ["sed", "s/POOL_ID/skytasks-0123456789/"]
NAMESPACE_WIDE = ["sed", "-e", "s|skytasks.io/pool: POOL_ID|app.kubernetes.io/managed-by: skytasks|", "-e",
                  "s/POOL_ID/all/"]


def filled_policy(sed: list[str]) -> str:
    said = NETWORK_POLICY.read_text()
    assert " ".join(a if a == "-e" else f"'{a}'" for a in sed[1:]) in said  # the command the comments give
    return subprocess.run([*sed, str(NETWORK_POLICY)], capture_output=True, text=True, check=True).stdout


def admits(policy: dict, source_labels: dict, target_labels: dict, port: int) -> bool | None:
    """Whether the policy lets a pod labelled `source_labels` open TCP `port` on one labelled
    `target_labels` (a pod it does not select is not its concern: None)."""
    def matches(selector, labels):
        assert set(selector) == {"matchLabels"}  # nothing this reading would miss
        return selector["matchLabels"].items() <= labels.items()

    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    if not matches(spec["podSelector"], target_labels):
        return None
    return any(all(set(peer) == {"podSelector"} for peer in rule["from"]) and
               any(matches(peer["podSelector"], source_labels) for peer in rule["from"]) and
               any(p == {"protocol": "TCP"} or p.get("port") == port for p in rule["ports"])
               for rule in spec["ingress"])


def test_the_network_policy_admits_the_pools_own_pods_only():
    spec = GPUPool(provider="kubernetes", k8s_image="x").spec()
    mine, other = (pods.pod_manifest(spec, spec.own(KubernetesSpec), pool_id, 0, OWNER)["metadata"]["labels"]
                   for pool_id in ("skytasks-0123456789", "skytasks-9876543210"))
    stranger = {"app": "web"}
    policy = yaml.safe_load(filled_policy(PER_POOL))
    assert policy["kind"] == "NetworkPolicy" and policy["metadata"]["name"] == "skytasks-pool-skytasks-0123456789"
    for port in (10000, 29500, 45678):  # the TCPStore's range and the kernel's, where the relay, gloo and NCCL are
        assert admits(policy, mine, mine, port) is True
        assert admits(policy, other, mine, port) is False and admits(policy, stranger, mine, port) is False
        assert admits(policy, stranger, other, port) is None  # another pool's pods: not this policy's
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP"}]  # TCP only: nothing but the pool listens, on ports picked at start
    wide = yaml.safe_load(filled_policy(NAMESPACE_WIDE))
    assert wide["metadata"]["name"] == "skytasks-pool-all"
    assert admits(wide, other, mine, 45678) is True and admits(wide, stranger, mine, 45678) is False
    assert admits(wide, stranger, stranger, 45678) is None


def test_the_test_cluster_accepts_the_network_policy(k8s_cluster, tmp_path):
    import json
    import uuid

    namespace = k8s_cluster.create_namespace(f"np-{uuid.uuid4().hex[:8]}")
    try:
        files = {}
        for form, sed in (("per-pool", PER_POOL), ("namespace-wide", NAMESPACE_WIDE)):
            files[form] = tmp_path / f"{form}.yaml"
            files[form].write_text(filled_policy(sed))
            applied = k8s_cluster.kubectl("apply", "-n", namespace, "-f", str(files[form]), check=False)
            assert applied.returncode == 0, f"{form}: {applied.stderr}"
        stored = {p["metadata"]["name"]: p for p in json.loads(k8s_cluster.kubectl(
            "get", "networkpolicies", "-n", namespace, "-o", "json").stdout)["items"]}
        for path in files.values():
            sent = yaml.safe_load(path.read_text())
            assert stored[sent["metadata"]["name"]]["spec"] == sent["spec"]  # kept as written, nothing dropped
            assert stored[sent["metadata"]["name"]]["metadata"]["labels"] == sent["metadata"]["labels"]
        assert len(stored) == 2
        for path in files.values():
            k8s_cluster.kubectl("delete", "-n", namespace, "-f", str(path))
        deadline = time.monotonic() + 30
        while json.loads(k8s_cluster.kubectl("get", "networkpolicies", "-n", namespace, "-o", "json").stdout)["items"]:
            assert time.monotonic() < deadline, "the network policies were not deleted"
            time.sleep(0.2)
    finally:
        k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def _api_error(status: int, message: str) -> Exception:
    import json

    from kubernetes.client.exceptions import ApiException

    exc = ApiException(status=status, reason="")
    exc.body = json.dumps({"kind": "Status", "message": message})
    return exc


def test_adopting_a_warm_pool_asks_a_403_again_and_nothing_else_that_names_a_field():
    """A warm pool's adopt: a 403 is asked again until ready_timeout_seconds (an API server just
    restarted denies for a moment what its RBAC grants), with the refusal's own words; a missing
    namespace or a refused manifest is still the PoolConfigError naming its field."""
    from skytasks.errors import PoolStartError
    from skytasks.providers.kubernetes import cluster
    from skytasks.providers.kubernetes.warm_pods import _asked_again

    rbac = 'configmaps "skytasks-1" is forbidden: ... RBAC: role.rbac.authorization.k8s.io "skytasks-pool" not found'
    again = _asked_again(cluster.refused(_api_error(403, rbac), "read configmaps", "default"))
    assert isinstance(again, PoolStartError) and not isinstance(again, PoolConfigError)
    assert str(again).startswith("kubernetes_credentials: the pool's identity may not read configmaps") and rbac in str(again)
    for status, said, field in [(404, 'namespaces "gone" not found', "k8s_namespace"), (422, "bad pod", "k8s_pod_template")]:
        kept = _asked_again(cluster.refused(_api_error(status, said), "read configmaps", "gone"))
        assert isinstance(kept, PoolConfigError) and str(kept).startswith(field + ":")
