"""A real Kubernetes (v1.20.2) for tests: etcd, kube-apiserver, controller-manager and scheduler on
loopback, and one or two real nodes (containerd, runc and a kubelet each) in namespaces of their own.

The binaries are Debian bookworm's Kubernetes source built once per machine by
`scripts/k8s/build.sh` (cached in ~/.cache/skytasks/k8s-v1.20.2/bin); `make system-deps` runs it.

- The control plane listens on 127.0.0.1 only, on free ports. Certificates come from openssl (one
  CA), authorization is Node,RBAC, service-account tokens are signed with a key pair made here.
  The apiserver runs in a mount namespace of its own whose /etc/hosts names every node 127.0.0.1:
  it reaches each kubelet (logs, exec) through a socat bridge of that node, and never asks a DNS
  server.
- Each node (`K8sCluster(folder, nodes=2)`: NODES[0] and NODES[1]) runs in its own pid, mount, net
  and uts namespaces (`unshare`): its address (192.0.2.0/24, a documentation range) on a veth of
  its own, its pods on the bridge CNI in its half of POD_SUBNET (198.51.100.0/24), fresh /run,
  /var/lib and /var/log, its own containerd, and files bind-mounted over the kernel settings the
  kubelet would otherwise change for the whole machine. Two nodes are joined by one veth pair made
  straight into their two namespaces (it never exists in the machine's own), with routes to each
  other's address and pods: pods reach each other by pod IP across nodes. Nothing sent from a
  node or its pods leaves the namespaces but through its socat bridges over unix sockets (to the
  apiserver, and from the host's loopback to its kubelet). The kubelets' cgroups live under a
  root of the cluster's own (`cgroup_root`, one folder per node in it), removed when it stops.
- The `kubernetes` Service's ClusterIP (SERVICE_IP, 203.0.113.1, a documentation range) is an
  address of every node namespace, where a socat takes port 443 to the apiserver: a pod's
  `load_incluster_config()` works with the variables the kubelet injects (no kube-proxy needed).
- A small DNS server on each node's address (its pods' nameserver) answers
  `service.namespace.svc.cluster.local` and a headless Service's
  `hostname.subdomain.namespace.svc.cluster.local` from the API, and nothing else (it forwards no
  query).
- Images come from no registry: IMAGE is a few empty folders whose command is the host's Python,
  run by mounting the host's interpreter and this repository read-only (`host_python_template`);
  PAUSE_IMAGE is the pods' sandbox (a static `pause` built with the binaries).
- A node can be lost as a machine is (`kill_node`: its namespaces die with every process in them,
  pods included; its Node object stays and goes NotReady within NODE_GRACE seconds) and come back
  (`restart_node`). `set_gpus`, `label_node` and `taint_node` make a node look like a cloud's.

Every daemon dies with the process that started it (PR_SET_PDEATHSIG, and a node's pid
namespace dies with its first process), so a killed test session leaves no daemon running; a
later start removes the cgroups such a session left. `stop()` leaves nothing: no process,
namespace, mount, veth or cgroup, and no state in `folder` but the logs.
"""

from __future__ import annotations

import atexit
import base64
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path

VERSION = "v1.20.2"
CACHE = Path(os.environ.get("SKYTASKS_K8S_CACHE", Path.home() / ".cache" / "skytasks" / f"k8s-{VERSION}"))
BIN = CACHE / "bin"
BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl", "pause")
REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "scripts" / "k8s" / "build.sh"

POD_SUBNET = "198.51.100.0/24"  # every node's pods (TEST-NET-2), half of it to each node
SERVICE_SUBNET = "203.0.113.0/24"  # Services (TEST-NET-3); nothing routes them but the one below
SERVICE_IP = "203.0.113.1"  # the `kubernetes` Service: an address of every node namespace
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
# What the kubelet writes for the whole machine unless told not to (protectKernelDefaults: false
# only stops it from failing when they differ): each gets a file of its own bound over it.
KERNEL_SETTINGS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")


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


