"""PoolWatch (skytasks/providers/kubernetes/pool_watch.py) against the real test cluster
(tests/harness/k8s/): pods and events seen from one LIST and a WATCH each, a resourceVersion the
server no longer holds (410) listed again, a killed and restarted kube-apiserver, and a 429 and a
503 from a real HTTP proxy in front of the real apiserver. The backoff's pure rules are tested
without a cluster at the end."""

from __future__ import annotations

import http.client
import json
import signal
import ssl
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import pytest

from skytasks.errors import PoolConfigError
from skytasks.providers.kubernetes import api_retry, pods
from skytasks.providers.kubernetes.pod_events import event_time
from skytasks.providers.kubernetes.pool_watch import PoolWatch


# -- helpers -----------------------------------------------------------------------------------


def admin_cfg(cluster: Any, kubeconfig: Any = None) -> Any:
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(str(kubeconfig or cluster.admin_kubeconfig), client_configuration=cfg,
                            persist_config=False)
    return cfg


def core(cluster: Any) -> Any:
    from kubernetes import client

    return client.CoreV1Api(client.ApiClient(admin_cfg(cluster)))


def until(what: Callable[[], Any], timeout: float = 30.0, every: float = 0.05, why: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {why or what}")
        time.sleep(every)


def sleeper(cluster: Any, name: str, pool: str) -> dict:
    """A pod of `pool` that runs this machine's Python asleep, ending at once when deleted."""
    template = cluster.host_python_template()["spec"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {pods.POOL_LABEL: pool}},
            "spec": {"terminationGracePeriodSeconds": 0, "volumes": template["volumes"],
                     "containers": [{**template["containers"][0], "name": "node",
                                     "command": [sys.executable, "-c", "import time; time.sleep(3600)"]}]}}


def event(name: str, pod: str, reason: str, **when: str) -> dict:
    return {"apiVersion": "v1", "kind": "Event", "metadata": {"name": name},
            "involvedObject": {"kind": "Pod", "name": pod, "namespace": "default", "apiVersion": "v1"},
            "reason": reason, "message": f"{reason} for {pod}", "type": "Normal",
            "source": {"component": "cluster-autoscaler"}, **when}


def stamp(seconds_from_now: float, micro: bool = False) -> str:
    t = datetime.now(timezone.utc) + timedelta(seconds=seconds_from_now)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def watch_threads(pool_id: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("skytasks-k8s-watch") and pool_id in t.name]


@pytest.fixture
def pool_id():
    return f"skytasks-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def api(k8s_cluster, pool_id):
    api = core(k8s_cluster)
    yield api
    api.delete_collection_namespaced_pod("default", label_selector=f"{pods.POOL_LABEL}={pool_id}",
                                         grace_period_seconds=0)


@pytest.fixture
def watch(k8s_cluster, pool_id):
    w = PoolWatch(admin_cfg(k8s_cluster), "default", pool_id).start(timeout=30)
    yield w
    w.stop()
    assert not watch_threads(pool_id)


def restart_apiserver(cluster: Any) -> float:
    """SIGKILL the cluster's kube-apiserver and start it again with the very command line it was
    started with (Popen.args: the mount namespace wrapper and every flag) and this process's
    environment, as it was; the new process takes its place in `cluster.daemons`, so the
    cluster's stop() ends it. Seconds until it answers /readyz again."""
    old = cluster.daemons["apiserver"]
    old.send_signal(signal.SIGKILL)
    old.wait(10)
    t0 = time.monotonic()
    with open(cluster.logs_dir / "apiserver.log", "ab") as log:
        cluster.daemons["apiserver"] = subprocess.Popen(old.args, stdin=subprocess.DEVNULL, stdout=log,
                                                        stderr=subprocess.STDOUT, start_new_session=True)

    def ready() -> bool:
        try:
            return cluster._get("/readyz")[0] == 200
        except OSError:
            return False

    until(ready, timeout=60, every=0.1, why="the restarted apiserver answers /readyz")
    return time.monotonic() - t0


# -- pods and events ---------------------------------------------------------------------------


