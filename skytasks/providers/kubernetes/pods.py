"""The objects a kubernetes pool makes, as manifests: the pool's owner object and one pod per node.

Pure functions: nothing here talks to a cluster, so every rule (the template's merge, the GPU
label chosen from the nodes' labels, what a pod carries and never carries) is tested without one.

A pod holds no secret and no code: its command is the keeper below, a few lines of the image's
own Python. The node agent, skytasks itself and the pool's secret arrive later over an exec
stream through the API server, which authenticates the controller.
"""

from __future__ import annotations

import copy
import re
from datetime import datetime, timedelta, timezone
from typing import Any, Iterable, Mapping, Optional

from skytasks.pool_spec import PoolSpec
from skytasks.providers.kubernetes.spec import KubernetesSpec

MANAGED_BY = ("app.kubernetes.io/managed-by", "skytasks")
POOL_LABEL = "skytasks.io/pool"
NODE_LABEL = "skytasks.io/node"
EXPIRES_ANNOTATION = "skytasks.io/expires-at"
NAME_ANNOTATION = "skytasks.io/pool-name"
CONTAINER = "node"
HEARTBEAT_FILE = "/tmp/skytasks.beat"
NOTICE_FILE = "/tmp/skytasks.notice"
DEFAULT_GRACE_SECONDS = 30  # Kubernetes' own default terminationGracePeriodSeconds
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
GPU_RESOURCE = "nvidia.com/gpu"

# The pod's own process. It ends the pod when the controller has been silent for the idle limit
# (its agent touches the heartbeat whenever it hears the controller), and turns Kubernetes' SIGTERM
# (a delete with a grace period, an eviction, a drain, a node shutting down) into the node's
# preemption notice, with the grace period as its deadline; the agent relays it to every rank.
# argv: idle seconds, grace seconds. Standard library only: it is the image's Python.
KEEPER = r"""
import json, os, signal, sys, time
idle, grace = float(sys.argv[1]), float(sys.argv[2])
beat, notice, start = %(beat)r, %(notice)r, time.time()
def asked_to_leave(signum, frame):
    tmp = notice + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"reason": "Kubernetes asked the pod to leave (deleted with a grace period, evicted, drained, "
                   "or its node is going away)", "deadline": time.time() + grace}, f)
    os.rename(tmp, notice)
    print("skytasks: SIGTERM: preemption notice given, %%gs to leave" %% grace, flush=True)
signal.signal(signal.SIGTERM, asked_to_leave)
print("skytasks: pod up; it ends after %%gs without its controller" %% idle, flush=True)
while True:
    try:
        last = max(start, os.stat(beat).st_mtime)
    except OSError:
        last = start
    if time.time() - last >= idle:
        print("skytasks: the controller was silent for %%ds (idle limit %%ds); ending the pod" %% (time.time() - last, idle),
              flush=True)
        sys.exit(0)
    time.sleep(max(0.5, min(5.0, idle / 4)))
""" % {"beat": HEARTBEAT_FILE, "notice": NOTICE_FILE}

# Node labels that name a node's GPU product, most specific first: NVIDIA GPU Feature Discovery
# (and the GPU operator), GKE, Karpenter on AWS, CoreWeave, and the generic ones some clusters set.
GPU_PRODUCT_LABELS = ("nvidia.com/gpu.product", "cloud.google.com/gke-accelerator",
                      "karpenter.k8s.aws/instance-gpu-name", "gpu.nvidia.com/class", "nvidia.com/gpu.family",
                      "accelerator")


def pod_name(pool_id: str, node_id: int) -> str:
    return f"{pool_id}-{node_id}"


def expires_at(max_lifetime_minutes: float, now: Optional[datetime] = None) -> str:
    now = now or datetime.now(timezone.utc)
    return (now + timedelta(minutes=max_lifetime_minutes)).strftime(TIME_FORMAT)


def owner_manifest(pool_id: str, pool_name: str, k8s: KubernetesSpec, now: Optional[datetime] = None) -> dict[str, Any]:
    """The pool's owner object, a ConfigMap: every pod names it as its owner, so deleting it (the
    pool's end, `skytasks gc --kubernetes`, or a person) has Kubernetes' garbage collector delete them."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": pool_id, "labels": {MANAGED_BY[0]: MANAGED_BY[1], POOL_LABEL: pool_id},
                         "annotations": {EXPIRES_ANNOTATION: expires_at(k8s.max_lifetime_minutes, now),
                                         NAME_ANNOTATION: pool_name}},
            "data": {"pool": pool_name, "idle-minutes": f"{k8s.idle_minutes:g}"}}


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"]}


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def gpu_product_affinity(accelerator: str, node_labels: Iterable[Mapping[str, str]]) -> Optional[tuple[str, list[str]]]:
    """The label the cluster's nodes carry that names `accelerator`, and every value of it that
    does ("H100" matches GFD's "NVIDIA-H100-80GB-HBM3" and GKE's "nvidia-h100-80gb"). The most
    specific label that any node carries wins; None when no node names the product."""
    want = _norm(accelerator)
    labels = [dict(n) for n in node_labels]
    for key in GPU_PRODUCT_LABELS:
        values = sorted({n[key] for n in labels if key in n and want and want in _norm(n[key])})
        if values:
            return key, values
    return None


def merge(base: Any, overlay: Any) -> Any:
    """`overlay` merged into `base`: mappings key by key, lists of named mappings by name
    (`containers`, `volumes`, `env`, `volumeMounts`), other lists appended (without repeats),
    anything else replaced by the overlay's."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        out = dict(base)
        for key, value in overlay.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(overlay, list):
        if all(isinstance(i, dict) and "name" in i for i in base + overlay) and base + overlay:
            out_list = [copy.deepcopy(i) for i in base]
            for item in overlay:
                at = next((k for k, b in enumerate(out_list) if b["name"] == item["name"]), None)
                if at is None:
                    out_list.append(copy.deepcopy(item))
                else:
                    out_list[at] = merge(out_list[at], item)
            return out_list
        return [copy.deepcopy(i) for i in base] + [copy.deepcopy(i) for i in overlay if i not in base]
    return copy.deepcopy(overlay)


