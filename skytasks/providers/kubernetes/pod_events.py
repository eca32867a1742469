"""What the Events about a pod say: a node autoscaler's word about a pod that waits for a node,
the newest warning (a mount, a sandbox, a pull), and when each happened.

A pod that no node can take yet is what makes an autoscaler add one, so on a cloud its wait is
normal (minutes). The autoscalers say so on the pod itself, as core/v1 Events:

- Cluster Autoscaler (GKE, EKS, AKS and most others), source component `cluster-autoscaler`:
  reason `TriggeredScaleUp`, "pod triggered scale-up: [{<group> <from>-><to> (max: <max>)}]",
  while it adds a node for the pod; reason `NotTriggerScaleUp`, "pod didn't trigger scale-up:
  <why per node group>", when it will not (a full node group, no group whose nodes would fit).
  Read in cluster-autoscaler 1.36.1's `processors/status/eventing_scale_up_processor.go` (the same on
  release-1.20 and 1.28).
- Karpenter, source component `karpenter`: reason `Nominated`, "Pod should schedule on:
  nodeclaim/<name>" (a NodeClaim it is launching) or "... node/<name>" (a node that has room);
  reason `FailedScheduling`, "Failed to schedule pod, <why>", when no NodePool can hold the pod.
  Read in karpenter v1.14.1's `pkg/controllers/provisioning/scheduling/events.go` (v1.0 to v1.5 too).

Pure functions over Events as the API returns them (plain dicts, camelCase).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Mapping, Optional, Sequence

CLUSTER_AUTOSCALER = "cluster-autoscaler"
KARPENTER = "karpenter"

# (source component, reason) -> what it means for the pod.
_WORDS: dict[tuple[str, str], Literal["adding", "refused"]] = {
    (CLUSTER_AUTOSCALER, "TriggeredScaleUp"): "adding",
    (CLUSTER_AUTOSCALER, "NotTriggerScaleUp"): "refused",
    (KARPENTER, "Nominated"): "adding",
    (KARPENTER, "FailedScheduling"): "refused",
}


@dataclass(frozen=True)
class AutoscalerWord:
    """The newest thing an autoscaler said about one pod."""

    kind: Literal["adding", "refused"]
    who: str  # "cluster-autoscaler", "karpenter"
    reason: str  # the Event's reason
    message: str  # its message, as the autoscaler wrote it

    def describe(self) -> str:
        return f"{self.who}: {self.message}"


def event_time(event: Mapping[str, Any]) -> float:
    """When an Event happened (seconds since the epoch; 0 when it says nothing): eventTime on newer
    clusters' events, lastTimestamp on older ones' (1.20's scheduler), else when it was first seen
    or made. Parsed, not compared as text: "12:00:03Z" and "12:00:03.5Z" sort the wrong way as text."""
    meta = event.get("metadata") or {}
    for stamp in (event.get("eventTime"), event.get("lastTimestamp"), event.get("firstTimestamp"),
                  meta.get("creationTimestamp")):
        if stamp:
            try:
                return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0


def source_of(event: Mapping[str, Any]) -> str:
    """Who posted an Event: core/v1's `source.component`, else events.k8s.io's
    `reportingComponent` (Karpenter posts through the newer API on recent clusters)."""
    return str((event.get("source") or {}).get("component") or event.get("reportingComponent")
               or event.get("reportingController") or "")


def _speaker(source: str) -> str:
    low = source.lower()
    if CLUSTER_AUTOSCALER in low:
        return CLUSTER_AUTOSCALER
    if low == KARPENTER or low.startswith(KARPENTER):
        return KARPENTER
    return low


def autoscaler_word(events: Sequence[Mapping[str, Any]]) -> Optional[AutoscalerWord]:
    """The newest Event in which an autoscaler spoke for the pod (None: none has)."""
    newest: Optional[tuple[float, AutoscalerWord]] = None
    for event in events:
        who = _speaker(source_of(event))
        kind = _WORDS.get((who, str(event.get("reason") or "")))
        if kind is None:
            continue
        when = event_time(event)
        if newest is None or when >= newest[0]:
            newest = (when, AutoscalerWord(kind, who, str(event["reason"]), str(event.get("message") or "").strip()))
    return None if newest is None else newest[1]


def newest_warning(events: Sequence[Mapping[str, Any]], skip: tuple[str, ...] = ("FailedScheduling",)) -> str:
    """The newest Warning about a pod (a mount, a sandbox, a pull), as "Reason: message"; the
    scheduler's word is in the pod's own condition while it waits, and stale after."""
    warnings = sorted((e for e in events if e.get("type") == "Warning" and e.get("reason") not in skip),
                      key=event_time)
    return f"{warnings[-1].get('reason')}: {warnings[-1].get('message')}" if warnings else ""