def test_pods_made_changed_and_deleted_are_seen_without_a_new_list(k8s_cluster, api, watch, pool_id):
    assert watch.healthy and watch.pods() == {} and watch.deleted() == set()
    listed = {k: v for k, v in watch.requests.items() if k.startswith("LIST")}
    assert listed == {"LIST pods": 1, "LIST events": 1}
    names = [f"{pool_id}-{n}" for n in range(3)]
    for name in names:
        api.create_namespaced_pod("default", sleeper(k8s_cluster, name, pool_id))
    api.create_namespaced_pod("default", sleeper(k8s_cluster, f"{pool_id}x-0", f"{pool_id}x"))  # another pool's
    try:
        until(lambda: all(watch.pods().get(n, {}).get("status", {}).get("phase") == "Running" for n in names),
              timeout=60, why="three pods Running, as the watch saw them")
        api.patch_namespaced_pod(names[0], "default", {"metadata": {"annotations": {"seen": "yes"}}})
        until(lambda: watch.pods()[names[0]]["metadata"].get("annotations", {}).get("seen") == "yes")
        before = watch.version
        api.delete_namespaced_pod(names[1], "default", grace_period_seconds=0)
        until(lambda: names[1] in watch.deleted(), why="the deleted pod is remembered as deleted")
        assert watch.version > before
        assert set(watch.pods()) == {names[0], names[2]}  # never the other pool's pod
        assert watch.last_state(names[1])["metadata"]["name"] == names[1]  # its last state, kept
        assert watch.last_state(f"{pool_id}-9") is None  # never seen is not deleted
        # Every change came over the two watches: still one LIST of each, however many changes.
        assert {k: v for k, v in watch.requests.items() if k.startswith("LIST")} == listed
        assert watch.requests["WATCH pods"] == 1 and watch.requests["WATCH events"] == 1
        # The kubelet's events about the pool's pods came too, oldest first.
        reasons = until(lambda: [e["reason"] for e in watch.events(names[0]) if e["reason"] == "Started"])
        assert reasons == ["Started"]
        times = [event_time(e) for e in watch.events(names[0])]
        assert times == sorted(times) and times[0] > 0
    finally:
        api.delete_namespaced_pod(f"{pool_id}x-0", "default", grace_period_seconds=0)


def test_a_start_loop_wakes_on_a_change_not_on_a_timer(k8s_cluster, api, watch, pool_id):
    seen = watch.version
    t0 = time.monotonic()
    assert watch.wait_for_change(seen, 0.3) == seen and time.monotonic() - t0 >= 0.29  # nothing: the timeout
    woken = threading.Event()
    got: list[int] = []
    threading.Thread(target=lambda: (got.append(watch.wait_for_change(seen, 30)), woken.set()), daemon=True).start()
    t0 = time.monotonic()
    api.create_namespaced_pod("default", sleeper(k8s_cluster, f"{pool_id}-0", pool_id))
    assert woken.wait(10) and got[0] > seen
    assert time.monotonic() - t0 < 2  # woken by the pod's ADDED, not a poll


def test_events_about_the_pools_pods_are_kept_in_time_order_and_no_other_pools(k8s_cluster, api, watch, pool_id):
    pod, other = f"{pool_id}-7", f"skytasks-{uuid.uuid4().hex[:10]}-7"
    tag = uuid.uuid4().hex[:6]
    # Another pool's first: the watch brings events in order, so once ours are in, it has been by.
    api.create_namespaced_event("default", event(f"{other}.{tag}", other, "TriggeredScaleUp",
                                                 lastTimestamp=stamp(0)))
    # 1.20's scheduler and kubelet fill lastTimestamp; newer components fill eventTime only.
    api.create_namespaced_event("default", event(f"{pod}.{tag}a", pod, "TriggeredScaleUp",
                                                 firstTimestamp=stamp(-5), lastTimestamp=stamp(5)))
    api.create_namespaced_event("default", event(f"{pod}.{tag}b", pod, "FailedScheduling",
                                                 eventTime=stamp(0, micro=True), action="Scheduling",
                                                 reportingComponent="default-scheduler",
                                                 reportingInstance="default-scheduler-x"))
    got = until(lambda: len(watch.events(pod)) == 2 and watch.events(pod), why="both events of the pool's pod")
    assert [e["reason"] for e in got] == ["FailedScheduling", "TriggeredScaleUp"]  # by their time, not arrival
    assert watch.events(other) == []
    assert watch.requests["LIST events"] == 1
    api.delete_namespaced_event(f"{pod}.{tag}a", "default")
    until(lambda: [e["reason"] for e in watch.events(pod)] == ["FailedScheduling"], why="an expired event goes")


def test_events_already_there_at_start_come_from_the_first_list(k8s_cluster, api, pool_id):
    api.create_namespaced_event("default", event(f"{pool_id}-0.early", f"{pool_id}-0", "NotTriggerScaleUp",
                                                 lastTimestamp=stamp(0)))
    w = PoolWatch(admin_cfg(k8s_cluster), "default", pool_id).start(timeout=30)
    try:
        assert [e["reason"] for e in w.events(f"{pool_id}-0")] == ["NotTriggerScaleUp"]
    finally:
        w.stop()


