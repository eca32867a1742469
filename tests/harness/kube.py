"""Pools on the Kubernetes test cluster (tests/harness/k8s/), as a user makes them: a
KubernetesCredentials block from a kubeconfig, an image, and a pod template that mounts this
machine's Python (the test image has none of its own)."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from skytasks import GPUPool


def credentials(kubeconfig: Path) -> Any:
    from prefect_kubernetes.credentials import KubernetesClusterConfig, KubernetesCredentials

    return KubernetesCredentials(cluster_config=KubernetesClusterConfig.from_file(kubeconfig))


def sharing(cluster: Any, folder: Path) -> dict[str, Any]:
    """The host template with `folder` of this machine mounted read-write at the same path in
    every pod: storage the ranks and the test share, as a cluster's shared volume would be."""
    template = cluster.host_python_template()
    template["spec"]["volumes"].append({"name": "shared", "hostPath": {"path": str(folder), "type": "Directory"}})
    template["spec"]["containers"][0]["volumeMounts"].append({"name": "shared", "mountPath": str(folder)})
    return template


def kube_pool(cluster: Any, kubeconfig: Path | None = None, share: Path | None = None, **fields: Any) -> GPUPool:
    template = sharing(cluster, share) if share is not None else cluster.host_python_template()
    base: dict[str, Any] = dict(provider="kubernetes", nodes=2, k8s_image=cluster.image,
                                k8s_pod_template=template, remote_python=sys.executable,
                                kubernetes_credentials=credentials(kubeconfig or cluster.admin_kubeconfig),
                                ready_timeout_seconds=90)
    return GPUPool(**{**base, **fields})


def held(cluster: Any, namespace: str = "default") -> list[str]:
    """Every pod and owner ConfigMap skytasks made in the namespace, as the API server lists them."""
    out = []
    for kind in ("pods", "configmaps"):
        listed = json.loads(cluster.kubectl("get", kind, "-n", namespace, "-l", "app.kubernetes.io/managed-by=skytasks",
                                            "-o", "json").stdout)["items"]
        out += [f"{kind}/{i['metadata']['name']}" for i in listed]
    return out


class Said(logging.Handler):
    """The skytasks logger's lines (what the console and the flow run's log show), each with how
    many seconds after `with Said()` it came."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.lines = time.monotonic(), []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.monotonic() - self.started, record.getMessage()))

    def __enter__(self) -> Said:
        log = logging.getLogger("skytasks")
        self._level = log.level
        log.setLevel(logging.INFO)
        log.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        log = logging.getLogger("skytasks")
        log.removeHandler(self)
        log.setLevel(self._level)

    def first(self, text: str) -> float | None:
        """When a line holding `text` first came (None: none did)."""
        return next((t for t, line in self.lines if text in line), None)
