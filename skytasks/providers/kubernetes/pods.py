"""The objects a kubernetes pool makes, as manifests: the pool's owner object and one pod per node.

Pure functions: nothing here talks to a cluster, so every rule (the template's merge, the GPU
product the pods require, their placement and Kueue group, what a pod carries and never carries)
is tested without one.

A pod holds no secret and no code: its command is the keeper below, a few lines of the image's
own Python. The node agent, skytasks itself and the pool's secret arrive later over an exec
stream through the API server, which authenticates the controller.
"""

from __future__ import annotations

import copy
from datetime import datetime
from typing import Any, Iterable, Mapping, Optional

from skytasks.pool_spec import PoolSpec
from skytasks.providers.kubernetes import gpu_types
from skytasks.providers.kubernetes.spec import KubernetesSettings

MANAGED_BY = ("app.kubernetes.io/managed-by", "skytasks")
POOL_LABEL = "skytasks.io/pool"
NODE_LABEL = "skytasks.io/node"
SLOT_LABEL = "skytasks.io/slot"
EXPIRES_ANNOTATION = "skytasks.io/expires-at"
NAME_ANNOTATION = "skytasks.io/pool-name"
CONTAINER = "node"
HEARTBEAT_FILE = "/tmp/skytasks.beat"
NOTICE_FILE = "/tmp/skytasks.notice"
DEFAULT_GRACE_SECONDS = 30  # Kubernetes' own default terminationGracePeriodSeconds
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
GPU_RESOURCE = "nvidia.com/gpu"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
# Kueue's plain-pod group (kueue v0.20 pkg/controller/jobs/pod/constants, docs tasks/run/plain_pods).
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_ROLE_ANNOTATION = "kueue.x-k8s.io/role-hash"
KUEUE_RETRIABLE_ANNOTATION = "kueue.x-k8s.io/retriable-in-group"
KUEUE_ROLE = "node"

# The pod's own process. It ends the pod when the controller has been silent for the idle limit
# (its agent touches the heartbeat whenever it hears the controller), and turns Kubernetes' SIGTERM
# (a delete with a grace period, an eviction, a drain, a node shutting down) into the node's
# preemption notice, with the grace period as its deadline; the agent relays it to every rank.
# The idle clock starts at the first heartbeat, never with the container: a pod that runs early
# waits for its siblings. A pod no controller ever reaches (it died during the start) ends at the
# pool's start window. argv: idle seconds, grace seconds, start window seconds. Standard library
# only: it is the image's Python.
KEEPER = r"""
import json, os, signal, sys, time
idle, grace, window = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
beat, notice, start = %(beat)r, %(notice)r, time.time()
def asked_to_leave(signum, frame):
    tmp = notice + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"reason": "Kubernetes asked the pod to leave (deleted with a grace period, evicted, drained, "
                   "or its node is going away)", "deadline": time.time() + grace}, f)
    os.rename(tmp, notice)
    print("skytasks: SIGTERM: preemption notice given, %%gs to leave" %% grace, flush=True)
signal.signal(signal.SIGTERM, asked_to_leave)
print("skytasks: pod up; waiting for the pool's controller (at most %%gs)" %% window, flush=True)
heard = False
while True:
    try:
        last = os.stat(beat).st_mtime
    except OSError:
        last = None
    if last is None:
        if time.time() - start >= window:
            print("skytasks: no controller reached this pod within %%ds of its start (the pool's start window: "
                  "ready_timeout_seconds + idle); ending the pod" %% window, flush=True)
            sys.exit(0)
    elif last == 1:  # the agent's word: a warm pool nobody held for keep_warm_minutes
        print("skytasks: nobody held the warm pool for its keep_warm_minutes; ending the pod", flush=True)
        sys.exit(0)
    else:
        if not heard:
            heard = True
            print("skytasks: the controller is here; the pod ends after %%gs without it" %% idle, flush=True)
        if time.time() - last >= idle:
            print("skytasks: the controller was silent for %%ds (idle limit %%ds); ending the pod"
                  %% (time.time() - last, idle), flush=True)
            sys.exit(0)
    time.sleep(max(0.5, min(5.0, idle / 4)))
""" % {"beat": HEARTBEAT_FILE, "notice": NOTICE_FILE}


def pod_name(pool_id: str, node_id: int) -> str:
    return f"{pool_id}-{node_id}"


