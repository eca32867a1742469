"""An exec into a pod asked for while the kube-apiserver is down (skytasks/providers/kubernetes/
exec_stream.py), on the real test cluster: the connection is asked for again until the restarted
server takes it, and the command runs once; a refusal (403) is raised at once, never waited on.

What CI found: a second process attaching to a warm pool while the apiserver restarted had its
preflight's first exec (the head's free port) refused, and its call failed with
`ConnectionRefusedError`, where every REST call beside it would have waited."""

from __future__ import annotations

import sys
import threading
import time
import uuid

import pytest

from skytasks.providers.kubernetes import exec_stream, pods


def _cfg(kubeconfig) -> object:
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(str(kubeconfig), client_configuration=cfg, persist_config=False)
    return cfg


@pytest.fixture
def pod(k8s_cluster):
    """A pod that sleeps, with this machine's Python, Running."""
    from kubernetes import client

    name = f"exec-{uuid.uuid4().hex[:8]}"
    template = k8s_cluster.host_python_template()["spec"]
    api = client.CoreV1Api(client.ApiClient(_cfg(k8s_cluster.admin_kubeconfig)))
    api.create_namespaced_pod("default", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {pods.POOL_LABEL: name}},
        "spec": {"terminationGracePeriodSeconds": 0, "volumes": template["volumes"],
                 "containers": [{**template["containers"][0], "name": "node",
                                 "command": [sys.executable, "-c", "import time; time.sleep(3600)"]}]}})
    deadline = time.monotonic() + 90
    while api.read_namespaced_pod(name, "default").status.phase != "Running":
        assert time.monotonic() < deadline, f"pod {name} not Running"
        time.sleep(0.2)
    yield name
    api.delete_namespaced_pod(name, "default", grace_period_seconds=0)


def _down(k8s_cluster) -> bool:
    try:
        k8s_cluster._get("/readyz", timeout=1.0)
        return False
    except OSError:
        return True


def test_an_exec_asked_for_while_the_apiserver_restarts_runs_once_it_is_back(k8s_cluster, pod):
    cfg = _cfg(k8s_cluster.admin_kubeconfig)
    restart: list[float] = []
    restarter = threading.Thread(target=lambda: restart.append(k8s_cluster.restart_apiserver(down_for=3.0)))
    restarter.start()
    try:
        deadline = time.monotonic() + 10
        while not _down(k8s_cluster):
            assert time.monotonic() < deadline, "the apiserver never went down"
            time.sleep(0.05)
        asked = time.monotonic()
        code, out, said = exec_stream.run(cfg, "default", pod, "node",
                                          [sys.executable, "-c", "print('ran', flush=True)"], timeout=60)
        waited = time.monotonic() - asked
    finally:
        restarter.join(90)
    assert restart, "the apiserver came back"
    assert (code, out.split(), said) == (0, [b"ran"], ""), (code, out, said)
    assert waited >= 2.0, f"it was down for 3 s and the exec took {waited:.1f} s: it never waited"


def test_an_exec_the_server_refuses_is_raised_at_once(k8s_cluster, pod):
    import websocket

    ns = "default"
    nobody = k8s_cluster.kubeconfig_for_service_account(ns, "default")  # may not exec into pods
    t0 = time.monotonic()
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        exec_stream.run(_cfg(nobody), ns, pod, "node", [sys.executable, "-c", "pass"], timeout=60)
    assert refused.value.status_code == 403
    assert time.monotonic() - t0 < 5, "a 403 is never asked again"


def test_which_upgrade_failures_are_asked_again():
    import ssl

    import websocket

    def bad(status: int, body: bytes = b"", headers: dict | None = None):
        return websocket.WebSocketBadStatusException("Handshake status", status, "", headers or {}, body)

    rbac_cold = (b'pods "p" is forbidden: User "system:serviceaccount:ml:skytasks" cannot create resource "pods/exec"'
                 b' in API group "" in the namespace "ml": RBAC: role.rbac.authorization.k8s.io "skytasks-pool" not found')
    lacking = b'pods "p" is forbidden: User "x" cannot create resource "pods/exec" in API group ""'
    asked_again = [ConnectionRefusedError(), ConnectionResetError(), ssl.SSLEOFError(), bad(503), bad(429),
                   websocket.WebSocketConnectionClosedException(), bad(403, rbac_cold)]
    at_once = [bad(401), bad(403, lacking), bad(404), ssl.SSLCertVerificationError(), ssl.SSLError()]
    assert [exec_stream._passes(e) for e in asked_again] == [True] * len(asked_again)
    assert [exec_stream._passes(e) for e in at_once] == [False] * len(at_once)
    from skytasks.providers.kubernetes import api_retry

    assert api_retry.retry_after(bad(429, headers={"retry-after": "7"})) == 7.0  # the upgrade's own headers


def test_a_connect_refused_throughout_is_asked_again_until_its_timeout_and_not_long_after():
    import socket

    from kubernetes import client

    with socket.socket() as held:  # a port of this machine that nothing listens on: each try is refused
        held.bind(("127.0.0.1", 0))
        cfg = client.Configuration(host=f"https://127.0.0.1:{held.getsockname()[1]}")
        t0 = time.monotonic()
        with pytest.raises(ConnectionRefusedError):
            exec_stream.run(cfg, "default", "p", "node", ["true"], timeout=3.0)
    assert 2.9 <= time.monotonic() - t0 <= 4.0, time.monotonic() - t0
