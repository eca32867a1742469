"""What a pod's status says, read for people and for decisions: why it waits (in the scheduler's
and the kubelet's own words), whether it can never start (and which field to fix), whether a
running pod was lost or asked to leave, and when a pool may start.

Pure functions over pods as the API returns them (plain dicts, camelCase), tested without a cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

# Waiting reasons of a container that no wait will mend: the image, the pod's configuration.
_NEVER_BY_WAITING = {
    "InvalidImageName": "k8s_image",
    "ErrImageNeverPull": "k8s_image",
    "CreateContainerConfigError": "k8s_pod_template",
    "CreateContainerError": "k8s_pod_template",
    "RunContainerError": "remote_python",
    "StartError": "remote_python",
}
# ErrImagePull is often passing (a registry's hiccup); these words in it say the image is not there.
_NO_SUCH_IMAGE = re.compile(r"not found|manifest unknown|does not exist|pull access denied|unauthorized|"
                            r"repository .* not found|no such host|invalid reference", re.I)
# The scheduler's reasons that a new node (an autoscaler, a freed GPU) may still answer.
_CAPACITY = re.compile(r"Insufficient|Too many pods|didn't have free ports|node\(s\) were unschedulable|"
                       r"had volume node affinity conflict|persistentvolumeclaim", re.I)
_SCHED_FIELD = (
    (re.compile(r"didn't match (Pod's )?node (selector|affinity)", re.I), "k8s_node_selector"),
    (re.compile(r"taint", re.I), "k8s_tolerations"),
)


@dataclass(frozen=True)
class PodView:
    name: str
    phase: str  # Pending, Running, Succeeded, Failed, Unknown
    running: bool  # the container runs (the keeper is up)
    ip: str
    node: str  # the Kubernetes node, once scheduled
    waiting: str  # why it is not running yet, in the cluster's words ("" when running)
    never: Optional[tuple[str, str]]  # (field to fix, the cluster's words) when it can never start
    leaving: bool  # deletionTimestamp set: asked to leave (a delete with grace, an eviction, a drain)
    gone: Optional[str]  # why a pod that ran is lost (failed, ended, its node not ready), else None


def _conditions(pod: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {c.get("type", ""): c for c in pod.get("status", {}).get("conditions") or []}


def _container(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return statuses[0] if statuses else {}


def never_starts_by_scheduler(message: str) -> Optional[str]:
    """The field to fix when the scheduler says no node can ever take the pod: every node it
    counts was refused for the selector, the affinity or a taint, none for want of room."""
    if not message or _CAPACITY.search(message):
        return None
    for pattern, field in _SCHED_FIELD:
        if pattern.search(message):
            return field
    return None


def view(pod: Mapping[str, Any]) -> PodView:
    meta, status = pod.get("metadata", {}), pod.get("status", {})
    phase = status.get("phase") or "Pending"
    container = _container(pod)
    state = container.get("state") or {}
    running = phase == "Running" and "running" in state
    conditions = _conditions(pod)
    waiting, never = "", None
    scheduled = conditions.get("PodScheduled", {})
    if scheduled.get("status") == "False":
        waiting = f"{scheduled.get('reason') or 'Unschedulable'}: {scheduled.get('message') or 'not scheduled yet'}"
        field = never_starts_by_scheduler(scheduled.get("message") or "")
        if field:
            never = (field, scheduled.get("message") or "")
    elif "waiting" in state:
        reason, message = state["waiting"].get("reason") or "Waiting", state["waiting"].get("message") or ""
        waiting = f"{reason}: {message}" if message else reason
        if reason in _NEVER_BY_WAITING:
            never = (_NEVER_BY_WAITING[reason], waiting)
        elif reason in ("ErrImagePull", "ImagePullBackOff") and _NO_SUCH_IMAGE.search(message):
            never = ("k8s_image", waiting)
    elif not running and phase == "Pending":
        waiting = "Pending: " + (status.get("reason") or status.get("message") or "being created")
    gone = None
    if phase in ("Failed", "Succeeded"):
        terminated = state.get("terminated") or {}
        said = terminated.get("message") or status.get("message") or ""
        gone = (f"pod {meta.get('name')} {phase.lower()}"
                f" ({status.get('reason') or terminated.get('reason') or 'ended'}"
                f"{', exit code %s' % terminated['exitCode'] if 'exitCode' in terminated else ''})"
                + (f": {said.strip()[-300:]}" if said else ""))
        # The keeper could not run at all: the image's shell or loader said the command is not there.
        if never is None and phase == "Failed" and terminated.get("exitCode") in (126, 127, 2):
            never = ("remote_python", gone)
    elif running and conditions.get("Ready", {}).get("status") == "False" and \
            conditions["Ready"].get("reason") in ("NodeNotReady", "NodeLost"):
        gone = f"pod {meta.get('name')}: its node {pod.get('spec', {}).get('nodeName', '')} is not ready"
    return PodView(name=meta.get("name", ""), phase=phase, running=running, ip=status.get("podIP") or "",
                   node=pod.get("spec", {}).get("nodeName") or "", waiting=waiting, never=never,
                   leaving=bool(meta.get("deletionTimestamp")), gone=gone)


@dataclass(frozen=True)
class Wait:
    detail: str  # what the pods not running are doing, for the progress line


@dataclass(frozen=True)
class Go:
    running: tuple[str, ...]  # the pods to start agents in (the rest are deleted)


@dataclass(frozen=True)
class Fail:
    field: Optional[str]  # the field to fix, when one is to blame
    reason: str


def start_decision(pods: Sequence[PodView], fewest: int, elapsed: float, timeout: float) -> Wait | Go | Fail:
    """Whether a pool's pods let it start: all of them running; or, on an elastic pool, at least
    `fewest` running while every other one waits for room (or can never start). A pod that can
    never start fails a fixed pool at once; waiting past `timeout` fails any pool."""
    running = tuple(p.name for p in pods if p.running and not p.leaving)
    ended = [p for p in pods if p.gone and not p.running]
    never = [p for p in pods if p.never]
    if len(running) == len(pods):
        return Go(running)
    stuck = [p for p in pods if p.name not in running]
    if len(running) >= fewest and all(p.never or p.gone or p.waiting.startswith("Unschedulable") for p in stuck):
        return Go(running)
    if never and len(pods) - len(never) < fewest:
        p = never[0]
        assert p.never is not None
        return Fail(p.never[0], f"pod {p.name} can never start: {p.never[1]}")
    if ended and len(pods) - len(ended) < fewest:
        return Fail(None, f"{ended[0].gone}")
    waiting = "; ".join(f"{p.name}: {p.waiting or p.phase}" for p in stuck[:3])
    if elapsed >= timeout:
        return Fail("ready_timeout_seconds", f"{len(stuck)} of {len(pods)} pods still not running after {timeout:g}s "
                                             f"({waiting})")
    return Wait(f"{len(running)}/{len(pods)} pods running; {waiting}" + (" ..." if len(stuck) > 3 else ""))