def owner_manifest(pool_id: str, pool_name: str, k8s: KubernetesSettings, expires: datetime) -> dict[str, Any]:
    """The pool's owner object, a ConfigMap: every pod names it as its owner, so deleting it (the
    pool's end, `skytasks gc --kubernetes`, or a person) has Kubernetes' garbage collector delete them.
    `expires` is the pool's lease (`remote_fields.Lease`), which the live controller renews: past it
    gc takes the pool for an orphan, however long a capless training run goes on while it lives."""
    annotations = {NAME_ANNOTATION: pool_name, EXPIRES_ANNOTATION: expires.strftime(TIME_FORMAT)}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": pool_id, "labels": {MANAGED_BY[0]: MANAGED_BY[1], POOL_LABEL: pool_id},
                         "annotations": annotations},
            "data": {"pool": pool_name, "idle-minutes": f"{k8s.idle_minutes:g}"}}


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    """The pods' reference to the owner, as their controller: `kubectl drain` then evicts them
    without `--force`. No `blockOwnerDeletion`: setting it needs `update` on the owner's
    finalizers, which deployments/kubernetes/rbac.yaml does not grant (the pods' deletion never
    waits on it anyway)."""
    return {"apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"],
            "controller": True}


def merge(base: Any, overlay: Any) -> Any:
    """`overlay` merged into `base`: mappings key by key, lists of named mappings by name
    (`containers`, `volumes`, `env`, `volumeMounts`), other lists appended (without repeats), a
    null never erases a mapping or list of the base, anything else replaced by the overlay's."""
    if overlay is None and isinstance(base, (dict, list)):
        return copy.deepcopy(base)
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


_REQUIRED_TERMS = ("spec", "affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution", "nodeSelectorTerms")


def _pop_path(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path[:-1]:
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree.pop(path[-1], None) if isinstance(tree, dict) else None


def narrow_terms(pool_terms: list[dict[str, Any]], template_terms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Required nodeSelectorTerms that hold where both the pool's and the template's hold: the
    terms are ORed, so every template term is ANDed with every pool term (their matchExpressions
    and matchFields together). An empty term matches no node, and so adds none."""
    if not pool_terms or not template_terms:
        return copy.deepcopy(pool_terms or template_terms)
    narrowed = []
    for mine in template_terms:
        for pools in pool_terms:
            if not any(mine.get(p) for p in ("matchExpressions", "matchFields")) or \
                    not any(pools.get(p) for p in ("matchExpressions", "matchFields")):
                continue
            term = {part: copy.deepcopy((mine.get(part) or []) + (pools.get(part) or []))
                    for part in ("matchExpressions", "matchFields") if mine.get(part) or pools.get(part)}
            narrowed.append(term)
    return narrowed or [{"matchExpressions": []}]  # no pair can hold: a term that matches no node, as written


def merge_template(pod: dict[str, Any], template: Mapping[str, Any]) -> dict[str, Any]:
    """The user's partial pod manifest merged into the pool's pod. A container entry without a
    name is the pool's own container. Where the pods may go only narrows: the template's required
    node affinity terms are crossed with the pool's (see `narrow_terms`), its nodeSelector merges
    key by key, and its pod (anti-)affinity terms are added to the pool's (they are ANDed)."""
    template = copy.deepcopy(dict(template))
    containers = (template.get("spec") or {}).get("containers")
    if containers:
        template["spec"]["containers"] = [c if c.get("name") else {**c, "name": CONTAINER} for c in containers]
    template_terms = _pop_path(template, _REQUIRED_TERMS)
    merged = merge(pod, template)
    if template_terms:
        pool_terms = _pop_path(merged, _REQUIRED_TERMS) or []
        at = merged
        for key in _REQUIRED_TERMS[:-1]:
            if not isinstance(at.get(key), dict):
                at[key] = {}
            at = at[key]
        at[_REQUIRED_TERMS[-1]] = narrow_terms(pool_terms, template_terms)
    return merged


def grace_seconds(pod: Mapping[str, Any]) -> int:
    value = pod.get("spec", {}).get("terminationGracePeriodSeconds")
    return DEFAULT_GRACE_SECONDS if value is None else int(value)


def _placement(spec: PoolSpec, k8s: KubernetesSettings, pool_id: str, node_id: int,
               node_labels: Optional[Iterable[Mapping[str, str]]], slot: Optional[int]) -> tuple[dict[str, Any], Optional[str]]:
    """The pod's affinity (the GPU product's nodes; at most `per_host` pods of the pool on one
    node) and its slot label's value. With `per_host` N > 1 each pod has a slot (node % N) and
    shuns only its own slot's pods, so at most N of the pool share a node."""
    affinity: dict[str, Any] = {}
    if spec.accelerator:
        terms = gpu_types.node_terms(spec.accelerator, node_labels, k8s.k8s_gpu_label)
        affinity["nodeAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}
    per_host, slot_value = k8s.per_host_for(spec), None
    if per_host is not None:
        selector = {POOL_LABEL: pool_id}
        if per_host > 1:
            slot_value = str((node_id if slot is None else slot) % per_host)
            selector[SLOT_LABEL] = slot_value
        affinity["podAntiAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": selector}, "topologyKey": HOSTNAME_TOPOLOGY}]}
    return affinity, slot_value