# -- a resourceVersion too old, a restarted API server --------------------------------------


def test_a_resource_version_the_server_no_longer_holds_is_listed_again_and_deletions_found(
        k8s_cluster, api, pool_id):
    # A fresh API server's watch cache holds every pod event since its start, from the etcd of a
    # fresh cluster at revision 1: resourceVersion "1" is too old (410) only for a server started
    # later, as a restarted one is.
    restart_apiserver(k8s_cluster)
    api = core(k8s_cluster)
    watch = PoolWatch(admin_cfg(k8s_cluster), "default", pool_id).start(timeout=30)
    try:
        _listed_again(k8s_cluster, api, watch, pool_id)
    finally:
        watch.stop()


def _listed_again(k8s_cluster: Any, api: Any, watch: PoolWatch, pool_id: str) -> None:
    keep, drop = f"{pool_id}-0", f"{pool_id}-1"
    for name in (keep, drop):
        api.create_namespaced_pod("default", sleeper(k8s_cluster, name, pool_id))
    until(lambda: all(watch.pods().get(n, {}).get("status", {}).get("phase") == "Running" for n in (keep, drop)),
          timeout=60, why="both pods Running: their stream goes quiet")
    assert watch.requests["LIST pods"] == 1
    # Hold the watch's lock: its thread, cut off, cannot apply anything until we let it. Its
    # resourceVersion becomes "1", which the API server's watch cache no longer holds, and a pod
    # is deleted meanwhile (the cut stream never carries that): the server must answer 410, and
    # the watch list again and find the pod gone.
    with watch._cond:
        watch._rv["pods"] = "1"
        watch._open["pods"].shutdown()
        api.delete_namespaced_pod(drop, "default", grace_period_seconds=0)
        until(lambda: drop not in [p.metadata.name for p in api.list_namespaced_pod(
            "default", label_selector=f"{pods.POOL_LABEL}={pool_id}").items])
    until(lambda: watch.requests["LIST pods"] == 2, why="a second LIST after the 410")
    assert "410" in watch.last_error and "too old resource version" in watch.last_error
    until(lambda: drop in watch.deleted(), why="the pod deleted while the watch was away, found by the LIST")
    assert keep in watch.pods() and keep not in watch.deleted()
    api.create_namespaced_pod("default", sleeper(k8s_cluster, f"{pool_id}-2", pool_id))
    until(lambda: f"{pool_id}-2" in watch.pods(), why="the new watch goes on")
    until(lambda: watch.healthy)
    assert watch.requests["LIST pods"] == 2


def test_the_watch_goes_on_through_a_killed_and_restarted_api_server(k8s_cluster, api, watch, pool_id):
    api.create_namespaced_pod("default", sleeper(k8s_cluster, f"{pool_id}-0", pool_id))
    until(lambda: f"{pool_id}-0" in watch.pods())
    down = restart_apiserver(k8s_cluster)
    assert down < 30
    until(lambda: not watch.healthy or watch.requests["WATCH pods"] > 1, why="the watch saw its connection cut")
    api = core(k8s_cluster)  # the old client's pooled connections died with the server
    until(lambda: _create(api, sleeper(k8s_cluster, f"{pool_id}-1", pool_id)), timeout=30,
          why="the restarted server takes a pod")
    until(lambda: f"{pool_id}-1" in watch.pods(), timeout=60, why="a pod made after the restart, seen by the watch")
    api.create_namespaced_event("default", event(f"{pool_id}-1.after", f"{pool_id}-1", "TriggeredScaleUp",
                                                 lastTimestamp=stamp(0)))
    until(lambda: any(e["reason"] == "TriggeredScaleUp" for e in watch.events(f"{pool_id}-1")), timeout=60,
          why="an event posted after the restart, seen by the events' watch")
    until(lambda: watch.healthy, why="both watches open again")
    assert watch.requests["WATCH pods"] >= 2 and watch.requests["WATCH events"] >= 2
    assert watch.last_error  # the break was noted for diagnostics
    assert f"{pool_id}-0" in watch.pods()


def _create(api: Any, manifest: dict) -> bool:
    try:
        api.create_namespaced_pod("default", manifest)
        return True
    except Exception:  # noqa: BLE001 - the server still coming up: asked again
        return False


# -- a 429 and a 503 from a real proxy -------------------------------------------------------


