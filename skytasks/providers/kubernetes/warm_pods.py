"""provider="kubernetes", warm pools (keep_warm_minutes): the pods outlive the process that made
them, and another process's provider takes them over. The provider's part that only a warm pool
uses, as a mixin of KubernetesProvider (provider.py), which has the attributes named below."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from skytasks.errors import PoolConfigError, PoolGone, PoolStartError
from skytasks.event_bus import PoolReporter
from skytasks.providers.kubernetes import cluster, pod_views, pods
from skytasks.providers.kubernetes.node_agents import PodAgents
from skytasks.providers.kubernetes.pool_watch import PoolWatch
from skytasks.providers.kubernetes.spec import KubernetesSettings
from skytasks.providers.remote_fields import Lease

if TYPE_CHECKING:
    from skytasks.pool_spec import PoolSpec


class WarmPods:
    """handle / adopt / leave_running of a KubernetesProvider."""

    # (the provider's, provider.py)
    pool_id: str
    namespace: str
    reporter: PoolReporter
    nodes: dict[int, str]
    placed: dict[str, str]
    _spec: PoolSpec
    _k8s: KubernetesSettings
    _cfg: Any
    _core: Any
    _agents: Optional[PodAgents]
    _pods: Optional[PoolWatch]
    _lease: Lease
    _owner_ref: Optional[dict[str, Any]]
    _made_owner: bool
    _made: int
    _ips: dict[str, str]
    _lost: dict[str, str]
    _node_labels: Optional[list[dict[str, str]]]
    _stopped: threading.Event
    _watcher: Optional[threading.Thread]
    _renew_lease: Callable[[Any], None]
    _read_node_labels: Callable[[str], Optional[list[dict[str, str]]]]
    _watch_pods: Callable[[], None]

    def handle(self) -> dict[str, Any]:
        """The pool's owner and pods, for another process's `adopt` (names and addresses only)."""
        return {"pool_id": self.pool_id, "namespace": self.namespace, "made": self._made,
                "started_at": self._lease.started_at.timestamp(),
                "nodes": {str(i): name for i, name in self.nodes.items()},
                "ips": {name: self._ips.get(name, "") for name in self.nodes.values()},
                "placed": {name: self.placed.get(name, "") for name in self.nodes.values()}}

    def adopt(self, handle: dict[str, Any]) -> None:
        """The pods of another process's pool: its owner read back (PoolGone on a 404 for it, or
        when the API lists none of its pods running; any other failure is raised as it is, and
        the pool asked again later), the watch and the lease taken up; each agent is reached by
        `reattach`. A pod deleted while the pool was warm is NodeGone at once."""
        from datetime import datetime, timezone

        from kubernetes import client

        self.pool_id = self.reporter.key = str(handle["pool_id"])
        self._cfg = cluster.configuration(self._spec.credentials)
        self._core = client.CoreV1Api(cluster.api_client(self._cfg))
        self._agents = PodAgents(self._cfg, self.namespace, self._k8s.python, self._k8s.ready_timeout_seconds)
        try:
            owner = self._core.read_namespaced_config_map(self.pool_id, self.namespace, _request_timeout=30)
        except Exception as exc:  # noqa: BLE001 - a 404 is a pool gone; anything else, unreachable
            if getattr(exc, "status", None) == 404:  # the API's own word; a timeout, 429 or 5xx is not
                raise PoolGone(f"{self.pool_id}: its owner object is gone (deleted, or taken by gc)") from None
            raise _asked_again(cluster.refused(exc, "read configmaps", self.namespace)) from exc
        self._owner_ref = pods.owner_reference({"metadata": {"name": owner.metadata.name, "uid": owner.metadata.uid}})
        self._made_owner = True  # from now on stop() deletes the owner, and with it every pod
        self._lease.started_at = datetime.fromtimestamp(float(handle.get("started_at", time.time())), timezone.utc)
        self._lease.keep(self._renew_lease, lambda line: self.reporter.note(f"{self.pool_id}: {line}"),
                         name=f"skytasks-lease-{self.pool_id}")
        try:
            self._pods = PoolWatch(self._cfg, self.namespace, self.pool_id).start(self._k8s.ready_timeout_seconds)
        except PoolConfigError as refusal:
            raise _asked_again(refusal) from refusal
        self.nodes = {int(i): str(name) for i, name in handle.get("nodes", {}).items()}
        self._ips.update(handle.get("ips", {}))
        self.placed.update(handle.get("placed", {}))
        self._made = max(int(handle.get("made", 0)), len(self.nodes))
        listed = self._pods.pods()
        for name in self.nodes.values():
            gone = pod_views.lost(self._pods, name) or (None if name in listed else
                                                        f"Kubernetes: pod {name} was deleted while the pool was warm")
            if gone:
                self._lost[name] = gone
        if all(name in self._lost for name in self.nodes.values()):
            raise PoolGone(f"{self.pool_id}: none of its pods runs any more")
        if self._spec.accelerator:
            self._node_labels = self._read_node_labels(self._spec.accelerator)
        self._watcher = threading.Thread(target=self._watch_pods, name=f"skytasks-k8s-lost-{self.pool_id}", daemon=True)
        self._watcher.start()

    def leave_running(self) -> None:
        """This process's exec streams, watch and lease renewal end; the owner and pods stay, with
        a lease that covers idle_minutes plus keep_warm_minutes from now."""
        self._stopped.set()
        if self._pods is not None:
            self._pods.wake()
        self._lease.stop()
        if self._core is not None and self._made_owner:
            try:
                self._renew_lease(self._lease.expiry())
            except Exception as exc:  # noqa: BLE001 - the renewal before last still holds for a while
                self.reporter.note(f"{self.pool_id}: could not renew its lease as it was released: "
                                   f"{cluster.api_message(exc)[:200]}")
        if self._agents:
            self._agents.end_all()  # the streams only: an exec'd agent outlives its stream
        if self._pods is not None:
            self._pods.stop()


def _asked_again(refusal: Exception) -> Exception:
    """A refusal met while adopting a warm pool, as the warm pool takes it. This identity made the
    pool, so a 403 is asked again until ready_timeout_seconds (not raised at once): an API server
    that has just restarted denies for a moment what its RBAC grants ("RBAC: role ... not found"
    until its caches fill). If it is still refused then, the pool's start fails with these words."""
    return PoolStartError(str(refusal)) if isinstance(refusal, cluster.Forbidden) else refusal