def merge_template(pod: dict[str, Any], template: Mapping[str, Any]) -> dict[str, Any]:
    """The user's partial pod manifest merged into the pool's pod. A container entry without a
    name is the pool's own container."""
    template = copy.deepcopy(dict(template))
    containers = template.get("spec", {}).get("containers")
    if containers:
        template["spec"]["containers"] = [c if c.get("name") else {**c, "name": CONTAINER} for c in containers]
    return merge(pod, template)


def grace_seconds(pod: Mapping[str, Any]) -> int:
    value = pod.get("spec", {}).get("terminationGracePeriodSeconds")
    return DEFAULT_GRACE_SECONDS if value is None else int(value)


def pod_manifest(spec: PoolSpec, k8s: KubernetesSpec, pool_id: str, node_id: int, owner_ref: Mapping[str, Any],
                 gpu_affinity: Optional[tuple[str, list[str]]] = None) -> dict[str, Any]:
    """One node's pod. The user's template fills in everything else, but never the pod's identity:
    its name, the labels and owner that let the pool (and the garbage collector) find it, its
    keeper, and `restartPolicy: Never` (a node that ended is replaced by the pool, not restarted)."""
    resources: dict[str, dict[str, Any]] = {}
    for key, value in (("cpu", k8s.cpu), ("memory", k8s.memory)):
        if value:
            resources.setdefault("requests", {})[key] = value
            resources.setdefault("limits", {})[key] = value
    tolerations = [dict(t) for t in k8s.tolerations]
    if k8s.gpus:
        resources.setdefault("limits", {})[GPU_RESOURCE] = str(k8s.gpus)  # a quantity, as the API takes it
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    shm: dict[str, Any] = {"medium": "Memory", **({"sizeLimit": k8s.shm_size} if k8s.shm_size else {})}
    pod: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod_name(pool_id, node_id), "labels": {}, "annotations": {NAME_ANNOTATION: spec.name}},
        "spec": {
            "containers": [{"name": CONTAINER, "image": k8s.image, "resources": resources,
                            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}],
            "volumes": [{"name": "dshm", "emptyDir": shm}],
            # No API token in the pods unless a service account is asked for: the ranks need none.
            "automountServiceAccountToken": bool(k8s.service_account),
            "enableServiceLinks": False,
        },
    }
    body = pod["spec"]
    if k8s.service_account:
        body["serviceAccountName"] = k8s.service_account
    if k8s.image_pull_secrets:
        body["imagePullSecrets"] = [{"name": n} for n in k8s.image_pull_secrets]
    if k8s.node_selector:
        body["nodeSelector"] = dict(k8s.node_selector)
    if tolerations:
        body["tolerations"] = tolerations
    if gpu_affinity:
        key, values = gpu_affinity
        body["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": key, "operator": "In", "values": values}]}]}}}
    pod = merge_template(pod, k8s.pod_template)
    meta, body = pod["metadata"], pod["spec"]
    meta["name"] = pod_name(pool_id, node_id)
    meta.pop("generateName", None)
    meta["labels"].update({MANAGED_BY[0]: MANAGED_BY[1], POOL_LABEL: pool_id, NODE_LABEL: str(node_id)})
    meta["ownerReferences"] = [dict(owner_ref)]
    body["restartPolicy"] = "Never"
    body["activeDeadlineSeconds"] = max(1, round(k8s.max_lifetime_minutes * 60))
    own = next(c for c in body["containers"] if c["name"] == CONTAINER)
    own["command"] = [k8s.remote_python, "-c", KEEPER, f"{k8s.idle_minutes * 60:g}", str(grace_seconds(pod))]
    own.pop("args", None)
    return pod


def secret_free(pod: Mapping[str, Any], secrets: Iterable[str]) -> bool:
    """Whether no secret value appears anywhere in a manifest (checked before every create)."""
    text = repr(pod)
    return not any(s and s in text for s in secrets)