def _v1_hierarchies(unified: bool = False) -> list[Path]:
    """The mount points of the cgroup v1 hierarchies (and of the v2 one beside them, where runc
    makes the containers' cgroups too)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[:1] == ["cgroup"] or (unified and right.split()[:1] == ["cgroup2"]):
            found.append(Path(left.split()[4]))
    return found


def _own_memory_cgroup() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path.rstrip("/")
    return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_cgroup_tree(path: Path, timeout: float = 10.0) -> bool:
    """rmdir a cgroup and every cgroup below it, deepest first (a cgroup folder holds no files
    that rmdir minds). Retries while killed processes are still leaving it."""
    deadline = time.monotonic() + timeout
    while True:
        if not path.exists():
            return True
        dirs = sorted((Path(d) for d, _, _ in os.walk(path)), key=lambda p: len(p.parts), reverse=True)
        busy = False
        for d in dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                busy = True
        if not busy and not path.exists():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _remove_cgroups(made: list[str], timeout: float = 10.0) -> None:
    """The cgroups a cluster made (listed in the order made), with all the kubelet and runc made
    below them: the cluster's own root with everything in it (waiting while killed processes
    leave), then the folders above it it had to make, if no other cluster uses them now."""
    for d in reversed(made):
        path = Path(d)
        if path.name.startswith("skytasks-k8s-"):
            _remove_cgroup_tree(path, timeout)
        else:
            try:
                path.rmdir()
            except OSError:
                pass


def _popen(argv: list[str], log: Path, **kw) -> subprocess.Popen:
    """A daemon in a process group of its own that the kernel kills when this thread exits."""
    with open(log, "ab") as out:
        return subprocess.Popen(["setpriv", "--pdeathsig", "KILL", *argv], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kw)


def _popen_kept(argv: list[str], log: Path) -> subprocess.Popen:
    """`_popen` from a thread of its own that waits on the daemon: it dies with this process, not
    with the thread that asked for it (a node restarted from a test's helper thread outlives it)."""
    started: list[subprocess.Popen | BaseException] = []
    up = threading.Event()

    def keep() -> None:
        try:
            started.append(_popen(argv, log))
        except BaseException as e:
            started.append(e)
        up.set()
        if isinstance(started[0], subprocess.Popen):
            started[0].wait()

    threading.Thread(target=keep, daemon=True, name=f"keeps {Path(argv[0]).name}").start()
    up.wait()
    if isinstance(started[0], BaseException):
        raise started[0]
    return started[0]


# -- images --------------------------------------------------------------------------------------


def oci_image_tar(name: str, files: dict[str, bytes | str | None], cmd: list[str], env: list[str]) -> bytes:
    """A one-layer image in `docker save` form, which `ctr images import` reads: `files` maps a
    path in the image to its bytes (mode 0755), a str (a symlink to it) or None (a folder)."""
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, content in sorted(files.items()):
            info = tarfile.TarInfo(path.lstrip("/"))
            info.mtime = 0
            if content is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o1777 if path == "/tmp" else 0o755
                tar.addfile(info)
            elif isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
                tar.addfile(info)
            else:
                info.size, info.mode = len(content), 0o755
                tar.addfile(info, io.BytesIO(content))
    layer = layer_buf.getvalue()
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z",
        "config": {"Env": env, "Cmd": cmd, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [name], "Layers": ["layer.tar"]}]).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for member, data in (("layer.tar", layer), (config_name, config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def python_image_tar() -> bytes:
    """IMAGE: the folders of a root file system, the usual links into /usr (merged /usr), and
    the host's Python as its command, which works once `host_python_template()` mounts it."""
    files: dict[str, bytes | str | None] = {d: None for d in ("/usr", "/etc", "/tmp", "/root", "/home", "/var",
                                                              "/var/tmp", "/run", "/proc", "/sys", "/dev")}
    for d in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        if os.path.islink(f"/{d}"):
            files[f"/{d}"] = os.readlink(f"/{d}")
        elif os.path.isdir(f"/{d}"):
            files[f"/{d}"] = None
    files["/etc/passwd"] = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
    files["/etc/group"] = b"root:x:0:\nnogroup:x:65534:\n"
    path = f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return oci_image_tar(IMAGE, files, [sys.executable], [f"PATH={path}", "LANG=C.UTF-8"])


def pause_image_tar() -> bytes:
    return oci_image_tar(PAUSE_IMAGE, {"/pause": (BIN / "pause").read_bytes()}, ["/pause"], [])


# -- the cluster ---------------------------------------------------------------------------------


@dataclass
class Node:
    """One node of the cluster: what its kubelet is told, and the namespaces it runs in."""

    index: int
    name: str
    ip: str
    pod_subnet: str
    gateway: str
    kubelet_port: int  # the kubelet's port in its namespace and its bridge's on the host's loopback
    healthz_port: int
    cgroup_root: str  # the kubelet's cgroupRoot: a folder of the cluster's cgroup root
    dir: Path  # its configuration, /run, /var/lib, /var/log and containerd's root
    containerd_sock: Path
    kubelet_sock: Path
    process: subprocess.Popen | None = field(default=None, repr=False)  # unshare; None once killed

    def init_pid(self, timeout: float = 10.0) -> int:
        """The node's pid 1 (unshare's child): in its namespaces once it exists."""
        deadline = time.monotonic() + timeout
        while self.process is not None:
            children = _children(self.process.pid)
            if children:
                return children[0]
            if self.process.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        raise RuntimeError(f"node {self.name} is not running")


class K8sCluster:
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

    def _openssl(self, *args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=self.pki)

    def _certificate(self, name: str, cn: str, org: str = "", ips: tuple[str, ...] = (),
                     dns: tuple[str, ...] = (), usage: str = "clientAuth") -> None:
        sans = [f"IP:{i}" for i in ips] + [f"DNS:{d}" for d in dns]
        (self.pki / f"{name}.cnf").write_text(
            "[req]\ndistinguished_name = dn\nprompt = no\n[dn]\n" + (f"O = {org}\n" if org else "") + f"CN = {cn}\n"
            "[ext]\nbasicConstraints = critical, CA:FALSE\nkeyUsage = critical, digitalSignature, keyEncipherment\n"
            f"extendedKeyUsage = {usage}\n" + (f"subjectAltName = {', '.join(sans)}\n" if sans else ""))
        self._openssl("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                      "-keyout", f"{name}.key", "-out", f"{name}.crt", "-config", f"{name}.cnf", "-extensions", "ext",
                      "-CA", "ca.crt", "-CAkey", "ca.key", "-days", "3650")

    def _certificates(self) -> None:
        self._openssl("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                      "-keyout", "ca.key", "-out", "ca.crt", "-subj", f"/CN=skytasks-test-ca-{self.tag}",
                      "-days", "3650", "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature")
        cluster_names = ("kubernetes", "kubernetes.default", "kubernetes.default.svc",
                         "kubernetes.default.svc.cluster.local", "localhost")
        self._certificate("apiserver", "kube-apiserver", ips=("127.0.0.1", *(n[1] for n in NODES), SERVICE_IP),
                          dns=cluster_names, usage="serverAuth")
        self._certificate("apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters")
        self._certificate("admin", "skytasks-admin", "system:masters")
        self._certificate("controller-manager", "system:kube-controller-manager")
        self._certificate("scheduler", "system:kube-scheduler")
        self._certificate("dns", "skytasks-dns", "system:masters")  # reads Services and Endpoints
        for n in self._nodes:  # each kubelet is its own Node to the Node authorizer
            self._certificate(f"kubelet-client-{n.index + 1}", f"system:node:{n.name}", "system:nodes")
            self._certificate(f"kubelet-{n.index + 1}", n.name, ips=(n.ip, "127.0.0.1"), dns=(n.name,),
                              usage="serverAuth")
        self._openssl("ecparam", "-genkey", "-name", "prime256v1", "-noout", "-out", "sa.key")
        self._openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub")

    def _kubeconfig(self, path: Path, user: dict, server: str | None = None) -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "skytasks",
            "clusters": [{"name": "skytasks", "cluster": {"server": server or self.server,
                                                           "certificate-authority": str(self.ca_cert)}}],
            "users": [{"name": "user", "user": user}],
            "contexts": [{"name": "skytasks", "context": {"cluster": "skytasks", "user": "user"}}],
        }, indent=1))
        return path

    def _cert_user(self, name: str) -> dict:
        return {"client-certificate": str(self.pki / f"{name}.crt"), "client-key": str(self.pki / f"{name}.key")}

    def _write_kubeconfigs(self) -> None:
        self._kubeconfig(self.admin_kubeconfig, self._cert_user("admin"))
        for name in ("controller-manager", "scheduler"):
            self._kubeconfig(self.folder / f"{name}.kubeconfig", self._cert_user(name))

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

    def _start_etcd(self) -> None:
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        client = f"http://127.0.0.1:{self.etcd_port}"
        self.daemons["etcd"] = _popen(
            ["etcd", "--name", "default", "--data-dir", str(self.folder / "etcd"), "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"default={peer}", "--initial-cluster-state", "new",
             "--initial-cluster-token", f"skytasks-{self.tag}", "--logger", "zap", "--log-outputs", "stderr",
             "--snapshot-count", "10000"], self.logs_dir / "etcd.log")

    def _start_apiserver(self) -> None:
        p = self.pki
        hosts = self.folder / "apiserver-hosts"
        hosts.write_text(f"127.0.0.1 localhost {' '.join(self.nodes)}\n")
        argv = [str(BIN / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1", f"--secure-port={self.api_port}", "--insecure-port=0",
                f"--advertise-address={NODE_IP}",
                f"--tls-cert-file={p / 'apiserver.crt'}", f"--tls-private-key-file={p / 'apiserver.key'}",
                f"--client-ca-file={p / 'ca.crt'}",
                f"--kubelet-client-certificate={p / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={p / 'apiserver-kubelet-client.key'}",
                "--kubelet-preferred-address-types=Hostname",
                f"--service-account-key-file={p / 'sa.pub'}", f"--service-account-signing-key-file={p / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--api-audiences=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_SUBNET}",
                "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=true", "--profiling=false", "--logtostderr=true", "--v=1"]
        # Its own mount namespace, where /etc/hosts gives each node's name (the address the
        # apiserver dials its kubelet at) as 127.0.0.1: the host's end of that kubelet's bridge.
        self._apiserver_command = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                   'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *argv]
        self.daemons["apiserver"] = _popen(self._apiserver_command, self.logs_dir / "apiserver.log")
        # The apiserver, as pods and the kubelet see it: a unix socket they reach by bridges.
        self.daemons["api-bridge"] = _popen(
            ["socat", f"UNIX-LISTEN:{self.run_dir / 'api.sock'},fork,unlink-early",
             f"TCP:127.0.0.1:{self.api_port}"], self.logs_dir / "api-bridge.log")
        # Each kubelet, as the apiserver sees it: a port of the host's loopback.
        for n in self._nodes:
            self.daemons[f"kubelet-bridge-{n.index + 1}"] = _popen(
                ["socat", f"TCP-LISTEN:{n.kubelet_port},bind=127.0.0.1,fork,reuseaddr",
                 f"UNIX-CONNECT:{n.kubelet_sock}"], self.logs_dir / f"kubelet-bridge-{n.index + 1}.log")

    def _get(self, path: str, timeout: float = 2.0, method: str = "GET", body: dict | None = None) -> tuple[int, str]:
        """The apiserver as the admin, without the `kubernetes` client (a PATCH is a JSON merge
        patch)."""
        import ssl

        ctx = ssl.create_default_context(cafile=str(self.ca_cert))
        ctx.load_cert_chain(self.pki / "admin.crt", self.pki / "admin.key")
        kind = "application/merge-patch+json" if method == "PATCH" else "application/json"
        request = urllib.request.Request(self.server + path, method=method, data=json.dumps(body).encode()
                                         if body is not None else None, headers={"Content-Type": kind})
        try:
            with urllib.request.urlopen(request, context=ctx, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def _check_daemons(self) -> None:
        nodes = [(f"node {n.name}", n.process) for n in self._nodes if n.process is not None]
        for name, p in [*self.daemons.items(), *nodes]:
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited ({p.returncode}):\n{self.logs()}")

    def _wait_apiserver(self, deadline: float) -> None:
        while True:
            self._check_daemons()
            try:
                if self._get("/readyz")[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the apiserver is not ready:\n{self.logs()}")
            time.sleep(0.1)

    def _start_controllers(self) -> None:
        p = self.pki
        self.daemons["controller-manager"] = _popen(
            [str(BIN / "kube-controller-manager"), f"--kubeconfig={self.folder / 'controller-manager.kubeconfig'}",
             "--leader-elect=false", "--port=0", "--secure-port=0", "--bind-address=127.0.0.1",
             f"--service-account-private-key-file={p / 'sa.key'}", f"--root-ca-file={p / 'ca.crt'}",
             "--use-service-account-credentials=true", f"--service-cluster-ip-range={SERVICE_SUBNET}",
             f"--cluster-signing-cert-file={p / 'ca.crt'}", f"--cluster-signing-key-file={p / 'ca.key'}",
             "--controllers=*,-cloud-node-lifecycle,-route,-service", "--profiling=false",
             f"--node-monitor-grace-period={NODE_GRACE}s", "--node-monitor-period=1s",
             "--logtostderr=true", "--v=1"], self.logs_dir / "controller-manager.log")
        self.daemons["scheduler"] = _popen(
            [str(BIN / "kube-scheduler"), f"--kubeconfig={self.folder / 'scheduler.kubeconfig'}",
             "--leader-elect=false", "--port=0", "--secure-port=0", "--bind-address=127.0.0.1",
             "--profiling=false", "--logtostderr=true", "--v=1"], self.logs_dir / "scheduler.log")

    # -- the nodes -------------------------------------------------------------------------------

    def _start_node(self, node: Node) -> tuple[threading.Thread, list[BaseException]]:
        """Writes the node's configuration and starts its namespaces, where containerd and then
        its kubelet start at once. Returns the thread that imports the images into its containerd."""
        n, i = node.dir, node.index + 1
        shutil.rmtree(n, ignore_errors=True)  # a restarted node starts as a machine that boots afresh
        for d in ("run", "var-lib", "var-log", "cni", "kernel", "containerd"):
            (n / d).mkdir(parents=True)
        for sock in (node.containerd_sock, node.kubelet_sock):  # a killed node's, which nothing serves
            sock.unlink(missing_ok=True)
        (n / "resolv.conf").write_text("nameserver 127.0.0.1\noptions ndots:5 timeout:1 attempts:1\n")
        (n / "cni" / "10-skytasks.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "skytasks", "plugins": [{
                "type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False, "hairpinMode": True,
                "ipam": {"type": "host-local", "ranges": [[{"subnet": node.pod_subnet, "gateway": node.gateway}]],
                         "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(n / "cni-ipam")}}]}))
        (n / "containerd.toml").write_text(f"""\
version = 2
root = "{n / 'containerd'}"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{node.containerd_sock}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{n / 'containerd-opt'}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "docker.io/{PAUSE_IMAGE}"
  disable_apparmor = true
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{n / 'cni'}"
""")
        (n / "kubelet.yaml").write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": "127.0.0.1", "port": node.kubelet_port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": node.healthz_port,
            "tlsCertFile": str(self.pki / f"kubelet-{i}.crt"), "tlsPrivateKeyFile": str(self.pki / f"kubelet-{i}.key"),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.ca_cert)}},
            "authorization": {"mode": "Webhook"},
            "cgroupDriver": "cgroupfs", "cgroupRoot": node.cgroup_root,
            "clusterDomain": "cluster.local", "clusterDNS": [node.ip], "resolvConf": str(n / "resolv.conf"),
            "failSwapOn": False, "makeIPTablesUtilChains": False, "protectKernelDefaults": False,
            "nodeStatusUpdateFrequency": "2s", "nodeStatusReportFrequency": "2s",
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "nodefs.inodesFree": "1%",
                             "imagefs.available": "1%"},
            "serializeImagePulls": False, "runtimeRequestTimeout": "2m",
        }))
        kubeconfig = self._kubeconfig(n / "kubelet.kubeconfig", self._cert_user(f"kubelet-client-{i}"))
        kubelet = [str(BIN / "kubelet"), f"--config={n / 'kubelet.yaml'}", f"--kubeconfig={kubeconfig}",
                   "--container-runtime=remote", f"--container-runtime-endpoint=unix://{node.containerd_sock}",
                   f"--node-ip={node.ip}", f"--hostname-override={node.name}", "--root-dir=/var/lib/kubelet",
                   f"--cert-dir={n / 'kubelet-pki'}", "--logtostderr=true", "--v=1"]
        spec = {"name": node.name, "ip": node.ip, "node": str(n), "logs": str(self.logs_dir), "suffix": f"-{i}",
                "api_sock": str(self.run_dir / "api.sock"), "api_port": self.api_port,
                "containerd_sock": str(node.containerd_sock), "kubelet_sock": str(node.kubelet_sock),
                "kubelet_port": node.kubelet_port, "kubelet": kubelet,
                "ca": str(self.ca_cert), "dns_cert": str(self.pki / "dns.crt"), "dns_key": str(self.pki / "dns.key")}
        (n / "spec.json").write_text(json.dumps(spec))
        # pid 1 of a pid namespace: when it dies, so does every process in it (containers too).
        # unshare dies with this process (setpriv, from a thread that waits on it) and takes its
        # child with it (--kill-child).
        node.process = _popen_kept(
            ["unshare", "--fork", "--pid", "--mount-proc", "--mount", "--net", "--uts", "--propagation", "private",
             "--kill-child=KILL", sys.executable, "-S", "-E", __file__, "node", str(n / "spec.json")],
            self.logs_dir / f"node-{i}.log")
        return self._in_thread(self._import_images, node)

    def _link_nodes(self, a: Node, b: Node) -> None:
        """One veth pair made straight into the two nodes' network namespaces (named `peer` in
        both: it never exists in the machine's own), and in each the routes to the other's
        address and to its pods. Either end dies with its namespace, and the other with it."""
        for x in (a, b):  # its own address is up (the routes' `src`) once net-ready is written
            deadline = time.monotonic() + 30
            while not (x.dir / "net-ready").exists():
                if x.process is None or x.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"node {x.name} has no network")
                time.sleep(0.01)
        pid_a, pid_b = a.init_pid(), b.init_pid()
        subprocess.run(["ip", "link", "add", "peer", "netns", str(pid_a), "type", "veth", "peer", "name", "peer",
                        "netns", str(pid_b)], check=True, capture_output=True)
        for (x, pid), y in (((a, pid_a), b), ((b, pid_b), a)):
            # The node's address on `peer` too: the ARP requests it sends there (for a pod's
            # packet) then say it, not another address of its own, such as SERVICE_IP, which the
            # other node has too and so drops as a martian source.
            routes = (f"addr add {x.ip}/32 dev peer\nlink set peer up\nroute add {y.ip}/32 dev peer src {x.ip}\n"
                      f"route add {y.pod_subnet} via {y.ip} dev peer src {x.ip}\n")
            subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "ip", "-batch", "-"], input=routes.encode(),
                           check=True, capture_output=True)

    def _image_tars(self) -> list[Path]:
        """The pause and python images as `docker save` tars, written once for every node."""
        with self._images_lock:
            folder = self.folder / "images"
            if not folder.exists():
                folder.mkdir()
                (folder / "pause.tar").write_bytes(pause_image_tar())
                (folder / "python.tar").write_bytes(python_image_tar())
            return [folder / "pause.tar", folder / "python.tar"]

    def _import_images(self, node: Node) -> None:
        deadline = time.monotonic() + 30
        while not node.containerd_sock.exists():
            if node.process is None or node.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"containerd did not start on {node.name}")
            time.sleep(0.05)
        for tar in self._image_tars():
            try:
                subprocess.run(["ctr", "--address", str(node.containerd_sock), "-n", "k8s.io", "images", "import",
                                str(tar)], check=True, capture_output=True, timeout=60)
            except subprocess.CalledProcessError as e:
                raise RuntimeError(f"{e}: {e.stderr!r}") from None

    def node_condition(self, name: str | None = None) -> str | None:
        """The status of the node's Ready condition ("True", "False", or "Unknown" for a node
        whose kubelet went silent), or None before it has one. The first node if not named."""
        code, body = self._get(f"/api/v1/nodes/{name or self.node_name}")
        if code != 200:
            return None
        conditions = json.loads(body).get("status", {}).get("conditions", [])
        return next((c["status"] for c in conditions if c["type"] == "Ready"), None)

    def node_ready(self, name: str | None = None) -> bool:
        return self.node_condition(name) == "True"

    def wait_ready(self, deadline: float, t0: float | None = None) -> None:
        """Until every running node is Ready and the `default` service account has its token
        (noting in `timings` when each node was, from t0)."""
        waiting = {n.name for n in self._nodes if n.process is not None}
        while True:
            self._check_daemons()
            try:
                for name in sorted(waiting):
                    if self.node_ready(name):
                        waiting.discard(name)
                        if t0 is not None:
                            self.timings[f"node_ready:{name}"] = time.monotonic() - t0
                if not waiting and self._get("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"not Ready: {sorted(waiting)}:\n{self.logs()}")
            time.sleep(0.2)

    def wait_node(self, name: str, ready: bool = True, timeout: float = 60.0) -> float:
        """Polls until the node is Ready (ready=True) or is not (False: NotReady or Unknown, as a
        lost node becomes within NODE_GRACE s); returns the seconds it took."""
        t0 = time.monotonic()
        while True:
            try:
                if self.node_ready(name) == ready:
                    return time.monotonic() - t0
            except OSError:
                pass
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"node {name} is still {self.node_condition(name)!r} after {timeout} s")
            time.sleep(0.2)

    # -- lost nodes, and nodes as a cloud's ------------------------------------------------------

    def kill_node(self, name: str) -> None:
        """The node's machine goes away: SIGKILL to its pid 1 ends every process in its
        namespaces at once (kubelet, containerd, its pods' processes), and the namespaces and
        their mounts and veths with them. Its Node object stays, and goes NotReady (Ready
        "Unknown") within NODE_GRACE s; its pods stay in the API as they were. `restart_node`
        brings it back."""
        node = self.node(name)
        p, node.process = node.process, None
        if p is not None:
            for pid in _children(p.pid):
                _kill(pid, signal.SIGKILL)
            _reap(p)

    def restart_node(self, name: str, timeout: float = 90.0) -> float:
        """A killed node boots again, with nothing of its former state (containers, pod IPs),
        and joins the other node again; returns once its Node is Ready (seconds). Pods still
        bound to it in the API are started again by its kubelet, as after a reboot."""
        node = self.node(name)
        if node.process is not None:
            raise RuntimeError(f"node {name} is running")
        t0 = time.monotonic()
        helpers = [self._start_node(node)]
        for other in self._nodes:
            if other is not node and other.process is not None:
                helpers.append(self._in_thread(self._link_nodes, *sorted((node, other), key=lambda x: x.index)))
        self._join(helpers, t0 + timeout)
        self.wait_node(name, True, max(1.0, t0 + timeout - time.monotonic()))
        self.timings[f"restart:{name}"] = took = time.monotonic() - t0
        return took

    def restart_apiserver(self, timeout: float = 60.0) -> float:
        """A control-plane restart: the kube-apiserver SIGKILLed, which cuts every watch and exec
        stream through it at once (on SIGTERM it drains them for up to a minute), and started
        again with the same command line and environment; nothing else is touched (etcd, the
        bridges, the kubelets, the pods and what was exec'd into them run on). Returns the
        seconds until it answers /readyz again."""
        old = self.daemons["apiserver"]
        _killpg(old, signal.SIGKILL)
        _reap(old)
        t0 = time.monotonic()
        started: list[subprocess.Popen] = []
        up = threading.Event()

        def keep() -> None:
            # The kernel ends the apiserver when the thread that started it exits (_popen's
            # pdeathsig): a thread of its own that waits on it, so a caller's thread may restart it.
            started.append(_popen(self._apiserver_command, self.logs_dir / "apiserver.log"))
            up.set()
            started[0].wait()

        threading.Thread(target=keep, daemon=True, name="k8s-apiserver").start()
        up.wait(30)
        self.daemons["apiserver"] = started[0]
        self._wait_apiserver(t0 + timeout)
        self.timings["restart:apiserver"] = took = time.monotonic() - t0
        return took

    def label_node(self, name: str, labels: dict[str, str | None]) -> None:
        """Sets the node's labels (None removes one), as a cloud labels a node it adds."""
        self._patch_node(name, {"metadata": {"labels": labels}})

    def taint_node(self, name: str, key: str, value: str = "", effect: str = "NoSchedule") -> None:
        """Adds a taint (or sets its value), as a booting or reserved node carries one. The node
        lifecycle controller owns the `node.kubernetes.io/*` taints and lifts them from a Ready
        node within seconds: to hold pods off a node, taint it with a key of your own."""
        self._update_taints(name, lambda taints: [t for t in taints if (t["key"], t["effect"]) != (key, effect)]
                            + [{"key": key, "value": value, "effect": effect} if value else
                               {"key": key, "effect": effect}])

    def untaint_node(self, name: str, key: str, effect: str | None = None) -> None:
        """Lifts the node's taints with that key (of that effect only, if given)."""
        self._update_taints(name, lambda taints: [t for t in taints
                                                  if t["key"] != key or (effect and t["effect"] != effect)])

    def set_gpus(self, name: str, count: int, product: str | None = None) -> None:
        """The node advertises `count` GPUs as NVIDIA's device plugin would (`nvidia.com/gpu`
        in its status capacity; its kubelet keeps it) and, given `product`, carries GPU Feature
        Discovery's labels (`nvidia.com/gpu.product`, `nvidia.com/gpu.count`). count=0 takes
        all of it away. Returns once the scheduler can count them (allocatable, about 2.5 s)."""
        want = str(count) if count else None
        code, body = self._get(f"/api/v1/nodes/{name}/status", method="PATCH",
                               body={"status": {"capacity": {"nvidia.com/gpu": want}}})
        if code != 200:
            raise RuntimeError(f"node {name} status: {code} {body}")
        self.label_node(name, {"nvidia.com/gpu.product": product if count else None,
                               "nvidia.com/gpu.count": want if product else None})
        deadline = time.monotonic() + 30
        while json.loads(self._get(f"/api/v1/nodes/{name}")[1])["status"].get("allocatable", {}).get(
                "nvidia.com/gpu") != want:
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {name} does not show nvidia.com/gpu={want} as allocatable")
            time.sleep(0.2)

    def _patch_node(self, name: str, patch: dict) -> dict:
        code, body = self._get(f"/api/v1/nodes/{name}", method="PATCH", body=patch)
        if code != 200:
            raise RuntimeError(f"node {name}: {code} {body}")
        return json.loads(body)

    def _update_taints(self, name: str, change) -> None:
        """Read, change, write back with the resourceVersion read: the node lifecycle controller
        writes taints too, and a lost race (409) reads again."""
        for _ in range(20):
            code, body = self._get(f"/api/v1/nodes/{name}")
            if code != 200:
                raise RuntimeError(f"node {name}: {code} {body}")
            got = json.loads(body)
            taints = change(got["spec"].get("taints") or [])
            code, body = self._get(f"/api/v1/nodes/{name}", method="PATCH", body={
                "metadata": {"resourceVersion": got["metadata"]["resourceVersion"]}, "spec": {"taints": taints}})
            if code == 200:
                return
            if code != 409:
                raise RuntimeError(f"node {name} taints: {code} {body}")
        raise RuntimeError(f"node {name} taints: too many conflicting writes")

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


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _killpg(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def _reap(p: subprocess.Popen, grace: float = 10.0) -> None:
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    # the rest of its group (socat's forks)
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


# -- stopping at exit ----------------------------------------------------------------------------

_clusters: weakref.WeakSet[K8sCluster] = weakref.WeakSet()
_handlers_installed = False


def _stop_all(wait: bool = True) -> None:
    for c in list(_clusters):
        try:
            c.stop(wait)
        except Exception:
            pass


def _on_sigterm(signum, frame) -> None:
    _stop_all(wait=False)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _register(c: K8sCluster) -> None:
    global _handlers_installed
    _clusters.add(c)
    if not _handlers_installed:
        _handlers_installed = True
        atexit.register(_stop_all)
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)


