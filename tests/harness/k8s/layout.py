"""Where the test cluster's binaries are, its addresses and names, and whether it can start here."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from tests.harness.k8s.cgroups import _v1_hierarchies

# Spelled in node_init, which runs with nothing but the standard library (python -S): the node's
# pid 1 binds these settings and puts SERVICE_IP on its loopback.
from tests.harness.k8s.node_init import KERNEL_SETTINGS as KERNEL_SETTINGS
from tests.harness.k8s.node_init import SERVICE_IP as SERVICE_IP

VERSION = "v1.20.2"
CACHE = Path(os.environ.get("SKYTASKS_K8S_CACHE", Path.home() / ".cache" / "skytasks" / f"k8s-{VERSION}"))
BIN = CACHE / "bin"
BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl", "pause")
REPO = Path(__file__).resolve().parents[3]  # tests/harness/k8s/layout.py
BUILD_SCRIPT = REPO / "scripts" / "k8s" / "build.sh"

POD_SUBNET = "198.51.100.0/24"  # every node's pods (TEST-NET-2), half of it to each node
SERVICE_SUBNET = "203.0.113.0/24"  # Services (TEST-NET-3); nothing routes them but the one below
# (name, address on its veth (TEST-NET-1), its pods' subnet, their gateway: the node's bridge)
NODES = (("skytasks-node", "192.0.2.2", "198.51.100.0/25", "198.51.100.1"),
         ("skytasks-node-2", "192.0.2.3", "198.51.100.128/25", "198.51.100.129"))
NODE_NAME, NODE_IP, _, POD_GATEWAY = NODES[0]  # the first node's, which a one-node cluster has
# Seconds without a kubelet's word before the controller-manager marks its Node NotReady
# (Unknown): a lost node shows in this long, and a loaded 2-core machine whose kubelets post
# every 2 s does not lose one by chance (Kubernetes' default is 40 s).
NODE_GRACE = 16
CGROUP_LEDGERS = Path("/run/skytasks-k8s-cgroups")
IMAGE = "skytasks-test/python:1"
PAUSE_IMAGE = "skytasks-test/pause:1"
TOOLS = ("etcd", "containerd", "containerd-shim-runc-v2", "runc", "ctr", "socat", "openssl", "ip", "unshare",
         "nsenter", "setpriv", "mount")
CNI_PLUGINS = ("bridge", "host-local", "loopback")


def available() -> str | None:
    """Why a cluster cannot start here, or None."""
    if os.geteuid() != 0:
        return "the Kubernetes test cluster runs as root (namespaces, mounts, cgroups)"
    missing = [b for b in BINARIES if not os.access(BIN / b, os.X_OK)]
    if missing:
        return f"Kubernetes {VERSION} is not built ({', '.join(missing)}): make system-deps (scripts/k8s/build.sh)"
    for tool in TOOLS:
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make system-deps installs it)"
    for plugin in CNI_PLUGINS:
        if not os.access(f"/usr/lib/cni/{plugin}", os.X_OK):
            return f"the CNI plugin {plugin} is not installed (containernetworking-plugins; make system-deps)"
    if not _v1_hierarchies():
        return "no cgroup v1 hierarchy is mounted (the kubelet 1.20 here runs on cgroup v1)"
    return None


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
