"""How a kubernetes pool reaches its cluster: credentials to an API client, and the API's refusals
as the errors a user can act on.

Credentials, in kubectl's order: the pool's `KubernetesCredentials` block; else the pod's own
service account when the controller runs in a pod (a flow run of a Kubernetes work pool); else
the default kubeconfig (`KUBECONFIG`, `~/.kube/config`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from skytasks.errors import PoolConfigError, PoolStartError

IN_CLUSTER_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
RBAC_FILE = "deployments/kubernetes/rbac.yaml"


class Forbidden(PoolConfigError):
    """A 403 for a missing permission, as `refused` words it (naming the verb and resource): a
    PoolConfigError, marked so that a caller for whom a 403 may pass (a warm pool's adopt, right
    after an API server restart) can tell it from the other refusals by its type."""


def configuration(credentials: Any) -> Any:
    """A `kubernetes.client.Configuration` for the pool's cluster (every client of the pool is
    made from it: the official client's objects are not safe to share between exec streams)."""
    from kubernetes import client, config

    cfg = client.Configuration()
    creds = credentials
    try:
        if creds is not None and getattr(creds, "cluster_config", None) is not None:
            cluster = creds.cluster_config
            config.load_kube_config_from_dict(dict(cluster.config), context=cluster.context_name,
                                              client_configuration=cfg, persist_config=False)
        elif os.environ.get("KUBERNETES_SERVICE_HOST") and os.path.exists(IN_CLUSTER_TOKEN):
            config.load_incluster_config(client_configuration=cfg)
        else:
            config.load_kube_config(client_configuration=cfg, persist_config=False)
    except config.ConfigException as exc:
        raise PoolConfigError(f"kubernetes_credentials: no cluster to talk to: {exc} (give the pool a "
                              "KubernetesCredentials block, or a kubeconfig in KUBECONFIG or ~/.kube/config)") from exc
    return cfg


def api_client(cfg: Any) -> Any:
    from kubernetes import client

    return client.ApiClient(configuration=cfg)


def api_message(exc: BaseException) -> str:
    """The API server's own words in an ApiException (its Status message), else the exception."""
    body = getattr(exc, "body", None) or getattr(exc, "resp_body", None)  # the client's, or a websocket's
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if body:
        try:
            return str(json.loads(body).get("message") or body)
        except (ValueError, AttributeError):
            return str(body)[:500]
    return f"{type(exc).__name__}: {exc}"


def refused(exc: BaseException, doing: str, namespace: str) -> Exception:
    """An API error as the pool's error: a missing permission is a PoolConfigError naming the
    verb and resource (and what grants it); a quota or a rejected manifest says which field."""
    status = getattr(exc, "status", None) or getattr(exc, "status_code", None)
    said = api_message(exc)
    if status == 403 and "forbidden" in said.lower() and "quota" not in said.lower():
        return Forbidden(f"kubernetes_credentials: the pool's identity may not {doing} in namespace "
                         f"{namespace!r}: {said} ({RBAC_FILE} grants what a pool needs)")
    if status == 403 and "quota" in said.lower():
        return PoolStartError(f"k8s_cpu/k8s_memory: a ResourceQuota in namespace {namespace!r} refused the pod: {said}")
    if status == 404 and "namespaces" in said.lower():
        return PoolConfigError(f"k8s_namespace: namespace {namespace!r} does not exist: {said}")
    if status == 422 or status == 400:
        return PoolConfigError(f"k8s_pod_template: the API server refused the pod ({doing}): {said}")
    if status is None:
        return PoolStartError(f"kubernetes: cannot reach the API server ({doing}): {said}")
    return PoolStartError(f"kubernetes: {doing} failed (HTTP {status}): {said}")


def private_stream(cfg: Any) -> bool:
    """Whether an exec stream through this configuration is private: https with the server's
    certificate verified. A kubeconfig with `insecure-skip-tls-verify`, or an `http://` server
    (kubectl proxy, an insecure port), lets whoever is in between read and rewrite it: the
    pool's streams are then sealed (skytasks.stream_seal)."""
    return str(cfg.host or "").lower().startswith("https://") and bool(cfg.verify_ssl)