class RefusingProxy(ThreadingHTTPServer):
    """A plain-HTTP proxy on loopback in front of the test cluster's apiserver (which it reaches
    over TLS as the admin): it answers the first request of each path in `refuse` ("LIST pods",
    "WATCH pods", ...) with that status, then forwards every request, streaming watches."""

    daemon_threads = True

    def __init__(self, cluster: Any, refuse: dict[str, tuple[int, dict[str, str]]]):
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.cluster, self.refuse = cluster, dict(refuse)
        self.answered: list[tuple[str, int]] = []
        self.ctx = ssl.create_default_context(cafile=str(cluster.ca_cert))
        self.ctx.load_cert_chain(cluster.pki / "admin.crt", cluster.pki / "admin.key")
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: RefusingProxy

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        kind = "pods" if "/pods" in self.path else "events" if "/events" in self.path else "other"
        what = f"{'WATCH' if 'watch=true' in self.path else 'LIST'} {kind}"
        with self.server.lock:
            refusal = self.server.refuse.pop(what, None)
            self.server.answered.append((what, refusal[0] if refusal else 200))
        if refusal:
            status, headers = refusal
            body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": status,
                               "message": f"the proxy says {status}"}).encode()
            self.send_response(status)
            for k, v in {**headers, "Content-Type": "application/json", "Content-Length": str(len(body))}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)
            return
        up = http.client.HTTPSConnection("127.0.0.1", self.server.cluster.api_port, context=self.server.ctx,
                                         timeout=600)
        try:
            up.request("GET", self.path, headers={k: v for k, v in self.headers.items()
                                                  if k.lower() not in ("host", "connection", "authorization")})
            r = up.getresponse()
            self.send_response(r.status)
            for k, v in r.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while data := r.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass  # the client went (a stopped watch)
        finally:
            up.close()


@pytest.fixture
def proxy(k8s_cluster):
    servers: list[RefusingProxy] = []

    def make(refuse: dict[str, tuple[int, dict[str, str]]]) -> RefusingProxy:
        p = RefusingProxy(k8s_cluster, refuse)
        threading.Thread(target=p.serve_forever, daemon=True).start()
        servers.append(p)
        return p

    yield make
    for p in servers:
        p.shutdown()
        p.server_close()


def test_a_429_and_a_503_are_retried_with_backoff_honouring_retry_after(k8s_cluster, api, proxy, pool_id):
    from kubernetes import client

    p = proxy({"LIST pods": (429, {"Retry-After": "2"}), "WATCH pods": (503, {}), "LIST events": (500, {})})
    cfg = client.Configuration(host=p.url)
    t0 = time.monotonic()
    w = PoolWatch(cfg, "default", pool_id).start(timeout=60)
    try:
        took = time.monotonic() - t0
        assert took >= 2.0, "the Retry-After of 2 s was honoured"
        assert ("LIST pods", 429) in p.answered and ("LIST events", 500) in p.answered
        assert w.requests["LIST pods"] == 2 and w.requests["LIST events"] == 2
        until(lambda: w.healthy and w.requests["WATCH pods"] == 2, why="the watch opened after its 503")
        assert ("WATCH pods", 503) in p.answered
        api.create_namespaced_pod("default", sleeper(k8s_cluster, f"{pool_id}-0", pool_id))
        until(lambda: f"{pool_id}-0" in w.pods(), why="the pod, through the proxy's stream")
        assert w.refusal is None
    finally:
        w.stop()
    assert not watch_threads(pool_id)


def test_a_start_past_its_timeout_of_5xx_fails_naming_the_api(k8s_cluster, proxy, pool_id):
    from kubernetes import client

    p = proxy({"LIST pods": (503, {"Retry-After": "30"})})
    t0 = time.monotonic()
    with pytest.raises(Exception) as failed:
        PoolWatch(client.Configuration(host=p.url), "default", pool_id).start(timeout=3)
    assert time.monotonic() - t0 < 3.5  # not after the Retry-After: a wait past the timeout is not begun
    assert "HTTP 503" in str(failed.value) and "list pods" in str(failed.value)
    assert not watch_threads(pool_id)


