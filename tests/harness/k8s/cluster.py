"""`K8sCluster`: a control plane and one or two nodes, started, used and stopped."""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from tests.harness.k8s.cgroups import _own_memory_cgroup, _pid_alive, _remove_cgroups, _v1_hierarchies
from tests.harness.k8s.control_plane import ControlPlane
from tests.harness.k8s.daemons import _children, _kill, _killpg, _reap, _register, _unregister
from tests.harness.k8s.layout import BIN, CGROUP_LEDGERS, IMAGE, NODES, PAUSE_IMAGE, REPO, SERVICE_IP, available, free_ports
from tests.harness.k8s.nodes import Node, NodeLifecycle


class K8sCluster(ControlPlane, NodeLifecycle):
    """One Kubernetes cluster with one or two nodes. `start()`, use, `stop()` (idempotent, safe
    after a partial start; also run at interpreter exit and on SIGTERM)."""

    def __init__(self, folder: Path, nodes: int = 1):
        if nodes not in (1, 2):
            raise ValueError(f"nodes={nodes}: the test cluster has one node or two")
        self.folder = Path(folder)
        self.tag = uuid.uuid4().hex[:6]
        self.etcd_port, self.etcd_peer_port, self.api_port, *kubelet_ports = free_ports(3 + nodes)
        self.server = f"https://127.0.0.1:{self.api_port}"
        self.image = IMAGE
        self.pause_image = PAUSE_IMAGE
        self.pki = self.folder / "pki"
        self.logs_dir = self.folder / "log"
        self.run_dir = self.folder / "run"  # unix sockets, short paths (108 characters at most)
        self.ca_cert = self.pki / "ca.crt"
        self.admin_kubeconfig = self.folder / "admin.kubeconfig"
        self.cgroup_root = f"{_own_memory_cgroup()}/skytasks-k8s-{os.getpid()}-{self.tag}"
        self._nodes = [Node(i, name, ip, subnet, gateway, kubelet_ports[i], 10248 + i, f"{self.cgroup_root}/{name}",
                            self.folder / ("node" if i == 0 else f"node-{i + 1}"),
                            self.run_dir / f"containerd-{i + 1}.sock", self.run_dir / f"kubelet-{i + 1}.sock")
                       for i, (name, ip, subnet, gateway) in enumerate(NODES[:nodes])]
        first = self._nodes[0]
        self.node_name, self.node_ip, self.kubelet_port, self.node_dir = first.name, first.ip, first.kubelet_port, first.dir
        self._made_cgroups: list[Path] = []  # in the order made, in every hierarchy
        self._ledger: Path | None = None
        self.daemons: dict[str, subprocess.Popen] = {}
        self.timings: dict[str, float] = {}
        self._stopped = False
        self._lock = threading.Lock()
        self._images_lock = threading.Lock()

    @property
    def nodes(self) -> list[str]:
        """The names of the cluster's nodes, lost ones included (their Node objects stay)."""
        return [n.name for n in self._nodes]

    def node(self, name: str) -> Node:
        for n in self._nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r}: the nodes are {self.nodes}")

    # -- start -----------------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> K8sCluster:
        """Up to Ready nodes and a `default` service account with its token (about 10-15 s for
        one node, a few seconds more for two: the nodes start with the control plane). The
        daemons die with the thread that calls this (PR_SET_PDEATHSIG): call it from one that
        outlives the cluster, as pytest's main thread does (the nodes die with this process).
        `timings` says how long each part took."""
        why = available()
        if why:
            raise RuntimeError(why)
        t0 = time.monotonic()
        _register(self)
        try:
            for d in (self.pki, self.logs_dir, self.run_dir):
                d.mkdir(parents=True, exist_ok=True)
            self._sweep_stale_cgroups()
            self._certificates()
            self._make_cgroup_root()
            self._write_kubeconfigs()
            self.timings["prepared"] = time.monotonic() - t0
            # containerd and the kubelets start while the control plane does
            helpers = [self._start_node(n) for n in self._nodes]
            if len(self._nodes) == 2:
                helpers.append(self._in_thread(self._link_nodes, *self._nodes))
            self._start_etcd()
            self._start_apiserver()
            self._wait_apiserver(t0 + timeout)
            self.timings["apiserver_ready"] = time.monotonic() - t0
            self._start_controllers()
            self._join(helpers, t0 + timeout)
            self.timings["images_imported"] = time.monotonic() - t0
            self.wait_ready(t0 + timeout, t0)
            self.timings["node_ready"] = self.timings["start"] = time.monotonic() - t0
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _in_thread(target, *args) -> tuple[threading.Thread, list[BaseException]]:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                target(*args)
            except BaseException as e:  # reported by _join
                errors.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread, errors

    def _join(self, helpers: list[tuple[threading.Thread, list[BaseException]]], deadline: float) -> None:
        for thread, errors in helpers:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive() or errors:
                raise RuntimeError(f"a node did not start: {errors[0] if errors else 'timed out'}\n{self.logs()}")

    def _sweep_stale_cgroups(self) -> None:
        """The cgroups of clusters whose test process died without stopping them: each cluster
        notes the ones it makes in a ledger of its own under CGROUP_LEDGERS."""
        for ledger in CGROUP_LEDGERS.glob("*.json"):
            try:
                pid = int(ledger.name.split("-")[0])
            except ValueError:
                continue
            if not _pid_alive(pid):
                _remove_cgroups(json.loads(ledger.read_text() or "[]"), timeout=1.0)
                ledger.unlink(missing_ok=True)

    def _make_cgroup_root(self) -> None:
        """The cluster's cgroup root and each node's folder in it (a kubelet's cgroupRoot must
        exist), in every hierarchy. Only the folders above the root go in the ledger: the root
        goes with all it holds."""
        CGROUP_LEDGERS.mkdir(parents=True, exist_ok=True)
        self._ledger = CGROUP_LEDGERS / f"{os.getpid()}-{self.tag}.json"
        for h in _v1_hierarchies(unified=True):
            for root in (self.cgroup_root, *(n.cgroup_root for n in self._nodes)):
                path = h
                for part in root.strip("/").split("/"):
                    parent, path = path, path / part
                    if not path.exists():
                        if not any(path.is_relative_to(m) for m in self._made_cgroups):
                            self._made_cgroups.append(path)
                            self._ledger.write_text(json.dumps([str(p) for p in self._made_cgroups]))
                        path.mkdir()
                        if "cpuset" in h.name.split(","):
                            for f in ("cpuset.cpus", "cpuset.mems"):
                                (path / f).write_text((parent / f).read_text())

    # -- use -------------------------------------------------------------------------------------

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "kubectl"), f"--kubeconfig={self.admin_kubeconfig}", *args],
                              capture_output=True, text=True, check=check, timeout=timeout)

    def create_namespace(self, name: str, timeout: float = 30.0) -> str:
        """A new namespace, returned once pods can be made in it: the apiserver refuses a pod
        until the controller-manager has given the namespace's `default` service account its
        token (a second or so after the namespace is made)."""
        code, body = self._get("/api/v1/namespaces", method="POST", body={"metadata": {"name": name}})
        if code != 201:
            raise RuntimeError(f"namespace {name}: {code} {body}")
        self.kubeconfig_for_service_account(name, "default", timeout=timeout, write=False)
        return name

    def kubeconfig_for_service_account(self, namespace: str, name: str, timeout: float = 30.0,
                                       write: bool = True) -> Path:
        """A kubeconfig that authenticates as that service account (with the token of its
        Secret, which the controller-manager makes within a second or so of its creation)."""
        deadline = time.monotonic() + timeout
        while True:
            code, body = self._get(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}")
            secrets = [s["name"] for s in json.loads(body).get("secrets") or []] if code == 200 else []
            for secret in secrets:
                code, body = self._get(f"/api/v1/namespaces/{namespace}/secrets/{secret}")
                token = json.loads(body).get("data", {}).get("token") if code == 200 else None
                if token:
                    path = self.folder / f"sa-{namespace}-{name}.kubeconfig"
                    if not write:
                        return path
                    return self._kubeconfig(path, {"token": base64.b64decode(token).decode()})
            if time.monotonic() > deadline:
                raise RuntimeError(f"no token for the service account {namespace}/{name}")
            time.sleep(0.1)

    def in_cluster_env(self) -> dict[str, str]:
        """The variables by which a pod's `load_incluster_config()` finds the apiserver. The
        kubelet injects these very values (the `kubernetes` Service) into every container; an
        explicit env entry sets them again, whatever the Service links."""
        return {"KUBERNETES_SERVICE_HOST": SERVICE_IP, "KUBERNETES_SERVICE_PORT": "443"}

    @staticmethod
    def host_python_template() -> dict:
        """A partial Pod manifest that runs this machine's Python (with this repository's
        virtual environment) in IMAGE: hostPath volumes, read-only at the same paths, and a
        container entry without a name (it merges into the pod's own container):

            {"spec": {"volumes": [...], "containers": [{"image": IMAGE, "volumeMounts": [...]}]}}

        `sys.executable` (the venv's python) runs in it, `import torch, skytasks` included."""
        paths: list[str] = []
        for p in ("/usr", *(f"/{d}" for d in ("lib", "lib64", "bin", "sbin") if not os.path.islink(f"/{d}")),
                  "/etc/ssl", "/etc/alternatives", sys.base_prefix, sys.prefix, str(REPO)):
            p = os.path.realpath(p)
            if os.path.isdir(p) and not any(p == q or p.startswith(q + "/") for q in paths):
                paths = [q for q in paths if not q.startswith(p + "/")] + [p]
        volumes, mounts = [], []
        for i, p in enumerate(paths):
            name = f"host-{i}-" + "".join(c if c.isalnum() else "-" for c in p.lower()).strip("-")[:40]
            name = name.rstrip("-")
            volumes.append({"name": name, "hostPath": {"path": p, "type": "Directory"}})
            mounts.append({"name": name, "mountPath": p, "readOnly": True})
        return {"spec": {"volumes": volumes, "containers": [{"image": IMAGE, "imagePullPolicy": "IfNotPresent",
                                                             "volumeMounts": mounts}]}}

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for p in sorted(self.logs_dir.glob("*.log")):
            parts.append(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    # -- stop ------------------------------------------------------------------------------------

    def stop(self, _wait: bool = True) -> None:
        if not self._lock.acquire(blocking=_wait):
            return  # stopping already (a SIGTERM during stop(): the kernel ends the daemons)
        try:
            self._stop()
        finally:
            self._lock.release()

    def _stop(self) -> None:
        t0 = time.monotonic()
        for node in self._nodes:  # its pid 1 first: the kernel ends every process of the namespace
            p, node.process = node.process, None
            if p is not None:
                init = _children(p.pid)
                for pid in init:
                    _kill(pid, signal.SIGKILL)
                _killpg(p, signal.SIGTERM if init else signal.SIGKILL)
                _reap(p)
        order = ("controller-manager", "scheduler", "apiserver", "kubelet-bridge-1", "kubelet-bridge-2", "api-bridge",
                 "etcd")
        # SIGKILL for the apiserver: on SIGTERM it drains open requests (a watch, an exec
        # stream) for 1 s up to a minute, and nothing it holds outlives the cluster anyway.
        apiserver = self.daemons.get("apiserver")
        rest = [self.daemons.pop(n) for n in order if n in self.daemons] + list(self.daemons.values())
        self.daemons.clear()
        for p in rest:
            _killpg(p, signal.SIGKILL if p is apiserver else signal.SIGTERM)
        for p in rest:
            _reap(p)
        _remove_cgroups([str(p) for p in self._made_cgroups])
        self._made_cgroups = []
        if self._ledger is not None:
            self._ledger.unlink(missing_ok=True)
        for d in (*(n.dir for n in self._nodes), self.run_dir, self.folder / "etcd", self.folder / "images"):
            shutil.rmtree(d, ignore_errors=True)
        self.timings["stop"] = time.monotonic() - t0
        _unregister(self)