def _unregister(c: K8sCluster) -> None:
    _clusters.discard(c)


# -- inside the node's namespaces (pid 1 there) --------------------------------------------------


def _serve_dns(spec: dict) -> None:
    """A small DNS server on the node's address, port 53 (its pods' nameserver), that answers A queries for
    `service.namespace.svc.cluster.local` (its ClusterIP, or a headless Service's pod IPs) and
    `hostname.service.namespace.svc.cluster.local` (a pod of a headless Service, by its hostname
    and subdomain) from the API, and no others: it forwards nothing anywhere."""
    import ssl
    import struct

    ctx = ssl.create_default_context(cafile=spec["ca"])
    ctx.load_cert_chain(spec["dns_cert"], spec["dns_key"])
    base = f"https://127.0.0.1:{spec['api_port']}/api/v1/namespaces"

    def get(path: str) -> dict | None:
        try:
            with urllib.request.urlopen(f"{base}/{path}", context=ctx, timeout=3) as r:
                return json.loads(r.read())
        except Exception:
            return None

    def addresses(endpoints: dict | None, hostname: str | None = None) -> list[str]:
        return [a["ip"] for sub in (endpoints or {}).get("subsets") or [] for a in sub.get("addresses") or []
                if hostname is None or a.get("hostname") == hostname]

    def lookup(name: str) -> list[str] | None:  # None: no such name
        if not name.endswith(".svc.cluster.local"):
            return None
        parts = name[: -len(".svc.cluster.local")].split(".")
        if len(parts) == 2:
            svc = get(f"{parts[1]}/services/{parts[0]}")
            if svc is None:
                return None
            ip = svc.get("spec", {}).get("clusterIP")
            return [ip] if ip and ip != "None" else addresses(get(f"{parts[1]}/endpoints/{parts[0]}"))
        if len(parts) == 3:
            return addresses(get(f"{parts[2]}/endpoints/{parts[1]}"), parts[0]) or None
        return None

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((spec["ip"], 53))
    while True:
        query, peer = sock.recvfrom(512)
        try:
            qid, flags, qdcount = struct.unpack("!HHH", query[:6])
            labels, i = [], 12
            while query[i]:
                labels.append(query[i + 1:i + 1 + query[i]].decode().lower())
                i += 1 + query[i]
            qtype = struct.unpack("!H", query[i + 1:i + 3])[0]
            question = query[12:i + 5]
            found = lookup(".".join(labels))
            answers = [ip for ip in found or [] if qtype == 1]
            rcode = 3 if found is None else 0  # NXDOMAIN
            reply = struct.pack("!HHHHHH", qid, 0x8400 | (flags & 0x0100) | rcode, 1, len(answers), 0, 0) + question
            for ip in answers:
                reply += struct.pack("!HHHLH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(ip)
            sock.sendto(reply, peer)
        except Exception:
            pass



def _node_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    node, logs, suffix = Path(spec["node"]), Path(spec["logs"]), spec["suffix"]

    def sh(*argv: str) -> None:
        subprocess.run(argv, check=True)

    def start(name: str, argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=open(logs / f"{name}{suffix}.log", "ab"),
                                stderr=subprocess.STDOUT)

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # and the kernel ends the rest
    sh("hostname", spec["name"])
    # Fresh /run, /var/lib, /var/log: the kubelet and containerd hard-code paths there.
    for src, dst in (("run", "/run"), ("var-lib", "/var/lib"), ("var-log", "/var/log")):
        sh("mount", "--bind", str(node / src), dst)
    # The machine's kernel settings the kubelet writes: it writes files of its own instead.
    for setting in KERNEL_SETTINGS:
        target = Path("/proc/sys") / setting
        if target.exists():
            copy = node / "kernel" / setting.replace("/", ".")
            copy.write_text(target.read_text())
            sh("mount", "--bind", str(copy), str(target))
    if not os.path.islink("/etc/resolv.conf"):
        sh("mount", "--bind", str(node / "resolv.conf"), "/etc/resolv.conf")
    # The node's address on a veth of its own (the kubelet wants it on an interface, and it must
    # outlive the link to the other node, which goes when that node is lost): a /32, the routes
    # to the other node come with that link.
    for argv in (["link", "set", "lo", "up"], ["addr", "add", f"{SERVICE_IP}/32", "dev", "lo"],
                 ["link", "add", "eth0", "type", "veth", "peer", "name", "eth1"],
                 ["addr", "add", f"{spec['ip']}/32", "dev", "eth0"],
                 ["link", "set", "eth0", "up"], ["link", "set", "eth1", "up"]):
        sh("ip", *argv)
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1")  # this namespace's own
    (node / "net-ready").touch()
    threading.Thread(target=_serve_dns, args=(spec,), daemon=True).start()
    procs = {
        "containerd": start("containerd", ["containerd", "--config", str(node / "containerd.toml")]),
        # The apiserver, for pods (the `kubernetes` Service's port) and the kubelet.
        "api-443": start("node-api-bridge", ["socat", "TCP-LISTEN:443,fork,reuseaddr",
                                             f"UNIX-CONNECT:{spec['api_sock']}"]),
        "api": start("node-api-bridge", ["socat", f"TCP-LISTEN:{spec['api_port']},fork,reuseaddr",
                                         f"UNIX-CONNECT:{spec['api_sock']}"]),
        # The kubelet, for the apiserver (logs, exec).
        "kubelet-bridge": start("node-kubelet-bridge", [
            "socat", f"UNIX-LISTEN:{spec['kubelet_sock']},fork,unlink-early",
            f"TCP:127.0.0.1:{spec['kubelet_port']}"]),
    }
    waiting_kubelet = True
    while True:
        # The kubelet starts with containerd, before the apiserver answers: it registers the
        # node as soon as it does (about 4 s sooner Ready than a kubelet started after it).
        if waiting_kubelet and Path(spec["containerd_sock"]).exists():
            procs["kubelet"] = start("kubelet", spec["kubelet"])
            waiting_kubelet = False
        try:  # pid 1 reaps every orphan of the namespace
            while (pid := os.waitpid(-1, os.WNOHANG)[0]) > 0:
                for name, p in procs.items():
                    if p.pid == pid:
                        p.returncode = -1
                        print(f"node: {name} exited", flush=True)
        except ChildProcessError:
            pass
        time.sleep(0.05)


if __name__ == "__main__":
    if sys.argv[1:2] == ["node"]:
        _node_main(sys.argv[2])
