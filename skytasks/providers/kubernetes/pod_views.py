"""A pool's pods as the watch last heard them, read for the provider's decisions: how each stands
while the pool starts (in the scheduler's, the kubelet's and a node autoscaler's words), why a
running one is lost, and when one asked to leave goes.

Functions over a `PoolWatch` and plain pod dicts: no request of their own.
"""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import datetime
from typing import Any, Mapping, Optional

from skytasks.providers.kubernetes import pod_status
from skytasks.providers.kubernetes.pod_events import autoscaler_word, newest_warning
from skytasks.providers.kubernetes.pool_watch import PoolWatch
from skytasks.providers.kubernetes.settings import knobs


def starting(watch: PoolWatch, names: list[str], autoscaler: str, unschedulable_since: dict[str, float],
             selector_field: str = "k8s_node_selector",
             pulls: Optional[dict[str, pod_status.PullTrouble]] = None) -> list[pod_status.PodView]:
    """Each pod of a start: a pod not heard of yet is being created, one heard of and deleted is
    gone; an unschedulable one is read with its autoscaler's word (`k8s_autoscaler`), timed from
    when it was first seen unschedulable (kept in `unschedulable_since` across calls). A node
    affinity no node matches is blamed on `selector_field`: the pool's GPU product (`accelerator`)
    when it sets no `k8s_node_selector` of its own. A pod whose image pull goes on failing is timed
    from its first failure (kept in `pulls` across calls: `pod_status.as_pull_failing`)."""
    listed, deleted, now = watch.pods(), watch.deleted(), time.monotonic()
    views = []
    for name in names:
        pod = listed.get(name)
        if pod is None:
            gone = f"pod {name} was deleted" if name in deleted else None
            views.append(pod_status.PodView(name, "Deleted" if gone else "Pending", False, "", "",
                                            "" if gone else "Pending: being created", None, False, gone))
            continue
        v = pod_status.view(pod)
        events = watch.events(name)
        if v.unschedulable:
            if v.mismatch == "k8s_node_selector":
                v = replace(v, mismatch=selector_field)
            waited = now - unschedulable_since.setdefault(name, now)
            v = pod_status.as_autoscaled(v, autoscaler, autoscaler_word(events), waited,
                                         knobs().k8s_autoscaler_silence_seconds)
        elif pulls is not None and v.waiting.startswith(("ErrImagePull", "ImagePullBackOff")):
            v, trouble = pod_status.as_pull_failing(v, pulls.get(name), now, newest_warning(events))
            if trouble is not None:
                pulls[name] = trouble
        elif v.waiting.startswith("ContainerCreating") or v.waiting.startswith("Pending: being"):
            why = newest_warning(events)  # a mount, a sandbox: said only in Events
            v = replace(v, waiting=f"{v.waiting} ({why})" if why else v.waiting)
        if pulls is not None and not v.waiting.startswith(("ErrImagePull", "ImagePullBackOff")):
            pulls.pop(name, None)  # no longer waiting on a pull: a later failure is timed anew
        views.append(v)
    return views


def lost(watch: PoolWatch, name: str) -> Optional[str]:
    """Why a pool's running pod is lost (deleted, failed, ended, its node not ready), in
    Kubernetes' words; None while it runs."""
    pod = watch.pods().get(name)
    if pod is None:
        return f"Kubernetes: pod {name} was deleted" if name in watch.deleted() else None
    gone = pod_status.view(pod).gone
    return None if gone is None else f"Kubernetes: {gone}"


def leaving_at(pod: Optional[Mapping[str, Any]]) -> Optional[float]:
    """When a pod asked to leave goes (epoch seconds): its deletionTimestamp, which the API server
    sets to the deletion's own grace period from now (`kubectl delete --grace-period`, an
    eviction's, a drain's), not the pod's terminationGracePeriodSeconds that its keeper knows."""
    stamp = ((pod or {}).get("metadata") or {}).get("deletionTimestamp")
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp() if stamp else None
    except ValueError:
        return None
