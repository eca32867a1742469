"""A replacement pod is kept off the Kubernetes nodes its pool gave up (lost, or found unhealthy by
the preflight): one more required node-affinity expression, `kubernetes.io/hostname NotIn [...]`,
in every node selector term (the terms are ORed, the expressions of a term ANDed), so it narrows
where the pod goes and never widens it."""

from __future__ import annotations

import copy
from typing import Any, Iterable

HOSTNAME = "kubernetes.io/hostname"


def avoid_hosts(manifest: dict[str, Any], hosts: Iterable[str]) -> dict[str, Any]:
    """The pod manifest, kept off `hosts` (Kubernetes node names); unchanged when there are none."""
    avoided = sorted({h for h in hosts if h})
    if not avoided:
        return manifest
    pod = copy.deepcopy(manifest)
    affinity = pod.setdefault("spec", {}).setdefault("affinity", {}).setdefault("nodeAffinity", {})
    required = affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", []) or [{}]
    expression = {"key": HOSTNAME, "operator": "NotIn", "values": avoided}
    required["nodeSelectorTerms"] = [{**t, "matchExpressions": [*t.get("matchExpressions", []), expression]}
                                     for t in terms]
    return pod
