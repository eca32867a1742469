"""A real Kubernetes (v1.20.2) for tests: etcd, kube-apiserver, controller-manager and scheduler on
loopback, and one real node (containerd, runc and a kubelet) in a namespace of its own.

The binaries are Debian bookworm's Kubernetes source built once per machine by
`scripts/k8s/build.sh` (cached in ~/.cache/skytasks/k8s-v1.20.2/bin); `make system-deps` runs it.

- The control plane listens on 127.0.0.1 only, on free ports. Certificates come from openssl (one
  CA), authorization is Node,RBAC, service-account tokens are signed with a key pair made here.
  The apiserver runs in a mount namespace of its own whose /etc/hosts names the node 127.0.0.1: it
  reaches the kubelet (logs, exec) through a socat bridge, and never asks a DNS server.
- The node runs in its own pid, mount and network namespaces (`unshare`): a veth with NODE_IP
  (192.0.2.0/24, a documentation range), pods on the bridge CNI in POD_SUBNET (198.51.100.0/24),
  fresh /run, /var/lib and /var/log, and files bind-mounted over the kernel settings the kubelet
  would otherwise change for the whole machine. The namespace has no route anywhere: nothing sent
  from it, nor from its pods, leaves it but through two socat bridges over unix sockets (to the
  apiserver, and from the host's loopback to the kubelet). The kubelet's cgroups live under a
  root of their own (`cgroup_root`), removed when the cluster stops.
- The `kubernetes` Service's ClusterIP (SERVICE_IP, 203.0.113.1, a documentation range) is an
  address of the node namespace, where a socat takes port 443 to the apiserver: a pod's
  `load_incluster_config()` works with the variables the kubelet injects (no kube-proxy needed).
- A small DNS server on NODE_IP (the pods' nameserver) answers `service.namespace.svc.cluster.local`
  and a headless Service's `hostname.subdomain.namespace.svc.cluster.local` from the API, and
  nothing else (it forwards no query).
- Images come from no registry: IMAGE is a few empty folders whose command is the host's Python,
  run by mounting the host's interpreter and this repository read-only (`host_python_template`);
  PAUSE_IMAGE is the pods' sandbox (a static `pause` built with the binaries).

Every daemon dies with the process that started it (PR_SET_PDEATHSIG, and the node's pid
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
from pathlib import Path

VERSION = "v1.20.2"
CACHE = Path(os.environ.get("SKYTASKS_K8S_CACHE", Path.home() / ".cache" / "skytasks" / f"k8s-{VERSION}"))
BIN = CACHE / "bin"
BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl", "pause")
REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "scripts" / "k8s" / "build.sh"

NODE_IP = "192.0.2.2"  # the node's veth (TEST-NET-1)
POD_SUBNET = "198.51.100.0/24"  # the pods' bridge (TEST-NET-2)
POD_GATEWAY = "198.51.100.1"
SERVICE_SUBNET = "203.0.113.0/24"  # Services (TEST-NET-3); nothing routes them but the one below
SERVICE_IP = "203.0.113.1"  # the `kubernetes` Service: an address of the node namespace
NODE_NAME = "skytasks-node"
CGROUP_LEDGERS = Path("/run/skytasks-k8s-cgroups")
IMAGE = "skytasks-test/python:1"
PAUSE_IMAGE = "skytasks-test/pause:1"
TOOLS = ("etcd", "containerd", "containerd-shim-runc-v2", "runc", "ctr", "socat", "openssl", "ip", "unshare",
         "setpriv", "mount")
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


class K8sCluster:
    """One Kubernetes cluster with one node. `start()`, use, `stop()` (idempotent, safe after a
    partial start; also run at interpreter exit and on SIGTERM)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.tag = uuid.uuid4().hex[:6]
        self.etcd_port, self.etcd_peer_port, self.api_port, self.kubelet_port = free_ports(4)
        self.server = f"https://127.0.0.1:{self.api_port}"
        self.node_name = NODE_NAME
        self.node_ip = NODE_IP
        self.image = IMAGE
        self.pause_image = PAUSE_IMAGE
        self.pki = self.folder / "pki"
        self.logs_dir = self.folder / "log"
        self.run_dir = self.folder / "run"  # unix sockets, short paths (108 characters at most)
        self.node_dir = self.folder / "node"
        self.ca_cert = self.pki / "ca.crt"
        self.admin_kubeconfig = self.folder / "admin.kubeconfig"
        self.cgroup_root = f"{_own_memory_cgroup()}/skytasks-k8s-{os.getpid()}-{self.tag}"
        self._made_cgroups: list[Path] = []  # in the order made, in every hierarchy
        self._ledger: Path | None = None
        self.daemons: dict[str, subprocess.Popen] = {}
        self.timings: dict[str, float] = {}
        self._stopped = False
        self._lock = threading.Lock()

    # -- start -----------------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> K8sCluster:
        """Up to a Ready node and a `default` service account with its token (about 9-13 s).
        The daemons die with the thread that calls this (PR_SET_PDEATHSIG): call it from one
        that outlives the cluster, as pytest's main thread does."""
        why = available()
        if why:
            raise RuntimeError(why)
        t0 = time.monotonic()
        _register(self)
        try:
            for d in (self.pki, self.logs_dir, self.run_dir, self.node_dir):
                d.mkdir(parents=True, exist_ok=True)
            self._sweep_stale_cgroups()
            self._certificates()
            self._make_cgroup_root()
            self._write_kubeconfigs()
            self._start_node()  # containerd and the kubelet start while the control plane does
            self._start_etcd()
            self._start_apiserver()
            importer = threading.Thread(target=self._import_images, daemon=True)
            importer.start()
            self._wait_apiserver(t0 + timeout)
            self.timings["apiserver_ready"] = time.monotonic() - t0
            self._start_controllers()
            importer.join(max(0.0, t0 + timeout - time.monotonic()))
            if importer.is_alive() or self._import_error:
                raise RuntimeError(f"images not imported: {self._import_error or 'timed out'}\n{self.logs()}")
            self.wait_ready(t0 + timeout)
            self.timings["node_ready"] = time.monotonic() - t0
            self.timings["start"] = time.monotonic() - t0
        except BaseException:
            self.stop()
            raise
        return self

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
        self._certificate("apiserver", "kube-apiserver", ips=("127.0.0.1", NODE_IP, SERVICE_IP), dns=cluster_names,
                          usage="serverAuth")
        self._certificate("apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters")
        self._certificate("admin", "skytasks-admin", "system:masters")
        self._certificate("controller-manager", "system:kube-controller-manager")
        self._certificate("scheduler", "system:kube-scheduler")
        self._certificate("dns", "skytasks-dns", "system:masters")  # reads Services and Endpoints
        self._certificate("kubelet-client", f"system:node:{self.node_name}", "system:nodes")
        self._certificate("kubelet", self.node_name, ips=(NODE_IP, "127.0.0.1"), dns=(self.node_name,),
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
        for name in ("controller-manager", "scheduler", "kubelet-client"):
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
        CGROUP_LEDGERS.mkdir(parents=True, exist_ok=True)
        self._ledger = CGROUP_LEDGERS / f"{os.getpid()}-{self.tag}.json"
        for h in _v1_hierarchies(unified=True):
            path = h
            for part in self.cgroup_root.strip("/").split("/"):
                parent, path = path, path / part
                if not path.exists():
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
        hosts.write_text(f"127.0.0.1 localhost {self.node_name}\n")
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
        # Its own mount namespace, where /etc/hosts gives the node's name (the address the
        # apiserver dials the kubelet at) as 127.0.0.1: the host's end of the kubelet's bridge.
        self.daemons["apiserver"] = _popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *argv], self.logs_dir / "apiserver.log")
        # The apiserver, as pods and the kubelet see it: a unix socket they reach by bridges.
        self.daemons["api-bridge"] = _popen(
            ["socat", f"UNIX-LISTEN:{self.run_dir / 'api.sock'},fork,unlink-early",
             f"TCP:127.0.0.1:{self.api_port}"], self.logs_dir / "api-bridge.log")
        # The kubelet, as the apiserver sees it: the host's loopback.
        self.daemons["kubelet-bridge"] = _popen(
            ["socat", f"TCP-LISTEN:{self.kubelet_port},bind=127.0.0.1,fork,reuseaddr",
             f"UNIX-CONNECT:{self.run_dir / 'kubelet.sock'}"], self.logs_dir / "kubelet-bridge.log")

    def _get(self, path: str, timeout: float = 2.0, method: str = "GET", body: dict | None = None) -> tuple[int, str]:
        """The apiserver as the admin, without the `kubernetes` client."""
        import ssl

        ctx = ssl.create_default_context(cafile=str(self.ca_cert))
        ctx.load_cert_chain(self.pki / "admin.crt", self.pki / "admin.key")
        request = urllib.request.Request(self.server + path, method=method, data=json.dumps(body).encode()
                                         if body is not None else None, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, context=ctx, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def _check_daemons(self) -> None:
        for name, p in self.daemons.items():
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
             "--logtostderr=true", "--v=1"], self.logs_dir / "controller-manager.log")
        self.daemons["scheduler"] = _popen(
            [str(BIN / "kube-scheduler"), f"--kubeconfig={self.folder / 'scheduler.kubeconfig'}",
             "--leader-elect=false", "--port=0", "--secure-port=0", "--bind-address=127.0.0.1",
             "--profiling=false", "--logtostderr=true", "--v=1"], self.logs_dir / "scheduler.log")

    # -- the node --------------------------------------------------------------------------------

    def _start_node(self) -> None:
        n = self.node_dir
        for d in ("run", "var-lib", "var-log", "cni", "kernel", "containerd"):
            (n / d).mkdir(exist_ok=True)
        (n / "resolv.conf").write_text("nameserver 127.0.0.1\noptions ndots:5 timeout:1 attempts:1\n")
        (n / "cni" / "10-skytasks.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "skytasks", "plugins": [{
                "type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False, "hairpinMode": True,
                "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET, "gateway": POD_GATEWAY}]],
                         "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(n / "cni-ipam")}}]}))
        (n / "containerd.toml").write_text(f"""\
version = 2
root = "{n / 'containerd'}"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{self.run_dir / 'containerd.sock'}"
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
            "address": "127.0.0.1", "port": self.kubelet_port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
            "tlsCertFile": str(self.pki / "kubelet.crt"), "tlsPrivateKeyFile": str(self.pki / "kubelet.key"),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.ca_cert)}},
            "authorization": {"mode": "Webhook"},
            "cgroupDriver": "cgroupfs", "cgroupRoot": self.cgroup_root,
            "clusterDomain": "cluster.local", "clusterDNS": [NODE_IP], "resolvConf": str(n / "resolv.conf"),
            "failSwapOn": False, "makeIPTablesUtilChains": False, "protectKernelDefaults": False,
            "nodeStatusUpdateFrequency": "2s", "nodeStatusReportFrequency": "2s",
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "nodefs.inodesFree": "1%",
                             "imagefs.available": "1%"},
            "serializeImagePulls": False, "runtimeRequestTimeout": "2m",
        }))
        kubelet = [str(BIN / "kubelet"), f"--config={n / 'kubelet.yaml'}",
                   f"--kubeconfig={self._kubeconfig(n / 'kubelet.kubeconfig', self._cert_user('kubelet-client'))}",
                   "--container-runtime=remote",
                   f"--container-runtime-endpoint=unix://{self.run_dir / 'containerd.sock'}",
                   f"--node-ip={NODE_IP}", f"--hostname-override={self.node_name}", "--root-dir=/var/lib/kubelet",
                   f"--cert-dir={n / 'kubelet-pki'}", "--logtostderr=true", "--v=1"]
        spec = {"folder": str(self.folder), "node": str(n), "run": str(self.run_dir), "logs": str(self.logs_dir),
                "api_port": self.api_port, "kubelet_port": self.kubelet_port, "kubelet": kubelet,
                "ca": str(self.ca_cert), "dns_cert": str(self.pki / "dns.crt"), "dns_key": str(self.pki / "dns.key")}
        (n / "spec.json").write_text(json.dumps(spec))
        # pid 1 of a pid namespace: when it dies, so does every process in it (containers too).
        # unshare dies with this thread (setpriv) and takes its child with it (--kill-child).
        self.daemons["node"] = _popen(
            ["unshare", "--fork", "--pid", "--mount-proc", "--mount", "--net", "--uts", "--propagation", "private",
             "--kill-child=KILL", sys.executable, "-S", "-E", __file__, "node", str(n / "spec.json")],
            self.logs_dir / "node.log")

    _import_error = ""

    def _import_images(self) -> None:
        try:
            sock = self.run_dir / "containerd.sock"
            deadline = time.monotonic() + 30
            while not sock.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("containerd did not start")
                time.sleep(0.05)
            for name, data in (("pause", pause_image_tar()), ("python", python_image_tar())):
                tar = self.node_dir / f"{name}-image.tar"
                tar.write_bytes(data)
                subprocess.run(["ctr", "--address", str(sock), "-n", "k8s.io", "images", "import",
                                str(tar)],
                               check=True, capture_output=True, timeout=60)
        except Exception as e:  # reported by start()
            self._import_error = f"{e}: {getattr(e, 'stderr', b'')!r}"

    def node_ready(self) -> bool:
        code, body = self._get(f"/api/v1/nodes/{self.node_name}")
        if code != 200:
            return False
        conditions = json.loads(body).get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def wait_ready(self, deadline: float) -> None:
        """Until the node is Ready and the `default` service account has its token."""
        while True:
            self._check_daemons()
            try:
                if self.node_ready() and self._get("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node is not Ready:\n{self.logs()}")
            time.sleep(0.2)

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
        node = self.daemons.pop("node", None)
        if node is not None:  # its pid 1 first: the kernel ends every process of the namespace
            init = _children(node.pid)
            for pid in init:
                _kill(pid, signal.SIGKILL)
            _killpg(node, signal.SIGTERM if init else signal.SIGKILL)
            _reap(node)
        order = ("controller-manager", "scheduler", "apiserver", "kubelet-bridge", "api-bridge", "etcd")
        rest = [self.daemons.pop(n) for n in order if n in self.daemons] + list(self.daemons.values())
        self.daemons.clear()
        for p in rest:
            _killpg(p, signal.SIGTERM)
        for p in rest:
            _reap(p)
        _remove_cgroups([str(p) for p in self._made_cgroups])
        self._made_cgroups = []
        if self._ledger is not None:
            self._ledger.unlink(missing_ok=True)
        for d in (self.node_dir, self.run_dir, self.folder / "etcd"):
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
    """A small DNS server on NODE_IP:53 (the pods' nameserver) that answers A queries for
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
    sock.bind((NODE_IP, 53))
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
    node, run, logs = Path(spec["node"]), Path(spec["run"]), Path(spec["logs"])

    def sh(*argv: str) -> None:
        subprocess.run(argv, check=True)

    def start(name: str, argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=open(logs / f"{name}.log", "ab"),
                                stderr=subprocess.STDOUT)

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # and the kernel ends the rest
    sh("hostname", NODE_NAME)
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
    for argv in (["link", "set", "lo", "up"], ["addr", "add", f"{SERVICE_IP}/32", "dev", "lo"],
                 ["link", "add", "eth0", "type", "veth", "peer", "name", "eth1"],
                 ["addr", "add", f"{NODE_IP}/24", "dev", "eth0"],
                 ["link", "set", "eth0", "up"], ["link", "set", "eth1", "up"]):
        sh("ip", *argv)
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1")  # this namespace's own
    threading.Thread(target=_serve_dns, args=(spec,), daemon=True).start()
    procs = {
        "containerd": start("containerd", ["containerd", "--config", str(node / "containerd.toml")]),
        # The apiserver, for pods (the `kubernetes` Service's port) and the kubelet.
        "api-443": start("node-api-bridge", ["socat", "TCP-LISTEN:443,fork,reuseaddr",
                                             f"UNIX-CONNECT:{run / 'api.sock'}"]),
        "api": start("node-api-bridge", ["socat", f"TCP-LISTEN:{spec['api_port']},fork,reuseaddr",
                                         f"UNIX-CONNECT:{run / 'api.sock'}"]),
        # The kubelet, for the apiserver (logs, exec).
        "kubelet-bridge": start("node-kubelet-bridge", [
            "socat", f"UNIX-LISTEN:{run / 'kubelet.sock'},fork,unlink-early",
            f"TCP:127.0.0.1:{spec['kubelet_port']}"]),
    }
    waiting_kubelet = True
    while True:
        # The kubelet starts with containerd, before the apiserver answers: it registers the
        # node as soon as it does (about 4 s sooner Ready than a kubelet started after it).
        if waiting_kubelet and (run / "containerd.sock").exists():
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
