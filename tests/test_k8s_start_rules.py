"""When a kubernetes pool's pods let it start, without a cluster: a pod's status read, what a node
autoscaler's Events say, and the start decision under each `k8s_autoscaler`. The Events are
shaped as Cluster Autoscaler and Karpenter post them (see pod_events' docstring)."""

from __future__ import annotations

import pytest

from skytasks.providers.kubernetes import pod_status
from skytasks.providers.kubernetes.pod_events import autoscaler_word, newest_warning

SELECTOR = "0/5 nodes are available: 5 node(s) didn't match Pod's node affinity/selector."
SELECTOR_NEW = (SELECTOR + " preemption: 0/5 nodes are available: 5 Preemption is not helpful for scheduling.")
BOOTING = ("0/2 nodes are available: 1 node(s) had taint {node.kubernetes.io/not-ready: }, that the pod didn't "
           "tolerate, 1 node(s) didn't match Pod's node affinity.")
ROOM = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."


def pod(phase="Pending", scheduled=None, waiting=None, running=False, terminated=None, ready=None, deleting=False,
        name="p-0", ready_status="False"):
    conditions = []
    if scheduled:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": scheduled})
    if ready is not None:
        conditions.append({"type": "Ready", "status": ready_status, **({"reason": ready} if ready else {})})
    state = {"running": {}} if running else {"waiting": waiting} if waiting else {"terminated": terminated} \
        if terminated else {}
    return {"metadata": {"name": name, **({"deletionTimestamp": "now"} if deleting else {})},
            "spec": {"nodeName": "n1"},
            "status": {"phase": phase, "podIP": "10.0.0.5", "conditions": conditions,
                       "containerStatuses": [{"state": state}] if state else []}}


def event(reason, message, component, at="2026-11-27T10:00:00Z", type_="Normal", event_time=None):
    return {"reason": reason, "message": message, "type": type_, "source": {"component": component},
            "lastTimestamp": at, **({"eventTime": event_time} if event_time else {})}


TRIGGERED = event("TriggeredScaleUp", "pod triggered scale-up: [{gpu-pool 0->1 (max: 4)}]", "cluster-autoscaler")
REFUSED = event("NotTriggerScaleUp", "pod didn't trigger scale-up: 1 max node group size reached",
                "cluster-autoscaler", at="2026-11-27T10:00:05Z")
NOMINATED = event("Nominated", "Pod should schedule on: nodeclaim/default-x7k2p", "karpenter")
KARPENTER_NO = event("FailedScheduling", "Failed to schedule pod, incompatible with nodepool \"default\"", "karpenter",
                     type_="Warning")


def test_why_a_pod_waits_in_the_clusters_words():
    v = pod_status.view(pod(scheduled=ROOM))
    assert v.waiting == f"Unschedulable: {ROOM}" and v.never is None and v.unschedulable and v.mismatch is None
    assert pod_status.view(pod(scheduled=SELECTOR)).mismatch == "k8s_node_selector"
    assert pod_status.view(pod(scheduled=SELECTOR_NEW)).mismatch == "k8s_node_selector"
    mixed = "0/2 nodes are available: 1 Insufficient cpu, 1 node(s) didn't match node selector."
    assert pod_status.view(pod(scheduled=mixed)).mismatch is None  # a node with room may come
    taint = "0/1 nodes are available: 1 node(s) had taint {gpu: yes}, that the pod didn't tolerate."
    assert pod_status.view(pod(scheduled=taint)).mismatch == "k8s_tolerations"
    assert pod_status.view(pod(scheduled=BOOTING)).mismatch is None  # a booting node's taint passes
    cordoned = "0/1 nodes are available: 1 node(s) were unschedulable."
    assert pod_status.view(pod(scheduled=cordoned)).mismatch is None
    spread = ("0/2 nodes are available: 2 node(s) didn't match pod affinity/anti-affinity, 2 node(s) didn't satisfy "
              "existing pods anti-affinity rules.")
    assert pod_status.view(pod(scheduled=spread)).mismatch == "k8s_pods_per_host"


def test_an_image_that_is_not_there_never_starts_but_a_blip_waits():
    v = pod_status.view(pod(waiting={"reason": "ErrImagePull", "message": 'rpc error: "reg/nope:1": not found'}))
    assert v.never and v.never[0] == "k8s_image"
    assert pod_status.view(pod(waiting={"reason": "ErrImagePull", "message": "i/o timeout"})).never is None
    dns = 'failed to resolve reference "reg.example/x:1": dial tcp: lookup reg.example: no such host'
    assert pod_status.view(pod(waiting={"reason": "ErrImagePull", "message": dns})).never is None
    slow = "context deadline exceeded"  # the kubelet timing out on a loaded node
    assert pod_status.view(pod(waiting={"reason": "CreateContainerError", "message": slow})).never is None
    config = pod_status.view(pod(waiting={"reason": "CreateContainerConfigError", "message": 'secret "s" not found'}))
    assert config.never and config.never[0] == "k8s_pod_template"


def test_a_running_pod_whose_node_stops_reporting_is_lost_whatever_the_reason():
    failed = pod_status.view(pod(phase="Failed", terminated={"exitCode": 137, "reason": "OOMKilled"}))
    assert failed.gone and "failed" in failed.gone
    # The node controller marks Ready False and sets no reason of its own (1.20): any reason but
    # the kubelet's own container-readiness ones means the node is gone.
    for reason in ("", "NodeNotReady", "NodeLost", "SomethingNew"):
        gone = pod_status.view(pod(phase="Running", running=True, ready=reason)).gone
        assert gone and "not ready" in gone, reason
    assert pod_status.view(pod(phase="Running", running=True, ready="ContainersNotReady")).gone is None
    assert pod_status.view(pod(phase="Running", running=True, ready="", ready_status="True")).gone is None
    assert pod_status.view(pod(phase="Running", running=True, deleting=True)).leaving


