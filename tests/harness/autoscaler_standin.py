"""A stand-in for a node autoscaler on the Kubernetes test cluster (tests/harness/k8s/): it says
on a pending pod what Cluster Autoscaler or Karpenter would, as core/v1 Events of the very
shape they post, and then makes "a node join" the way a cloud's node does (the labels the pod
requires, a taint lifted, GPUs advertised).

The shapes are read from the autoscalers' own source:

- Cluster Autoscaler, tag `cluster-autoscaler-1.36.1` (commit
  35e8a280425c76a4040f57ae0fa232a952c02024; the same strings on release-1.20 and release-1.28):
  `utils/kubernetes/factory.go` records with `EventSource{Component: "cluster-autoscaler"}`;
  `processors/status/eventing_scale_up_processor.go` posts, on each pod,
  - Normal `TriggeredScaleUp`, `"pod triggered scale-up: %v"` of its `[]ScaleUpInfo`, each
    `"{%v %v->%v (max: %v)}"` (group id, current size, new size, max size;
    `processors/nodegroupset/nodegroup_set_processor.go`), so `[{gpu-pool 0->1 (max: 4)}]`,
    several groups joined by one space;
  - Normal `NotTriggerScaleUp`, `"pod didn't trigger scale-up: %s"`, where `%s` is
    `"<count> <reason>"` per reason joined by `", "` (counting node groups; Go map order), or
    `max total nodes in cluster reached`.
- Karpenter, tag `v1.14.1` (commit 6e7eab7a0f485d7225eb98995fad9b66c79b322b):
  `pkg/operator/operator.go` records as `karpenter` (controller-runtime's
  `GetEventRecorderFor(AppName)`); `pkg/controllers/provisioning/scheduling/events.go` posts
  Normal `Nominated`, `"Pod should schedule on: %s"` (`nodeclaim/<name>`, then `node/<name>`
  when known, joined by `", "`), and Warning `FailedScheduling`, `"Failed to schedule pod, %s"`
  (one error per NodePool joined by `"; "`; up to v1.4 each began
  `incompatible with nodepool "<name>", daemonset overhead=<json>, `).

Both write through client-go's EventRecorder (`tools/record/event.go`): the Event is named
`<pod>.<unix nanoseconds in hex>` in the pod's namespace, refers to the pod by kind, namespace,
name, uid, apiVersion and resourceVersion, has `count` 1, first and last timestamps equal, and
`reportingComponent` equal to `source.component`. This posts exactly that, as the cluster's admin.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any, Mapping, Sequence

CLUSTER_AUTOSCALER = "cluster-autoscaler"
KARPENTER = "karpenter"


def scale_up_infos(groups: Sequence[tuple[str, int, int, int]]) -> str:
    """Go's `%v` of Cluster Autoscaler's []ScaleUpInfo: `[{<group> <from>-><to> (max: <max>)} ...]`."""
    return "[" + " ".join(f"{{{g} {a}->{b} (max: {m})}}" for g, a, b, m in groups) + "]"


def not_triggered_reasons(reasons: str | Mapping[str, int]) -> str:
    """What follows "pod didn't trigger scale-up: ": given as text, or as {reason: how many node
    groups}, written `"<count> <reason>"` joined by ", " as Cluster Autoscaler's ReasonsMessage does."""
    if isinstance(reasons, str):
        return reasons
    return ", ".join(f"{count} {reason}" for reason, count in reasons.items())