def pod_manifest(spec: PoolSpec, k8s: KubernetesSettings, pool_id: str, node_id: int, owner_ref: Mapping[str, Any],
                 node_labels: Optional[Iterable[Mapping[str, str]]] = None, slot: Optional[int] = None) -> dict[str, Any]:
    """One node's pod. `node_labels`: the labels of the cluster's nodes, when the pool could read
    them (values there that name the accelerator join the known ones). `slot`: the placement slot
    with `k8s_pods_per_host` > 1 (default: node % per_host; a replacement may take its lost pod's).

    The user's template fills in everything else, but never the pod's identity: its name, the
    labels and owner that let the pool (and the garbage collector) find it, its Kueue group, its
    keeper, and `restartPolicy: Never` (a node that ended is replaced by the pool, not restarted)."""
    resources: dict[str, dict[str, Any]] = {}
    for key, value in (("cpu", k8s.k8s_cpu), ("memory", k8s.k8s_memory)):
        if value:
            resources.setdefault("requests", {})[key] = value
            resources.setdefault("limits", {})[key] = value
    tolerations = [dict(t) for t in k8s.k8s_tolerations]
    gpus = k8s.gpus_for(spec)
    if gpus:
        resources.setdefault("limits", {})[GPU_RESOURCE] = str(gpus)  # a quantity, as the API takes it
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    shm: dict[str, Any] = {"medium": "Memory", **({"sizeLimit": k8s.k8s_shm_size} if k8s.k8s_shm_size else {})}
    pod: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod_name(pool_id, node_id), "labels": {}, "annotations": {NAME_ANNOTATION: spec.name}},
        "spec": {
            "containers": [{"name": CONTAINER, "image": k8s.k8s_image, "resources": resources,
                            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}],
            "volumes": [{"name": "dshm", "emptyDir": shm}],
            # No API token in the pods unless a service account is asked for: the ranks need none.
            "automountServiceAccountToken": bool(k8s.k8s_service_account),
            "enableServiceLinks": False,
        },
    }
    body = pod["spec"]
    if k8s.k8s_service_account:
        body["serviceAccountName"] = k8s.k8s_service_account
    if k8s.k8s_image_pull_secrets:
        body["imagePullSecrets"] = [{"name": n} for n in k8s.k8s_image_pull_secrets]
    if k8s.k8s_node_selector:
        body["nodeSelector"] = dict(k8s.k8s_node_selector)
    if tolerations:
        body["tolerations"] = tolerations
    affinity, slot_value = _placement(spec, k8s, pool_id, node_id, node_labels, slot)
    if affinity:
        body["affinity"] = affinity
    pod = merge_template(pod, k8s.k8s_pod_template)
    meta, body = pod["metadata"], pod["spec"]
    meta["name"] = pod_name(pool_id, node_id)
    meta.pop("generateName", None)
    labels = meta.setdefault("labels", {})
    labels.update({MANAGED_BY[0]: MANAGED_BY[1], POOL_LABEL: pool_id, NODE_LABEL: str(node_id)})
    if slot_value is not None:
        labels[SLOT_LABEL] = slot_value
    if k8s.k8s_queue:
        _join_kueue_group(meta, k8s, pool_id, spec.nodes)
    meta["ownerReferences"] = [dict(owner_ref)]
    body["restartPolicy"] = "Never"
    if k8s.k8s_priority_class:
        body["priorityClassName"] = k8s.k8s_priority_class
    if k8s.max_lifetime_minutes is not None:
        body["activeDeadlineSeconds"] = max(1, round(k8s.max_lifetime_minutes * 60))
    own = next(c for c in body["containers"] if c["name"] == CONTAINER)
    idle = k8s.idle_minutes * 60
    own["command"] = [k8s.python, "-c", KEEPER, f"{idle:g}", str(grace_seconds(pod)),
                      f"{k8s.ready_timeout_seconds + idle:g}"]
    own.pop("args", None)
    return pod


def _join_kueue_group(meta: dict[str, Any], k8s: KubernetesSettings, pool_id: str, nodes: int) -> None:
    """Kueue admits the pool whole: one plain-pod group per pool, of the start size; a replacement
    pod joins it with the same count. Every pod is one role (a pinned role hash: pods that differ
    only in their slot's anti-affinity, or a replacement made after new nodes appeared, would
    otherwise be new roles, which evicts the group), and not retriable in the group, so the group
    ends, and Kueue lets the pods go, once every pod of the pool has ended."""
    meta["labels"].update({KUEUE_QUEUE_LABEL: str(k8s.k8s_queue), KUEUE_GROUP_LABEL: pool_id})
    meta.setdefault("annotations", {}).update({KUEUE_TOTAL_ANNOTATION: str(nodes), KUEUE_ROLE_ANNOTATION: KUEUE_ROLE,
                                               KUEUE_RETRIABLE_ANNOTATION: "false"})


def secret_free(pod: Mapping[str, Any], secrets: Iterable[str]) -> bool:
    """Whether no secret value appears anywhere in a manifest (checked before every create)."""
    text = repr(pod)
    return not any(s and s in text for s in secrets)