# -- refusals --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def narrow(k8s_cluster):
    """A namespace with two identities: `nobody` may do nothing; `lister` may list pods and events
    but not watch them."""
    ns = f"watch-{uuid.uuid4().hex[:6]}"
    k8s_cluster.create_namespace(ns)
    k8s_cluster.kubectl("create", "role", "lister", "--verb=list", "--resource=pods,events", "-n", ns)
    for sa in ("nobody", "lister"):
        k8s_cluster.kubectl("create", "serviceaccount", sa, "-n", ns)
    k8s_cluster.kubectl("create", "rolebinding", "lister", "--role=lister", f"--serviceaccount={ns}:lister", "-n", ns)
    yield ns
    k8s_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.mark.parametrize("who, doing", [("nobody", "list pods"), ("lister", "watch pods")])
def test_a_missing_permission_fails_the_start_naming_it(k8s_cluster, narrow, pool_id, who, doing):
    cfg = admin_cfg(k8s_cluster, k8s_cluster.kubeconfig_for_service_account(narrow, who))
    t0 = time.monotonic()
    with pytest.raises(PoolConfigError) as refused:
        PoolWatch(cfg, narrow, pool_id).start(timeout=30)
    assert time.monotonic() - t0 < 5  # at once: a refusal is not retried
    said = str(refused.value)
    assert f"may not {doing} in namespace {narrow!r}" in said and "rbac.yaml" in said
    assert not watch_threads(pool_id)


def test_stop_ends_both_threads_at_once_and_twice_is_fine(k8s_cluster, pool_id):
    w = PoolWatch(admin_cfg(k8s_cluster), "default", pool_id).start(timeout=30)
    assert len(watch_threads(pool_id)) == 2 and w.healthy
    t0 = time.monotonic()
    w.stop()
    assert time.monotonic() - t0 < 1.0
    assert not watch_threads(pool_id) and not w.healthy
    w.stop()
    assert w.wait_for_change(w.version, 5) == w.version  # a stopped watch wakes its waiters at once


# -- the backoff's rules (no cluster) ----------------------------------------------------------


def api_error(status: int, retry_after: str | None = None) -> Exception:
    from kubernetes.client.exceptions import ApiException

    exc = ApiException(status=status, reason="x")
    exc.headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return exc


def test_which_answers_pass_and_which_refuse():
    import urllib3

    for status in (429, 500, 502, 503, 504):
        assert api_retry.passing(api_error(status)) and not api_retry.refused(api_error(status))
    for status in (401, 403):
        assert api_retry.refused(api_error(status)) and not api_retry.passing(api_error(status))
    for status in (400, 404, 409, 410, 422):
        assert not api_retry.passing(api_error(status))
    for broken in (ConnectionRefusedError(), ConnectionResetError(), TimeoutError(),
                   urllib3.exceptions.ProtocolError("cut"), http.client.IncompleteRead(b""), api_error(0)):
        assert api_retry.passing(broken), broken
    assert not api_retry.passing(KeyError("metadata"))  # a bug is not the network


def test_retry_after_in_seconds_or_as_a_date_and_capped():
    assert api_retry.retry_after(api_error(429, "3")) == 3.0
    assert api_retry.retry_after(api_error(429)) is None
    assert api_retry.retry_after(api_error(429, "99999")) == api_retry.MAX_RETRY_AFTER
    assert api_retry.retry_after(api_error(503, "Wed, 21 Oct 2015 07:28:10 GMT"), now=1445412480.0) == 10.0
    assert api_retry.retry_after(api_error(503, "soon")) is None


def test_backoff_doubles_to_its_cap_with_full_jitter_and_never_under_retry_after():
    top = api_retry.Backoff(first=0.5, cap=30.0, rng=lambda: 1.0)
    assert [top.delay() for _ in range(8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    top.reset()
    assert top.delay() == 0.5
    low = api_retry.Backoff(rng=lambda: 0.0)
    assert low.delay() == 0.0 and low.delay(server_asked=2.0) == 2.0
    spread = {round(api_retry.Backoff().delay(), 6) for _ in range(50)}
    assert len(spread) > 40 and all(0 <= d <= 0.5 for d in spread)  # jittered: pools do not retry in step


def test_events_sort_by_event_time_else_last_else_first_else_creation():
    e = [{"eventTime": "2026-01-01T00:00:03.500000Z", "metadata": {}},
         {"lastTimestamp": "2026-01-01T00:00:03Z", "metadata": {}},
         {"firstTimestamp": "2026-01-01T00:00:01Z", "metadata": {}},
         {"metadata": {"creationTimestamp": "2026-01-01T00:00:02Z"}}, {"metadata": {}}]
    assert [event_time(x) for x in sorted(e, key=event_time)] == [event_time(e[i]) for i in (4, 2, 3, 1, 0)]
    assert event_time(e[4]) == 0.0 and event_time(e[0]) - event_time(e[1]) == 0.5