def test_the_autoscalers_words_are_read_from_their_own_events():
    assert autoscaler_word([]) is None
    assert autoscaler_word([event("Scheduled", "assigned", "default-scheduler")]) is None
    word = autoscaler_word([TRIGGERED])
    assert word and word.kind == "adding" and word.describe() == \
        "cluster-autoscaler: pod triggered scale-up: [{gpu-pool 0->1 (max: 4)}]"
    assert autoscaler_word([TRIGGERED, REFUSED]).kind == "refused"  # the newest word counts
    assert autoscaler_word([REFUSED, TRIGGERED]).kind == "refused"  # by time, not by list order
    assert autoscaler_word([NOMINATED]).kind == "adding"
    assert autoscaler_word([KARPENTER_NO]).kind == "refused"
    # A FailedScheduling of the scheduler's own is not Karpenter's refusal.
    assert autoscaler_word([event("FailedScheduling", SELECTOR, "default-scheduler", type_="Warning")]) is None
    # events.k8s.io's shape: eventTime and reportingComponent, no source.
    newer = {"reason": "TriggeredScaleUp", "message": "pod triggered scale-up: [{g 1->2 (max: 3)}]",
             "reportingComponent": "cluster-autoscaler", "eventTime": "2026-11-27T10:00:09.000000Z"}
    assert autoscaler_word([REFUSED, newer]).kind == "adding"


def test_the_newest_warning_is_the_newest_by_its_own_time():
    events = [event("FailedMount", "new", "kubelet", at="2026-11-27T10:00:09Z", type_="Warning"),
              event("FailedMount", "old", "kubelet", at="2026-11-27T10:00:01Z", type_="Warning"),
              event("FailedScheduling", SELECTOR, "default-scheduler", at="2026-11-27T10:01:00Z", type_="Warning")]
    assert newest_warning(events) == "FailedMount: new"


@pytest.mark.parametrize("mode", ["auto", "none", "wait"])
def test_a_scale_up_is_waited_for_only_when_an_autoscaler_says_so(mode):
    v = pod_status.view(pod(scheduled=SELECTOR))
    adding = pod_status.as_autoscaled(v, mode, autoscaler_word([TRIGGERED]), waited=120)
    if mode == "none":
        assert adding.never and adding.never[0] == "k8s_node_selector"
    elif mode == "auto":
        assert adding.never is None and "cluster-autoscaler: pod triggered scale-up" in adding.waiting
    else:
        assert adding.never is None


def test_a_refusal_fails_at_once_in_the_autoscalers_words():
    v = pod_status.view(pod(scheduled=ROOM))
    refused = pod_status.as_autoscaled(v, "auto", autoscaler_word([TRIGGERED, REFUSED]), waited=1)
    assert refused.never and "max node group size reached" in refused.never[1]
    assert refused.never[0] == "k8s_autoscaler"
    karpenter = pod_status.as_autoscaled(pod_status.view(pod(scheduled=SELECTOR)), "auto",
                                         autoscaler_word([KARPENTER_NO]), waited=1)
    assert karpenter.never and karpenter.never[0] == "k8s_node_selector" and "karpenter:" in karpenter.never[1]
    assert pod_status.as_autoscaled(v, "wait", autoscaler_word([REFUSED]), waited=1).never is None


def test_a_silent_cluster_is_taken_as_fixed_after_thirty_seconds():
    v = pod_status.view(pod(scheduled=SELECTOR))
    early = pod_status.as_autoscaled(v, "auto", None, waited=5)
    assert early.never is None and "waiting up to 30s for a node autoscaler" in early.waiting
    late = pod_status.as_autoscaled(v, "auto", None, waited=pod_status.AUTOSCALER_SILENCE_SECONDS)
    assert late.never and late.never[0] == "k8s_node_selector" and "taken as fixed" in late.never[1]
    assert pod_status.as_autoscaled(v, "none", None, waited=0).never is not None
    assert pod_status.as_autoscaled(v, "wait", None, waited=3600).never is None
    # Room and a booting node are waited for on any cluster: a GPU may free, the node comes up.
    for message in (ROOM, BOOTING):
        assert pod_status.as_autoscaled(pod_status.view(pod(scheduled=message)), "none", None, 3600).never is None


def test_when_a_pool_may_start():
    up = pod_status.view(pod(phase="Running", running=True, name="a"))
    room = pod_status.view(pod(scheduled="0/1 nodes are available: 1 Insufficient cpu.", name="b"))
    never = pod_status.view(pod(waiting={"reason": "InvalidImageName", "message": "bad"}, name="c"))
    decide = pod_status.start_decision
    assert decide([up, up], 2, 0, 10) == pod_status.Go(("a", "a"))
    assert isinstance(decide([up, room], 2, 1, 10), pod_status.Wait)
    assert decide([up, room], 1, 1, 10) == pod_status.Go(("a",))  # elastic: the other waits for room
    failed = decide([up, never], 2, 1, 10)
    assert isinstance(failed, pod_status.Fail) and failed.field == "k8s_image"
    late = decide([up, room], 2, 10, 10)
    assert isinstance(late, pod_status.Fail) and late.field == "ready_timeout_seconds"
    refused = pod_status.as_autoscaled(room, "auto", autoscaler_word([REFUSED]), 1)
    said = decide([up, refused], 2, 1, 10)
    assert isinstance(said, pod_status.Fail) and "pod didn't trigger scale-up" in said.reason
