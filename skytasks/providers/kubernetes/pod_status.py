"""What a pod's status says, read for people and for decisions: why it waits (in the scheduler's
and the kubelet's own words), whether it can never start (and which field to fix), whether a
running pod was lost or asked to leave, and when a pool may start.

Pure functions over pods as the API returns them (plain dicts, camelCase), tested without a cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence

from skytasks.providers.kubernetes.pod_events import AutoscalerWord

# Waiting reasons of a container that no wait will mend: the image, the pod's configuration.
# (CreateContainerError is not one: it is most often the kubelet timing out on a slow node.)
_NEVER_BY_WAITING = {
    "InvalidImageName": "k8s_image",
    "ErrImageNeverPull": "k8s_image",
    "CreateContainerConfigError": "k8s_pod_template",
    "RunContainerError": "remote_python",
    "StartError": "remote_python",
}
# ErrImagePull is often passing (a registry's hiccup, a DNS blip: "no such host" is one); these
# words in it say the registry answered that the image is not there, or not for this pod.
_NO_SUCH_IMAGE = re.compile(r"not found|manifest unknown|does not exist|pull access denied|unauthorized|"
                            r"repository .* not found|invalid reference", re.I)
# Taints a node carries while it boots, drains or recovers: a wait mends them (an autoscaled node
# is `not-ready` until its kubelet and network are up).
_PASSING_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable",
                   "node.kubernetes.io/network-unavailable", "node.kubernetes.io/unschedulable",
                   "node.kubernetes.io/memory-pressure", "node.kubernetes.io/disk-pressure",
                   "node.kubernetes.io/pid-pressure", "node.cloudprovider.kubernetes.io/uninitialized",
                   "ToBeDeletedByClusterAutoscaler", "DeletionCandidateOfClusterAutoscaler", "karpenter.sh/disrupted",
                   "karpenter.sh/disruption", "karpenter.sh/unregistered")
# The scheduler's per-node reasons that only another kind of node answers, and the field to fix.
_MISMATCH = (
    (re.compile(r"didn't match (Pod's )?node (selector|affinity)", re.I), "k8s_node_selector"),
    (re.compile(r"didn't (match|satisfy) (pod|existing pods'?) (anti-)?affinity", re.I), "k8s_pods_per_host"),
    (re.compile(r"taint", re.I), "k8s_tolerations"),
)
# The Ready condition's reasons the kubelet sets itself; any other Ready=False on a running pod is
# the node controller's word that the pod's node stopped reporting (it sets no reason of its own).
_KUBELET_READY_REASONS = ("ContainersNotReady", "ReadinessGatesNotReady", "PodCompleted")


def _reasons(message: str) -> list[str]:
    """The scheduler's per-node reasons: "0/5 nodes are available: 2 Insufficient cpu, 3 node(s)
    had taint {...}, that the pod didn't tolerate." (1.20) and the same with ". preemption: ..."
    after it (newer releases)."""
    _, _, rest = message.partition("are available:")
    rest = re.split(r"\.\s*preemption:", rest, maxsplit=1)[0]
    return [r.strip(" .") for r in re.split(r",\s+(?=\d+\s)", rest) if r.strip(" .")]


def mismatch_field(message: str) -> Optional[str]:
    """The field to fix when every node the scheduler counts refused the pod for its selector, its
    affinity or a taint it does not tolerate, none for want of room nor for a passing state (a
    booting node's taint, a cordon): on a fixed cluster, no wait will ever place it."""
    reasons = _reasons(message)
    if not reasons:
        return None
    fields = []
    for reason in reasons:
        if any(taint in reason for taint in _PASSING_TAINTS) or "were unschedulable" in reason:
            return None
        field = next((f for pattern, f in _MISMATCH if pattern.search(reason)), None)
        if field is None:  # room (Insufficient ..., Too many pods, ports, volumes), or unknown: a wait may mend it
            return None
        fields.append(field)
    return fields[0]


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
    unschedulable: bool = False  # the scheduler found no node for it (yet: an autoscaler may add one)
    # The field to fix when no node of the cluster as it is matches the pod (see mismatch_field):
    # fatal on a fixed cluster, the very thing an autoscaler answers on a cloud.
    mismatch: Optional[str] = None


def _conditions(pod: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {c.get("type", ""): c for c in pod.get("status", {}).get("conditions") or []}


def _container(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return statuses[0] if statuses else {}


def view(pod: Mapping[str, Any]) -> PodView:
    meta, status = pod.get("metadata", {}), pod.get("status", {})
    phase = status.get("phase") or "Pending"
    container = _container(pod)
    state = container.get("state") or {}
    running = phase == "Running" and "running" in state
    conditions = _conditions(pod)
    waiting, never, unschedulable, mismatch = "", None, False, None
    scheduled = conditions.get("PodScheduled", {})
    if scheduled.get("status") == "False":
        waiting = f"{scheduled.get('reason') or 'Unschedulable'}: {scheduled.get('message') or 'not scheduled yet'}"
        unschedulable = True
        mismatch = mismatch_field(scheduled.get("message") or "")
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
            conditions["Ready"].get("reason") not in _KUBELET_READY_REASONS:
        gone = f"pod {meta.get('name')}: its node {pod.get('spec', {}).get('nodeName', '')} is not ready"
    return PodView(name=meta.get("name", ""), phase=phase, running=running, ip=status.get("podIP") or "",
                   node=pod.get("spec", {}).get("nodeName") or "", waiting=waiting, never=never,
                   leaving=bool(meta.get("deletionTimestamp")), gone=gone, unschedulable=unschedulable,
                   mismatch=mismatch)


# How long a pod may wait unschedulable, under k8s_autoscaler="auto", before a cluster on which no
# autoscaler spoke for it is taken as fixed (SKYTASKS_K8S_AUTOSCALER_SILENCE_SECONDS' default).
# Cluster Autoscaler looks at unschedulable pods every
# 10 s (--scan-interval) and Karpenter batches them for 1-10 s: both speak well within this.
AUTOSCALER_SILENCE_SECONDS = 30.0


def as_autoscaled(v: PodView, mode: str, word: Optional[AutoscalerWord], waited: float,
                  silence: float = AUTOSCALER_SILENCE_SECONDS) -> PodView:
    """An unschedulable pod read with what the cluster's node autoscaler said of it
    (`k8s_autoscaler`): "auto" waits while one adds a node and fails on its refusal, and takes a
    cluster where none spoke within `silence` seconds as fixed; "none" is a fixed cluster
    (a selector, affinity or taint no node matches can never start); "wait" always waits."""
    if not v.unschedulable or mode == "wait":
        return v
    if mode == "auto" and word is not None:
        if word.kind == "adding":
            return replace(v, waiting=f"waiting for a node the autoscaler is adding: {word.describe()}")
        field = v.mismatch or "k8s_autoscaler"
        return replace(v, never=(field, f"the cluster's node autoscaler will not add a node for it: {word.describe()} "
                                        f"(the scheduler: {v.waiting})"))
    if v.mismatch and (mode == "none" or waited >= silence):
        why = "" if mode == "none" else (f"; no node autoscaler spoke for the pod within "
                                         f"{silence:g}s, so the cluster is taken as fixed "
                                         "(k8s_autoscaler='wait' waits anyway)")
        return replace(v, never=(v.mismatch, v.waiting + why))
    if mode == "auto" and v.mismatch:
        return replace(v, waiting=f"{v.waiting} (waiting up to {silence:g}s for a node "
                                  f"autoscaler to answer, {waited:.0f}s so far)")
    return v


# How long an image pull may go on failing (ErrImagePull, then the kubelet's back-off between
# tries: 10 s, 20 s, 40 s, ...) before the start fails naming k8s_image: a registry's blip or a
# DNS hiccup mends within it; a registry name that does not resolve never does.
PULL_FAILING_SECONDS = 60.0
_PULLING = ("ErrImagePull", "ImagePullBackOff")


@dataclass(frozen=True)
class PullTrouble:
    since: float  # when the pod's pull was first seen failing (monotonic seconds)
    words: str  # the kubelet's own words on its last failed pull (ErrImagePull's message)


def as_pull_failing(v: PodView, trouble: Optional[PullTrouble], now: float, said: str = "",
                    limit: float = PULL_FAILING_SECONDS) -> tuple[PodView, Optional[PullTrouble]]:
    """A pod read with how long its image pull has gone on failing: (the view, the trouble to
    remember for the next look, None once the pod no longer waits on a pull). A pull that keeps
    failing for `limit` seconds can never start (k8s_image, in the kubelet's words); before that
    the view says how long it has been failing. A definite "not found" was `never` already.
    `said`: the newest warning in the pod's Events ("Failed: Failed to pull image ..."), the
    kubelet's words when the pod was first seen in its back-off rather than on a failed pull."""
    reason, _, message = v.waiting.partition(": ")
    if v.never or reason not in _PULLING:
        return v, None
    words = message if reason == "ErrImagePull" and message else (trouble.words if trouble else said or v.waiting)
    trouble = PullTrouble(trouble.since if trouble else now, words)
    failing = now - trouble.since
    if failing >= limit:
        return replace(v, never=("k8s_image", f"the image could not be pulled for {failing:.0f}s "
                                              f"(the kubelet: {trouble.words})")), trouble
    return replace(v, waiting=f"{v.waiting} (the pull has failed for {failing:.0f}s; the start fails at "
                              f"{limit:g}s)"), trouble


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
    if len(running) >= fewest and all(p.never or p.gone or p.unschedulable for p in stuck):
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
