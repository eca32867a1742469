"""Deleting what a kubernetes pool made, and waiting until the API server holds none of it: the
pool's own stop, and `skytasks gc --kubernetes` for pools whose controller is gone."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Optional

from skytasks.providers.kubernetes import cluster, pods

if TYPE_CHECKING:
    from skytasks.providers.kubernetes.pool_watch import PoolWatch


def list_pods(core: Any, namespace: str, selector: str) -> list[dict[str, Any]]:
    """The pods a label selector finds, as the API returns them (plain dicts): the one LIST of pods
    outside a pool's watch (its teardown's last look, and gc's)."""
    found = core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False, _request_timeout=30)
    return list(json.loads(found.data)["items"])


def pool_pods(core: Any, namespace: str, pool_id: str) -> list[str]:
    return [p["metadata"]["name"] for p in list_pods(core, namespace, f"{pods.POOL_LABEL}={pool_id}")]


def delete_pool(core: Any, namespace: str, pool_id: str, wait_seconds: float,
                watch: Optional[PoolWatch] = None) -> tuple[list[str], str]:
    """Delete every pod of the pool (at once: no grace, the pool is ending) and its owner, then wait
    until none is listed. What is still there after `wait_seconds`, and why. With the pool's
    `watch`, the wait is on it (no request) and one LIST confirms; without (gc), a LIST each 0.3 s."""
    from kubernetes import client

    detail = ""
    now = client.V1DeleteOptions(grace_period_seconds=0, propagation_policy="Background")
    try:
        core.delete_collection_namespaced_pod(namespace, label_selector=f"{pods.POOL_LABEL}={pool_id}",
                                              grace_period_seconds=0, body=now, _request_timeout=30)
    except Exception as exc:  # noqa: BLE001 - said below with what is left
        detail = f"deleting pods: {cluster.api_message(exc)[:300]}"
    try:
        core.delete_namespaced_config_map(pool_id, namespace, body=now, _request_timeout=30)
    except Exception as exc:  # noqa: BLE001
        if getattr(exc, "status", None) != 404:
            detail = f"{detail}; deleting the owner configmap: {cluster.api_message(exc)[:300]}".lstrip("; ")
    deadline = time.monotonic() + wait_seconds
    if watch is not None and watch.healthy:
        seen = watch.version
        while watch.pods() and time.monotonic() < deadline:
            seen = watch.wait_for_change(seen, 1.0)
    while True:
        try:
            left = [f"pod {namespace}/{p}" for p in pool_pods(core, namespace, pool_id)]
        except Exception as exc:  # noqa: BLE001
            return [f"the pods of {namespace}/{pool_id}"], f"cannot list what is left: {cluster.api_message(exc)[:300]}"
        if not left:
            return [], ""
        if time.monotonic() >= deadline:
            return left, detail or f"still listed {wait_seconds:g}s after their deletion"
        time.sleep(0.3)
