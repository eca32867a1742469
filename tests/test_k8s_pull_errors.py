"""An image that cannot be pulled fails a Kubernetes pool's start within about a minute (issue 58),
naming k8s_image and the kubelet's own words, not after ready_timeout_seconds: a pull error that
persists through the kubelet's back-off for PULL_FAILING_SECONDS is the image's fault; a blip
shorter than that waits; a definite "not found" fails at once. The rule, on fake time; then on
the real test cluster, a registry name that cannot resolve (its nodes ask only their own DNS, on
their loopback: no packet leaves).
"""

from __future__ import annotations

import re
import time

import pytest

from skytasks import PoolStartError
from skytasks.providers.kubernetes import pod_status
from skytasks.providers.kubernetes.pod_status import PULL_FAILING_SECONDS, Fail, Wait, as_pull_failing, start_decision
from tests.harness.kube import held, kube_pool
from tests.test_k8s_start_rules import pod

DNS = ('rpc error: code = Unknown desc = failed to pull and unpack image "nonexistent.invalid/x:1": failed to resolve '
       'reference "nonexistent.invalid/x:1": dial tcp: lookup nonexistent.invalid on 127.0.0.1:53: no such host')
BACK_OFF = {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "nonexistent.invalid/x:1"'}


def _look(waiting, trouble, now, said=""):
    return as_pull_failing(pod_status.view(pod(waiting=waiting)), trouble, now, said)


def test_a_pull_that_keeps_failing_through_the_back_off_fails_at_the_limit_in_the_kubelets_words():
    v, trouble = _look({"reason": "ErrImagePull", "message": DNS}, None, now=100.0)
    assert v.never is None and trouble is not None and trouble.since == 100.0 and trouble.words == DNS
    assert "the pull has failed for 0s" in v.waiting
    for t, waiting in ((110, BACK_OFF), (120, {"reason": "ErrImagePull", "message": DNS}), (159.9, BACK_OFF)):
        v, trouble = _look(waiting, trouble, now=t)
        assert v.never is None and trouble.since == 100.0, (t, v)
        assert isinstance(start_decision([v], 1, t - 100, 900), Wait)
    v, trouble = _look(BACK_OFF, trouble, now=100 + PULL_FAILING_SECONDS)
    assert v.never == ("k8s_image", f"the image could not be pulled for {PULL_FAILING_SECONDS:.0f}s (the kubelet: {DNS})")
    decision = start_decision([v], 1, PULL_FAILING_SECONDS, 900)
    assert isinstance(decision, Fail) and decision.field == "k8s_image" and DNS in decision.reason


def test_a_blip_waits_and_a_later_failure_is_timed_anew():
    _, trouble = _look({"reason": "ErrImagePull", "message": "i/o timeout"}, None, now=0.0)
    v, after = _look({"reason": "ContainerCreating"}, trouble, now=20.0)  # the next try pulled it
    assert after is None and v.never is None
    v, trouble = _look({"reason": "ErrImagePull", "message": "i/o timeout"}, after, now=50.0)
    v, trouble = _look(BACK_OFF, trouble, now=100.0)
    assert v.never is None and trouble.since == 50.0  # 50 s of failing, not 100


def test_first_seen_in_its_back_off_the_pull_is_named_in_the_events_words():
    said = f"Failed: Failed to pull image \"nonexistent.invalid/x:1\": {DNS}"
    _, trouble = _look(BACK_OFF, None, now=0.0, said=said)
    v, _ = _look(BACK_OFF, trouble, now=PULL_FAILING_SECONDS, said="")
    assert v.never and v.never[0] == "k8s_image" and said in v.never[1]


def test_a_definite_not_found_still_fails_at_once():
    v, trouble = _look({"reason": "ErrImagePull", "message": 'rpc error: "reg/nope:1": not found'}, None, now=0.0)
    assert v.never and v.never[0] == "k8s_image" and trouble is None
    assert isinstance(start_decision([v], 1, 0.0, 900), Fail)


def test_an_image_that_cannot_be_pulled_fails_the_start_within_about_a_minute(k8s_cluster):
    image = "nonexistent.invalid/skytasks/none:1"
    template = k8s_cluster.host_python_template()
    del template["spec"]["containers"][0]["image"]  # the template's own image would win over k8s_image
    started = time.monotonic()
    with pytest.raises(PoolStartError) as caught:
        with kube_pool(k8s_cluster, nodes=1, k8s_image=image, k8s_pod_template=template, ready_timeout_seconds=900):
            pass
    took = time.monotonic() - started
    text = str(caught.value)
    print(f"unpullable image: the start failed after {took:.1f}s: {text}")
    assert took < PULL_FAILING_SECONDS + 45, took  # not ready_timeout_seconds' 900 s
    assert text.startswith("k8s_image: "), text
    assert re.search(r"nonexistent\.invalid", text) and re.search(r"no such host|lookup|resolve", text), text
    deadline = time.monotonic() + 60
    while (left := held(k8s_cluster)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], f"left in the cluster: {left}"