class AutoscalerStandIn:
    """Posts an autoscaler's Events on pods of `cluster` (a K8sCluster), and joins nodes."""

    def __init__(self, cluster: Any):
        from kubernetes import client, config

        self.cluster = cluster
        # raw JSON in and out (`_preload_content=False`): the Events as the API server has them
        self.core: Any = client.CoreV1Api(config.new_client_from_config(str(cluster.admin_kubeconfig)))

    # -- Cluster Autoscaler ----------------------------------------------------------------------

    def triggered_scale_up(self, pod: str, namespace: str, group: str = "gpu-pool", from_: int = 0, to: int = 1,
                           max: int = 4, groups: Sequence[tuple[str, int, int, int]] = ()) -> dict:
        """Cluster Autoscaler adds a node for the pod: `pod triggered scale-up: [{group 0->1 (max: 4)}]`
        (`groups` gives several (group, from, to, max) at once, as a balanced scale-up does)."""
        infos = scale_up_infos(groups or [(group, from_, to, max)])
        return self.post(pod, namespace, CLUSTER_AUTOSCALER, "Normal", "TriggeredScaleUp",
                         f"pod triggered scale-up: {infos}")

    def not_triggered(self, pod: str, namespace: str, reasons: str | Mapping[str, int]) -> dict:
        """Cluster Autoscaler will not add a node for the pod, e.g. reasons
        {"max node group size reached": 1, "Insufficient nvidia.com/gpu": 2}, or
        "max total nodes in cluster reached"."""
        return self.post(pod, namespace, CLUSTER_AUTOSCALER, "Normal", "NotTriggerScaleUp",
                         f"pod didn't trigger scale-up: {not_triggered_reasons(reasons)}")

    # -- Karpenter -------------------------------------------------------------------------------

    def karpenter_nominated(self, pod: str, namespace: str, nodeclaim: str | None, node: str | None = None) -> dict:
        """Karpenter launches a NodeClaim for the pod (or found it a node):
        `Pod should schedule on: nodeclaim/<nodeclaim>[, node/<node>]`."""
        info = ([f"nodeclaim/{nodeclaim}"] if nodeclaim else []) + ([f"node/{node}"] if node else [])
        return self.post(pod, namespace, KARPENTER, "Normal", "Nominated", f"Pod should schedule on: {', '.join(info)}")

    def karpenter_failed(self, pod: str, namespace: str, errors: Sequence[str]) -> dict:
        """No NodePool of Karpenter's can hold the pod: Warning FailedScheduling (the reason
        kube-scheduler uses too: only `source.component` tells them apart),
        `Failed to schedule pod, <error>; <error>` (one per NodePool), e.g. v1.0-v1.4's
        `incompatible with nodepool "gpu", daemonset overhead={"cpu":"150m"}, ...`."""
        return self.post(pod, namespace, KARPENTER, "Warning", "FailedScheduling",
                         f"Failed to schedule pod, {'; '.join(errors)}")

    # -- a node joins ----------------------------------------------------------------------------

    def node_joins(self, node: str, labels: Mapping[str, str] | None = None, untaint: str | None = None,
                   gpus: int = 0, gpu_product: str | None = None) -> None:
        """The node the autoscaler added comes up: it carries the labels the pod requires, loses
        the taint that kept pods off it while it booted (a key of the test's own: the node
        lifecycle controller lifts `node.kubernetes.io/not-ready` from a Ready node by itself),
        and advertises its GPUs (`nvidia.com/gpu`, with GPU Feature Discovery's labels)."""
        if gpus:
            self.cluster.set_gpus(node, gpus, gpu_product)
        if labels:
            self.cluster.label_node(node, dict(labels))
        if untaint:
            self.cluster.untaint_node(node, untaint)

    # -- the Events ------------------------------------------------------------------------------

    def post(self, pod: str, namespace: str, component: str, type_: str, reason: str, message: str) -> dict:
        """One core/v1 Event on the pod, as client-go's EventRecorder writes it; returns it as the
        API server stored it (camelCase dict)."""
        got = self.core.read_namespaced_pod(pod, namespace)
        now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{pod}.{time.time_ns():x}", "namespace": namespace},
            "involvedObject": {"kind": "Pod", "namespace": namespace, "name": pod, "uid": got.metadata.uid,
                               "apiVersion": "v1", "resourceVersion": got.metadata.resource_version},
            "reason": reason, "message": message, "type": type_,
            "source": {"component": component},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            "reportingComponent": component, "reportingInstance": "",
        }
        return json.loads(self.core.create_namespaced_event(namespace, body, _preload_content=False).data)

    def events(self, pod: str, namespace: str, component: str | None = None) -> list[dict]:
        """The pod's Events (camelCase dicts, oldest first), of one source component if given."""
        listed = json.loads(self.core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.kind=Pod,involvedObject.name={pod}", _preload_content=False).data)
        items = [e for e in listed["items"] if component is None or (e.get("source") or {}).get("component") == component]
        return sorted(items, key=lambda e: (e.get("lastTimestamp") or "", e["metadata"]["name"]))
