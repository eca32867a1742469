"""provider="kubernetes": one pod per node, made and deleted by the pool, no operator needed.

Start: make the pool's owner object (a ConfigMap every pod names as its owner), open the pool's
watch of its pods and their events (`pool_watch`: the API server is read by watching, never by
polling each pod), then one pod per node; wait until every pod runs (an elastic pool: at least
`min_nodes`, the rest waiting for room), saying why the others wait in the scheduler's, the
kubelet's and a node autoscaler's words (`pod_status`, `pod_events`); a pod that can never
start fails the start at once. Then one exec stream per pod through the API server carries the
node's agent (`node_agents`). A pod that fails, is deleted, or whose node stops being ready is a
lost node, replaced by a new pod; one asked to leave gives its ranks a preemption notice (its
keeper turns SIGTERM into one). Stop, on every path: end the streams, delete every pod and the
owner, and wait until the API server holds none of them. Without the controller, pods end
themselves after `idle_minutes` and at `max_lifetime_minutes` (`activeDeadlineSeconds`);
`skytasks gc --kubernetes` deletes what is left.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid
from typing import Any, Optional

from skytasks.errors import PoolStartError
from skytasks.event_bus import PoolReporter
from skytasks.pool_spec import PoolSpec
from skytasks.providers import Capabilities, NodeLink, NodeProvider, agent_args
from skytasks.providers.kubernetes import cluster, pod_status, pod_views, pods
from skytasks.providers.kubernetes.avoid import avoid_hosts
from skytasks.providers.kubernetes.node_agents import PodAgents
from skytasks.providers.kubernetes.pool_watch import PoolWatch
from skytasks.providers.kubernetes.spec import KubernetesSettings
from skytasks.providers.kubernetes.warm_pods import WarmPods
from skytasks.providers.remote_fields import Lease
from skytasks.providers.teardown import uninterruptible
from skytasks.settings import settings

# A start re-reads its pods at every change the watch hears, and at least this often (for the
# autoscaler's silence and the ready timeout, which no change announces).
TICK_SECONDS = 1.0
GROW_WAIT_SECONDS = 20.0


class KubernetesProvider(WarmPods, NodeProvider):
    # Pods wait for a scheduler and hold GPUs: never a second pool per call. A new exec into the
    # same pod reaches its running agent; a replacement pod keeps off the nodes the preflight found
    # unhealthy (avoid).
    capabilities = Capabilities(gpus_from_config=True, reattaches=True, replaces_elsewhere=True)

    def __init__(self, spec: PoolSpec, reporter: Optional[PoolReporter] = None):
        self._spec, self._k8s = spec, spec.own(KubernetesSettings)
        self.pool_id = f"skytasks-{uuid.uuid4().hex[:10]}"
        self.reporter = reporter or PoolReporter(spec.name, "kubernetes")
        self.reporter.key = self.pool_id
        self.namespace = self._k8s.k8s_namespace
        self._cfg: Any = None
        self._core: Any = None
        self._owner_ref: Optional[dict[str, Any]] = None
        self._node_labels: Optional[list[dict[str, str]]] = None  # the nodes' labels, when the pool may read them
        self._pods: Optional[PoolWatch] = None
        # The owner's skytasks.io/expires-at, renewed while this controller lives (gc's orphan rule).
        self._lease = Lease(self._k8s.idle_minutes, self._k8s.max_lifetime_minutes)
        self._lease.keep_warm_minutes = spec.keep_warm_minutes  # a released warm pool is no orphan
        # What to fix when no node matches the pods' node affinity: the selector the user set, else
        # the GPU product the pool requires, else the template's own affinity.
        self._selector_field = ("k8s_node_selector" if self._k8s.k8s_node_selector or not self._spec.accelerator
                                else "accelerator")
        self._agents: Optional[PodAgents] = None
        self.nodes: dict[int, str] = {}  # node id -> its pod
        self.placed: dict[str, str] = {}  # pod -> the Kubernetes node it runs on
        self.avoided: set[str] = set()  # Kubernetes nodes new pods keep off (found unhealthy)
        self._lost: dict[str, str] = {}  # pod -> why it was lost, as the watch saw it
        self._made = 0  # pods made so far (each gets a new name)
        self._aborted = threading.Event()
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._watcher: Optional[threading.Thread] = None
        self._ips: dict[str, str] = {}  # pod -> its IP, where its peers reach it
        self._made_owner = False  # until then the pool made nothing (every pod names the owner)

    def abort(self) -> None:
        self._aborted.set()
        if self._pods is not None:
            self._pods.wake()

    # -- start ------------------------------------------------------------------------------

    def start(self) -> list[NodeLink]:
        try:
            self._connect()
            names = self._create_pods(self._spec.nodes)
            ready = self._wait_running(names, self._spec.fewest, self._k8s.ready_timeout_seconds)
            self._delete_pods([n for n in names if n not in ready], why="not running when the pool started")
            if len(ready) < len(names):
                self.reporter.note(f"{self.pool_id}: started with {len(ready)} of {len(names)} pods (min_nodes="
                                   f"{self._spec.fewest}); the others could not be scheduled")
            self.reporter.progress(0, len(ready), f"{len(ready)} pods running; starting node agents")
            links = self._start_agents(ready, first=0)
            self.reporter.progress(len(links), len(ready), "every node agent is up")
            self._watcher = threading.Thread(target=self._watch_pods, name=f"skytasks-k8s-lost-{self.pool_id}",
                                             daemon=True)
            self._watcher.start()
            return links
        except BaseException:
            self.stop()
            raise

    def _connect(self) -> None:
        from kubernetes import client

        self._cfg = cluster.configuration(self._spec.credentials)
        self._core = client.CoreV1Api(cluster.api_client(self._cfg))
        self._agents = PodAgents(self._cfg, self.namespace, self._k8s.python, self._k8s.ready_timeout_seconds)
        owner = pods.owner_manifest(self.pool_id, self._spec.name, self._k8s, self._lease.expiry())
        made = self._api(lambda: self._core.create_namespaced_config_map(self.namespace, owner), "create configmaps")
        self._owner_ref = pods.owner_reference({"metadata": {"name": made.metadata.name, "uid": made.metadata.uid}})
        self._made_owner = True
        self._lease.keep(self._renew_lease, lambda line: self.reporter.note(f"{self.pool_id}: {line}"),
                         name=f"skytasks-lease-{self.pool_id}")
        # Watching before the first pod is made: every change to the pool's pods is heard.
        self._pods = PoolWatch(self._cfg, self.namespace, self.pool_id).start(self._k8s.ready_timeout_seconds)
        if self._spec.accelerator:
            self._node_labels = self._read_node_labels(self._spec.accelerator)

    def _api(self, call: Any, doing: str) -> Any:
        import urllib3
        from kubernetes.client.exceptions import ApiException

        try:
            return call()
        except (ApiException, urllib3.exceptions.HTTPError) as exc:
            raise cluster.refused(exc, doing, self.namespace) from exc

    def _renew_lease(self, until: Any) -> None:
        patch = {"metadata": {"annotations": {pods.EXPIRES_ANNOTATION: until.strftime(pods.TIME_FORMAT)}}}
        self._core.patch_namespaced_config_map(self.pool_id, self.namespace, patch, _request_timeout=30)

    def _read_node_labels(self, accelerator: str) -> Optional[list[dict[str, str]]]:
        """The labels of the cluster's nodes, when the pool may read nodes: the GPU product values
        they carry join those the pods require. Without them (reading nodes is cluster-wide, and
        rbac.yaml does not grant it) the pods still require the product, by the labels the
        clouds' autoscalers build GPU nodes from."""
        try:
            nodes = self._core.list_node(_request_timeout=30).items
        except Exception as exc:  # noqa: BLE001 - a pool need not be allowed to read nodes
            self.reporter.note(f"{self.pool_id}: cannot read the cluster's nodes ({cluster.api_message(exc)[:200]}); "
                               f"the pods require {accelerator!r} by the GPU product labels autoscaled node pools "
                               "carry (k8s_gpu_label names another)")
            return None
        return [dict(n.metadata.labels or {}) for n in nodes]

    def _create_pods(self, count: int, slot: Optional[int] = None) -> list[str]:
        names = []
        secrets = [v for k, v in self._spec.env.items() if k in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")]
        for _ in range(count):
            assert self._owner_ref is not None
            manifest = avoid_hosts(pods.pod_manifest(self._spec, self._k8s, self.pool_id, self._made, self._owner_ref,
                                                     node_labels=self._node_labels, slot=slot), self.avoided)
            if not pods.secret_free(manifest, secrets):
                raise PoolStartError("k8s_pod_template: a secret value of the pool appears in the pod's manifest; "
                                     "secrets reach the nodes over the controller's stream, never in a pod spec")
            self._made += 1
            self._api(lambda m=manifest: self._core.create_namespaced_pod(self.namespace, m), "create pods")
            names.append(manifest["metadata"]["name"])
        return names

    def _wait_running(self, names: list[str], fewest: int, timeout: float) -> list[str]:
        """Until the pods may start (`pod_status.start_decision`): the names of those that run.
        Woken by the watch at each change to them, never asking the API server itself."""
        assert self._pods is not None
        started, seen = time.monotonic(), self._pods.version
        since: dict[str, float] = {}  # pod -> when it was first seen unschedulable
        pulls: dict[str, pod_status.PullTrouble] = {}  # pod -> since when its image pull fails, and why
        while True:
            views = pod_views.starting(self._pods, names, self._k8s.k8s_autoscaler, since, self._selector_field, pulls)
            decision = pod_status.start_decision(views, fewest, time.monotonic() - started, timeout)
            if isinstance(decision, pod_status.Go):
                for v in views:
                    self.placed[v.name] = v.node
                self._ips.update({v.name: v.ip for v in views})
                return list(decision.running)
            if isinstance(decision, pod_status.Fail):  # the field to fix first, as every pool error says it
                raise PoolStartError(f"{decision.field + ': ' if decision.field else ''}{decision.reason}; "
                                     "every pod was deleted")
            self.reporter.progress(sum(v.running for v in views), len(views), decision.detail)
            seen = self._pods.wait_for_change(seen, TICK_SECONDS)
            if self._aborted.is_set():
                raise InterruptedError(f"the start of {self.pool_id} was cancelled")

    def _start_agents(self, names: list[str], first: int) -> list[NodeLink]:
        assert self._agents is not None
        ids = list(range(first, first + len(names)))
        for node_id, name in zip(ids, names):
            self.nodes[node_id] = name
        with concurrent.futures.ThreadPoolExecutor(max(1, len(names))) as pool:
            return list(pool.map(self._start_agent, ids))

    def _start_agent(self, node_id: int) -> NodeLink:
        assert self._agents is not None
        name = self.nodes[node_id]
        link = self._agents.start(node_id, name, self._ips[name], agent_args(pods.HEARTBEAT_FILE, pods.NOTICE_FILE))
        return self._dressed(link, name)

    def _dressed(self, link: NodeLink, name: str) -> NodeLink:
        link.where = f"pod {name} on node {self.placed.get(name) or '?'}"
        link.loss_detail = lambda: self._loss_detail(name)
        # close_lost is close: the link's own exec stream, never a newer one the pod was reached by.
        link.notice_deadline = lambda: pod_views.leaving_at(self._pods.last_state(name) if self._pods else None)
        return link

    def reattach(self, node_id: int, door: str, timeout: float) -> NodeLink:
        """A new exec into the node's pod reaching its running agent (an exec'd process outlives
        its stream: an API server restart, a proxy's cut, a controller's lost connection).
        NodeGone when the pool's watch says the pod is gone (deleted, failed, ended, its node not
        ready) or nothing is behind the door; anything else (the API server not answering yet)
        is tried again."""
        from skytasks.errors import NodeGone

        name = self.nodes.get(node_id)
        if name is None or self._agents is None:
            raise NodeGone(f"node {node_id} is no longer one of the pool's pods")
        gone = self._lost.get(name) or (pod_views.lost(self._pods, name) if self._pods else None)
        if gone:
            raise NodeGone(gone)
        return self._dressed(self._agents.attach(node_id, name, self._ips[name], door, timeout), name)

    def _loss_detail(self, name: str) -> str:
        if name in self._lost:
            return self._lost[name]
        pod = self._pods.pods().get(name) if self._pods else None
        if pod is None:
            return f"Kubernetes: pod {name} was deleted"
        v = pod_status.view(pod)
        said = self._agents.last_words(name) if self._agents else ""
        return f"Kubernetes: {v.gone or f'pod {name} is {v.phase}'}" + (f"; the exec stream said: {said}" if said else "")

    def _watch_pods(self) -> None:
        """A pod that failed, ended, was deleted, or whose node is not ready: its stream is ended,
        so the session finds the node lost at once (rather than after the heartbeat's silence).
        Woken by the watch at each change, asking the API server nothing itself."""
        assert self._pods is not None
        seen = self._pods.version
        while not self._stopped.is_set():
            for name in list(self.nodes.values()):
                gone = pod_views.lost(self._pods, name)
                if gone and name not in self._lost:
                    self._lost[name] = gone
                    if self._agents:
                        self._agents.end(name)
            seen = self._pods.wait_for_change(seen, 5.0)

    # -- the calls' needs -------------------------------------------------------------------

    def free_port(self, head: int) -> int:
        assert self._agents is not None
        return self._agents.free_port(self.nodes[head])

    def prepare_workdir(self, request: Any) -> tuple[str, str | None]:
        assert self._agents is not None
        return self._agents.prepare_workdir(request, [self.nodes[i] for i in sorted(self.nodes)])

    def avoid(self, node_id: int) -> None:
        """The preflight found this node unhealthy: pods made from now on keep off its Kubernetes node."""
        self.avoided.add(self.placed.get(self.nodes.get(node_id, ""), ""))

    def replace(self, node_id: int) -> NodeLink:
        old = self.nodes.get(node_id, "?")
        self.release(node_id)
        try:
            # In the lost pod's placement slot: it fits where the lost one did (k8s_pods_per_host).
            [name] = self._create_pods(1, slot=int(old.rsplit("-", 1)[1]) if old != "?" else None)
            self._wait_running([name], 1, self._k8s.ready_timeout_seconds)
        except Exception as exc:
            raise PoolStartError(f"node {node_id} (pod {old}) was lost and no new pod could be had: {exc}") from exc
        self.nodes[node_id] = name
        self.reporter.note(f"{self.pool_id}: node {node_id} (pod {old}) replaced by pod {name} on node "
                           f"{self.placed.get(name, '?')}")
        return self._start_agent(node_id)

    def grow(self, count: int) -> list[NodeLink]:
        names: list[str] = []
        try:
            names = self._create_pods(count)
            ready = self._wait_running(names, 0, GROW_WAIT_SECONDS)  # 0: pods with no room now are not waited for
        except Exception as exc:  # noqa: BLE001 - growing never fails a call
            self._delete_pods(names, why="could not grow")
            self.reporter.note(f"{self.pool_id}: could not grow by {count} pod{'s' * (count != 1)} now: {exc}")
            return []
        self._delete_pods([n for n in names if n not in ready], why="not running in time to grow the pool")
        if not ready:
            self.reporter.note(f"{self.pool_id}: could not grow by {count} pod{'s' * (count != 1)} now: no room "
                               "for them in the cluster")
            return []
        first = max(self.nodes, default=-1) + 1
        self.reporter.note(f"{self.pool_id}: grew by {', '.join(ready)}")
        return self._start_agents(ready, first)

    def release(self, node_id: int) -> None:
        name = self.nodes.pop(node_id, None)
        if name is None:
            return
        if self._agents:
            self._agents.end(name)
        self._delete_pods([name], why="released")

    def _delete_pods(self, names: list[str], why: str) -> None:
        from kubernetes import client

        for name in names:
            try:
                self._core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0,
                                                 body=client.V1DeleteOptions(grace_period_seconds=0))
            except Exception as exc:  # noqa: BLE001 - gone already (404) is fine; stop() checks what is left
                if getattr(exc, "status", None) != 404:
                    self.reporter.note(f"{self.pool_id}: could not delete pod {name} ({why}): "
                                       f"{cluster.api_message(exc)[:200]}")

    # -- stop -------------------------------------------------------------------------------

    def stop(self) -> None:
        """End the streams, delete every pod and the owner, and wait until none is left. Runs in
        a thread of its own and is waited for through Ctrl-C and SIGTERM."""
        self._stopped.set()
        if self._pods is not None:
            self._pods.wake()
        uninterruptible(self._teardown, lambda: self.reporter.note("still deleting the pool's pods; please wait"),
                        name="skytasks-k8s-teardown")

    def _teardown(self) -> BaseException | None:
        from skytasks.providers.kubernetes.teardown import delete_pool

        with self._stop_lock:
            self._lease.stop()
            if self._agents:
                self._agents.end_all()
            if self._core is None or not self._made_owner:
                if self._pods is not None:
                    self._pods.stop()
                return None
            try:  # the watch stays open until the pods are gone: it says so without a LIST each 0.3 s
                left, detail = delete_pool(self._core, self.namespace, self.pool_id,
                                           settings().teardown_wait_seconds, self._pods)
            finally:
                if self._pods is not None:
                    self._pods.stop()
            self.nodes.clear()
            if left:
                return self.reporter.teardown_failed(left, detail)
            return None
